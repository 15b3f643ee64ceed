# One-off: drafting's time per step with the draft layer eager and through its compiled graphs (compiled.DraftGraphs),
# the verify pass eager (no verify graphs to compile), one MT-bench prompt, 128 tokens, DynamicTree(8); arms in turn,
# each twice (the first graphs run pays their compiles). Prints the loop's stages (StepTimer) and, by a wrapper, the
# proposer's propose and update and the graphs' own calls.
# Usage: python draft_profile.py [FILE INDEX]: prompt INDEX of medusa_spec/data/FILE (one per category), default
# mt_bench_question.jsonl 0
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import medusa_spec
from medusa_spec import MedusaModel, default_model
from medusa_spec.bench import encode, read_eval_prompts
from medusa_spec.compiled import DraftGraphs
from medusa_spec.inputs import resolve_sampling, special_tokens
from medusa_spec.loop import StepTimer, decode
from medusa_spec.propose import DynamicDraftLayerProposer, heads_proposer
from medusa_spec.tree import DynamicTree

DATA = Path(medusa_spec.__file__).parent / "data"
path = default_model.prepare()
tokenizer = AutoTokenizer.from_pretrained(path)
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
file, index = (sys.argv[1], int(sys.argv[2])) if len(sys.argv) > 2 else ("mt_bench_question.jsonl", 0)
ids = encode(tokenizer, [text for _, text in read_eval_prompts(DATA / file, 1)][index])
print(f"{file} {index}: {ids.shape[1]} prompt tokens")
mm.generate(ids, max_new_tokens=8, tree=DynamicTree(8))
graphs = DraftGraphs()
graphs.prepare(mm.heads, mm._packed_weights)
sampling = resolve_sampling(base, None, None, None, None, None)
eos, pad = special_tokens(base, None, None, None)
seconds = {}


def timed(name, fn):
    def wrapper(self, *args):
        start = time.perf_counter()
        out = fn(self, *args)
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
        return out

    return wrapper


DynamicDraftLayerProposer.propose = timed("propose", DynamicDraftLayerProposer.propose)
DynamicDraftLayerProposer.update = timed("update", DynamicDraftLayerProposer.update)
DraftGraphs.forward = timed("graph calls", DraftGraphs.forward)
for arm in ("eager", "graphs", "eager", "graphs"):
    seconds.clear()
    proposer = heads_proposer(base, mm.heads, DynamicTree(8), mm._packed_weights, graphs if arm == "graphs" else None)
    timer = StepTimer()
    start = time.perf_counter()
    out = decode(base, mm.spec, proposer, ids, None, 128, sampling, eos, pad, None, timer, mm._packed_weights, None,
                 None)
    steps = out.stats.steps
    print(f"{arm}: {1000 * (time.perf_counter() - start) / steps:.1f} ms/step over {steps} steps; stages "
          f"{ {k: round(1000 * v / timer.steps, 1) for k, v in timer.seconds.items()} }; "
          f"{ {k: round(1000 * v / steps, 2) for k, v in seconds.items()} }", flush=True)
