# One-off: eager and compiled medusa_spec beside transformers, one process: python ab_compiled.py N_PROMPTS
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_spec import MedusaModel, default_model

path = default_model.prepare()
tok = AutoTokenizer.from_pretrained(path)
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
qs = [json.loads(line) for line in open("medusa_spec/data/mt_bench_question.jsonl")]
seen, prompts = set(), []
for q in qs:
    if q["category"] not in seen:
        seen.add(q["category"])
        prompts.append(q["turns"][0])
prompts = prompts[: int(sys.argv[1])]


def ids_of(p):
    ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt")
    return ids if torch.is_tensor(ids) else ids["input_ids"]


# warm-up: compile shapes
t = time.perf_counter()
for tree in ([], None):
    mm.generate(ids_of(prompts[0]), max_new_tokens=128, tree=tree, compile=True)
print("warm-up s", time.perf_counter() - t, flush=True)
mm.generate(ids_of(prompts[0]), max_new_tokens=16, tree=None)
methods = {
    "transformers": lambda ids: base.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=128, do_sample=False
    ),
    "off": lambda ids: mm.generate(ids, max_new_tokens=128, tree=[]).sequences,
    "off_compiled": lambda ids: mm.generate(ids, max_new_tokens=128, tree=[], compile=True).sequences,
    "heads": lambda ids: mm.generate(ids, max_new_tokens=128).sequences,
    "heads_compiled": lambda ids: mm.generate(ids, max_new_tokens=128, compile=True).sequences,
}
secs = {m: 0.0 for m in methods}
toks = {m: 0 for m in methods}
same = {m: 0 for m in methods}
for p in prompts:
    ids = ids_of(p)
    ref = None
    for m, f in methods.items():
        t = time.perf_counter()
        with torch.inference_mode():
            out = f(ids)
        secs[m] += time.perf_counter() - t
        new = out[0, ids.shape[1] :]
        toks[m] += new.numel()
        if ref is None:
            ref = new
        same[m] += int(torch.equal(new, ref))
for m in methods:
    print(
        f"{m:15s} {toks[m] / secs[m]:6.1f} tok/s  "
        f"x{(toks[m] / secs[m]) / (toks['transformers'] / secs['transformers']):.2f} identical {same[m]}/{len(prompts)}"
    )
