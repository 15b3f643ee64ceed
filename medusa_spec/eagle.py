"""The draft layer of `head_type="eagle"`: one small decoder layer that drafts the tree level by level, as EAGLE's does.

Slot j of the layer's own KV cache holds W [u(f_j), u(E(x_j+1))]: the base's final hidden state at position j and the
embedding of the token after it (u: unit RMS), at position j. The layer's output g_j there stands for the base's
state at j + 1, so the heads' projection turns it into a guess of the token at j + 2; a drafted node then takes
the next slot with its parent's output in place of a state the base has not computed yet, so one layer drafts any
depth. Head k's state is the layer's output k slots down a drafted path (then head k's residual block), so the
heads' loss, accuracies, trees and acceptance are the same as for the other head types.

Training unrolls the layer as decoding runs it (EAGLE-3's training-time test): step 0 reads the base's true states
at every position, causal over the row; step k reads step k - 1's outputs with the data's tokens, each query seeing
the true slots up to its own position and its own chain of drafted slots. So a deeper guess learns from the
drafted states it will read at decoding time, where teacher forcing would train it on true states it never gets.

The layer is a Llama decoder layer (attention with rotary positions, SwiGLU MLP, RMS norms) whatever the base's
family, as EAGLE's is for every model it drafts for: it reads only the base's states and token embeddings, so no
modeling code of the base's is copied; its positions are the base's.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from .base import BaseSpec, cache_argument
from .context import unit_rms
from .verify import model_mask

# The draft layer's masks: full attention, boolean (it runs sdpa), whatever the base's layers use.
DRAFT_LAYER_SPEC = BaseSpec(hidden_size=0, vocab_size=0, layer_types=("full_attention",), sliding_window=None,
                            bool_mask=True, takes_logits_to_keep=False, name_or_path=None)
# The draft layer's cache argument in the installed transformers (its name changed within 5.x; see cache_argument).
LAYER_CACHE_ARG = cache_argument(LlamaDecoderLayer.forward)


def draft_layer_shape(text_config, hidden_size: int) -> dict[str, int]:
    """The draft layer's shape for a base model (MedusaConfig.draft_layer): the base's attention heads where they
    divide the LM head's input width (else heads of 64, else one), and its MLP width (else 4 x hidden_size)."""
    heads = getattr(text_config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1 or hidden_size % heads:
        heads = hidden_size // 64 if hidden_size % 64 == 0 else 1
    intermediate = getattr(text_config, "intermediate_size", None)
    if not isinstance(intermediate, int) or intermediate < 1:
        intermediate = 4 * hidden_size
    return {"num_attention_heads": heads, "intermediate_size": intermediate}


class DraftLayer(nn.Module):
    """fc: [u(state), u(next token's embedding)] -> H; one Llama decoder layer; a final RMS norm (the output stands
    for a normed final state, what the LM head reads).

    A new layer passes the state through: fc starts as [I, 0] and the layer's two residual branches end in
    zero-initialised projections, so its output at slot j is the base's state at j, whose guess (the token after j)
    is where new Medusa heads start too. From a random start the heads' loss began above a uniform guess's
    (over SmolLM2-135M's 4,096-token draft vocabulary)."""

    def __init__(self, hidden_size: int, shape: dict[str, int]):
        super().__init__()
        heads = shape["num_attention_heads"]
        config = LlamaConfig(hidden_size=hidden_size, intermediate_size=shape["intermediate_size"],
                             num_attention_heads=heads, num_key_value_heads=heads, num_hidden_layers=1,
                             vocab_size=1, pad_token_id=None, bos_token_id=None, eos_token_id=None)
        config._attn_implementation = "sdpa"  # takes the boolean masks built here (DRAFT_LAYER_SPEC)
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.norm = LlamaRMSNorm(hidden_size, eps=config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, :hidden_size].copy_(torch.eye(hidden_size))
            self.layer.self_attn.o_proj.weight.zero_()
            self.layer.mlp.down_proj.weight.zero_()

    def forward(self, states: torch.Tensor, next_embeds: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                cache: DynamicCache) -> torch.Tensor:
        """New slots: states [B, n, H] (the base's, or the layer's own outputs), next_embeds [B, n, H] (E of the
        token after each), positions [B, n], mask [B, 1, n, past + n] bool -> outputs [B, n, H]; the slots' keys
        and values are appended to `cache`."""
        x = self.fc(torch.cat([unit_rms(states), unit_rms(next_embeds)], dim=-1))
        x = self.layer(x, attention_mask=mask, position_ids=positions, use_cache=True, **{LAYER_CACHE_ARG: cache},
                       position_embeddings=self.rotary(x, positions))
        return self.norm(x)

    def unroll(self, states: torch.Tensor, next_embeds: torch.Tensor, allowed: torch.Tensor,
               position_ids: torch.Tensor, steps: int) -> torch.Tensor:
        """Training: the base's states and next_embeds [B, T, H] at every position (next_embeds[:, t]: E of the token
        after t), allowed [B, T, T] (causal within each example), position_ids [B, T] -> outputs [B, T, steps, H].

        Step k's query at t is the slot k deep on the path drafted from t: its state is step k - 1's output at t,
        its token the one after t + k, its position t's + k. It sees the true slots step 0 made up to t (those
        `allowed` lets t see) and the slots steps 1..k made at t: its own chain. Tokens past a row's end are
        zeros (their targets are past the end too)."""
        cache = DynamicCache()
        own_chain = torch.eye(states.shape[1], dtype=torch.bool, device=states.device).expand_as(allowed)
        outputs = []
        for k in range(steps):
            mask = model_mask(torch.cat([allowed, *[own_chain] * k], dim=-1), bool_mask=True, dtype=states.dtype)
            states = self(states, next_embeds, mask, position_ids + k, cache)
            outputs.append(states)
            next_embeds = torch.cat([next_embeds[:, 1:], torch.zeros_like(next_embeds[:, :1])], dim=1)
        return torch.stack(outputs, dim=-2)
