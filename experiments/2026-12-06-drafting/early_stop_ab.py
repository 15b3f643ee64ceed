# One-off: eagle heads' dynamic trees on the compiled verify pass, drafting every level against stopping where no
# deeper candidate could enter the tree (DynamicDraftLayerProposer.complete), one process, in turn per prompt, with
# the step's stages timed (StepTimer). Usage: python early_stop_ab.py [PROMPTS_PER_FILE]
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import medusa_spec
from medusa_spec import MedusaModel, default_model
from medusa_spec.bench import encode, read_eval_prompts
from medusa_spec.loop import StepTimer
from medusa_spec.propose import DynamicDraftLayerProposer

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
start = time.perf_counter()
mm.generate(prompts[0][1], max_new_tokens=8, tree=None, compile=True)  # compiles and prices the blocks
print(f"warm-up {time.perf_counter() - start:.0f} s; tree {mm._trees.compiled_trees}", flush=True)
complete = DynamicDraftLayerProposer.complete
methods = {
    "tree=[]": ([], complete),
    "every level": (None, lambda self, values, value: False),
    "stop early": (None, complete),
}
totals = {name: Counter() for name in methods}
sizes = {name: Counter() for name in methods}
for i, (kind, ids) in enumerate(prompts):
    outputs = {}
    for name in list(methods)[i % 3 :] + list(methods)[: i % 3]:
        tree, rule = methods[name]
        DynamicDraftLayerProposer.complete = rule
        timer = StepTimer()
        start = time.perf_counter()
        out = mm.generate(ids, max_new_tokens=128, tree=tree, compile=True, timer=timer)
        totals[name]["seconds"] += time.perf_counter() - start
        DynamicDraftLayerProposer.complete = complete
        totals[name]["tokens"] += out.sequences.shape[1] - ids.shape[1]
        totals[name]["steps"] += timer.steps
        for stage, seconds in timer.seconds.items():
            totals[name][stage] += seconds
        sizes[name].update(out.stats.tree_sizes or [])
        outputs[name] = out.sequences
    with torch.inference_mode():
        reference = base.generate(ids, max_new_tokens=128, do_sample=False)
    print(
        f"prompt {i} ({kind}): identical to transformers': {[n for n in methods if torch.equal(outputs[n], reference)]}"
    )
off = totals["tree=[]"]["tokens"] / totals["tree=[]"]["seconds"]
for name, t in totals.items():
    rate, steps = t["tokens"] / t["seconds"], t["steps"]
    stages = {stage: round(1000 * t[stage] / steps, 1) for stage in StepTimer.STAGES if stage != "prefill"}
    print(
        f"{name:>11}: {rate:5.1f} tok/s, {t['tokens'] / steps:.2f} tok/step, x tree=[] {rate / off:.3f}; "
        f"ms/step {stages}; sizes {dict(sorted(sizes[name].items()))}"
    )
