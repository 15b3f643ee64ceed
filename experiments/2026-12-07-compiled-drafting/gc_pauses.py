"""Do the compiled calls' rare 1.5-2 s prefills come from Python's garbage collector (issue 57)? generate(compile=True,
tree=None) with the shipped eagle heads on MT-bench first turns, one per category, twice over; gc.callbacks time each
collection by generation. Then gc.freeze() (the heap so far, compiled graphs included, left out of later collections)
and the same prompts again. Usage: MEDUSA_SPEC_STEP_COSTS=0 python gc_pauses.py [ROUNDS]"""

import gc
import sys
import time

from medusa_spec import MedusaModel, default_model
from medusa_spec.bench import MT_BENCH, encode, read_eval_prompts
from medusa_spec.loop import StepTimer
from medusa_spec.train.load import load_model_and_tokenizer

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
base, tokenizer = load_model_and_tokenizer(str(default_model.prepare()))
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
prompts = [(c, encode(tokenizer, text)) for c, text in read_eval_prompts([str(MT_BENCH)], per_category=1)]
pauses, started = [], [0.0]


def on_gc(phase, info):
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        pauses.append((info["generation"], time.perf_counter() - started[0]))


def run(label: str) -> None:
    pauses.clear()
    total, calls = 0.0, 0
    for _ in range(rounds):
        for category, ids in prompts:
            timer = StepTimer()
            before = len(pauses)
            start = time.perf_counter()
            mm.generate(ids, max_new_tokens=128, compile=True, timer=timer)
            seconds = time.perf_counter() - start
            total, calls = total + seconds, calls + 1
            full = [p for g, p in pauses[before:] if g == 2]
            print(f"{label} {category:10s} {seconds:5.2f} s, prefill {1000 * timer.seconds['prefill']:5.0f} ms, "
                  f"gen-2 collections {len(full)} ({1000 * sum(full):.0f} ms)", flush=True)
    for g in range(3):
        times = [p for gen, p in pauses if gen == g]
        print(f"{label}: generation {g}: {len(times)} collections, {1000 * sum(times):.0f} ms in all, "
              f"longest {1000 * max(times, default=0):.0f} ms", flush=True)
    print(f"{label}: {calls} calls, {total:.1f} s", flush=True)


mm.generate(prompts[0][1], max_new_tokens=8, compile=True)  # compiles, prices the sizes
gc.callbacks.append(on_gc)
print(f"objects tracked by gc after the compile: {len(gc.get_objects())}", flush=True)
run("as is")
gc.collect()
gc.freeze()
run("frozen")
