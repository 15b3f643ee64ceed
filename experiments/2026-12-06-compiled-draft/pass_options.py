# One-off: one draft-layer pass of the shipped eagle heads (4 slots after 300, a column-wise copy computing from its
# oneDNN packs, as the proposer runs it) eager and compiled under inductor options, on a static buffer.
# Usage: python pass_options.py dyn|static freeze|full|aten [PAST]
#   dyn: the attended slots a dynamic dimension (as DraftGraphs compiles); freeze: freezing alone; full:
#   compiled.compile_options (freezing, max_autotune, inductor's C++ GEMM only); aten: full with aten's kernels allowed.
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from medusa_spec import MedusaModel, default_model
from medusa_spec.columnwise import columnwise_copy
from medusa_spec.compiled import adopt, compile_options
from medusa_spec.eagle import DRAFT_LAYER_SPEC
from medusa_spec.kv_cache import new_cache
from medusa_spec.verify import layer_masks

torch.manual_seed(0)
base = AutoModelForCausalLM.from_pretrained(default_model.prepare(), dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
layer = columnwise_copy(mm.heads.draft_layer, packs=mm._packed_weights, eval_mode=True)
embed = base.get_input_embeddings()
H, N = 576, 4
PAST = int(sys.argv[3]) if len(sys.argv) > 3 else 300
shapes, choice = sys.argv[1], sys.argv[2]
full = compile_options(torch.device("cpu"), torch.float32)
options = {"freeze": {"freezing": True}, "full": full,
           "aten": {**full, "max_autotune_gemm_backends": "CPP,ATEN"}}[choice]


def forward(states, next_embeds, positions, mask, cache):
    return layer(states, next_embeds, mask, positions, cache)


def per_call_ms(fn, calls=300):
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1000 * (time.perf_counter() - start) / calls


with torch.no_grad():
    cache = new_cache()
    states, ids, positions = torch.randn(1, PAST, H), torch.randint(0, 49152, (1, PAST)), torch.arange(PAST)[None]
    causal = torch.ones(1, PAST, PAST, dtype=torch.bool).tril()
    layer(states, embed(ids), layer_masks(DRAFT_LAYER_SPEC, causal, positions, positions, torch.float32), positions,
          cache)
    static = adopt(cache, PAST)
    states, embeds, positions = torch.randn(1, N, H), torch.randn(1, N, H), torch.full((1, N), PAST)
    mask = layer_masks(DRAFT_LAYER_SPEC, torch.ones(1, N, PAST + N, dtype=torch.bool), positions, positions,
                       torch.float32)
    run = torch.compile(forward, fullgraph=True, dynamic=False)
    buffer = static.layers[0]

    def call(fn):
        buffer.window(PAST + N)
        buffer.cumulative_length.fill_(PAST)
        return fn(states, embeds, positions, mask, static)

    buffer.window(PAST + N)
    if shapes == "dyn":
        for each in (mask, buffer.keys, buffer.values):
            torch._dynamo.mark_dynamic(each, 3 if each is mask else 2)
    with torch._inductor.config.patch(options):
        start = time.perf_counter()
        run(states, embeds, positions, mask, static)
        print(f"compiled in {time.perf_counter() - start:.0f} s")
        print(f"{shapes} {choice}: compiled {per_call_ms(lambda: call(run)):.3f} ms, "
              f"eager {per_call_ms(lambda: call(forward)):.3f} ms a pass")
