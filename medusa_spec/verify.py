"""One forward pass of the base model over a block of new tokens arranged as a tree.

The prompt (prefill) is the special case of a chain. Every cache slot carries a validity flag
and a position, so rows of a batch may hold padding or rejected slots anywhere: a query sees
a slot only if the slot is valid, is in its own tree ancestry, and (for sliding-window layers)
lies within the window counted in positions, not in slots.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

from .base import BaseSpec


def attention_masks(spec: BaseSpec, kv_valid, kv_pos, q_pos, block_mask, dtype: torch.dtype):
    """Masks for a block of N queries over L = S past + N new slots.

    kv_valid [B, L] bool, kv_pos [B, L] long, q_pos [B, N] long, block_mask [N, N] bool
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


def forward_block(base_model: nn.Module, spec: BaseSpec, input_ids, q_pos, block_mask, cache, kv_valid, kv_pos,
                  last_only: bool = False):
    """Run the base model on input_ids [B, N] at positions q_pos [B, N] after the cached slots.

    kv_valid / kv_pos [B, S + N] describe the cached slots followed by the new ones.
    Returns (logits [B, N or 1, V], hidden [B, N, H]) where hidden is the final hidden state
    after the model's last norm; the new keys and values are appended to `cache`.
    """
    dtype = base_model.get_output_embeddings().weight.dtype
    mask = attention_masks(spec, kv_valid, kv_pos, q_pos, block_mask, dtype)
    extra = {"logits_to_keep": 1} if last_only and spec.takes_logits_to_keep else {}
    with columnwise_linears(base_model, input_ids.numel()):
        out = base_model(input_ids=input_ids, attention_mask=mask, position_ids=q_pos, cache=cache, use_cache=True,
                         output_hidden_states=True, return_dict=True, **extra)
    logits = out.logits[:, -1:] if last_only else out.logits
    return logits, out.hidden_states[-1]


# Up to this many rows (tokens in a block, all rows of a batch together) a CPU matmul runs faster
# column-wise; prefills of longer prompts keep nn.Linear's own kernel, which is as fast there.
COLUMNWISE_MAX_ROWS = 64


@contextmanager
def columnwise_linears(model: nn.Module, rows: int):
    """While a block of `rows` tokens runs through `model`, its fp32 CPU nn.Linear layers compute y = x W^T
    as (W x^T)^T. Why: on CPU, BLAS runs nn.Linear on 2-64 rows as a general matmul that streams W
    about half as fast as the one-row product does (measured on this project's 2-core machine: all
    of SmolLM2-135M's layer weights take 55 ms for 1 row, 85-105 ms for 2-8 rows by nn.Linear and
    40-50 ms column-wise). Verifying a tree then costs about what one decoding step costs. The sums
    agree up to fp32 rounding order, as between any two matmul kernels.

    Only plain fp32 nn.Linear layers on CPU are switched (bf16 kernels round differently enough to
    flip near-tied greedy tokens against one-row decoding), never subclasses (quantised, LoRA wrappers
    call a plain base layer that is switched) or layers with their own forward already (accelerate
    offload hooks); each gets its class forward back on exit.
    """
    if not 2 <= rows <= COLUMNWISE_MAX_ROWS:
        yield
        return
    linears = [module for module in model.modules()
               if type(module) is nn.Linear and "forward" not in vars(module)
               and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32]
    for linear in linears:
        linear.forward = partial(columnwise_linear, linear.weight, linear.bias)
    try:
        yield
    finally:
        for linear in linears:
            del linear.forward


def columnwise_linear(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """nn.functional.linear(x, weight, bias), computed as mm(weight, x^T)^T."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch.mm(weight, rows.t()).t()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])
