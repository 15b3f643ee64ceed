# One-off: tokens a step per row with eagle heads on a static tree, one row at a time against the rows as one
# left-padded batch (the same prompts, the same tree). Usage: python batch_acceptance.py [ROWS] [TREE_JSON]
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import medusa_spec
from medusa_spec import MedusaModel, default_model
from medusa_spec.bench import read_eval_prompts

DATA = Path(medusa_spec.__file__).parent / "data"
rows = int(sys.argv[1]) if len(sys.argv) > 1 else 4
tree = json.loads(sys.argv[2]) if len(sys.argv) > 2 else [[0]]
path = default_model.prepare()
tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
texts = [
    tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
    for _, t in read_eval_prompts(DATA / "mt_bench_question.jsonl", per_category=1)
][:rows]
alone = []
for text in texts:
    one = tokenizer([text], return_tensors="pt", add_special_tokens=False)
    out = mm.generate(one.input_ids, one.attention_mask, max_new_tokens=128, tree=tree)
    alone.append((out.stats.new_tokens[0], out.stats.row_steps[0]))
batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
out = mm.generate(batch.input_ids, batch.attention_mask, max_new_tokens=128, tree=tree)
print(f"tree {tree}")
print("alone: tokens/step per row", [round(tokens / steps, 2) for tokens, steps in alone])
print(
    f"batch of {rows}: {out.stats.steps} steps, new tokens per row {out.stats.new_tokens}, "
    f"tokens/step per row {[round(t / s, 2) for t, s in zip(out.stats.new_tokens, out.stats.row_steps)]}"
)
print("accepted at depth", out.stats.accepted_at_depth)
