# One-off, at 44315ff: the compiled verify pass of 1, 2, 4 and 8 nodes (one row) after 240 tokens, each block its own
# graph here (generate(compile=True) pads 2-8 nodes to 8), the fastest of 5. Usage: python blocks.py
import torch
from transformers import AutoModelForCausalLM

from medusa_spec import MedusaModel, autotree, compiled, default_model

compiled.BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64)
path = default_model.prepare()
base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
mm._compiled.prepare(base, mm.spec, tuple(mm.heads.feature_layers))
seconds = autotree.measure_compiled_verify(mm, mm._compiled, (1, 2, 4, 8), context=240, repeats=5)
print({n: round(1000 * s, 2) for n, s in seconds.items()}, "ms")
