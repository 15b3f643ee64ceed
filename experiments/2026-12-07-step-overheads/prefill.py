# One-off (twelfth session): SmolLM2-135M's decoder body over an MT-bench prompt but its last token, and one token
# through the whole model, eager, with nn.Linear (plain) or the column-wise copy the loop runs; fastest of 4.
# Usage: python experiments/2026-12-07-step-overheads/prefill.py
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_spec import default_model
from medusa_spec.columnwise import columnwise_copy


def fastest(call, repeats=4):
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return 1000 * min(seconds)


path = default_model.prepare()
tokenizer = AutoTokenizer.from_pretrained(path)
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
with open("medusa_spec/data/mt_bench_question.jsonl") as f:
    question = json.loads(f.readline())["turns"][0]
ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                    return_tensors="pt", return_dict=True)["input_ids"]
print(f"{ids.shape[1]} prompt tokens, {torch.get_num_threads()} threads")
with torch.inference_mode():
    for name in ("plain", "columnwise") * 2:
        model = base if name == "plain" else columnwise_copy(base, eval_mode=True)
        body = fastest(lambda: model.model(input_ids=ids[:, :-1]))
        token = fastest(lambda: model(input_ids=ids[:, -1:]))
        print(f"{name}: body {body:.1f} ms, one token {token:.1f} ms")
