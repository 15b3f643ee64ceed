# One-off: a one-row step's weights (SmolLM2-135M's shapes) through each linear kernel, GB/s (see NOTES.md).
import time

import torch

from medusa_spec.columnwise import ONEDNN_LINEAR, ONEDNN_PACK

print(torch.get_num_threads(), torch.__version__)
x = torch.randn(135_000_000)


def t(f, n=5):
    f()
    s = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - s) / n


d = t(lambda: x.sum())
print("sum 540MB", d * 1e3, "ms", 540e6 / d / 1e9, "GB/s")
# 30 layers of weights of smollm2: q 576x576, k 192x576, v 192x576, o 576x576, gate/up 1536x576, down 576x1536
Ws = []
for _ in range(30):
    Ws += [
        torch.randn(576, 576),
        torch.randn(192, 576),
        torch.randn(192, 576),
        torch.randn(576, 576),
        torch.randn(1536, 576),
        torch.randn(1536, 576),
        torch.randn(576, 1536),
    ]
Ws.append(torch.randn(49152, 576))
nbytes = sum(w.numel() * 4 for w in Ws)
print("weights MB", nbytes / 1e6)
v = torch.randn(1, 576)
v2 = torch.randn(1, 1536)


def inp(w):
    return v if w.shape[1] == 576 else v2


d = t(lambda: [torch.nn.functional.linear(inp(w), w) for w in Ws])
print("F.linear", d * 1e3, nbytes / d / 1e9)
d = t(lambda: [torch.mv(w, inp(w)[0]) for w in Ws])
print("mv", d * 1e3, nbytes / d / 1e9)
packs = [ONEDNN_PACK(w, None, None, 1) if False else None for w in Ws]
try:
    packs = [ONEDNN_PACK(w, 1) for w in Ws]
except Exception as e:
    print("pack err", e)

    packs = None
if packs:
    d = t(lambda: [ONEDNN_LINEAR(inp(w), p, None, "none", [], "") for w, p in zip(Ws, packs)])
    print("onednn packed", d * 1e3, nbytes / d / 1e9)
Wt = [w.t().contiguous() for w in Ws]
d = t(lambda: [inp(w) @ wt for w, wt in zip(Ws, Wt)])
print("x@Wt", d * 1e3, nbytes / d / 1e9)


# The same product as a mul-sum reduction that inductor compiles: one compiled call per weight, then one graph.
def gemv(x, w):
    return (w * x).sum(-1)


each = torch.compile(gemv, dynamic=False)
t(lambda: [each(inp(w)[0], w) for w in Ws], n=1)  # compiles
d = t(lambda: [each(inp(w)[0], w) for w in Ws])
print("compiled mul-sum, a call per weight", d * 1e3, nbytes / d / 1e9)
graph = torch.compile(lambda *ws: [gemv(inp(w)[0], w) for w in ws])
t(lambda: graph(*Ws), n=1)
d = t(lambda: graph(*Ws))
print("compiled mul-sum, one graph", d * 1e3, nbytes / d / 1e9)
