"""Command-line options that several `medusa-spec` subcommands take, each defined once: flag, type, help, and what
it means when it is not given. cli.py adds them to demo, generate, chat and bench; the distill and train settings
(train/fields.py `shared`) and the tree command name them too, so `distill --temperature` is `generate
--temperature`. A command chooses only its default value (`--max-new-tokens` 128 to generate, 512 to distill), and may
keep an old spelling working as a hidden alias (`bench --out`, `train --output-dir`: now `--output`)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .default_model import DISTRIBUTION
from .folders import DTYPES
from .lookup import LOOKUP_TOKENS


def default_device() -> str:
    """--device not given: cuda when available, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str) -> str:
    """`device` if torch can run a model there, else an error saying what to pass: torch would fail deep inside the
    model's .to() (an AssertionError where this build of torch has no CUDA)."""
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device}: not a device torch knows; use cpu, cuda or cuda:N") from None
    if parsed.type == "cpu":
        return device
    if parsed.type != "cuda":  # mps, xpu...: taken where torch has one; meta and the like hold no data to run
        backend = torch.backends.mps if parsed.type == "mps" else getattr(torch, parsed.type, None)
        if not callable(getattr(backend, "is_available", None)) or not backend.is_available():
            raise ValueError(f"--device {device}: this PyTorch build/machine has no {parsed.type} device to run a "
                             f"model on; use --device cpu or cuda")
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this PyTorch build/machine has no CUDA; use --device cpu, or leave "
                         f"--device out (cuda when available, else cpu)")
    count = torch.cuda.device_count()
    if (parsed.index or 0) >= count:
        raise ValueError(f"--device {device}: this machine has {count} CUDA device(s); use cuda:0 to cuda:{count - 1}")
    return device


