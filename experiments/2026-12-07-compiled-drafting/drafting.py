"""Where the compiled heads step's drafting goes (issue 57): generate(compile=True, tree=None) with the shipped eagle
heads on MT-bench first turns, one per category; the proposer's propose and update timed per call, and torch's
profiler over them (self CPU time by op), after a warm-up call that compiles every graph and prices the tree sizes.
Usage: MEDUSA_SPEC_STEP_COSTS=0 python drafting.py [PROMPTS] [HEADS]"""

import sys
import time

from torch.profiler import ProfilerActivity, profile, record_function

from medusa_spec import MedusaModel, default_model
from medusa_spec.bench import MT_BENCH, encode, read_eval_prompts
from medusa_spec.propose import DynamicDraftLayerProposer
from medusa_spec.train.load import load_model_and_tokenizer

count = int(sys.argv[1]) if len(sys.argv) > 1 else 3
heads = sys.argv[2] if len(sys.argv) > 2 else default_model.shipped_heads()
base, tokenizer = load_model_and_tokenizer(str(default_model.prepare()))
mm = MedusaModel.from_pretrained(base, heads)
prompts = [text for _, text in read_eval_prompts([str(MT_BENCH)], per_category=1)][:count]
times, calls, profiling = {"propose": 0.0, "update": 0.0}, {"propose": 0, "update": 0}, [False]


def timed(name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        with record_function(name):
            out = fn(*args, **kwargs)
        if profiling[0]:
            times[name] += time.perf_counter() - start
            calls[name] += 1
        return out

    return wrapper


for name in times:
    setattr(DynamicDraftLayerProposer, name, timed(name, getattr(DynamicDraftLayerProposer, name)))
mm.generate(encode(tokenizer, "Hello"), max_new_tokens=4, compile=True)  # compiles, prices the sizes
mm.generate(encode(tokenizer, prompts[0]), max_new_tokens=128, compile=True)  # untimed
profiling[0] = True
for text in prompts:
    ids = encode(tokenizer, text)
    start = time.perf_counter()
    out = mm.generate(ids, max_new_tokens=128, compile=True)
    seconds = time.perf_counter() - start
    print(f"{out.stats.new_tokens[0]} tokens in {seconds:.2f} s, {out.stats.row_steps[0]} steps, "
          f"sizes {sum(out.stats.tree_sizes) / len(out.stats.tree_sizes):.2f}", flush=True)
for name in times:
    print(f"{name}: {calls[name]} calls, {1000 * times[name] / max(calls[name], 1):.2f} ms a call", flush=True)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for text in prompts:
        mm.generate(encode(tokenizer, text), max_new_tokens=128, compile=True)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
