"""Where eager drafting's time goes (one row, the shipped eagle heads, tree=None, MT-bench's first 4 first turns,
128 new tokens): the proposer's propose and update and the draft layer's parts, each under a record_function label,
after one untimed call; torch's profiler, ops and labels by CPU total. Usage: python profile_drafting.py"""
import functools

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_spec import MedusaModel, default_model, propose
from medusa_spec.bench import MT_BENCH, read_eval_prompts


def labelled(cls, name):
    method = getattr(cls, name)

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with record_function(f"## {getattr(cls, '__name__', '')}.{name}"):
            return method(*args, **kwargs)
    setattr(cls, name, wrapper)


for cls, name in ((propose.DynamicDraftLayerProposer, "propose"), (propose.DraftLayerProposer, "update"),
                  (propose.DynamicSizing, "update"), (propose.DynamicSizing, "chosen_size"),
                  (propose.DynamicDraftLayerProposer, "complete"), (propose, "ranked_tree")):
    labelled(cls, name)
path = default_model.prepare()
tokenizer = AutoTokenizer.from_pretrained(path)
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
for cls in {type(m) for m in mm.heads.modules()}:
    if cls.__module__.startswith("medusa_spec") and hasattr(cls, "forward"):
        labelled(cls, "forward")
for name in ("draft_logits", "features"):
    labelled(type(mm.heads), name)
texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
         for _, p in read_eval_prompts(MT_BENCH, per_category=1)][:4]
ids = [tokenizer(t, return_tensors="pt", add_special_tokens=False).input_ids for t in texts]
mm.generate(ids[0], max_new_tokens=16)
steps = 0
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for x in ids:
        steps += mm.generate(x, max_new_tokens=128).stats.steps - 1
print(steps, "steps")
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=45, max_name_column_width=60))
