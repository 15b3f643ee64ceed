"""profile_blocks.py with inductor's kernel profiling on (`cpp.enable_kernel_profile`: each generated C++ kernel
records itself), so the profiler sees inside the compiled verify graphs of 1 and 8 nodes: the passes only, the
prompt's eager prefill left out. Usage: python kernels.py (alone on the machine)."""
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from medusa_spec import MedusaModel, autotree, compiled, default_model

options = compiled.compile_options
compiled.compile_options = lambda device, dtype: {**options(device, dtype), "cpp.enable_kernel_profile": True}
base = AutoModelForCausalLM.from_pretrained(default_model.prepare(), dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
mm._compiled.prepare(base, mm.spec, tuple(mm.heads.feature_layers))
seconds = autotree.measure_compiled_verify(mm, mm._compiled, (1, 8), context=240, repeats=8)
print({n: round(1000 * s, 2) for n, s in seconds.items()}, "ms", flush=True)
for nodes in (1, 8):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        autotree.measure_compiled_verify(mm, mm._compiled, (nodes,), context=240, repeats=10)
    events = [e for e in prof.key_averages() if not e.key.startswith(("mkldnn::", "aten::"))
              or "flash" in e.key or "linear" in e.key]
    print(f"\n=== {nodes} node(s): kernels by self CPU time over 11 passes "
          "(prefill ops included under mkldnn/aten) ===")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:30]:
        print(f"{e.self_cpu_time_total / 1e3:9.2f} ms {e.count:6d} calls  {e.key[:110]}")
