"""The eager verify pass (loop.verify, as profile_batch.py) with its masked multi-row attention through sdpa's
enable_gqa (columnwise.gqa_sdpa_attention) against the group folded into the query rows (each key/value head read
once for its group's rows, as transformers folds a one-row query), switched by re-registering the copy's attention
function; taking turns, fastest of 8. Usage: python fold_ab.py (alone on the machine)."""
import time

import torch
from transformers import AttentionInterface, AutoModelForCausalLM

from medusa_spec import MedusaModel, columnwise, default_model, loop
from medusa_spec.columnwise import GQA_SDPA, columnwise_copy
from medusa_spec.kv_cache import new_cache
from medusa_spec.propose import Candidates
from medusa_spec.slots import prefill
from medusa_spec.tree import chain_tree


def folded(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    rows, heads, n, width = query.shape
    groups = heads // key.shape[1]
    if attention_mask is None or groups == 1 or n == 1 or attention_mask.shape[1] != 1:
        return columnwise.gqa_sdpa_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    mask = attention_mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(attention_mask.shape[0], 1, groups * n, -1)
    out = torch.nn.functional.scaled_dot_product_attention(query.reshape(rows, key.shape[1], groups * n, width), key,
                                                           value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(rows, heads, n, width).transpose(1, 2).contiguous(), None


torch.set_grad_enabled(False)
base = AutoModelForCausalLM.from_pretrained(default_model.prepare(), dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
spec, layers = mm.spec, tuple(mm.heads.feature_layers)
copy = columnwise_copy(base, packs=mm._packed_weights, eval_mode=True)
for rows, sizes in ((8, (1, 2, 4)), (4, (2, 4)), (1, (4, 8, 16))):
    ids = torch.randint(0, spec.vocab_size, (rows, 256), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        _, _, slots = prefill(copy, spec, ids, torch.ones_like(ids, dtype=torch.bool), new_cache(),
                              feature_layers=layers)
        nobody = torch.zeros(rows, dtype=torch.long)

        def verify(n):
            logits, _ = loop.verify(copy, spec, slots, Candidates(ids[:, -n:], chain_tree(n - 1)), layers)
            loop.commit(slots, 0, nobody, nobody.bool())
            return logits

        best = {}
        for kind, function in (("gqa", columnwise.gqa_sdpa_attention), ("folded", folded)) * 8:
            AttentionInterface.register(GQA_SDPA, function)
            for n in sizes:
                start = time.perf_counter()
                logits = verify(n)
                best[kind, n] = min(best.get((kind, n), 1e9), time.perf_counter() - start)
                if kind == "folded":
                    AttentionInterface.register(GQA_SDPA, columnwise.gqa_sdpa_attention)
                    same = torch.equal(verify(n).argmax(-1), logits.argmax(-1))
                    AttentionInterface.register(GQA_SDPA, folded)
                    assert same
        print(f"{rows} row(s), context 256, verify ms: " + "  ".join(
            f"{n} nodes {1000 * best['gqa', n]:.1f} -> {1000 * best['folded', n]:.1f}" for n in sizes), flush=True)
