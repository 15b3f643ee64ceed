"""Batch 4 and 8 (eager): what tree=None's pricing predicts against what each fixed tree runs at.

For each batch: the table AdaptiveTree starts from (StepCosts.at(batch), costs timed in this process), then warm calls
of tree=[], tree=[[0]], tree=[[0],[0,0]] and tree=None, interleaved for `--rounds`, each with a StepTimer: tokens a
row-step, ms a step and per stage, and the tree sizes tree=None chose. Usage: python diagnose.py [--batches 4 8]
[--rounds 2] [--trees "[]" "[[0]]" None] (alone on the machine)."""

from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_spec import MedusaModel, default_model
from medusa_spec.bench import MT_BENCH, read_eval_prompts
from medusa_spec.loop import StepTimer

os.environ["MEDUSA_SPEC_STEP_COSTS"] = "0"
parser = argparse.ArgumentParser()
parser.add_argument("--batches", type=int, nargs="+", default=[4, 8])
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--trees", nargs="+", default=["[]", "[[0]]", "[[0],[0,0]]", "None"])
parser.add_argument("--no-table", action="store_true")
args = parser.parse_args()
path = default_model.prepare()
tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
mm = MedusaModel.from_pretrained(model, str(default_model.shipped_heads()))
texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
         for _, p in read_eval_prompts(MT_BENCH, per_category=1)]
trees = {name: eval(name) for name in args.trees}  # noqa: S307 (a one-off script's own arguments)
for rows in args.batches:
    batch = tokenizer(texts[:rows], return_tensors="pt", padding=True, add_special_tokens=False)
    print(f"== batch {rows}, prompt width {batch.input_ids.shape[1]}")
    for row in ([] if args.no_table else mm._trees.table(mm, rows)):
        print({k: v for k, v in row.items() if k != "tree"})
    totals = {name: [0.0, 0, 0, 0, StepTimer()] for name in trees}
    sizes = []
    for _ in range(args.rounds):
        for name, tree in trees.items():
            timer = totals[name][4]
            start = time.perf_counter()
            out = mm.generate(batch.input_ids, batch.attention_mask, max_new_tokens=args.max_new_tokens,
                              pad_token_id=tokenizer.eos_token_id, tree=tree, timer=timer)
            totals[name][0] += time.perf_counter() - start
            totals[name][1] += sum(out.stats.new_tokens)
            totals[name][2] += sum(out.stats.row_steps)
            totals[name][3] += out.stats.steps - 1
            if name == "None":
                sizes += out.stats.tree_sizes or []
    first = next(iter(totals.values()))
    base = first[1] / first[0]
    for name, (seconds, new, row_steps, steps, timer) in totals.items():
        per = {k: round(1000 * v / max(timer.steps, 1), 1) for k, v in timer.seconds.items() if k != "prefill"}
        prefill = 1000 * timer.seconds["prefill"] / args.rounds
        print(f"tree={name:12} {new / seconds:6.1f} tok/s ({new / seconds / base:.2f}x)  "
              f"{new / row_steps:.2f} tok/row-step  {steps / args.rounds:.0f} steps  ms/step {per}  "
              f"prefill {prefill:.0f} ms")
    print("tree=None sizes", dict(sorted((n, sizes.count(n)) for n in set(sizes))))
