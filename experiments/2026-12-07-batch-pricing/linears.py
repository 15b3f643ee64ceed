"""All of SmolLM2-135M's linear layers (30 decoder layers' 7 and the LM head), cold in cache as in a pass, per row
count, by each fp32 CPU kernel torch offers, fastest of `repeats` passes, kernels taking turns: oneDNN from weights
packed for 8 rows (what the loops run), packed for 1 or 64 rows, oneDNN from plain weights, nn.functional.linear
(MKL), column-wise mm(W, x^T). Usage: python linears.py [rows ...] (alone on the machine)."""
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from medusa_spec import default_model
from medusa_spec.columnwise import ONEDNN_LINEAR, ONEDNN_PACK

ROWS = [int(r) for r in sys.argv[1:]] or [1, 2, 4, 8, 16, 24, 32, 64]
torch.set_grad_enabled(False)
base = AutoModelForCausalLM.from_pretrained(default_model.prepare(), dtype=torch.float32)
weights = [m.weight.detach() for m in base.modules() if isinstance(m, torch.nn.Linear)]
print(len(weights), "linears,", sum(w.numel() for w in weights) * 4 / 1e6, "MB")
packs = {hint: [ONEDNN_PACK(w, hint) for w in weights] for hint in (1, 8, 64)}


def pass_with(kernel, rows):
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}

    def run():
        for i, w in enumerate(weights):
            kernel(i, w, xs[w.shape[1]])
    return run


kernels = {
    "oneDNN packed(8)": lambda i, w, x: ONEDNN_LINEAR(x, packs[8][i], None, "none", [], ""),
    "oneDNN packed(1)": lambda i, w, x: ONEDNN_LINEAR(x, packs[1][i], None, "none", [], ""),
    "oneDNN packed(64)": lambda i, w, x: ONEDNN_LINEAR(x, packs[64][i], None, "none", [], ""),
    "oneDNN plain": lambda i, w, x: ONEDNN_LINEAR(x, w, None, "none", [], ""),
    "F.linear (MKL)": lambda i, w, x: torch.nn.functional.linear(x, w),
    "mm(W, x^T)": lambda i, w, x: torch.mm(w, x.t()).t().contiguous(),
}
for rows in ROWS:
    runs = {name: pass_with(k, rows) for name, k in kernels.items()}
    best = dict.fromkeys(runs, 1e9)
    for _ in range(5):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    print(f"{rows:3d} rows: " + "  ".join(f"{name} {1000 * s:6.1f}" for name, s in best.items()), flush=True)
