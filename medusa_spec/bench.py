"""`medusa-spec bench`: every decoding method on the same prompts, in one process, alternating per prompt.

Methods: transformers greedy `generate` (the reference), transformers prompt-lookup decoding,
this library with speculation off (same loop, root-only tree), greedy with the tree, and
sampling at T=0.7; then the other proposers through this library's verifier, greedy: the tree
plus a prompt-lookup chain (medusa_lookup), the lookup chain alone (lookup), a draft made of
the base model's first layers with adaptive K (self_draft) and a separate draft model
(draft_model, only when one is given); and llama.cpp decoding a GGUF of the same weights greedily
from the same token ids (llama_cpp, where llama-cpp-python is installed). Reports tokens/s, mean
tokens per step (per base-model pass), speed-up over the reference, for the speculating methods
speculation's own share (their rate over medusa_off's: the same loop and kernels without drafting) and,
for greedy methods, the fraction of prompts whose output equals the reference token for token; for this
library's methods, where each decoding step's time goes (loop.StepTimer): drafting, the verify pass,
acceptance and the cache commit, in ms per step and share. provenance() says what a report was run on.
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .autotree import COMPILED_TREE_NODES
from .compiled import block_size
from .dflash_propose import generate_with_dflash
from .draft import generate_with_draft, self_draft
from .lookup import LOOKUP_TOKENS
from .loop import StepTimer
from .prompts import parse_prompt_spec, read_prompts

METHODS = ("hf_greedy", "hf_prompt_lookup", "hf_sample", "llama_cpp", "medusa_off", "medusa_greedy", "medusa_sample",
           "medusa_lookup", "lookup", "self_draft", "draft_model", "dflash")
DRAFT_METHODS = ("self_draft", "draft_model", "dflash")  # dflash: a DFlash draft (load_dflash), generate_with_dflash
# Every method that needs nothing beyond this package and the model: draft_model needs a second model, dflash a DFlash
# draft, llama_cpp an optional package and a GGUF file (the command line adds each where it can run).
DEFAULT_METHODS = tuple(m for m in METHODS if m not in ("draft_model", "dflash", "llama_cpp"))
GREEDY = ("hf_prompt_lookup", "llama_cpp", "medusa_off", "medusa_greedy", "medusa_lookup", "lookup", "self_draft",
          "draft_model", "dflash")
REFERENCE = "hf_greedy"
# Speculation off: this library's loop and kernels with the root-only tree. The greedy methods that speculate through
# the same loop are also given their rate over it, the part of their speed-up that speculation earns.
SPECULATION_OFF = "medusa_off"
SPECULATING = ("medusa_greedy", "medusa_lookup", "lookup", "self_draft", "draft_model", "dflash")
# Sampled methods draw as transformers' generate does with these settings (the rest from the model's generation
# config, as generate reads it), and their speed-up is over transformers sampling so: top-p sorts the vocabulary at
# every token, a cost a greedy reference would not pay.
SAMPLING = dict(do_sample=True, temperature=0.7, top_p=0.9)
SAMPLED = ("hf_sample", "medusa_sample")
STEP_STAGES = StepTimer.STAGES[1:]  # a step's stages; prefill, once per prompt, is reported apart
# The default prompts ship inside the package, with their licence (data/SOURCE.md), so bench runs from any install.
MT_BENCH = Path(__file__).resolve().parent / "data" / "mt_bench_question.jsonl"


def read_eval_prompts(specs: str | Path | list, per_category: int | None = None,
                      prompt_field: str | None = None) -> list[tuple[str, str]]:
    """(category, first turn) of the prompts of --prompts FILE[:N] ... (one path, or a list of them), each file read
    as distill reads it (prompts.py: any prompt shape it knows; FILE:N, its first N prompts); the category is the
    record's `category` (MT-bench's), else the file's name without .jsonl; at most `per_category` per category."""
    specs = [specs] if isinstance(specs, (str, Path)) else specs
    prompts, seen = [], defaultdict(int)
    for spec in specs:
        path, limit = parse_prompt_spec(str(spec))
        for prompt in read_prompts(path, prompt_field, limit):
            category = prompt.category or path.name.removesuffix(".jsonl")
            if per_category is None or seen[category] < per_category:
                seen[category] += 1
                prompts.append((category, prompt.turns[0]))
    if not prompts:
        raise ValueError(f"{' '.join(map(str, specs))}: no prompts")
    return prompts


def encode(tokenizer, text: str) -> torch.Tensor:
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"]
    return tokenizer(text, return_tensors="pt").input_ids


