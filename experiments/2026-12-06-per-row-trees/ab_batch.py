# One-off: per-row dynamic trees in a batch (each row its own EAGLE-2 tree, one verify pass) against tree=None's
# choice for batches (AdaptiveTree over static trees) and tree=[], warm, in one process, arms rotating per round.
# Left-padded MT-bench first turns (one per category), 128 new tokens, greedy; every row checked token-identical to
# transformers' greedy generate on the same batch; step costs timed in this process (MEDUSA_SPEC_STEP_COSTS=0).
# Usage: python ab_batch.py [--batches 4 8] [--rounds 2] [--fixed 4]: --fixed adds DynamicTree(N) without step costs.
import argparse
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_spec import DynamicTree, MedusaModel, default_model
from medusa_spec.bench import MT_BENCH, read_eval_prompts

parser = argparse.ArgumentParser()
parser.add_argument("--batches", type=int, nargs="+", default=[4, 8])
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--fixed", type=int, nargs="*", default=[])
args = parser.parse_args()
os.environ["MEDUSA_SPEC_STEP_COSTS"] = "0"
path = default_model.prepare()
tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
         for _, p in read_eval_prompts(MT_BENCH, per_category=1)]
mm = MedusaModel.from_pretrained(model, default_model.shipped_heads())
print(f"torch threads {torch.get_num_threads()}; {args.max_new_tokens} new tokens; {args.rounds} rounds")
for rows in args.batches:
    batch = tokenizer(texts[:rows], return_tensors="pt", padding=True, add_special_tokens=False)
    arms = {"tree=[]": [], "tree=None": None, "dynamic, priced": mm.dynamic_tree(rows)}
    arms |= {f"DynamicTree({n})": DynamicTree(n) for n in args.fixed}
    print(f"batch {rows}: priced tree's step ms " + " ".join(f"{ms:.1f}" for ms in arms["dynamic, priced"].step_ms))

    def run(tree):
        start = time.perf_counter()
        out = mm.generate(batch.input_ids, batch.attention_mask, max_new_tokens=args.max_new_tokens,
                          pad_token_id=pad, tree=tree)
        return time.perf_counter() - start, out

    for tree in arms.values():  # warm-up: step costs, packed weights
        run(tree)
    start = time.perf_counter()
    with torch.inference_mode():
        reference = model.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad)
    reference_seconds = time.perf_counter() - start
    seconds, new, steps, identical = ({name: 0 for name in arms} for _ in range(4))
    sizes = {name: [] for name in arms}
    for r in range(args.rounds):
        names = list(arms)[r % len(arms):] + list(arms)[: r % len(arms)]
        for name in names:
            elapsed, out = run(arms[name])
            seconds[name] += elapsed
            new[name] += sum(out.stats.new_tokens)
            steps[name] += out.stats.steps
            sizes[name] += out.stats.tree_sizes or []
            width = min(reference.shape[1], out.sequences.shape[1])
            identical[name] += sum(torch.equal(a[:width], b[:width]) for a, b in zip(reference, out.sequences))
    off = new["tree=[]"] / seconds["tree=[]"]
    transformers_rate = new["tree=[]"] / args.rounds / reference_seconds
    print(f"  transformers {transformers_rate:.1f} tok/s (one call)")
    for name in arms:
        rate = new[name] / seconds[name]
        print(f"  {name:>16}: {rate:6.1f} tok/s  {rate / off:.2f}x tree=[]  "
              f"{new[name] / steps[name] / rows:.2f} tok/step/row  {identical[name]}/{rows * args.rounds} identical"
              + (f"  mean nodes {sum(sizes[name]) / len(sizes[name]):.2f}" if sizes[name] else ""))
