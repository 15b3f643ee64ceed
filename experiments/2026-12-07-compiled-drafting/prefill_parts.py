"""Where a compiled call's time before its first step goes (issue 57): generate(compile=True) with the shipped eagle
heads, tree=[] and the one-node chain [[0]] (the draft layer's start included), on MT-bench first turns; cProfile
over the timed calls after one that compiles the graphs, cumulative time of this library's functions and transformers'
per call. Usage: MEDUSA_SPEC_STEP_COSTS=0 python prefill_parts.py [PROMPTS]"""

import cProfile
import pstats
import sys
import time

from medusa_spec import MedusaModel, default_model
from medusa_spec.bench import MT_BENCH, encode, read_eval_prompts
from medusa_spec.loop import StepTimer
from medusa_spec.train.load import load_model_and_tokenizer

count = int(sys.argv[1]) if len(sys.argv) > 1 else 4
base, tokenizer = load_model_and_tokenizer(str(default_model.prepare()))
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
prompts = [encode(tokenizer, text) for _, text in read_eval_prompts([str(MT_BENCH)], per_category=1)][:count]
for tree in ([], [[0]]):
    mm.generate(prompts[0], max_new_tokens=8, tree=tree, compile=True)  # compiles
    profiler = cProfile.Profile()
    seconds, prefill = 0.0, 0.0
    for ids in prompts:
        timer = StepTimer()
        start = time.perf_counter()
        profiler.enable()
        mm.generate(ids, max_new_tokens=128, tree=tree, compile=True, timer=timer)
        profiler.disable()
        seconds += time.perf_counter() - start
        prefill += timer.seconds["prefill"]
    print(f"tree={tree}: {1000 * seconds / count:.0f} ms a call, prefill stage {1000 * prefill / count:.0f} ms, "
          f"prompts of {[ids.shape[1] for ids in prompts]} tokens", flush=True)
    stats = pstats.Stats(profiler)
    stats.sort_stats("cumtime").print_stats("medusa_spec|modeling_llama|_signature", 45)
