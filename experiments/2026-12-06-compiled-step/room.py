# One-off, at 362833f (before the attention window): the one-row compiled verify pass after 240 tokens with a cache
# buffer of CACHE_SLOTS slots, all of which it attended to. Usage: python room.py 256 (or 1024)
import sys

import torch
from transformers import AutoModelForCausalLM

from medusa_spec import MedusaModel, compiled, default_model
from medusa_spec.loop import StepTimer

compiled.CACHE_SLOTS = int(sys.argv[1])
path = default_model.prepare()
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
ids = torch.randint(0, 49152, (1, 200), generator=torch.Generator().manual_seed(0))
mm.generate(ids, max_new_tokens=40, tree=[], compile=True)
best = 1e9
for _ in range(3):
    timer = StepTimer()
    mm.generate(ids, max_new_tokens=40, tree=[], compile=True, eos_token_id=[], timer=timer)
    best = min(best, timer.seconds["verify"] * 1000 / timer.steps)
print("CACHE_SLOTS", compiled.CACHE_SLOTS, "shapes", mm._compiled.shapes, "verify ms/step", round(best, 2))
