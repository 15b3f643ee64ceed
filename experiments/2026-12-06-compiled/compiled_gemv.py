# One-off: all of SmolLM2-135M's weight shapes as mul-sum reductions, one compiled call each vs one graph.
import time

import torch

torch.manual_seed(0)


def t(f, n=5):
    f()
    f()
    s = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - s) / n


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
v = torch.randn(576)
v2 = torch.randn(1536)


def gemv(x, w):
    return (w * x).sum(-1)


cg = torch.compile(gemv, dynamic=False)


def run():
    return [cg(v if w.shape[1] == 576 else v2, w) for w in Ws]


s = time.perf_counter()
run()
print("compile s", time.perf_counter() - s, flush=True)
d = t(run)
print("compiled gemv each", d * 1e3, nbytes / d / 1e9)


def allv(*ws):
    return [gemv(v if w.shape[1] == 576 else v2, w) for w in ws]


ca = torch.compile(allv)
s = time.perf_counter()
ca(*Ws)
print("compile all s", time.perf_counter() - s, flush=True)
d = t(lambda: ca(*Ws))
print("compiled all-in-one", d * 1e3, nbytes / d / 1e9)
w = Ws[4]
x = v
print((cg(x, w) - torch.nn.functional.linear(x[None], w)[0]).abs().max())
