"""Eager, one row: the decoding loop's stages (StepTimer) per step for tree=None (the shipped eagle heads' priced
DynamicTree) and tree=[] over MT-bench's first 4 first turns, 128 new tokens, arms taking turns twice.
Usage: python stages.py (alone on the machine)."""
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_spec import MedusaModel, default_model
from medusa_spec.bench import MT_BENCH, read_eval_prompts
from medusa_spec.loop import StepTimer

path = default_model.prepare()
tokenizer = AutoTokenizer.from_pretrained(path)
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
         for _, p in read_eval_prompts(MT_BENCH, per_category=1)][:4]
ids = [tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids for text in texts]
for tree in (None, [], None, []):
    timer, tokens, start = StepTimer(), 0, time.perf_counter()
    for x in ids:
        tokens += sum(mm.generate(x, max_new_tokens=128, tree=tree, timer=timer).stats.new_tokens)
    seconds = time.perf_counter() - start
    print(f"tree={tree!s:5} {tokens / seconds:5.1f} tok/s, {timer.steps} steps, ms a step: "
          f"{ {k: round(1000 * v / timer.steps, 1) for k, v in timer.seconds.items() if k != 'prefill'} }", flush=True)
