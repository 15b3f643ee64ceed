"""Where a batch's drafting goes: 8 MT-bench first turns, left-padded, the shipped eagle heads on the static tree
[[0]] (what tree=None runs at batch 8), 128 new tokens; propose_on, update and their parts under record_function
labels, after one untimed call; ops and labels by CPU total. Usage: python profile_batch_drafting.py [rows]"""
import functools
import sys

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_spec import MedusaModel, default_model, propose
from medusa_spec.bench import MT_BENCH, read_eval_prompts


def labelled(cls, name):
    method = getattr(cls, name)

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with record_function(f"## {cls.__name__}.{name}"):
            return method(*args, **kwargs)
    setattr(cls, name, wrapper)


rows = int(sys.argv[1]) if len(sys.argv) > 1 else 8
path = default_model.prepare()
tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
for cls, name in ((propose.DraftLayerProposer, "propose_on"), (propose.DraftLayerProposer, "update")):
    labelled(cls, name)
for cls in {type(m) for m in mm.heads.modules()}:
    if cls.__module__.startswith("medusa_spec") and hasattr(cls, "forward"):
        labelled(cls, "forward")
for name in ("draft_logits", "features", "token_ids"):
    labelled(type(mm.heads), name)
texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
         for _, p in read_eval_prompts(MT_BENCH, per_category=1)][:rows]
batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
mm.generate(batch.input_ids, batch.attention_mask, max_new_tokens=8, tree=[[0]], pad_token_id=tokenizer.eos_token_id)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    out = mm.generate(batch.input_ids, batch.attention_mask, max_new_tokens=128, tree=[[0]],
                      pad_token_id=tokenizer.eos_token_id)
print(out.stats.steps - 1, "steps")
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
