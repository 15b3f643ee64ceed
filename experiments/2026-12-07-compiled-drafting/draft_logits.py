"""What a compiled drafting level's head could save (issue 57): the shipped eagle heads' draft_logits (head block,
draft LM head over 4,096 tokens) + log-softmax + top-k on 1 and 4 rows, as the proposer runs it (eager, through the
columnwise copy with the draft LM head's pack) and through one torch.compile'd graph of the same (freezing, inductor's
C++ GEMM, as compiled.DraftGraphs compiles the draft layer); fastest of 200 calls, the weights read after a 32 MB
buffer has flushed them from the cache each time, as a decoding step reads them after the verify pass.
Usage: python draft_logits.py"""

import time

import torch

from medusa_spec import MedusaModel, default_model
from medusa_spec.columnwise import PackedWeights, columnwise_copy
from medusa_spec.train.load import load_model_and_tokenizer

torch.manual_seed(0)
base, _ = load_model_and_tokenizer(str(default_model.prepare()))
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
lm_head = base.get_output_embeddings()
packs = PackedWeights()
heads = columnwise_copy(mm.heads, packs=packs, eval_mode=True)
vars(heads)["draft_lm_packed"] = packs.get(heads.draft_lm_weight)
plain = columnwise_copy(mm.heads, eval_mode=True, linears=False)
flush = torch.zeros(8 * 1024 * 1024)


def top(model, head: int, outputs: torch.Tensor):
    logp = model.draft_logits(head, outputs, lm_head).float().log_softmax(-1)
    return logp.masked_fill(logp.isnan(), float("-inf")).topk(8, dim=-1)


def fastest(fn, x) -> float:
    best = float("inf")
    for _ in range(200):
        flush.add_(1.0)
        start = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - start)
    return best


options = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
           "autotune_num_choices_displayed": 0}
with torch.inference_mode():
    for rows in (1, 4):
        x = torch.randn(1, rows, 576)
        eager = fastest(lambda v: top(heads, 1, v), x)
        graph = torch.compile(lambda v: top(plain, 1, v), fullgraph=True, dynamic=False)
        with torch._inductor.config.patch(options):
            start = time.perf_counter()
            graph(x)
            seconds = time.perf_counter() - start
        same = torch.equal(graph(x)[1], top(heads, 1, x)[1])
        print(f"{rows} row(s): eager {1000 * eager:.3f} ms, compiled {1000 * fastest(graph, x):.3f} ms "
              f"(compiled in {seconds:.0f} s), same top-8: {same}", flush=True)
