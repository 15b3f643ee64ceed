"""The compiled one-node verify pass after 240 tokens (as profile_blocks.py), fastest of 8, with the copy's attention
as it is now or, with `old`, as before this session (a one-row query under compile went transformers' way, which
copies the key/value heads per query head: repeat_kv). Usage: python one_node.py new|old; run.sh alternates them,
one process each."""
import sys

import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from medusa_spec import MedusaModel, autotree, columnwise, default_model

if sys.argv[1] == "old":
    def old_gqa_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        extras = ("softcap", "position_bias", "output_attentions")
        plain = (query.shape[2] == 1 or attention_mask is None or query.shape[1] == key.shape[1]
                 or any(kwargs.get(name) not in (None, False) for name in extras))
        if plain:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(columnwise.GQA_SDPA, old_gqa_sdpa_attention)
base = AutoModelForCausalLM.from_pretrained(default_model.prepare(), dtype=torch.float32)
mm = MedusaModel.from_pretrained(base, default_model.shipped_heads())
mm._compiled.prepare(base, mm.spec, tuple(mm.heads.feature_layers))
seconds = autotree.measure_compiled_verify(mm, mm._compiled, (1,), context=240, repeats=8)
print(sys.argv[1], {n: round(1000 * s, 2) for n, s in seconds.items()}, "ms", flush=True)
