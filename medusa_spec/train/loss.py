"""Losses. Medusa-1: sum_k decay^k * CE(head k, the token k + 2 ahead). Medusa-2 adds a loss on
the base model itself: cross-entropy on the next token, or the KL divergence to the untouched
base (self-distillation), with the heads' loss weighted by lambda.

Shapes: logits [B, T, V], head_logits [B, T, K, V]; input_ids, loss_mask, segment_ids [B, T].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def target_mask(loss_mask: torch.Tensor, segment_ids: torch.Tensor, shift: int) -> torch.Tensor:
    """[B, T - shift]: position t is trained to predict token t + shift, which must be an assistant
    token of the same example (packed rows hold several examples)."""
    return loss_mask[:, shift:] & (segment_ids[:, shift:] == segment_ids[:, :-shift])


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # A batch with no target for this shift contributes 0, not NaN.
    return (values * mask).sum() / mask.sum().clamp(min=1)


def shifted_cross_entropy(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                          segment_ids: torch.Tensor, shift: int, targets: torch.Tensor | None = None) -> torch.Tensor:
    """Mean CE of logits at t against token t + shift, over the valid targets. `targets` [B, T]: the
    tokens as indices into the logits (a reduced draft vocabulary), -1 where the vocabulary lacks them."""
    if input_ids.shape[1] <= shift:
        return logits.sum() * 0.0
    targets = input_ids if targets is None else targets
    mask = target_mask(loss_mask, segment_ids, shift) & (targets[:, shift:] >= 0)
    ce = F.cross_entropy(logits[:, :-shift].flatten(0, 1).float(), targets[:, shift:].clamp(min=0).flatten(), reduction="none")
    return _masked_mean(ce.view(input_ids.shape[0], -1), mask)


def shifted_soft_cross_entropy(logits: torch.Tensor, teacher_logits: torch.Tensor, loss_mask: torch.Tensor,
                               segment_ids: torch.Tensor, shift: int) -> torch.Tensor:
    """Mean CE of logits at t against the teacher's distribution of token t + shift, which its logits
    at t + shift - 1 give, over the valid targets (the soft-target twin of shifted_cross_entropy)."""
    if logits.shape[1] <= shift:
        return logits.sum() * 0.0
    teacher = F.softmax(teacher_logits[:, shift - 1: -1].float(), dim=-1)
    ce = -(teacher * F.log_softmax(logits[:, :-shift].float(), dim=-1)).sum(-1)
    return _masked_mean(ce, target_mask(loss_mask, segment_ids, shift))


def heads_loss(head_logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, segment_ids: torch.Tensor,
               decay: float, targets: torch.Tensor | None = None,
               teacher_logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_k decay^k * CE_k, where head k (0-based) at position t predicts token t + k + 2; `targets`
    as in shifted_cross_entropy. With `teacher_logits` [B, T, V'] (the base's own logits over the heads'
    vocabulary) head k learns the base's whole distribution there instead of the data's token.
    Returns (loss, per-head CE [K], detached, for logging)."""
    if teacher_logits is None:
        per_head = [shifted_cross_entropy(head_logits[:, :, k], input_ids, loss_mask, segment_ids, shift=k + 2,
                                          targets=targets) for k in range(head_logits.shape[2])]
    else:
        per_head = [shifted_soft_cross_entropy(head_logits[:, :, k], teacher_logits, loss_mask, segment_ids, shift=k + 2)
                    for k in range(head_logits.shape[2])]
    loss = sum(decay ** k * ce for k, ce in enumerate(per_head))
    return loss, torch.stack(per_head).detach()


def kl_to_teacher(logits: torch.Tensor, teacher_logits: torch.Tensor, loss_mask: torch.Tensor,
                  segment_ids: torch.Tensor) -> torch.Tensor:
    """Mean KL(teacher || model) of the next-token distributions, at the positions that predict an
    assistant token: keeps the LoRA-tuned base close to what the untouched base would say."""
    log_p = F.log_softmax(logits[:, :-1].float(), dim=-1)
    log_q = F.log_softmax(teacher_logits[:, :-1].float(), dim=-1)
    kl = F.kl_div(log_p, log_q, log_target=True, reduction="none").sum(-1)
    return _masked_mean(kl, target_mask(loss_mask, segment_ids, 1))
