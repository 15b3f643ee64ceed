"""oneDNN's linear from weights packed for 8 rows (what the decoding loops run), all of SmolLM2-135M's linear layers
cold in cache as in a pass, for each row count 1-16: fastest of 9 passes, the row counts taking turns.
Usage: python rows_sweep.py (alone on the machine)."""
import time

import torch
from transformers import AutoModelForCausalLM

from medusa_spec import default_model
from medusa_spec.columnwise import ONEDNN_LINEAR, ONEDNN_PACK

torch.set_grad_enabled(False)
base = AutoModelForCausalLM.from_pretrained(default_model.prepare(), dtype=torch.float32)
weights = [m.weight.detach() for m in base.modules() if isinstance(m, torch.nn.Linear)]
packs = [ONEDNN_PACK(w, 8) for w in weights]
rows = list(range(1, 17))
inputs = {r: {w.shape[1]: torch.randn(r, w.shape[1]) for w in weights} for r in rows}
best = dict.fromkeys(rows, 1e9)
for _ in range(9):
    for r in rows:
        start = time.perf_counter()
        for w, p in zip(weights, packs):
            ONEDNN_LINEAR(inputs[r][w.shape[1]], p, None, "none", [], "")
        best[r] = min(best[r], time.perf_counter() - start)
print("rows: ms for all linears (fastest of 9)")
print("  ".join(f"{r}: {1000 * s:.1f}" for r, s in best.items()))
