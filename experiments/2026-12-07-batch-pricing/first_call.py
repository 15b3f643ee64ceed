"""What a first call on a fresh MedusaModel pays that a warm one does not, with the step costs on disk: batch
`rows` of MT-bench first turns, 128 new tokens, tree=None and tree=[] taking turns, each on a MedusaModel fresh from
the heads folder, its first call then a second (warm) one, each with a StepTimer. Usage: python first_call.py [rows]"""
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_spec import MedusaModel, default_model
from medusa_spec.bench import MT_BENCH, read_eval_prompts
from medusa_spec.loop import StepTimer

rows = int(sys.argv[1]) if len(sys.argv) > 1 else 4
path = default_model.prepare()
tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
         for _, p in read_eval_prompts(MT_BENCH, per_category=1)][:rows]
batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
heads = default_model.shipped_heads()
MedusaModel.from_pretrained(model, heads).generate(batch.input_ids, batch.attention_mask, max_new_tokens=4)  # costs
for tree in (None, [], None, [], None, []):
    mm = MedusaModel.from_pretrained(model, heads)
    for kind in ("first", "warm"):
        timer = StepTimer()
        start = time.perf_counter()
        out = mm.generate(batch.input_ids, batch.attention_mask, max_new_tokens=128, tree=tree, timer=timer,
                          pad_token_id=tokenizer.eos_token_id)
        seconds = time.perf_counter() - start
        stages = {k: round(v, 2) for k, v in timer.seconds.items()}
        print(f"tree={tree!s:5} {kind:5} {seconds:6.2f} s  {sum(out.stats.new_tokens) / seconds:6.1f} tok/s  "
              f"{out.stats.steps - 1} steps  stages (s) {stages}  "
              f"outside the loop {seconds - sum(timer.seconds.values()):.2f}",
              flush=True)