class LlamaCpp:
    """llama.cpp (llama-cpp-python's Llama) decoding a GGUF file greedily from token ids, stopping after max_new_tokens
    or at one of `eos` (as transformers' generate stops at the generation config's eos_token_id)."""

    def __init__(self, gguf: str | Path, n_ctx: int, threads: int, eos: set[int]):
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   verbose=False)
        self.eos = eos

    def generate(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """The new token ids after the prompt `ids`."""
        new = []
        # reset() first: otherwise Llama.generate keeps the cache of the prefix this prompt shares with the last one
        # (a chat template's system turn) and skips its prefill, which no other method is given.
        self.llm.reset()
        # temp=0 is llama.cpp's greedy sampler; a repeat penalty of 1 changes no logit.
        for token in self.llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            new.append(int(token))
            if len(new) == max_new_tokens or token in self.eos:
                break
        return new


def llama_cpp_missing(gguf: str | Path | None) -> str | None:
    """Why the llama_cpp method cannot run here, or None when it can."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as err:  # not installed, or its compiled library failed to load (OSError, RuntimeError)
        return f"llama-cpp-python is not importable ({type(err).__name__}: {err}); pip install -e \".[llamacpp]\""
    if gguf is None:
        return "no GGUF file of the model's weights: pass --gguf FILE"
    if not Path(gguf).is_file():
        return f"--gguf {shown_path(gguf)}: no such file"
    return None


def eos_ids(base_model) -> set[int]:
    """The token ids transformers' generate stops at by default: the generation config's eos_token_id."""
    eos = base_model.generation_config.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


def run_method(method: str, mm, input_ids: torch.Tensor, max_new_tokens: int, tree, drafts=None,
               lookup_tokens: int = LOOKUP_TOKENS, llama: LlamaCpp | None = None, compile: bool = False) -> dict:
    """One generation; returns new tokens, seconds, forward passes (None where unknown) and the sequence, and
    for this library's methods the seconds of each decoding stage (stage_seconds) over timed_steps steps.
    drafts: {method: draft model} for the draft methods; llama: the engine of llama_cpp; compile: the MedusaModel's
    methods verify through compiled graphs (generate(compile=True))."""
    base = mm.base_model
    if method == "llama_cpp":
        start = time.perf_counter()
        new = llama.generate(input_ids[0].tolist(), max_new_tokens)
        seconds = time.perf_counter() - start
        return {"new_tokens": len(new), "seconds": seconds, "steps": len(new),
                "sequence": torch.cat([input_ids[0].cpu(), torch.tensor(new, dtype=input_ids.dtype)])}
    input_ids = input_ids.to(base.device)
    # Every method reads the whole prompt: none infers padding from a pad token the prompt happens to hold.
    mask = torch.ones_like(input_ids)
    start = time.perf_counter()
    if method.startswith("hf_"):
        extra = {"hf_prompt_lookup": dict(prompt_lookup_num_tokens=LOOKUP_TOKENS),
                 "hf_sample": SAMPLING}.get(method, {})
        with torch.inference_mode():
            sequence = base.generate(input_ids, attention_mask=mask,
                                     max_new_tokens=max_new_tokens, **{"do_sample": False, **extra})[0]
        seconds = time.perf_counter() - start
        new = sequence.shape[0] - input_ids.shape[1]
        return {"new_tokens": new, "seconds": seconds, "steps": new if method in (REFERENCE, "hf_sample") else None,
                "sequence": sequence.cpu()}
    timer = StepTimer()
    if method == "dflash":  # eager: only the MedusaModel's methods have compiled graphs
        out = generate_with_dflash(base, drafts[method], input_ids, mask, max_new_tokens=max_new_tokens, timer=timer)
    elif method in DRAFT_METHODS:
        out = generate_with_draft(base, drafts[method], input_ids, mask, max_new_tokens=max_new_tokens, timer=timer)
    else:
        # lookup is the chain alone: the root-only tree (tree=[]) with the chain, as generate_with_lookup(base).
        options = {"medusa_off": dict(tree=[]), "medusa_sample": SAMPLING,
                   "medusa_lookup": dict(lookup_tokens=lookup_tokens),
                   "lookup": dict(tree=[], lookup_tokens=lookup_tokens)}.get(method, {})
        out = mm.generate(input_ids, mask, max_new_tokens=max_new_tokens, timer=timer, compile=compile,
                          **{"tree": tree, **options})
    seconds = time.perf_counter() - start
    record = {"new_tokens": out.stats.new_tokens[0], "seconds": seconds, "steps": out.stats.row_steps[0],
              "stage_seconds": timer.seconds, "timed_steps": timer.steps, "sequence": out.sequences[0].cpu()}
    if out.stats.acceptance_rate is not None:
        record["acceptance_rate"] = out.stats.acceptance_rate
    if out.stats.draft_lengths:  # a draft model's K, or the lookup chain's length
        record["mean_draft_length"] = sum(out.stats.draft_lengths) / len(out.stats.draft_lengths)
    if out.stats.tree_sizes:  # tree=None: the heads' tree adapted step by step (1 = the root alone)
        record["mean_tree_nodes"] = sum(out.stats.tree_sizes) / len(out.stats.tree_sizes)
    return record


def draft_models(base_model, methods, self_draft_layers: int | None = None, draft_model=None, dflash=None) -> dict:
    """{method: draft model} for the draft methods among `methods`: the base model's first `self_draft_layers`
    layers (default: half of them) for self_draft, `draft_model` (if given) for draft_model, `dflash` (a DFlash draft,
    if given) for dflash."""
    drafts = {}
    if "self_draft" in methods:
        layers = self_draft_layers or max(1, base_model.config.get_text_config().num_hidden_layers // 2)
        drafts["self_draft"] = self_draft(base_model, layers)
    if "draft_model" in methods and draft_model is not None:
        drafts["draft_model"] = draft_model
    if "dflash" in methods and dflash is not None:
        drafts["dflash"] = dflash
    return drafts


def bench(mm, tokenizer, prompts: list[tuple[str, str]], max_new_tokens: int = 256, tree=None,
          methods=DEFAULT_METHODS, seed: int = 0, drafts=None, lookup_tokens: int = LOOKUP_TOKENS,
          gguf: str | Path | None = None, compile: bool = False) -> list[dict]:
    """Per-prompt records of every method; the methods' order rotates from prompt to prompt.
    drafts: {method: draft model} for the draft methods among `methods` (see draft_models); gguf: the GGUF file of
    the same weights that llama_cpp decodes, on as many threads as torch uses; compile: this library's methods
    verify through compiled graphs, every block size they may meet compiled before the first prompt."""
    methods = tuple(methods)
    missing = [m for m in methods if m in DRAFT_METHODS and m not in (drafts or {})]
    if missing:
        raise ValueError(f"{', '.join(missing)} needs a draft model: pass drafts (bench.draft_models) or, on the "
                         f"command line, --draft-model DIR for draft_model and --dflash DIR for dflash")
    if "llama_cpp" in methods and (why := llama_cpp_missing(gguf)):
        raise ValueError(f"llama_cpp cannot run: {why}")
    torch.manual_seed(seed)
    warm = encode(tokenizer, "Hello")
    encoded = [(category, encode(tokenizer, text)) for category, text in prompts]
    llama = None
    if "llama_cpp" in methods:
        longest = max(ids.shape[1] for ids in [warm] + [ids for _, ids in encoded])
        llama = LlamaCpp(gguf, longest + max_new_tokens, torch.get_num_threads(), eos_ids(mm.base_model))
    for method in methods:  # first calls pay one-off costs (allocations, kernel selection)
        run_method(method, mm, warm, 4, tree, drafts, lookup_tokens, llama, compile)
    if compile and {"medusa_lookup", "lookup"} & set(methods):
        # the graphs of the blocks a lookup chain may add: compiled now, not inside a timed prompt
        mm.compile_blocks(sorted({block_size(n) for n in range(1, COMPILED_TREE_NODES + lookup_tokens + 1)}))
    records = []
    for i, (category, input_ids) in enumerate(tqdm(encoded, desc="bench", unit="prompt")):
        order = methods[i % len(methods):] + methods[: i % len(methods)]
        results = {method: run_method(method, mm, input_ids, max_new_tokens, tree, drafts, lookup_tokens, llama,
                                      compile) for method in order}
        reference = results[REFERENCE]["sequence"] if REFERENCE in results else None
        for method, result in results.items():
            sequence = result.pop("sequence")
            if reference is not None and method in GREEDY:
                result["equal_to_reference"] = torch.equal(sequence, reference)
            records.append({"prompt": i, "category": category, "method": method, **result})
    return records


def reference_of(method: str) -> str:
    """The transformers run a method's speed-up is over: the one decoding the same way."""
    return "hf_sample" if method in SAMPLED else REFERENCE


def summarize(records: list[dict]) -> dict:
    """{group: {method: figures}} for every category and "overall"; a speed-up is over reference_of(method),
    None where that did not run; over_medusa_off, for the SPECULATING methods where medusa_off ran, is the rate over
    medusa_off's, so that a speed-up is medusa_off's (the kernels') times it (speculation's)."""
    groups = defaultdict(lambda: defaultdict(list))
    for record in records:
        for group in (record["category"], "overall"):
            groups[group][record["method"]].append(record)
    summary = {}
    for group, by_method in groups.items():
        rate = {m: sum(r["new_tokens"] for r in rs) / sum(r["seconds"] for r in rs) for m, rs in by_method.items()}
        summary[group] = {}
        for method, rs in by_method.items():
            steps = [r["steps"] for r in rs]
            figures = {"prompts": len(rs), "new_tokens": sum(r["new_tokens"] for r in rs),
                       "tokens_per_second": round(rate[method], 2),
                       "tokens_per_step": (round(sum(r["new_tokens"] for r in rs) / sum(steps), 3)
                                           if None not in steps else None),
                       "speedup": (round(rate[method] / rate[reference_of(method)], 3)
                                   if reference_of(method) in rate else None)}
            if method in SPECULATING and SPECULATION_OFF in rate:
                figures["over_medusa_off"] = round(rate[method] / rate[SPECULATION_OFF], 3)
            if method in GREEDY and REFERENCE in rate:
                figures["equal_to_reference"] = round(sum(r["equal_to_reference"] for r in rs) / len(rs), 3)
            for name in ("acceptance_rate", "mean_draft_length"):
                if all(name in r for r in rs):
                    figures[name] = round(sum(r[name] for r in rs) / len(rs), 3)
            if all("mean_tree_nodes" in r for r in rs):  # tree=None: the sizes behind the tokens per step
                figures["mean_tree_nodes"] = round(sum(r["mean_tree_nodes"] * r["timed_steps"] for r in rs)
                                                   / sum(r["timed_steps"] for r in rs), 2)
            if "stage_seconds" in rs[0]:
                figures |= step_stages(rs)
            summary[group][method] = figures
    return summary


def step_stages(records: list[dict]) -> dict:
    """Where the decoding steps' time went, over `records` of one method: step_ms (the mean step) and, per
    stage, ms_per_step and share of the step; prefill_ms, once per prompt, apart. No stages without a step."""
    steps = sum(r["timed_steps"] for r in records)
    figures = {"prefill_ms": round(1000 * sum(r["stage_seconds"]["prefill"] for r in records) / len(records), 2)}
    if not steps:
        return figures
    seconds = {stage: sum(r["stage_seconds"][stage] for r in records) for stage in STEP_STAGES}
    step = sum(seconds.values())
    return figures | {"step_ms": round(1000 * step / steps, 3),
                      "stages": {stage: {"ms_per_step": round(1000 * s / steps, 3), "share": round(s / step, 3)}
                                 for stage, s in seconds.items()}}


def markdown(summary: dict, skipped: dict | None = None) -> str:
    """The report's tables; skipped: {method: why it did not run}, said under them."""
    lines = ["| group | method | tok/s | tokens/step | speed-up | over medusa_off | = greedy |",
             "|---|---|---|---|---|---|---|"]
    for group in sorted(summary, key=lambda g: (g == "overall", g)):
        for method in sorted(summary[group], key=METHODS.index):
            f = summary[group][method]
            cells = [group, method, f"{f['tokens_per_second']:.1f}",
                     "-" if f["tokens_per_step"] is None else f"{f['tokens_per_step']:.2f}",
                     "-" if f["speedup"] is None else f"{f['speedup']:.2f}x",
                     f"{f['over_medusa_off']:.2f}x" if "over_medusa_off" in f else "-",
                     f"{f['equal_to_reference']:.0%}" if "equal_to_reference" in f else "-"]
            lines.append("| " + " | ".join(cells) + " |")
    settings = ", ".join(f"{k} {v}" for k, v in SAMPLING.items() if k != "do_sample")
    lines += ["", f"Speed-up over {REFERENCE}; {' and '.join(SAMPLED)} over hf_sample (sampling at {settings}). "
              f"Over medusa_off: speculation's own share, the rate over this library's loop with speculation off "
              f"(tree=[], the same kernels); a speed-up is medusa_off's times it."]
    lines += [f"{method} skipped: {why}." for method, why in (skipped or {}).items()]
    timed = {m: f for m, f in summary.get("overall", {}).items() if "stages" in f}
    if timed:
        lines += ["", "Where a step's time goes (overall; ms per step and share of the step; tree nodes: the mean "
                  "size tree=None chose, root included):", "",
                  "| method | step ms | tree nodes | " + " | ".join(STEP_STAGES) + " | prefill ms |",
                  "|---" * (len(STEP_STAGES) + 4) + "|"]
        for method in sorted(timed, key=METHODS.index):
            f = timed[method]
            cells = [method, f"{f['step_ms']:.2f}", f"{f['mean_tree_nodes']:.2f}" if "mean_tree_nodes" in f else "-",
                     *(f"{f['stages'][s]['ms_per_step']:.2f} ({f['stages'][s]['share']:.0%})" for s in STEP_STAGES),
                     f"{f['prefill_ms']:.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> bool:
    """Speed-up by category and method as a PNG; False when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = sorted(summary, key=lambda g: (g == "overall", g))
    methods = [m for m in METHODS if any(m in summary[g] for g in groups)]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups)), 4))
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        ax.bar([i + j * width for i in range(len(groups))],
               [summary[g].get(method, {}).get("speedup") or 0 for g in groups], width, label=method)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], groups, rotation=30, ha="right")
    ax.set_ylabel(f"speed-up over {REFERENCE} (sampled: over hf_sample)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(records: list[dict], out_dir: str | Path, meta: dict) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(records)
    (out_dir / "bench.json").write_text(json.dumps({"meta": meta, "summary": summary, "records": records}, indent=1))
    (out_dir / "bench.md").write_text(markdown(summary, meta.get("skipped")))
    plotted = plot(summary, out_dir / "bench.png")
    return {"summary": summary, "plotted": plotted}


def shown_path(path: str | Path) -> str:
    """`path` as a report names it, never as a path of the machine it ran on: as given when relative, else relative
    to the working folder or to the folder holding this package (a checkout's heads/, the package's data/), else by
    its name alone."""
    path = Path(path)
    if not path.is_absolute():
        return path.as_posix()
    path = path.resolve()
    for root in (Path.cwd().resolve(), Path(__file__).resolve().parent.parent):
        if root != Path(root.anchor) and path.is_relative_to(root):
            return path.relative_to(root).as_posix()
    return path.name


def shown_prompt_spec(spec: str) -> str:
    """A --prompts FILE[:N] as a report names it (shown_path)."""
    path, limit = parse_prompt_spec(spec)
    return shown_path(path) + ("" if limit is None else f":{limit}")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def weights_sha256(folder: str | Path) -> dict[str, str]:
    """{file name relative to `folder`: sha256} of every weights file in an adapter folder (any format's, a LoRA's
    under lora/ too)."""
    folder = Path(folder)
    return {path.relative_to(folder).as_posix(): file_sha256(path) for path in sorted(folder.rglob("*"))
            if path.is_file() and path.suffix in (".safetensors", ".pt", ".bin", ".pth")}


def library_commit() -> dict:
    """This package's git commit when it runs from a checkout (None otherwise: an installed wheel, where its version
    says what it is) and whether its tracked files differ from that commit."""
    package = Path(__file__).resolve().parent

    def git(*args) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(package), *args], capture_output=True, text=True, timeout=30)

    try:
        # Tracked here, not only inside some repository: a virtual environment in a checkout is not the checkout.
        if git("ls-files", "--error-unmatch", Path(__file__).name).returncode:
            return {"commit": None}
        commit = git("rev-parse", "HEAD").stdout.strip()
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".").stdout.strip()
    except (OSError, subprocess.SubprocessError):  # no git, or it hung
        return {"commit": None}
    return {"commit": commit or None, "uncommitted_changes": bool(changed)}


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (/proc/cpuinfo), else as Python's platform module does."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(heads: str | Path | None = None, gguf: str | Path | None = None) -> dict:
    """What a report's numbers were measured with: this library's version and commit (library_commit), the sha256 of
    the adapter's weights files (and of the GGUF file llama_cpp decoded), the CPU and the libraries' versions."""
    import transformers

    from . import __version__

    versions = {"medusa_spec": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                "python": platform.python_version()}
    figures = {"medusa_spec": {"version": __version__, **library_commit()}, "versions": versions,
               "cpu": cpu_model(), "adapter_sha256": weights_sha256(heads) if heads is not None else None}
    if gguf is not None:
        import llama_cpp

        versions["llama_cpp"] = getattr(llama_cpp, "__version__", None)
        figures["gguf_sha256"] = file_sha256(Path(gguf))
    return figures
