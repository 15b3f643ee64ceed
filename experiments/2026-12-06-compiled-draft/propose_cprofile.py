# One-off: cProfile over the eagle heads' propose and update calls with the draft layer through its compiled graphs
# (compiled.DraftGraphs), the verify pass eager, one MT-bench prompt, 128 tokens, DynamicTree(8); the second of two
# calls (the first compiles). Usage: python propose_cprofile.py
import cProfile
import pstats
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import medusa_spec
from medusa_spec import MedusaModel, default_model
from medusa_spec.bench import encode, read_eval_prompts
from medusa_spec.compiled import DraftGraphs
from medusa_spec.inputs import resolve_sampling, special_tokens
from medusa_spec.loop import decode
from medusa_spec.propose import DynamicDraftLayerProposer, heads_proposer
from medusa_spec.tree import DynamicTree

DATA = Path(medusa_spec.__file__).parent / "data"
path = default_model.prepare()
tokenizer = AutoTokenizer.from_pretrained(path)
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
ids = encode(tokenizer, [text for _, text in read_eval_prompts(DATA / "mt_bench_question.jsonl", 1)][0])
graphs = DraftGraphs()
graphs.prepare(mm.heads, mm._packed_weights)
sampling = resolve_sampling(base, None, None, None, None, None)
eos, pad = special_tokens(base, None, None, None)
profiles = [cProfile.Profile()]


def profiled(fn):
    def wrapper(self, *args):
        profiles[-1].enable()
        try:
            return fn(self, *args)
        finally:
            profiles[-1].disable()

    return wrapper


DynamicDraftLayerProposer.propose = profiled(DynamicDraftLayerProposer.propose)
DynamicDraftLayerProposer.update = profiled(DynamicDraftLayerProposer.update)
for call in range(2):
    profiles.append(cProfile.Profile())
    proposer = heads_proposer(base, mm.heads, DynamicTree(8), mm._packed_weights, graphs)
    out = decode(base, mm.spec, proposer, ids, None, 128, sampling, eos, pad, None, None, mm._packed_weights, None,
                 None)
print("steps", out.stats.steps)
pstats.Stats(profiles[-1]).sort_stats("tottime").print_stats(30)
