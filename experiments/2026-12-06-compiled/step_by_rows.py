# One-off: SmolLM2-135M's compiled step (freezing + inductor's C++ GEMM) for N rows: python step_by_rows.py N 0
import copy
import sys
import time
import types

import torch
import torch._inductor.config as ic
from transformers import AutoModelForCausalLM, StaticCache

from medusa_spec import default_model

N = int(sys.argv[1])
thr = int(sys.argv[2])

ic.max_autotune = True
ic.freezing = True
ic.max_autotune_gemm_backends = "CPP"
path = default_model.prepare()
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
model = copy.deepcopy(model)


def fwd(self, x):
    if x.shape[-2] <= thr:
        y = (x[..., None, :] * self.weight).sum(-1)
        return y if self.bias is None else y + self.bias
    return torch.nn.functional.linear(x, self.weight, self.bias)


for m in model.modules():
    if isinstance(m, torch.nn.Linear):
        m.forward = types.MethodType(fwd, m)
L = 1024


def step(ids, pos, mask, cache):
    out = model(
        input_ids=ids,
        position_ids=pos,
        attention_mask=mask,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=True,
    )
    return out.logits, out.hidden_states[-1]


with torch.inference_mode():
    step(torch.tensor([[1]]), torch.tensor([[0]]), None, StaticCache(config=model.config, max_cache_len=8))
cache = StaticCache(config=model.config, max_cache_len=L)
cache.early_initialization(1, model.config.num_key_value_heads, 64, torch.float32, torch.device("cpu"))
cstep = torch.compile(step, dynamic=False, fullgraph=True)
ids = torch.ones(1, N, dtype=torch.long)
with torch.inference_mode():
    ts = []
    for p in range(0, 30):
        mask = torch.zeros(1, 1, N, L, dtype=torch.bool)
        mask[..., : p + N] = True
        for layer in cache.layers:
            layer.cumulative_length.fill_(p)
        s = time.perf_counter()
        lo, _ = cstep(ids, torch.arange(p, p + N)[None], mask, cache)
        ts.append(time.perf_counter() - s)
        if p < 2:
            print("call", p, ts[-1], flush=True)
    ts = ts[3:]
    ts.sort()
    print("N", N, "thr", thr, "median step ms", ts[len(ts) // 2] * 1e3, "min", ts[0] * 1e3)
