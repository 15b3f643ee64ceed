# One-off: blocks of 2 and 4 nodes (dc71fd7) against padding every 2-8 node tree to the 8-node graph, both on the
# compiled verify pass, one process, methods in turn per prompt. The old way is the same code with compiled.block_size
# as it was (its pricing and its padding). Usage: python blocks_ab.py [PROMPTS_PER_FILE]
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import medusa_spec
from medusa_spec import MedusaModel, autotree, compiled, default_model
from medusa_spec.bench import encode, read_eval_prompts

DATA = Path(medusa_spec.__file__).parent / "data"
per_file = int(sys.argv[1]) if len(sys.argv) > 1 else 4
path = default_model.prepare()
tokenizer = AutoTokenizer.from_pretrained(path)
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
prompts = []
for name in ("mt_bench_question.jsonl", "other_tasks_question.jsonl"):
    prompts += [(name.split("_")[0], encode(tokenizer, text)) for _, text in read_eval_prompts(DATA / name, 1)][
        :per_file
    ]
new_block_size = compiled.block_size


def old_block_size(n: int) -> int:
    return next((size for size in (1, 8, 16, 32, 64) if size >= n), -(-n // 64) * 64)


start = time.perf_counter()
mm.generate(prompts[0][1], max_new_tokens=8, tree=None, compile=True)  # compiles blocks 1, 2, 4, 8 and prices them
draft = mm._trees.step_costs(mm, dynamic=True).at(1)[1]
new_tree = autotree.compiled_dynamic_tree(mm, mm._compiled, draft)
compiled.block_size = autotree.block_size = old_block_size
old_tree = autotree.compiled_dynamic_tree(mm, mm._compiled, draft)
compiled.block_size = autotree.block_size = new_block_size
print(f"warm-up {time.perf_counter() - start:.0f} s; graphs {sorted(mm._compiled.shapes)}", flush=True)
print("step ms, new:", [round(x, 1) for x in new_tree.step_ms])
print("step ms, old:", [round(x, 1) for x in old_tree.step_ms], flush=True)
methods = {
    "tree=[]": ([], new_block_size),
    "old blocks": (old_tree, old_block_size),
    "new blocks": (new_tree, new_block_size),
}
totals = {name: [0.0, 0, 0] for name in methods}  # seconds, new tokens, steps
sizes = {name: Counter() for name in methods}
for i, (kind, ids) in enumerate(prompts):
    names = list(methods)[i % 3 :] + list(methods)[: i % 3]
    outputs = {}
    for name in names:
        tree, size_of = methods[name]
        compiled.block_size = autotree.block_size = size_of
        start = time.perf_counter()
        out = mm.generate(ids, max_new_tokens=128, tree=tree, compile=True)
        seconds = time.perf_counter() - start
        compiled.block_size = autotree.block_size = new_block_size
        totals[name][0] += seconds
        totals[name][1] += out.sequences.shape[1] - ids.shape[1]
        totals[name][2] += out.stats.steps
        sizes[name].update(out.stats.tree_sizes or [])
        outputs[name] = out.sequences
    with torch.inference_mode():
        reference = base.generate(ids, max_new_tokens=128, do_sample=False)
    same = [name for name in methods if torch.equal(outputs[name], reference)]
    print(f"prompt {i} ({kind}): identical to transformers' greedy: {same}", flush=True)
off = totals["tree=[]"][1] / totals["tree=[]"][0]
for name, (seconds, tokens, steps) in totals.items():
    rate = tokens / seconds
    print(
        f"{name:>10}: {rate:5.1f} tok/s, {tokens / steps:.2f} tok/step, {1000 * seconds / steps:.1f} ms/step, "
        f"x tree=[] {rate / off:.3f}; sizes {dict(sorted(sizes[name].items()))}"
    )
