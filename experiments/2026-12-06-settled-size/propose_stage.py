# One-off: the propose stage alone (DynamicDraftLayerProposer.propose + update, ms per step), with the settled-size
# stop and with the nodes-only stop (size_settled patched to say no), alternating call by call in one process:
# tree=None (the priced DynamicTree) on each of the first 8 MT-bench prompts at batch 1, and the DynamicTree priced
# for 4 rows on the first 4 prompts, left-padded, 4 times; eager, 128 new tokens, greedy. Usage: python propose_stage.py
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_spec import MedusaModel, default_model
from medusa_spec.bench import MT_BENCH, read_eval_prompts
from medusa_spec.propose import DynamicDraftLayerProposer

os.environ["MEDUSA_SPEC_STEP_COSTS"] = "0"
path = default_model.prepare()
tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
         for _, p in read_eval_prompts(MT_BENCH, per_category=1)]
mm = MedusaModel.from_pretrained(model, default_model.shipped_heads())
settled, propose, update = (DynamicDraftLayerProposer.size_settled, DynamicDraftLayerProposer.propose,
                            DynamicDraftLayerProposer.update)
seconds = [0.0]


def timed(fn):
    def wrapper(self, *args):
        start = time.perf_counter()
        out = fn(self, *args)
        seconds[0] += time.perf_counter() - start
        return out

    return wrapper


DynamicDraftLayerProposer.propose, DynamicDraftLayerProposer.update = timed(propose), timed(update)
for rows, calls in ((1, 8), (4, 4)):
    priced = None if rows == 1 else mm.dynamic_tree(rows)
    totals = {"settled": [0.0, 0], "nodes only": [0.0, 0]}
    for i in range(calls):
        batch = tokenizer(texts[i: i + 1] if rows == 1 else texts[:4], return_tensors="pt", padding=True,
                          add_special_tokens=False)
        if i == 0:
            mm.generate(batch.input_ids, batch.attention_mask, max_new_tokens=16, tree=priced,
                        pad_token_id=tokenizer.pad_token_id)  # warm-up: step costs, packed weights
        for stop in (("settled", "nodes only") if i % 2 == 0 else ("nodes only", "settled")):
            DynamicDraftLayerProposer.size_settled = settled if stop == "settled" else (lambda *args: False)
            seconds[0] = 0.0
            out = mm.generate(batch.input_ids, batch.attention_mask, max_new_tokens=128, tree=priced,
                              pad_token_id=tokenizer.pad_token_id)
            totals[stop][0] += seconds[0]
            totals[stop][1] += out.stats.steps
    print(f"batch {rows}, {calls} calls each: " + ", ".join(
        f"{stop} {1000 * s / steps:.2f} ms/step ({steps} steps)" for stop, (s, steps) in totals.items()), flush=True)
