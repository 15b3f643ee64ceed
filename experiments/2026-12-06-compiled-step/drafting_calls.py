# One-off: what each compiled drafting call costs inside a step (after the verify pass) and in a loop of its own.
# Needs compiled_drafting.patch applied (git apply) on 362833f. Usage: python drafting_calls.py
import time

import torch
from transformers import AutoModelForCausalLM

from medusa_spec import MedusaModel, autotree, default_model
from medusa_spec import compiled as C

path = default_model.prepare()
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
steps = C.CompiledSteps()
steps.prepare(base, mm.spec, tuple(mm.heads.feature_layers), mm.heads)
T = {}
orig = C.CompiledSteps._call


def _call(self, run, shape, what, cache, past, *args):
    t = time.perf_counter()
    r = orig(self, run, shape, what, cache, past, *args)
    dt = time.perf_counter() - t
    T.setdefault(shape, []).append(dt)
    return r


C.CompiledSteps._call = _call
autotree.measure_step_costs(mm, sizes=(8,), context=64, repeats=3, dynamic=True, compiled=steps)
T.clear()
autotree.measure_step_costs(mm, sizes=(8,), context=64, repeats=30, dynamic=True, compiled=steps)
for k, v in T.items():
    v = sorted(v)
    print(k, len(v), "min ms", round(v[0] * 1000, 3), "median", round(v[len(v) // 2] * 1000, 3))
# direct: same call repeated

x = torch.randn(1, 1, 576)


def bench(fn, reps=300):
    for _ in range(3):
        fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1000


with torch.inference_mode():
    print("top via _call", bench(lambda: orig(steps, steps.top, ("top", 1, 1, 0, 4), "", None, 0, x, 0, 4)))
    print("top direct", bench(lambda: steps.top(x, 0, 4)))
    print("top eager", bench(lambda: steps.heads.draft_top(0, x, steps.model.get_output_embeddings(), 4)))
    from torch.profiler import profile

    with profile() as prof:
        for _ in range(50):
            steps.top(x, 0, 4)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
