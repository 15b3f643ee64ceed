# One-off: one linear product on a cold cache (a 128 MB buffer touched before each), fp32 against bf16 and fp16
# weights, plain and oneDNN-packed, for the draft layer's shapes. Usage: python half_linear.py
import time

import torch

torch.manual_seed(0)
flush = torch.randn(64 * 1024 * 1024 // 4 * 2)  # 128 MB


def cold(fn, reps=50):
    ts = []
    for _ in range(reps):
        flush.add_(1.0)
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2] * 1000


for n, k in [(576, 576), (4096, 576), (1536, 576)]:
    for M in (1, 4):
        x = torch.randn(M, k)
        w = torch.randn(n, k)
        r = {}
        r["fp32"] = cold(lambda: torch.nn.functional.linear(x, w))
        wb = w.bfloat16()
        xb = x.bfloat16()
        r["bf16"] = cold(lambda: torch.nn.functional.linear(xb, wb))
        wh = w.half()
        xh = x.half()
        r["fp16"] = cold(lambda: torch.nn.functional.linear(xh, wh))
        r["bf16w->fp32"] = cold(lambda: torch.nn.functional.linear(x, wb.float()))
        print(n, k, M, {a: round(b, 3) for a, b in r.items()})
print("packed")
L = torch.ops.mkldnn._linear_pointwise.default
P = torch.ops.mkldnn._reorder_linear_weight.default
for n, k in [(576, 576), (4096, 576), (1152 * 0 + 576, 1152)]:
    for M in (1, 4):
        x = torch.randn(M, k)
        w = torch.randn(n, k)
        pw = P(w, M)
        r = {
            "fp32": cold(lambda: torch.nn.functional.linear(x, w)),
            "packed": cold(lambda: L(x, pw, None, "none", [], "")),
        }
        xh = x.half()
        wh = w.half()
        r["fp16"] = cold(lambda: torch.nn.functional.linear(xh, wh))
        try:
            pwh = P(wh, M)
            r["packed16"] = cold(lambda: L(xh, pwh, None, "none", [], ""))
        except Exception as e:
            r["packed16"] = str(e)[:60]
        wb = w.bfloat16()
        xb = x.bfloat16()
        try:
            pwb = P(wb, M)
            r["packedbf16"] = cold(lambda: L(xb, pwb, None, "none", [], ""))
        except Exception as e:
            r["packedbf16"] = str(e)[:60]
        print(n, k, M, r)
