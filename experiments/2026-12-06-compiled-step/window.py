# One-off, at 44315ff: the one-row compiled verify pass (attending to the text's slots) after prompts of 200, 600 and
# 37 tokens, one graph for all; output against transformers'. Usage: python window.py
import time

import torch
from transformers import AutoModelForCausalLM

from medusa_spec import MedusaModel, default_model
from medusa_spec.loop import StepTimer

path = default_model.prepare()
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
for n in (200, 600, 37):
    ids = torch.randint(0, 49152, (1, n), generator=torch.Generator().manual_seed(n))
    ref = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    t = time.perf_counter()
    out = mm.generate(ids, max_new_tokens=40, tree=[], compile=True, eos_token_id=[])
    first = time.perf_counter() - t
    best = 1e9
    for _ in range(2):
        timer = StepTimer()
        mm.generate(ids, max_new_tokens=40, tree=[], compile=True, eos_token_id=[], timer=timer)
        best = min(best, timer.seconds["verify"] * 1000 / timer.steps)
    print(
        "prompt",
        n,
        "first call s",
        round(first, 1),
        "identical",
        torch.equal(out.sequences[:, n:], ref[:, n:]),
        "shapes",
        mm._compiled.shapes,
        "verify ms/step",
        round(best, 2),
        flush=True,
    )
