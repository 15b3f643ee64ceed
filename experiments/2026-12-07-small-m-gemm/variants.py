"""variants.cpp's kernels beside oneDNN's packed linear, one process, interleaved round by round: the linears of a
SmolLM2-135M pass alone (as compare.py), M rows, each kernel's fastest of 9 rounds."""
import time

import torch
from torch.utils.cpp_extension import load_inline

ext = load_inline("panel_variants2", cpp_sources=open(__file__.replace(".py", ".cpp")).read(),
                  functions=["pack", "linear"],
                  extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"])
torch.manual_seed(0)
H, FF, KV, L, V = 576, 1536, 192, 30, 49152
shapes = [(H, H), (KV, H), (KV, H), (H, H), (FF, H), (FF, H), (H, FF)]
weights = [[torch.randn(o, i) * 0.02 for o, i in shapes] for _ in range(L)] + [[torch.randn(V, H) * 0.02]]
x = torch.randn(8, H)
variants = {0: "16c x 6r pf2k", 1: "16c x 6r pf4k", 2: "8c x 8r pf2k", 3: "8c x 8r pf512", 4: "16c x 6r",
            5: "8c x 8r pf4k"}
width = {0: 16, 1: 16, 2: 8, 3: 8, 4: 16, 5: 8}
packs = {c: [[ext.pack(w, c) for w in ws] for ws in weights] for c in (8, 16)}
onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in ws] for ws in weights]
for c, ws in packs.items():
    for v in (k for k, cw in width.items() if cw == c):
        w = weights[-1][0]
        assert (ext.linear(x[:5], ws[-1][0], v) - x[:5] @ w.T).abs().max() < 1e-4, v
del weights


def timed(run):
    t = time.perf_counter()
    run()
    return time.perf_counter() - t


def run_variant(v, xs):
    for ws in packs[width[v]]:
        for w in ws:
            ext.linear(xs[w.shape[1]], w, v)


def run_onednn(xs):
    for ws in onednn:
        for w in ws:
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], w, None, "none", [], "")


for m in [1, 2, 4, 8]:
    xs = {H: torch.randn(m, H), FF: torch.randn(m, FF)}
    best = {name: float("inf") for name in ["oneDNN", *variants.values()]}
    with torch.no_grad():
        for _ in range(9):
            best["oneDNN"] = min(best["oneDNN"], timed(lambda: run_onednn(xs)))
            for v, name in variants.items():
                best[name] = min(best[name], timed(lambda: run_variant(v, xs)))
    print(f"{m} rows: " + " | ".join(f"{name} {t * 1e3:.2f}" for name, t in best.items()), flush=True)
