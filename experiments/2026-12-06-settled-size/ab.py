# One-off: drafting that stops once the step's size is settled (DynamicDraftLayerProposer.size_settled) against
# drafting that stops only where no deeper candidate could enter a `nodes`-node tree (size_settled patched to say
# no), in one process, eager, greedy, 128 new tokens, step costs timed in this process (MEDUSA_SPEC_STEP_COSTS=0).
# Batch 1: the first 8 MT-bench prompts (one per category), tree=[] and tree=None (a priced DynamicTree) with each
# stop, arms rotating per prompt. Batch 4: the first 4 prompts left-padded, tree=[], tree=None (static trees for a
# batch) and the DynamicTree priced for 4 rows with each stop, 2 rounds. Every output is checked against the first
# speculating arm's (the same trees by construction) and against tree=[]'s. Usage: python ab.py
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_spec import MedusaModel, default_model
from medusa_spec.bench import MT_BENCH, read_eval_prompts
from medusa_spec.eagle import DraftLayer
from medusa_spec.propose import DynamicDraftLayerProposer

os.environ["MEDUSA_SPEC_STEP_COSTS"] = "0"
path = default_model.prepare()
tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
         for _, p in read_eval_prompts(MT_BENCH, per_category=1)]
mm = MedusaModel.from_pretrained(model, default_model.shipped_heads())
settled, forward = DynamicDraftLayerProposer.size_settled, DraftLayer.forward
passes = [0]


def counting(*args, **kwargs):
    passes[0] += 1
    return forward(*args, **kwargs)


DraftLayer.forward = counting


def run(batch, tree, stop):
    DynamicDraftLayerProposer.size_settled = settled if stop == "settled" else (lambda *args: False)
    passes[0] = 0
    start = time.perf_counter()
    out = mm.generate(batch.input_ids, batch.attention_mask, max_new_tokens=128, tree=tree,
                      pad_token_id=tokenizer.pad_token_id)
    return time.perf_counter() - start, out, passes[0]


def report(rows, arms, records):
    off = sum(records["tree=[]"]["new"]) / sum(records["tree=[]"]["seconds"])
    for name in arms:
        r = records[name]
        rate = sum(r["new"]) / sum(r["seconds"])
        print(f"  batch {rows} {name:>28}: {rate:6.1f} tok/s  {rate / off:.3f}x tree=[]  "
              f"{sum(r['new']) / sum(r['steps']) / rows:.2f} tok/step/row  "
              f"{sum(r['passes']) / sum(r['steps']):.2f} draft passes/step  {r['same']}/{len(r['new'])} calls same",
              flush=True)


print(f"torch threads {torch.get_num_threads()}")
arms = {"tree=[]": ([], "settled"), "tree=None, settled": (None, "settled"), "tree=None, nodes only": (None, "nodes")}
records = {name: {"seconds": [], "new": [], "steps": [], "passes": [], "same": 0} for name in arms}
for i, text in enumerate(texts[:8]):
    batch = tokenizer([text], return_tensors="pt", add_special_tokens=False)
    if i == 0:
        for tree, stop in arms.values():
            run(batch, tree, stop)  # warm-up: step costs, packed weights
    names = list(arms)[i % 3:] + list(arms)[: i % 3]
    outputs = {}
    for name in names:
        seconds, out, count = run(batch, *arms[name])
        outputs[name] = out.sequences
        for key, value in (("seconds", seconds), ("new", sum(out.stats.new_tokens)), ("steps", out.stats.steps),
                           ("passes", count)):
            records[name][key].append(value)
    for name in arms:
        records[name]["same"] += torch.equal(outputs[name], outputs["tree=[]"])
report(1, arms, records)

batch = tokenizer(texts[:4], return_tensors="pt", padding=True, add_special_tokens=False)
priced = mm.dynamic_tree(4)
arms = {"tree=[]": ([], "settled"), "tree=None (static)": (None, "settled"),
        "DynamicTree priced, settled": (priced, "settled"), "DynamicTree priced, nodes only": (priced, "nodes")}
records = {name: {"seconds": [], "new": [], "steps": [], "passes": [], "same": 0} for name in arms}
for tree, stop in arms.values():
    run(batch, tree, stop)
for r in range(2):
    names = list(arms)[r:] + list(arms)[:r]
    outputs = {}
    for name in names:
        seconds, out, count = run(batch, *arms[name])
        outputs[name] = out.sequences
        for key, value in (("seconds", seconds), ("new", sum(out.stats.new_tokens)), ("steps", out.stats.steps),
                           ("passes", count)):
            records[name][key].append(value)
    for name in arms:
        records[name]["same"] += torch.equal(outputs[name], outputs["tree=[]"])
report(4, arms, records)
