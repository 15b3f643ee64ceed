"""Where an eager verify pass of `rows` rows goes: the loop's own verify (loop.verify, then a commit that keeps
nothing) of chains of 1, 2 and 4 nodes after 256 tokens, timed (fastest of 6), then 1 and 2 nodes each under torch's
profiler over 5 passes, ops by self CPU time. Usage: python profile_batch.py [rows] (alone on the machine)."""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from medusa_spec import MedusaModel, default_model, loop
from medusa_spec.columnwise import columnwise_copy
from medusa_spec.kv_cache import new_cache
from medusa_spec.propose import Candidates
from medusa_spec.slots import prefill
from medusa_spec.tree import chain_tree

rows = int(sys.argv[1]) if len(sys.argv) > 1 else 8
torch.set_grad_enabled(False)
base = AutoModelForCausalLM.from_pretrained(default_model.prepare(), dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
spec, layers = mm.spec, tuple(mm.heads.feature_layers)
copy = columnwise_copy(base, packs=mm._packed_weights, eval_mode=True)
ids = torch.randint(0, spec.vocab_size, (rows, 256), generator=torch.Generator().manual_seed(0))
with torch.inference_mode():
    _, _, slots = prefill(copy, spec, ids, torch.ones_like(ids, dtype=torch.bool), new_cache(), feature_layers=layers)
    nobody = torch.zeros(rows, dtype=torch.long)

    def verify(n):
        loop.verify(copy, spec, slots, Candidates(ids[:, -n:], chain_tree(n - 1)), layers)
        loop.commit(slots, 0, nobody, nobody.bool())

    best = {}
    for _ in range(6):
        for n in (1, 2, 4):
            start = time.perf_counter()
            verify(n)
            best[n] = min(best.get(n, 1e9), time.perf_counter() - start)
    print(f"{rows} rows, verify ms (fastest of 6):", {n: round(1000 * s, 1) for n, s in best.items()}, flush=True)
    for n in (1, 2):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                verify(n)
        print(f"\n=== {n} node(s), {rows} rows: 5 verify passes ===")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
