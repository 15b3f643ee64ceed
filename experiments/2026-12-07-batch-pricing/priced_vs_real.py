"""One row, eager, the shipped eagle heads on tree=None's priced DynamicTree: each step's real cost (the wall time
between the proposer's consecutive updates: commit, drafting, verify, acceptance) by the size the step chose, against
the step_ms the tree was priced with (timed in this process at the first call). Usage: python priced_vs_real.py
[--compile] (alone on the machine)."""
import os
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_spec import MedusaModel, default_model, propose
from medusa_spec.bench import MT_BENCH, read_eval_prompts

os.environ["MEDUSA_SPEC_STEP_COSTS"] = "0"
compile_ = "--compile" in sys.argv
path = default_model.prepare()
tokenizer = AutoTokenizer.from_pretrained(path)
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
real: dict[int, list[float]] = {}
last = [None]
update = propose.DynamicSizing.update


def timed_update(self, step):
    now = time.perf_counter()
    if last[0] is not None and self.sizes:
        real.setdefault(self.sizes[-1], []).append(1000 * (now - last[0]))
    last[0] = now
    update(self, step)


propose.DynamicSizing.update = timed_update
texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
         for _, p in read_eval_prompts(MT_BENCH, per_category=1)]
for round_ in range(2):
    real.clear()
    tokens = steps = 0
    for text in texts:
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        last[0] = None
        out = mm.generate(ids, max_new_tokens=128, compile=compile_)
        tokens, steps = tokens + sum(out.stats.new_tokens), steps + out.stats.steps - 1
    tree = next(iter(mm._trees.compiled_trees.values())) if compile_ else mm._trees.dynamic_tree(mm)
    print(f"round {round_}: {tokens / steps:.2f} tokens a step; size: steps, priced step ms, real step ms "
          f"(fastest / median)")
    for n in sorted(real):
        times = real[n]
        print(f"  {n:2d}: {len(times):4d}  priced {tree.step_ms[n - 1]:6.1f}  real {min(times):6.1f} / "
              f"{statistics.median(times):6.1f}", flush=True)
