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
- warm: a call on a MedusaModel that has run this batch before, beside transformers' greedy `generate` on it.
Each kind runs `--rounds` times, the two arms in turn and in the other order every round: on this project's 2-core
VMs two arms of identical work differ by up to 10% in one run, and a machine that slows down over a run would favour
whichever arm always ran first. Every row is checked token-identical to transformers'. Prints tokens/s (all rows' new
tokens / seconds, over the rounds) and the tree=None / tree=[] ratio of each. Without `--model`, SmolLM2-135M-Instruct
and its shipped heads. Run it with nothing else on the machine (`uptime`: a load average well under 1 on the cores it
uses), else the figures are not measurements.
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a causal LM folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--heads", default=None, help="heads folder (default: the shipped heads)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=Path, default=MT_BENCH)
    args = parser.parse_args(argv)
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
          f"{args.rounds} rounds")
    for rows in args.batches:
        batch = encode(rows)
        seconds = {(kind, name): 0.0 for kind in KINDS for name in METHODS}
        new = dict.fromkeys(seconds, 0)
        identical, checked, sizes = dict.fromkeys(METHODS, 0), 0, []
        reference_seconds = 0.0
        warm = {name: MedusaModel.from_pretrained(model, heads) for name in METHODS}
        for name, tree in METHODS.items():  # its first call at this batch size; the rounds' calls are warm ones
            with costs_on_disk(True):  # reads the step costs, or times them and keeps them for the kinds below
                run(warm[name], batch, tree)

        def timed(kind: str, name: str, mm: MedusaModel):
            elapsed, out = run(mm, batch, METHODS[name])
            seconds[kind, name] += elapsed
            new[kind, name] += sum(out.stats.new_tokens)
            return out

        for round_ in range(args.rounds):
            names = list(METHODS) if round_ % 2 == 0 else list(reversed(METHODS))
            for name in names:
                with costs_on_disk(False):
                    timed("first call", name, MedusaModel.from_pretrained(model, heads))  # timed inside: fresh
            for name in names:
                with costs_on_disk(True):
                    timed("first call, costs on disk", name, MedusaModel.from_pretrained(model, heads))
            if rows > 1:
                for name in names:
                    at_one = MedusaModel.from_pretrained(model, heads)
                    with costs_on_disk(True):  # the one-row call reads the step costs (or times and keeps them)
                        run(at_one, encode(1), METHODS[name])
                    timed("new batch size", name, at_one)
            start = time.perf_counter()
            with torch.inference_mode():
                reference = model.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False,
                                           pad_token_id=pad)
            reference_seconds += time.perf_counter() - start
            checked += rows
            for name in names:
                out = timed("warm", name, warm[name])
                width = min(reference.shape[1], out.sequences.shape[1])
                identical[name] += sum(torch.equal(a[:width], b[:width]) for a, b in zip(reference, out.sequences))
                if name == "tree=None":
                    sizes += out.stats.tree_sizes or [1] * (out.stats.steps - 1)
        reference_rate = new["warm", "tree=[]"] / reference_seconds
        print(f"batch {rows}: transformers {reference_rate:.1f} tok/s; "
              + ", ".join(f"{name} {identical[name]}/{checked} rows identical" for name in METHODS))
        for kind in KINDS:
            if kind == "new batch size" and rows == 1:
                continue  # a call at batch 1 after one at batch 1 is a warm one
            rates = {name: new[kind, name] / seconds[kind, name] for name in METHODS}
            print(f"  {kind:>25}: " + "  ".join(f"{name} {rate:7.1f} tok/s" for name, rate in rates.items())
                  + f"  tree=None / tree=[] {rates['tree=None'] / rates['tree=[]']:.2f}x")
        print(f"  tree=None's tree sizes (steps, warm): {dict(sorted((n, sizes.count(n)) for n in set(sizes)))}")


if __name__ == "__main__":
    main()
