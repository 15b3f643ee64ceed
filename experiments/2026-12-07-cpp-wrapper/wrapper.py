# One-off (eleventh session): the compiled verify pass of 1 and 8 nodes (one row) after 240 tokens, fastest of 5, with
# inductor's default Python wrapper or its C++ wrapper (cpp_wrapper=True), which calls the graph's kernels from C++
# instead of Python. Usage: python wrapper.py [cpp]   (one variant per process)
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from medusa_spec import MedusaModel, autotree, compiled, default_model

cpp = sys.argv[1:] == ["cpp"]
options = compiled.compile_options
if cpp:
    compiled.compile_options = lambda device, dtype: {**options(device, dtype), "cpp_wrapper": True}
path = default_model.prepare()
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
mm._compiled.prepare(base, mm.spec, tuple(mm.heads.feature_layers))
start = time.perf_counter()
seconds = autotree.measure_compiled_verify(mm, mm._compiled, (1, 8), context=240, repeats=5)
print("cpp_wrapper" if cpp else "python wrapper", {n: round(1000 * s, 2) for n, s in seconds.items()}, "ms",
      f"(with compiles: {time.perf_counter() - start:.0f} s)", flush=True)
