"""The linear chain of gemm.py compiled by inductor two ways, in one process, interleaved: inductor's own C++ GEMM
(the project's options: freezing, max_autotune, CPP backend, C++ wrapper) against the same graph calling the AVX2 panel
kernel as a custom op (registered in C++, called from inductor's C++ wrapper through the dispatcher). M = 1, 4, 8."""
import time

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

SRC = open(__file__.replace("graph.py", "panel_op.cpp")).read()
load_inline("panel_op", cpp_sources=SRC, extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
            extra_ldflags=["-fopenmp"], is_python_module=False)


@torch.library.register_fake("medusa_kernels::panel_linear")
def _(x, w):
    return x.new_empty(*x.shape[:-1], w.shape[0] * 16)


torch.manual_seed(0)
H, FF, KV, L, V = 576, 1536, 192, 30, 49152
shapes = [(H, H), (KV, H), (KV, H), (H, H), (FF, H), (FF, H), (H, FF)]


class Chain(torch.nn.Module):
    def __init__(self, weights, head, packed):
        super().__init__()
        self.packed = packed
        prep = (lambda w: torch.ops.medusa_kernels.panel_pack(w)) if packed else (lambda w: w)
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(prep(w), requires_grad=False)
                                          for ws in weights for w in ws])
        self.head = torch.nn.Parameter(prep(head), requires_grad=False)

    def forward(self, x):
        lin = torch.ops.medusa_kernels.panel_linear if self.packed else F.linear
        for i in range(L):
            q, k, v, o, g, u, d = self.ws[i * 7:(i + 1) * 7]
            a = lin(x, q) + lin(x, k).repeat(1, 3) + lin(x, v).repeat(1, 3)
            x = x + lin(a, o)
            x = x + lin(F.silu(lin(x, g)) * lin(x, u), d)
        return lin(x, self.head)


weights = [[torch.randn(o, i) * 0.02 for o, i in shapes] for _ in range(L)]
head = torch.randn(V, H) * 0.02
x = torch.randn(3, H)
plain, panels = Chain(weights, head, False).eval(), Chain(weights, head, True).eval()
with torch.no_grad():
    print("eager max |diff|:", (plain(x) - panels(x)).abs().max().item())
opts = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP",
        "max_autotune_report_choices_stats": False, "cpp_wrapper": True}
graphs = {}
for name, module in (("inductor GEMM", plain), ("panel op", panels)):
    for m in (1, 4, 8):
        torch._dynamo.reset()
        with torch.no_grad(), torch._inductor.config.patch(opts):
            f = torch.compile(module, dynamic=False)
            t = time.perf_counter()
            f(torch.randn(m, H))
            print(f"{name} m={m}: compiled in {time.perf_counter() - t:.0f} s", flush=True)
            graphs[name, m] = f
best = {key: float("inf") for key in graphs}
with torch.no_grad(), torch._inductor.config.patch(opts):
    for _ in range(9):
        for (name, m), f in graphs.items():
            x = torch.randn(m, H)
            t = time.perf_counter()
            f(x)
            best[name, m] = min(best[name, m], time.perf_counter() - t)
for (name, m), t in best.items():
    print(f"{name:14s} {m} rows: {t * 1e3:6.2f} ms")
