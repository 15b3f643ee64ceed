# One-off (twelfth session): the compiled verify pass of SmolLM2-135M after 240 tokens with dynamo's every guard, or
# with compiled._guards_on_arguments (what landed), in one process: each arm its own graphs, the arms alternating,
# fastest of 20, 4 rounds. Usage: python experiments/2026-12-07-guards/guards.py 1 8   (block sizes)
import sys

import torch
from transformers import AutoModelForCausalLM

from medusa_spec import MedusaModel, autotree, compiled, default_model

sizes = tuple(int(s) for s in sys.argv[1:]) or (1,)
path = default_model.prepare()
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
c = mm._compiled
c.prepare(base, mm.spec, tuple(mm.heads.feature_layers))
kept = []
filt = compiled._guards_on_arguments("input_ids", "position_ids", "mask", "cache")
def counting(entries):
    flags = filt(entries)
    kept.append((sum(flags), len(flags)))
    return flags
forward = compiled._forward_of(c.model, mm.spec, c.feature_layers)
arms = {"every guard": torch.compile(forward, fullgraph=True, dynamic=False),
        "argument guards": torch.compile(compiled._forward_of(c.model, mm.spec, c.feature_layers), fullgraph=True,
                                         dynamic=False, options={"guard_filter_fn": counting})}
shapes = {}
for name, run in arms.items():
    c.run, c.shapes = run, set()
    autotree.measure_compiled_verify(mm, c, sizes, context=240, repeats=1)
    shapes[name] = c.shapes
print("guards kept / all:", kept, flush=True)
for r in range(4):
    for name, run in arms.items():
        c.run, c.shapes = run, shapes[name]
        sec = autotree.measure_compiled_verify(mm, c, sizes, context=240, repeats=20)
        print(name, {n: round(1000 * x, 3) for n, x in sec.items()}, "ms", flush=True)
