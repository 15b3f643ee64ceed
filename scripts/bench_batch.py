"""Batched greedy decoding: the heads against transformers' `generate` on the same left-padded batch.

    python scripts/bench_batch.py [--heads DIR] [--batch 4] [--max-new-tokens 128] [--rounds 2] [--prompts FILE]

The first `--batch` prompts of `--prompts` (default: MT-bench first turns, one per category) form one batch.
`tree=None` measures its tree table first (outside the timings); each round then times, alternating, transformers'
greedy `generate`, `MedusaModel.generate` with `tree=None` (the library's default: it adapts its tree to how often the
heads guess right), with the tree it started from kept, and with the root alone (no speculation), and checks every
row is token-identical to transformers'. Prints tokens/s of each, the speed-up and tokens per step, measured in this
one run. `scripts/unfamiliar_prompts.jsonl` holds 4 prompts far from the heads' training data. Run it with nothing
else on the machine.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_spec import MedusaModel, default_model
from medusa_spec.bench import MT_BENCH, read_eval_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default=str(default_model.shipped_heads()))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=Path, default=MT_BENCH)
    args = parser.parse_args()
    path = default_model.prepare()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    mm = MedusaModel.from_pretrained(model, args.heads)
    prompts = [text for _, text in read_eval_prompts(args.prompts, per_category=1)][: args.batch]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    start_tree = mm.default_choices(len(prompts))  # measures tree=None's table once, untimed
    trees = {"tree=None": None, f"start tree kept ({len(start_tree) + 1} nodes)": start_tree, "root alone": []}
    seconds = dict.fromkeys(["transformers", *trees], 0.0)
    new = dict.fromkeys(trees, 0)
    steps = dict.fromkeys(trees, 0)
    sizes, identical, rows = [], dict.fromkeys(trees, 0), 0
    for _ in range(args.rounds):
        start = time.perf_counter()
        with torch.inference_mode():
            reference = model.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad)
        seconds["transformers"] += time.perf_counter() - start
        rows += len(prompts)
        for name, tree in trees.items():
            start = time.perf_counter()
            out = mm.generate(batch.input_ids, batch.attention_mask, max_new_tokens=args.max_new_tokens,
                              pad_token_id=pad, tree=tree)
            seconds[name] += time.perf_counter() - start
            width = min(reference.shape[1], out.sequences.shape[1])
            identical[name] += sum(torch.equal(a[:width], b[:width]) for a, b in zip(reference, out.sequences))
            new[name] += sum(out.stats.new_tokens)  # transformers' too, where the rows are identical
            steps[name] += sum(out.stats.row_steps)
            sizes += out.stats.tree_sizes or []
    reference_rate = new["tree=None"] / seconds["transformers"]
    print(f"batch {len(prompts)} ({args.prompts.name}), {args.max_new_tokens} new tokens, {args.rounds} rounds: "
          f"transformers {reference_rate:.1f} tok/s")
    for name in trees:
        rate = new[name] / seconds[name]
        print(f"  {name}: {rate:.1f} tok/s, {rate / reference_rate:.2f}x, {new[name] / steps[name]:.2f} tokens/step "
              f"per row, {identical[name]}/{rows} rows identical")
    print(f"  tree=None's tree sizes (steps): {dict(sorted((n, sizes.count(n)) for n in set(sizes)))}")


if __name__ == "__main__":
    main()
