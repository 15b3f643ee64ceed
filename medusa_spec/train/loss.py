"""Losses. Medusa-1: sum_k decay^k * CE(head k, the token k + 2 ahead). Medusa-2 adds a loss on
the base model itself: cross-entropy on the next token, or the KL divergence to the untouched
base (self-distillation), with the heads' loss weighted by lambda.

Shapes: logits [B, T, V], head_states [B, T, K, H]; input_ids, loss_mask, segment_ids [B, T].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..columnwise import linear


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
    ce = F.cross_entropy(logits[:, :-shift].flatten(0, 1).float(), targets[:, shift:].clamp(min=0).flatten(),
                         reduction="none")
    return _masked_mean(ce.view(input_ids.shape[0], -1), mask)


def heads_loss(head_states: torch.Tensor, projections: list[tuple[torch.Tensor, torch.Tensor | None]],
               input_ids: torch.Tensor, loss_mask: torch.Tensor, segment_ids: torch.Tensor, decay: float,
               targets: torch.Tensor | None = None,
               teacher_logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_k decay^k * CE_k, where head k (0-based) at position t predicts token t + k + 2 with the
    logits head_states[:, t, k] @ W_k.T + b_k, projections[k] = (W_k, b_k). The logits are formed only
    at the positions that have a target, a chunk at a time (linear_cross_entropy). `targets` as in
    shifted_cross_entropy. With `teacher_logits` [B, T, V'] (the base's own logits over the heads'
    vocabulary) head k learns the base's whole distribution there instead of the data's token.
    Returns (loss, per-head CE [K], detached, for logging)."""
    tokens = input_ids if targets is None else targets
    per_head = []
    for k, (weight, bias) in enumerate(projections):
        shift = k + 2
        if input_ids.shape[1] <= shift:
            per_head.append(head_states.sum() * 0.0)
            continue
        mask = target_mask(loss_mask, segment_ids, shift)
        if teacher_logits is None:
            mask = mask & (tokens[:, shift:] >= 0)
            wanted = tokens[:, shift:][mask]
        else:
            # the teacher's logits at t + shift - 1 name token t + shift
            wanted = teacher_logits[:, shift - 1: -1][mask]
        total = linear_cross_entropy(head_states[:, :-shift, k][mask], weight, bias, wanted)
        per_head.append(total / mask.sum().clamp(min=1))  # a batch with no target adds 0, not NaN
    loss = sum(decay ** k * ce for k, ce in enumerate(per_head))
    return loss, torch.stack(per_head).detach()


def linear_cross_entropy(states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                         chunk_rows: int = 1024) -> torch.Tensor:
    """Summed cross-entropy of the logits states @ weight.T + bias ([N, H] x [V, H]) against targets
    (token indices [N], or teacher logits [N, V] whose softmax is the target), without ever holding
    all N rows' logits: autograd would keep every head's [N, V] logits and log-softmax for backward,
    gigabytes at a 50-150k vocabulary."""
    return _LinearCrossEntropy.apply(states, weight, bias, targets, chunk_rows)


class _LinearCrossEntropy(torch.autograd.Function):
    """linear_cross_entropy, one chunk of rows at a time, the gradients taken in the same pass (d CE /
    d logits = softmax - target), so a chunk's logits are freed before the next chunk's are formed."""

    @staticmethod
    def forward(ctx, states, weight, bias, targets, chunk_rows):
        need_states, need_weight, need_bias = ctx.needs_input_grad[:3]
        exact = torch.promote_types(weight.dtype, torch.float32)  # softmax in fp32 at least
        grad_states = torch.zeros_like(states) if need_states else None
        grad_weight = torch.zeros_like(weight, dtype=exact) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=exact) if need_bias else None  # need_bias: bias is not None
        total = torch.zeros((), dtype=exact, device=states.device)
        for start in range(0, states.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            x = states[rows].to(weight.dtype)  # heads are fp32; a mixed-precision base's LM head is not
            # Autograd is off in here: `linear` takes the fastest CPU kernel (oneDNN on x86: well above nn.Linear's
            # rate for a chunk of rows through the LM head, and for the gradient's product below).
            log_probs = linear(x, weight, bias).to(exact).log_softmax(-1)
            if targets.dtype == torch.long:
                picked = targets[rows, None]
                total -= log_probs.gather(1, picked).sum()
                minus_one = torch.full(picked.shape, -1.0, dtype=exact, device=x.device)
                grad = log_probs.exp_().scatter_add_(1, picked, minus_one)
            else:
                teacher = targets[rows].to(exact).softmax(-1)
                total -= (teacher * log_probs).sum()
                grad = log_probs.exp_().sub_(teacher)
            if need_states:
                grad_states[rows] = linear(grad.to(weight.dtype), weight.t())
            if need_weight:
                grad_weight += grad.T @ x.to(exact)
            if need_bias:
                grad_bias += grad.sum(0)
        ctx.weight_dtype = weight.dtype  # nn.Linear keeps its bias in the same dtype
        ctx.save_for_backward(grad_states, grad_weight, grad_bias)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_states, grad_weight, grad_bias = ctx.saved_tensors
        return (None if grad_states is None else grad_states * grad_total.to(grad_states.dtype),
                None if grad_weight is None else (grad_weight * grad_total).to(ctx.weight_dtype),
                None if grad_bias is None else (grad_bias * grad_total).to(ctx.weight_dtype),
                None, None)


def kl_to_teacher(logits: torch.Tensor, teacher_logits: torch.Tensor, loss_mask: torch.Tensor,
                  segment_ids: torch.Tensor) -> torch.Tensor:
    """Mean KL(teacher || model) of the next-token distributions, at the positions that predict an
    assistant token: keeps the LoRA-tuned base close to what the untouched base would say."""
    log_p = F.log_softmax(logits[:, :-1].float(), dim=-1)
    log_q = F.log_softmax(teacher_logits[:, :-1].float(), dim=-1)
    kl = F.kl_div(log_p, log_q, log_target=True, reduction="none").sum(-1)
    return _masked_mean(kl, target_mask(loss_mask, segment_ids, 1))
