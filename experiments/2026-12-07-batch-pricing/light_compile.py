"""How long a compiled one-row verify graph takes to compile, and how fast it runs, with lighter inductor options
than generate(compile=True)'s (compiled.compile_options: weights frozen, inductor's own C++ GEMM by max_autotune,
the C++ wrapper): `--variant full` those, `freezing` (frozen weights, aten's prepacked oneDNN linear, C++ wrapper),
`plain` (inductor's defaults). One variant per process (a graph compiles once per process); the eager pass
(loop.verify through the decoding loop's column-wise copy) timed beside it. Usage:
python light_compile.py --variant freezing (alone on the machine)."""
import argparse
import time

import torch
from transformers import AutoModelForCausalLM

from medusa_spec import MedusaModel, autotree, compiled, default_model, loop
from medusa_spec.columnwise import columnwise_copy
from medusa_spec.kv_cache import new_cache
from medusa_spec.propose import Candidates
from medusa_spec.slots import prefill
from medusa_spec.tree import chain_tree

VARIANTS = {"full": None,
            "freezing": {"freezing": True, "max_autotune": False, "cpp_wrapper": True},
            "plain": {}}
parser = argparse.ArgumentParser()
parser.add_argument("--variant", choices=VARIANTS, default="freezing")
args = parser.parse_args()
if VARIANTS[args.variant] is not None:
    compiled.compile_options = lambda device, dtype: dict(VARIANTS[args.variant])
base = AutoModelForCausalLM.from_pretrained(default_model.prepare(), dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
mm._compiled.prepare(base, mm.spec, tuple(mm.heads.feature_layers))
sizes = (1, 4)
for n in sizes:
    start = time.perf_counter()
    autotree.measure_compiled_verify(mm, mm._compiled, (n,), repeats=1)
    print(f"{args.variant}: block {n} compiled (and run twice) in {time.perf_counter() - start:.0f} s", flush=True)
spec, layers = mm.spec, tuple(mm.heads.feature_layers)
copy = columnwise_copy(base, packs=mm._packed_weights, eval_mode=True)
ids = torch.randint(0, spec.vocab_size, (1, autotree.AUTO_CONTEXT), generator=torch.Generator().manual_seed(0))
with torch.inference_mode():
    _, _, slots = prefill(copy, spec, ids, torch.ones_like(ids, dtype=torch.bool), new_cache(), feature_layers=layers)
    nobody = torch.zeros(1, dtype=torch.long)

    def eager(n):
        loop.verify(copy, spec, slots, Candidates(ids[:, -n:], chain_tree(n - 1)), layers)
        loop.commit(slots, 0, nobody, nobody.bool())

    best = {}
    for _ in range(8):
        graph = autotree.measure_compiled_verify(mm, mm._compiled, sizes, repeats=1)
        for n in sizes:
            best["graph", n] = min(best.get(("graph", n), 1e9), graph[n])
            start = time.perf_counter()
            eager(n)
            best["eager", n] = min(best.get(("eager", n), 1e9), time.perf_counter() - start)
print(f"{args.variant}: one row after {autotree.AUTO_CONTEXT} tokens, fastest of 8: " + "  ".join(
    f"{n} node(s) graph {1000 * best['graph', n]:.1f} ms, eager {1000 * best['eager', n]:.1f} ms" for n in sizes))
