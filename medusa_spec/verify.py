"""One forward pass of the base model over a block of new tokens arranged as a tree.

The prompt (prefill) is the special case of a chain. Every cache slot carries a validity flag
and a position, so rows of a batch may hold padding or rejected slots anywhere: a query sees
a slot only if the slot is valid, is in its own tree ancestry, and (for sliding-window layers)
lies within the window counted in positions, not in slots.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache

from .base import BaseSpec

# One mask, or one per layer type ("full_attention" / "sliding_attention") for models that mix them.
Mask = torch.Tensor | dict[str, torch.Tensor]


def attention_masks(spec: BaseSpec, kv_valid: torch.Tensor, kv_pos: torch.Tensor, q_pos: torch.Tensor,
                    block_mask: torch.Tensor, dtype: torch.dtype) -> Mask:
    """Masks for a block of N queries over L = S past + N new slots.

    kv_valid [B, L] bool, kv_pos [B, L] long, q_pos [B, N] long, block_mask [N, N] or each row's [B, N, N] bool
    (query i may see new slot j). Returns one [B, 1, N, L] mask, or a dict by layer type when
    the model mixes full and sliding-window layers.
    """
    n = q_pos.shape[1]
    past = kv_valid.shape[1] - n
    allowed = kv_valid[:, None, :].expand(-1, n, -1).clone()
    allowed[:, :, past:] &= block_mask
    # Every query sees itself, so no row is empty (padding queries would give NaN in sdpa);
    # a padding slot is never visible to any other query.
    allowed[:, :, past:] |= torch.eye(n, dtype=torch.bool, device=allowed.device)
    return layer_masks(spec, allowed, q_pos, kv_pos, dtype)


def layer_masks(spec: BaseSpec, allowed: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor,
                dtype: torch.dtype) -> Mask:
    """allowed [B, N, L] bool -> the model's mask: one [B, 1, N, L] mask, or a dict by layer type
    when the model mixes full and sliding-window layers (a window counted in positions)."""
    masks = {}
    for layer_type in spec.layer_types:
        mask = allowed
        if layer_type == "sliding_attention":
            mask = allowed & ((q_pos[:, :, None] - kv_pos[:, None, :]) < spec.sliding_window)
        masks[layer_type] = model_mask(mask, spec.bool_mask, dtype)
    return next(iter(masks.values())) if len(masks) == 1 else masks


def model_mask(allowed: torch.Tensor, bool_mask: bool, dtype: torch.dtype) -> torch.Tensor:
    """[B, N, L] bool (True = may attend) -> the [B, 1, N, L] mask the attention implementation takes:
    boolean for sdpa, additive float (0 / most negative) for eager."""
    allowed = allowed[:, None]
    if bool_mask:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def forward_block(base_model: nn.Module, spec: BaseSpec, input_ids: torch.Tensor, q_pos: torch.Tensor,
                  block_mask: torch.Tensor, cache: DynamicCache, kv_valid: torch.Tensor, kv_pos: torch.Tensor,
                  last_only: bool = False, feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the base model on input_ids [B, N] at positions q_pos [B, N] after the cached slots.

    kv_valid / kv_pos [B, S + N] describe the cached slots followed by the new ones.
    Returns (logits [B, N or 1, V], hidden [B, N, H]) where hidden is the final hidden state
    after the model's last norm (with feature_layers, followed by those layers' states: see base_features);
    the new keys and values are appended to `cache`.
    The decoding loops call it on a columnwise_copy of the model: a tree's few rows then cost about
    what one row does on CPU (see columnwise).
    """
    dtype = base_model.get_output_embeddings().weight.dtype
    mask = attention_masks(spec, kv_valid, kv_pos, q_pos, block_mask, dtype)
    extra = {"logits_to_keep": 1} if last_only and spec.takes_logits_to_keep else {}
    out = base_model(input_ids=input_ids, attention_mask=mask, position_ids=q_pos, use_cache=True,
                     output_hidden_states=True, return_dict=True, **{spec.cache_arg: cache}, **extra)
    logits = out.logits[:, -1:] if last_only else out.logits
    return logits, base_features(out.hidden_states, feature_layers)


def base_features(hidden_states: tuple[torch.Tensor, ...], feature_layers: tuple[int, ...]) -> torch.Tensor:
    """A transformers output's hidden_states (the embeddings, then each decoder layer's output, the last one
    after the final norm) -> the final state [..., H], followed by feature_layers' states: [..., (1 + n) H]."""
    if not feature_layers:
        return hidden_states[-1]
    return torch.cat([hidden_states[-1], *(hidden_states[i] for i in feature_layers)], dim=-1)
