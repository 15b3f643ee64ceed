# One-off (thirteenth session): how much the compiled dynamic tree's step costs move from one pricing to the next.
# generate(tree=None, compile=True) prices each block size once per process, at its first call: the compiled verify
# pass of 1, 2, 4 and 8 nodes and a step's drafting, each the fastest of `repeats` timings. Here, after the graphs are
# compiled, six pricings with each number of repeats, alternating, in one process. Prints the step ms of each block
# (verify + drafting), as compiled_dynamic_tree builds them.
# Usage: python experiments/2026-12-07-commit-in-place/pricing.py 2 8
import sys

import torch
from transformers import AutoModelForCausalLM

from medusa_spec import MedusaModel, autotree, default_model

counts = [int(r) for r in sys.argv[1:]] or [2, 8]
base = AutoModelForCausalLM.from_pretrained(default_model.prepare(), dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
compiled = mm._compiled
compiled.prepare(base, mm.spec, tuple(mm.heads.feature_layers), mm.heads, mm._packed_weights)
autotree.compiled_dynamic_tree(mm, compiled, packs=mm._packed_weights)  # compiles every graph it times
blocks = (1, 2, 4, 8)
for round_ in range(6):
    for repeats in counts:
        verify = autotree.measure_compiled_verify(mm, compiled, blocks, repeats=repeats)
        _, draft = autotree.measure_step_costs(mm, sizes=(8,), context=autotree.AUTO_CONTEXT, repeats=repeats,
                                               packs=mm._packed_weights, dynamic=True, time_verify=False,
                                               graphs=compiled.draft)
        step = {n: round(1000 * (verify[n] + min(draft.values())), 2) for n in blocks}
        print(f"round {round_} repeats {repeats}: step ms {step}, 8 / 4 nodes {step[8] / step[4]:.3f}", flush=True)
