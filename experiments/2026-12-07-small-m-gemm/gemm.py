"""How a pass's linear layers scale with its rows (nodes) on this CPU: SmolLM2-135M's 30 layers' shapes (q, k, v, o,
gate, up, down) and the tied LM head, fp32, weights cold (540 MB, far over the 32 MB L3), M = 1, 2, 4, 8, 16 rows.
Kernels: aten's linear (eager), oneDNN's packed linear (what inductor's freezing packs the weights into), and one
torch.compile'd graph of the whole chain with the project's inductor options (freezing, the C++ GEMM template).
Also the time to read every weight once (a sum): the memory-streaming bound."""
import sys
import time

import torch
import torch.nn.functional as F

torch.manual_seed(0)
H, FF, KV, L, V = 576, 1536, 192, 30, 49152
shapes = [(H, H), (KV, H), (KV, H), (H, H), (FF, H), (FF, H), (H, FF)]  # (out, in)
weights = [[torch.randn(o, i) * 0.02 for o, i in shapes] for _ in range(L)]
lm_head = torch.randn(V, H) * 0.02
total = sum(w.numel() for ws in weights for w in ws) + lm_head.numel()
print(f"weights: {total * 4 / 1e6:.0f} MB, threads {torch.get_num_threads()}")


def best(fn, repeats=7):
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3, sorted(times)[len(times) // 2] * 1e3


def read_all():
    s = torch.zeros(())
    for ws in weights:
        for w in ws:
            s += w.sum()
    return s + lm_head.sum()


print(f"read every weight (sum): best {best(read_all)[0]:.2f} ms")


def chain(x, ws, head):
    # Not the model: each matrix once, its input sliced or padded to its width; only the linears' cost matters here.
    for q, k, v, o, g, u, d in ws:
        a = F.linear(x, q) + F.linear(x, k).repeat(1, 3) + F.linear(x, v).repeat(1, 3)
        x = x + F.linear(a, o)
        x = x + F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)
    return F.linear(x, head)


packed = None
try:
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in ws] for ws in weights]
    packed_head = torch.ops.mkldnn._reorder_linear_weight(lm_head, 8)
except Exception as e:  # noqa: BLE001
    print("no oneDNN pack:", e)


def chain_packed(x):
    lin = lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # noqa: E731
    for q, k, v, o, g, u, d in packed:
        a = lin(x, q) + lin(x, k).repeat(1, 3) + lin(x, v).repeat(1, 3)
        x = x + lin(a, o)
        x = x + lin(F.silu(lin(x, g)) * lin(x, u), d)
    return lin(x, packed_head)


class Chain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(w, requires_grad=False) for ws in weights for w in ws])
        self.head = torch.nn.Parameter(lm_head, requires_grad=False)

    def forward(self, x):
        ws = [list(self.ws[i * 7:(i + 1) * 7]) for i in range(L)]
        return chain(x, ws, self.head)


sizes = [1, 2, 4, 8, 16]
rows = {}
for m in sizes:
    x = torch.randn(m, H)
    with torch.no_grad():
        rows[m] = [best(lambda: chain(x, weights, lm_head))[0]]
        if packed is not None:
            rows[m].append(best(lambda: chain_packed(x))[0])
    print(m, " ".join(f"{t:.2f}" for t in rows[m]), flush=True)

if "--compile" in sys.argv:
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    print("vec isa", pick_vec_isa())
    module = Chain().eval()
    opts = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP",
            "max_autotune_report_choices_stats": False, "cpp_wrapper": True}
    for m in [1, 8]:
        x = torch.randn(m, H)
        torch._dynamo.reset()
        with torch.no_grad(), torch._inductor.config.patch(opts):
            f = torch.compile(module)
            t = time.perf_counter()
            f(x)
            print(f"compile m={m}: {time.perf_counter() - t:.0f} s", flush=True)
            print(m, "compiled", f"{best(lambda: f(x))[0]:.2f}", flush=True)
