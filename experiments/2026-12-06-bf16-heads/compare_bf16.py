"""The shipped eagle heads' tokens per step in fp32 and rounded to bfloat16, on 11 eval prompts, with one fixed
dynamic tree (tree=None's size follows timed step costs, which a busy machine skews); counts steps, times nothing.
Run from the repository root: python experiments/2026-12-06-bf16-heads/compare_bf16.py"""

import torch

from medusa_spec import MedusaModel, default_model
from medusa_spec.bench import encode, read_eval_prompts
from medusa_spec.train.load import load_model_and_tokenizer
from medusa_spec.tree import DynamicTree

base, tok = load_model_and_tokenizer(str(default_model.prepare()))
mm = MedusaModel.from_pretrained(base, "heads/smollm2-135m-instruct")
prompts = (read_eval_prompts(["medusa_spec/data/mt_bench_question.jsonl"], 1)[:6]
           + read_eval_prompts(["medusa_spec/data/other_tasks_question.jsonl"], 1))
tree = DynamicTree(nodes=12)


def run():
    res = []
    for cat, text in prompts:
        out = mm.generate(encode(tok, text), max_new_tokens=128, tree=tree)
        res.append((out.stats.new_tokens[0], out.stats.row_steps[0], out.sequences[0].tolist()))
        print(cat, res[-1][:2], flush=True)
    return res


a = run()
with torch.no_grad():
    for p in mm.heads.parameters():
        p.copy_(p.to(torch.bfloat16).to(p.dtype))
b = run()
for name, r in (("fp32", a), ("bf16", b)):
    per_prompt = [round(x[0] / x[1], 2) for x in r]
    print(name, "tokens/step", round(sum(x[0] for x in r) / sum(x[1] for x in r), 4), per_prompt)
print("identical outputs", sum(x[2] == y[2] for x, y in zip(a, b)), "of", len(a))