def native_bf16(device: str) -> bool:
    """Whether `device` computes bf16 natively: a CUDA GPU that supports it, or a CPU with AVX512-BF16 or AMX
    instructions (read from /proc/cpuinfo). Other CPUs emulate it: a 64-row decoding step of SmolLM2-135M took
    several times fp32's on an AVX2-only EPYC."""
    if device.startswith("cuda"):
        return torch.cuda.is_bf16_supported()
    return device == "cpu" and bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them in /proc/cpuinfo (empty elsewhere)."""
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def fast_dtype(device: str) -> str:
    """--dtype not given to distill: bfloat16 where `device` computes it natively, else float32."""
    return "bfloat16" if native_bf16(device) else "float32"


def tree_arg(text: str):
    """--tree: JSON rank paths, 'off' for no speculation (one token per step), 'auto', or a node count N (an int: the
    command grows the tree once the heads are loaded, see cli.sized_tree)."""
    if text == "off":
        return []
    if text == "auto":
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    try:
        tree = json.loads(text)
    except json.JSONDecodeError:
        tree = None
    if not isinstance(tree, list):  # a bare JSON number or string is no tree either
        raise argparse.ArgumentTypeError(f"--tree must be JSON rank paths such as '[[0],[1],[0,0]]', 'off', 'auto' "
                                         f"or a node count such as 16, got {text!r}")
    return tree


def non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return int(text)


def seed(text: str) -> int:
    """A seed torch takes: torch.manual_seed refuses past 64 bits ("Overflow when unpacking long long")."""
    value = int(text)
    if not -2**63 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"must be an integer from {-2**63} to {2**64 - 1}, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


@dataclass(frozen=True)
class Flag:
    help: str  # what it sets; add_flag appends the default
    type: object = None  # argparse's type; bool: --flag / --no-flag
    choices: tuple | None = None
    metavar: str | None = None
    nargs: str | None = None
    unset: str | None = None  # what an absent flag means where its default is None


_FROM_GENERATION_CONFIG = "the model's generation_config, else {}"  # as transformers' generate resolves it

FLAGS = {
    # The model.
    "model": Flag("local folder of a transformers causal LM and its tokenizer, as save_pretrained writes them; "
                  "nothing is downloaded", metavar="DIR",
                  unset=f"SmolLM2-135M-Instruct from the {DISTRIBUTION} package"),
    "heads": Flag("adapter folder", metavar="DIR",
                  unset="the shipped heads for the default model, else untrained heads"),
    "dtype": Flag("dtype the model is loaded in (auto: as saved)", choices=tuple(DTYPES),
                  unset="bfloat16 where the device computes it natively (a GPU; a CPU with AVX512-BF16 or AMX), "
                        "else float32"),
    "device": Flag("device the model runs on", unset="cuda when available, else cpu"),
    "plain_text": Flag("the tokenizer has no chat template: use the plain 'User:/Assistant:' format", type=bool),
    # Decoding.
    "max_new_tokens": Flag("tokens generated per answer at most (an eos ends it sooner)", type=int, metavar="N"),
    "tree": Flag("the heads' candidate tree: JSON rank paths such as '[[0],[1],[0,0]]', 'off' (one token per step), "
                 "'auto' (the tree with the most expected tokens per second on this machine for the heads' "
                 "measured accuracies; the heads' own tree when they carry none), or a node count N (root "
                 "included: the tree of N nodes with the most expected tokens per step for those accuracies, as "
                 "`medusa-spec tree --nodes N` stores; a built-in shape for heads without them)", type=tree_arg),
    "system_prompt": Flag("a system message put before every conversation", metavar="TEXT", unset="none"),
    # Sampling: each one not given resolves as in transformers' generate (inputs.resolve_sampling), so a model whose
    # generation_config samples samples here too.
    "compile": Flag("verify through torch.compile'd graphs of the base model: each shape compiles once per process "
                    "(minutes on a small CPU, a line on stderr says so), then every step costs less; in bench, "
                    "this library's methods", type=bool),
    "do_sample": Flag("sample; --no-do-sample: greedy", type=bool, unset=_FROM_GENERATION_CONFIG.format("greedy")),
    "temperature": Flag("sampling temperature", type=float, unset=_FROM_GENERATION_CONFIG.format("1.0")),
    "top_k": Flag("sample among the K most likely tokens, 0: all", type=int, metavar="K",
                  unset=_FROM_GENERATION_CONFIG.format("50")),
    "top_p": Flag("sample among the most likely tokens whose probabilities sum to P, 1.0: all", type=float,
                  metavar="P", unset=_FROM_GENERATION_CONFIG.format("1.0")),
    "seed": Flag("seed of torch's random numbers (demo: the random model and prompt; generate, chat, bench, distill: "
                 "sampling; train: initialisation, data order and dropout)", type=seed),
    # Proposers besides the heads: generate and chat speculate with one, bench compares them as methods.
    "lookup": Flag("also verify a chain of up to N prompt-lookup candidates (copied from the prompt, the output and "
                   "--documents) in the same pass as the heads' tree; in bench, the chain of the lookup and "
                   "medusa_lookup methods; 0 turns it off", type=non_negative_int, metavar="N",
                   unset=f"{LOOKUP_TOKENS}; in generate and chat 0 with a draft model"),
    "documents": Flag("text files whose tokens prompt lookup also searches (with --lookup)", nargs="+",
                      metavar="FILE", unset="none"),
    "draft_model": Flag("a draft model with the base's vocabulary: generate and chat speculate with it instead of "
                        "the heads; bench adds the draft_model method", metavar="DIR", unset="none"),
    "dflash": Flag("a speculators DFlash draft folder for the model (train --head-type dflash writes one): generate "
                   "and chat speculate with it instead of the heads (--tree: its rank paths, N for each step's N best "
                   "nodes by its probabilities, 'off', or left out for the chain of its block), bench adds the "
                   "dflash method; it drafts eagerly", metavar="DIR",
                   unset="none"),
    "self_draft_layers": Flag("a draft made of the model's first N layers (Llama, Qwen2, Gemma): generate and chat "
                              "speculate with it instead of the heads; bench's self_draft method uses it",
                              type=positive_int, metavar="N", unset="none; half the model's layers in bench"),
    "draft_tokens": Flag("draft tokens per step", type=positive_int, metavar="K",
                         unset="chosen each step from measured acceptance and costs"),
    "max_draft_tokens": Flag("upper bound of the adaptive number of draft tokens (not with --draft-tokens, which "
                             "fixes the number)", type=positive_int, metavar="K", unset="8"),
    # Prompt files (bench, distill) and where a command writes (bench, distill, train).
    "prompts": Flag("prompt JSONL files, each FILE or FILE:N (the first N prompts of FILE): records with `turns` "
                    "(MT-bench's), `prompt`, `question`, `text`, `instruction` or `input`, or bare JSON strings; "
                    "bench times each prompt's first turn, reported by the record's `category` (else the file's "
                    "name), distill answers every turn", nargs="+", metavar="FILE[:N]"),
    "prompt_field": Flag("the prompt's field in every prompt file", metavar="NAME",
                         unset="read from each file's first record"),
    "output": Flag("where the command writes (bench: a folder for bench.json, bench.md, bench.png; distill: the "
                   "conversations, FILE.jsonl or a folder of gzipped chunks, resumable: prompts already in it are "
                   "skipped; train: a folder for the adapter, checkpoints/ and train_log.jsonl)", metavar="PATH"),
    # Training data and measuring heads (train, tree).
    "data": Flag("conversation JSONL files, as `medusa-spec distill` writes them", nargs="+", metavar="FILE"),
    "exclude": Flag("leave out the conversations of --data listed in these files: the trained_conversations.txt every "
                    "run writes beside its adapter (e.g. the one --init-heads came with), so that heads learn from "
                    "(train) and are measured on (train, tree) answers they have not seen; a conversation beginning "
                    "as a listed one is left out too", nargs="+", metavar="FILE"),
    "max_length": Flag("tokens per row; longer conversations are truncated", type=int),
    "batch_size": Flag("rows run through the model at once (distill: decoded together, a finished row taking the "
                       "next prompt at once; train: per micro-batch and process; tree: per measuring batch)",
                       type=int),
    "eval_ranks": Flag("ranks measured per head when evaluating (the tree builder's candidates)", type=int),
    "keep_loops": Flag("keep the loops answers end in (a run of 32 tokens each closing an 8-token sequence the answer "
                       "wrote before): distill lets such an answer run on instead of stopping it where the loop began; "
                       "train keeps loops in the loss and the held-out accuracy instead of leaving them out",
                       type=bool),
}


def add_flag(parser: argparse.ArgumentParser, name: str, default=None, *, required: bool = False,
             suppress: bool = False, default_help: str | None = None, aliases: tuple[str, ...] = ()) -> None:
    """Add FLAGS[name] as --name-with-dashes. default: this command's value when the flag is not given (the help
    says it, or default_help, this command's words for it; None: the flag's `unset` meaning); suppress: an absent
    flag leaves the namespace without it (the recipe-driven commands fill it from their settings); aliases: this
    command's old spellings of the flag (e.g. "--output-dir"), accepted and left out of --help."""
    flag = FLAGS[name]
    shown = default_help or (flag.unset if default is None else None)
    if required:
        help_text = flag.help + " (required)"
    elif shown is not None:
        help_text = f"{flag.help} (default: {shown})"
    else:
        help_text = f"{flag.help} (default: {default})"
    options = dict(default=argparse.SUPPRESS if suppress else default, help=help_text)
    if required and not suppress:
        if aliases:  # argparse would refuse an alias given for a required option: one of them is required
            parser = parser.add_mutually_exclusive_group(required=True)
        else:
            options["required"] = True
    if flag.type is bool:
        options["action"] = argparse.BooleanOptionalAction
    for key in ("type", "choices", "metavar", "nargs"):
        if flag.type is not bool and getattr(flag, key) is not None:
            options[key] = getattr(flag, key)
    parser.add_argument("--" + name.replace("_", "-"), **options)
    # An alias is a second argument with the same dest and no default of its own (the flag's default stands).
    hidden = {key: value for key, value in options.items() if key not in ("default", "help", "required")}
    for alias in aliases:
        parser.add_argument(alias, dest=name, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **hidden)
