# One-off: tree=None's modelled step costs for a batch against the step it runs. For each batch size: the table the
# static trees were chosen from (verify and drafting ms per tree size, modelled from one row and the 4-row probe), then
# a warm generate with tree=None and with tree=[] under a StepTimer (ms a step by stage, tree sizes run).
# Usage: python batch_costs.py [BATCH ...]
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import medusa_spec
from medusa_spec import MedusaModel, default_model
from medusa_spec.bench import read_eval_prompts
from medusa_spec.loop import StepTimer

DATA = Path(medusa_spec.__file__).parent / "data"
batches = [int(b) for b in sys.argv[1:]] or [4, 8]
path = default_model.prepare()
tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
texts = [
    tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
    for _, t in read_eval_prompts(DATA / "mt_bench_question.jsonl", per_category=1)
]
one = tokenizer(texts[:1], return_tensors="pt", add_special_tokens=False)
mm.generate(one.input_ids, one.attention_mask, max_new_tokens=16)  # the dynamic trees' costs, as a first call
for batch in batches:
    inputs = tokenizer(texts[:batch], return_tensors="pt", padding=True, add_special_tokens=False)
    start = time.perf_counter()
    table = mm._trees.table(mm, batch)
    print(f"batch {batch}: pricing took {time.perf_counter() - start:.2f} s")
    for row in table:
        print(
            f"  {row['nodes']:>3} nodes: verify {row['verify_ms']:7.1f} ms, draft {row['draft_ms']:6.1f} ms, "
            f"expected {row['expected_tokens_per_step']:.2f} tok/step/row, {row['expected_tokens_per_second']:.1f}/s"
        )
    for tree in (None, []):
        mm.generate(inputs.input_ids, inputs.attention_mask, max_new_tokens=32, tree=tree)  # warm
        timer = StepTimer()
        out = mm.generate(inputs.input_ids, inputs.attention_mask, max_new_tokens=128, tree=tree, timer=timer)
        steps = timer.steps
        stages = {k: round(1000 * v / steps, 1) for k, v in timer.seconds.items() if k != "prefill"}
        tokens = sum(out.stats.new_tokens)
        print(
            f"  tree={tree}: {steps} steps, {tokens / steps:.2f} tokens/step (all rows), ms/step {stages}, "
            f"sizes {dict(Counter(out.stats.tree_sizes or []))}"
        )
