# One-off (thirteenth session): per-call and per-step costs around the compiled verify pass of SmolLM2-135M, once
# generate(tree=[], compile=True) has compiled its graph: CompiledSteps.prepare (the weights' signature), the loop's
# column-wise base copy with packed weights, keep_accepted of one slot on a static buffer, the 30 layers' windows;
# fastest of 20 (200). Then three whole calls. Usage: python experiments/2026-12-07-commit-in-place/parts.py
import json
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_spec import MedusaModel, default_model
from medusa_spec.columnwise import columnwise_copy
from medusa_spec.compiled import adopt
from medusa_spec.kv_cache import keep_accepted

os.environ.setdefault("MEDUSA_SPEC_STEP_COSTS", "0")
path = default_model.prepare()
tokenizer = AutoTokenizer.from_pretrained(path)
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
with open("medusa_spec/data/mt_bench_question.jsonl") as f:
    question = json.loads(f.readline())["turns"][0]
ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                    return_tensors="pt", return_dict=True)["input_ids"]
mm.generate(ids, max_new_tokens=128, tree=[], compile=True, eos_token_id=[])


def fastest(name, call, repeats=20):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    print(f"{name}: {1000 * best:.3f} ms", flush=True)


compiled = mm._compiled
layers = tuple(mm.heads.feature_layers)
fastest("prepare", lambda: compiled.prepare(base, mm.spec, layers, mm.heads, mm._packed_weights))
fastest("columnwise_copy", lambda: columnwise_copy(base, packs=mm._packed_weights, eval_mode=True))
with torch.inference_mode():
    static = adopt(base(input_ids=ids, use_cache=True).past_key_values, 300)
    for layer in static.layers:
        layer.window(ids.shape[1] + 1)
    keep = torch.zeros(1, 1, dtype=torch.long)
    fastest("keep_accepted 1 slot", lambda: keep_accepted(static, ids.shape[1], keep), 200)
    fastest("window x30", lambda: [(layer.window(200), layer.cumulative_length.fill_(199)) for layer in static.layers],
            200)
for _ in range(3):
    start = time.perf_counter()
    mm.generate(ids, max_new_tokens=128, tree=[], compile=True, eos_token_id=[])
    print("call", time.perf_counter() - start)
