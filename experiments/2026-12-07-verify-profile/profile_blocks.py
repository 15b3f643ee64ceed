"""Where a compiled verify pass of 8 nodes spends its time beyond one node's: the one-row verify graphs of 1 and 8
nodes after 240 tokens (as ../2026-12-06-compiled-step/blocks.py), timed, then each under torch's profiler over 10
passes, the kernels by self CPU time. Usage: python profile_blocks.py (alone on the machine)."""
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from medusa_spec import MedusaModel, autotree, default_model

base = AutoModelForCausalLM.from_pretrained(default_model.prepare(), dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
mm._compiled.prepare(base, mm.spec, tuple(mm.heads.feature_layers))
seconds = autotree.measure_compiled_verify(mm, mm._compiled, (1, 8), context=240, repeats=8)
print({n: round(1000 * s, 2) for n, s in seconds.items()}, "ms", flush=True)
for nodes in (1, 8):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        autotree.measure_compiled_verify(mm, mm._compiled, (nodes,), context=240, repeats=10)
    print(f"\n=== {nodes} node(s): 11 passes (one untimed) and their set-up ===")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
