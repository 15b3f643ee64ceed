"""What tree=None's step-cost timing costs a fresh process's first call at batch 8 (no costs on disk): each
measure_step_costs call TreeChoice makes for it, timed. Usage: python timing_cost.py (alone on the machine)."""
import os
import time

import torch
from transformers import AutoModelForCausalLM

from medusa_spec import MedusaModel, autotree, default_model

os.environ["MEDUSA_SPEC_STEP_COSTS"] = "0"
base = AutoModelForCausalLM.from_pretrained(default_model.prepare(), dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
measure = autotree.measure_step_costs


def timed(*args, **kwargs):
    start = time.perf_counter()
    result = measure(*args, **kwargs)
    print(f"  measure_step_costs sizes={kwargs.get('sizes')} rows={kwargs.get('batch')} dynamic={kwargs.get('dynamic')}"
          f" time_verify={kwargs.get('time_verify')}: {time.perf_counter() - start:.2f} s")
    return result


autotree.measure_step_costs = timed
start = time.perf_counter()
mm._trees.proposer(mm, None, 8)
print(f"tree=None's proposer for batch 8, costs timed: {time.perf_counter() - start:.2f} s")
