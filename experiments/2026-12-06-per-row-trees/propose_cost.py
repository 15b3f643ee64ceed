# One-off: the eager DynamicDraftLayerProposer's propose and update time per step, and tokens per step, on
# DynamicTree(8), one MT-bench prompt at batch 1 and the first four (left-padded) at batch 4, 128 new tokens, greedy,
# three calls each (the first warms up). Run it at two commits to compare them. Usage: python propose_cost.py
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_spec import DynamicTree, MedusaModel, default_model
from medusa_spec.bench import MT_BENCH, read_eval_prompts
from medusa_spec.propose import DynamicDraftLayerProposer

path = default_model.prepare()
tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
         for _, p in read_eval_prompts(MT_BENCH, per_category=1)]
mm = MedusaModel.from_pretrained(model, default_model.shipped_heads())
seconds = {}


def timed(name, fn):
    def wrapper(self, *args):
        start = time.perf_counter()
        out = fn(self, *args)
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
        return out

    return wrapper


DynamicDraftLayerProposer.propose = timed("propose", DynamicDraftLayerProposer.propose)
DynamicDraftLayerProposer.update = timed("update", DynamicDraftLayerProposer.update)
for rows in (1, 4):
    batch = tokenizer(texts[:rows], return_tensors="pt", padding=True, add_special_tokens=False)
    for call in range(3):
        seconds.clear()
        start = time.perf_counter()
        out = mm.generate(batch.input_ids, batch.attention_mask, max_new_tokens=128, tree=DynamicTree(8),
                          pad_token_id=tokenizer.pad_token_id)
        wall, steps = time.perf_counter() - start, out.stats.steps
        if call:
            print(f"batch {rows}: {1000 * wall / steps:.1f} ms/step, propose {1000 * seconds['propose'] / steps:.2f} "
                  f"ms/step, update {1000 * seconds['update'] / steps:.2f}, "
                  f"{sum(out.stats.new_tokens) / steps / rows:.2f} tok/step/row", flush=True)
