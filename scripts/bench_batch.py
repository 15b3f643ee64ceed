"""Batched greedy decoding: `tree=None` against `tree=[]` (no speculation) at batch 1, 4 and 8, warm and at first calls.

    python scripts/bench_batch.py [--model DIR] [--heads DIR] [--batches 1 4 8] [--max-new-tokens 128] [--rounds 2]
        [--prompts FILE]

Batch B is the first B prompts of `--prompts` (default: MT-bench first turns, one per category), left-padded. For each
batch size and each of `tree=None` (the library's default) and `tree=[]`, in this one run:
- first call: a MedusaModel fresh from the heads folder, its first generate() at that batch size (tree=None's step
  costs are timed inside it, with MEDUSA_SPEC_STEP_COSTS=0; both pack the base model's weights in it);
- first call, costs on disk: the same, in a process after the one that timed them (cost_cache: read, not timed);
- new batch size: a MedusaModel that has run one call at batch 1, its first call at that batch size (issue 57: tree=None
  must not time anything again here);
- warm: `--rounds` calls each, alternating with transformers' greedy `generate` on the same batch.
Every row is checked token-identical to transformers'. Prints tokens/s (all rows' new tokens / seconds) and the
tree=None / tree=[] ratio of each. Without `--model`, SmolLM2-135M-Instruct and its shipped heads. Run it with nothing
else on the machine (`uptime`: a load average well under 1 on the cores it uses), else the figures are not
measurements.
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_spec import MedusaModel, default_model
from medusa_spec.bench import MT_BENCH, read_eval_prompts

METHODS = {"tree=None": None, "tree=[]": []}
KINDS = ("warm", "new batch size", "first call", "first call, costs on disk")


@contextmanager
def costs_on_disk(on: bool):
    """Step costs read from and kept on disk (cost_cache) or timed in this process alone, for the block."""
    before = os.environ.get("MEDUSA_SPEC_STEP_COSTS")
    os.environ["MEDUSA_SPEC_STEP_COSTS"] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["MEDUSA_SPEC_STEP_COSTS"]
        else:
            os.environ["MEDUSA_SPEC_STEP_COSTS"] = before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a causal LM folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--heads", default=None, help="heads folder (default: the shipped heads)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=Path, default=MT_BENCH)
    args = parser.parse_args()
    path = args.model or default_model.prepare()
    heads = args.heads or str(default_model.shipped_heads())
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = [text for _, text in read_eval_prompts(args.prompts, per_category=1)]
    if len(prompts) < max(args.batches):
        raise SystemExit(f"{args.prompts} gives {len(prompts)} prompts (one per category), fewer than batch "
                         f"{max(args.batches)}")
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]

    def encode(rows: int):
        return tokenizer(texts[:rows], return_tensors="pt", padding=True, add_special_tokens=False)

    def run(mm: MedusaModel, batch, tree) -> tuple[float, object]:
        start = time.perf_counter()
        out = mm.generate(batch.input_ids, batch.attention_mask, max_new_tokens=args.max_new_tokens,
                          pad_token_id=pad, tree=tree)
        return time.perf_counter() - start, out

    print(f"{Path(path).name}, heads {Path(heads).name}; {args.prompts.name}; {args.max_new_tokens} new tokens; "
          f"{args.rounds} warm rounds")
    warmed_at_one = {}
    for name, tree in METHODS.items():  # the MedusaModels of 'new batch size': one call at batch 1 first
        warmed_at_one[name] = MedusaModel.from_pretrained(model, heads)
        with costs_on_disk(True):  # they time the step costs, or read them, and keep them on disk
            run(warmed_at_one[name], encode(1), tree)
    for rows in args.batches:
        batch = encode(rows)
        seconds = {(kind, name): 0.0 for kind in KINDS for name in METHODS}
        new = dict.fromkeys(seconds, 0)
        identical, checked, sizes = dict.fromkeys(METHODS, 0), 0, []
        reference_seconds = 0.0
        warm = {name: MedusaModel.from_pretrained(model, heads) for name in METHODS}
        for name, tree in METHODS.items():
            with costs_on_disk(False):
                seconds["first call", name], out = run(warm[name], batch, tree)  # fresh: this is its first call
            new["first call", name] = sum(out.stats.new_tokens)
            with costs_on_disk(True):
                seconds["first call, costs on disk", name], out = run(MedusaModel.from_pretrained(model, heads),
                                                                      batch, tree)
            new["first call, costs on disk", name] = sum(out.stats.new_tokens)
            seconds["new batch size", name], out = run(warmed_at_one[name], batch, tree)
            new["new batch size", name] = sum(out.stats.new_tokens)
        for _ in range(args.rounds):
            start = time.perf_counter()
            with torch.inference_mode():
                reference = model.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False,
                                           pad_token_id=pad)
            reference_seconds += time.perf_counter() - start
            checked += rows
            for name, tree in METHODS.items():
                elapsed, out = run(warm[name], batch, tree)
                seconds["warm", name] += elapsed
                new["warm", name] += sum(out.stats.new_tokens)
                width = min(reference.shape[1], out.sequences.shape[1])
                identical[name] += sum(torch.equal(a[:width], b[:width]) for a, b in zip(reference, out.sequences))
                if name == "tree=None":
                    sizes += out.stats.tree_sizes or [1] * (out.stats.steps - 1)
        reference_rate = new["warm", "tree=[]"] / reference_seconds
        print(f"batch {rows}: transformers {reference_rate:.1f} tok/s; "
              + ", ".join(f"{name} {identical[name]}/{checked} rows identical" for name in METHODS))
        for kind in KINDS:
            if kind == "new batch size" and rows == 1:
                continue  # the batch-1 call before was its first: these calls are warm ones
            rates = {name: new[kind, name] / seconds[kind, name] for name in METHODS}
            print(f"  {kind:>25}: " + "  ".join(f"{name} {rate:7.1f} tok/s" for name, rate in rates.items())
                  + f"  tree=None / tree=[] {rates['tree=None'] / rates['tree=[]']:.2f}x")
        print(f"  tree=None's tree sizes (steps, warm): {dict(sorted((n, sizes.count(n)) for n in set(sizes)))}")


if __name__ == "__main__":
    main()
