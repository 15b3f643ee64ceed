# One-off (thirteenth session): the loop's column-wise copy of SmolLM2-135M with packed weights (PackedWeights, whose
# check reads every weight at each call) and without, and the prompt's body (all but its last token) through each;
# fastest of 6, three rounds. Usage: python experiments/2026-12-07-commit-in-place/packs.py
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_spec import default_model
from medusa_spec.columnwise import PackedWeights, columnwise_copy

path = default_model.prepare()
tokenizer = AutoTokenizer.from_pretrained(path)
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
with open("medusa_spec/data/mt_bench_question.jsonl") as f:
    question = json.loads(f.readline())["turns"][0]
ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                    return_tensors="pt", return_dict=True)["input_ids"]
packs = PackedWeights()


def fastest(call, repeats=6):
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return 1000 * min(seconds)


with torch.inference_mode():
    for _ in range(3):
        packed = columnwise_copy(base, packs=packs, eval_mode=True)
        plain = columnwise_copy(base, eval_mode=True)
        print("copy packed %.1f plain %.1f" % (fastest(lambda: columnwise_copy(base, packs=packs, eval_mode=True)),
                                               fastest(lambda: columnwise_copy(base, eval_mode=True))))
        print("body packed %.1f plain %.1f" % (fastest(lambda: packed.model(input_ids=ids[:, :-1])),
                                               fastest(lambda: plain.model(input_ids=ids[:, :-1]))), flush=True)
