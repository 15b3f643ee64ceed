# One-off: where eager drafting's time goes in a heads step (eagle heads, DynamicTree of 8 nodes, one row), by
# Python function (cProfile over propose and update) and by torch op. Usage: python profile_propose.py [PROMPTS]
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import medusa_spec
from medusa_spec import MedusaModel, default_model
from medusa_spec.bench import encode, read_eval_prompts
from medusa_spec.propose import DynamicDraftLayerProposer
from medusa_spec.tree import DynamicTree

DATA = Path(medusa_spec.__file__).parent / "data"
path = default_model.prepare()
tokenizer = AutoTokenizer.from_pretrained(path)
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
prompts = [text for _, text in read_eval_prompts(DATA / "mt_bench_question.jsonl", per_category=1)][
    : int(sys.argv[1]) if len(sys.argv) > 1 else 3
]
times = {"propose": 0.0, "update": 0.0}
calls = {"propose": 0, "update": 0}
profiler = cProfile.Profile()


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        profiler.enable()
        try:
            return fn(*args, **kwargs)
        finally:
            profiler.disable()
            times[name] += time.perf_counter() - t
            calls[name] += 1

    return wrapper


for name in times:
    setattr(DynamicDraftLayerProposer, name, timed(name, getattr(DynamicDraftLayerProposer, name)))
for i, text in enumerate(prompts):
    ids = encode(tokenizer, text)
    if i == 0:  # warm-up, not counted
        mm.generate(ids, max_new_tokens=16, tree=DynamicTree(8))
        profiler = cProfile.Profile()
        times = dict.fromkeys(times, 0.0)
        calls = dict.fromkeys(calls, 0)
    out = mm.generate(ids, max_new_tokens=128, tree=DynamicTree(8))
for name in times:
    print(f"{name}: {calls[name]} calls, {1000 * times[name] / max(calls[name], 1):.2f} ms a call")
stats = pstats.Stats(profiler)
stats.sort_stats("tottime").print_stats(25)
stats.sort_stats("cumtime").print_stats("medusa_spec|modeling_llama", 30)
