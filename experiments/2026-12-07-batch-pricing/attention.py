"""A verify pass's attention (SmolLM2-135M: 9 query heads over 3 key/value heads of 64), `rows` x n query rows
after `context` keys, with a boolean mask: sdpa with enable_gqa (what columnwise.gqa_sdpa_attention ran for masked
rows) against the group folded into the query rows (the key/value heads read once per group, as transformers folds a
one-row query): 30 layers' worth, fastest of 7, taking turns. Usage: python attention.py [rows] [context]"""
import sys
import time

import torch
import torch.nn.functional as F

torch.set_grad_enabled(False)
rows = int(sys.argv[1]) if len(sys.argv) > 1 else 8
context = int(sys.argv[2]) if len(sys.argv) > 2 else 300
hq, hkv, d, layers = 9, 3, 64, 30
g = hq // hkv
for n in (1, 2, 4, 8, 16):
    q = torch.randn(layers, rows, hq, n, d)
    k = torch.randn(layers, rows, hkv, context + n, d)
    v = torch.randn(layers, rows, hkv, context + n, d)
    mask = torch.rand(rows, 1, n, context + n) > 0.1

    def gqa():
        return [F.scaled_dot_product_attention(q[i], k[i], v[i], attn_mask=mask, enable_gqa=True)
                for i in range(layers)]

    def folded():
        m = mask[:, :, None].expand(-1, -1, g, -1, -1).reshape(rows, 1, g * n, -1)
        return [F.scaled_dot_product_attention(q[i].reshape(rows, hkv, g * n, d), k[i], v[i], attn_mask=m)
                .reshape(rows, hq, n, d) for i in range(layers)]

    def math():
        m = mask[:, :, None].expand(-1, -1, g, -1, -1).reshape(rows, 1, g * n, -1)
        out = []
        for i in range(layers):
            scores = torch.matmul(q[i].reshape(rows, hkv, g * n, d), k[i].transpose(-1, -2)) * d ** -0.5
            out.append(torch.matmul(scores.masked_fill_(~m, float("-inf")).softmax(-1), v[i]).reshape(rows, hq, n, d))
        return out

    a, b = gqa(), folded()
    diff_math = max((x - y).abs().max().item() for x, y in zip(a, math()))
    diff = max((x - y).abs().max().item() for x, y in zip(a, b))
    best = {"gqa": 1e9, "folded": 1e9, "math": 1e9}
    for _ in range(7):
        for name, fn in (("gqa", gqa), ("folded", folded), ("math", math)):
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    print(f"{rows} rows x {n:2d} nodes, context {context}: enable_gqa {1000 * best['gqa']:6.2f} ms, folded "
          f"{1000 * best['folded']:6.2f} ms, max |diff| {diff:.1e}; folded math {1000 * best['math']:6.2f} ms, "
          f"max |diff| {diff_math:.1e}", flush=True)
