"""The base model and the heads behind one forward (what accelerate wraps), and the attention mask of packed rows."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..columnwise import columnwise_copy
from ..verify import base_features, model_mask
from .loss import heads_loss


class Outputs(NamedTuple):  # a NamedTuple: DDP finds the tensors in it
    head_states: torch.Tensor            # [B, T, K, H], before the heads' vocabulary projection
    hidden: torch.Tensor                 # [B, T, H], the base's final hidden state (then the heads' feature_layers')
    base_logits: torch.Tensor | None     # [B, T, V], when asked for
    teacher_logits: torch.Tensor | None  # [B, T, V] with the LoRA adapter disabled, when asked for
    heads_loss: tuple[torch.Tensor, torch.Tensor] | None  # (loss, per-head CE [K]), when a loss_mask is given


def causal_within_examples(segment_ids: torch.Tensor) -> torch.Tensor:
    """segment_ids [B, T] -> [B, T, T] bool: causal within each example of a packed row. A padding
    position sees only itself (an all-masked query row would give NaN in sdpa)."""
    length = segment_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    allowed = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal & (segment_ids[:, None, :] > 0)
    return allowed | torch.eye(length, dtype=torch.bool, device=segment_ids.device)


def attention_mask(segment_ids: torch.Tensor, bool_mask: bool, dtype: torch.dtype) -> torch.Tensor:
    """segment_ids [B, T] -> the base model's [B, 1, T, T] mask, causal within each example."""
    return model_mask(causal_within_examples(segment_ids), bool_mask, dtype)


class TrainModule(nn.Module):
    """The base model and the heads behind one forward: the unit accelerate wraps (DDP needs every
    trained parameter reached through a single module's forward)."""

    def __init__(self, base_model: nn.Module, heads: nn.Module, bool_mask: bool, takes_logits_to_keep: bool):
        super().__init__()
        self.base_model = base_model
        self.heads = heads
        self.bool_mask = bool_mask
        self.takes_logits_to_keep = takes_logits_to_keep

    def forward(self, input_ids, position_ids, segment_ids, hidden=None, base_logits=False, teacher_logits=False,
                train_base=False, greedy_paths=False, loss_mask=None, draft_targets=None, soft_targets=False,
                decay=0.8) -> Outputs:
        """hidden: cached hidden states, as Outputs.hidden holds them (then the base does not run; base_logits must
        be False).
        train_base: let gradients reach the base (the LoRA weights); else the heads read a detached state.
        Dependent heads read the data's next tokens as their path (teacher forcing), or with
        greedy_paths (needs base_logits) the base model's own greedy tokens, as at decoding time.
        loss_mask: also the heads' loss (heads_loss in loss.py, with decay), computed here because the
        projections it applies may be trained weights, which DDP sees only if forward uses them.
        draft_targets [V]: token id -> index in the heads' reduced vocabulary (-1: none), if reduced;
        soft_targets: the heads learn the base's distribution over their vocabulary, not the data's token."""
        lm_head = self.base_model.get_output_embeddings()
        mask = attention_mask(segment_ids, self.bool_mask, lm_head.weight.dtype)
        inputs = {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids, "use_cache": False}
        logits = teacher = None
        if hidden is None:
            # Without base logits, skip the vocabulary projection of the base (the heads make their own).
            keep = {"logits_to_keep": 1} if not base_logits and self.takes_logits_to_keep else {}
            grad = train_base and torch.is_grad_enabled()
            # A frozen base runs through a columnwise_copy: its linear layers take oneDNN's kernel on x86 CPUs in
            # fp32, faster than nn.Linear's for a training batch's forward; a trained one needs autograd.
            base = self.base_model if grad else columnwise_copy(self.base_model)
            with torch.set_grad_enabled(grad):
                out = base(**inputs, output_hidden_states=True, **keep)
            hidden = base_features(out.hidden_states, self.heads.feature_layers)
            logits = out.logits if base_logits else None
        if teacher_logits:
            with torch.no_grad(), self.base_model.disable_adapter():
                teacher = self.base_model(**inputs).logits
        next_embeds = None
        embed = self.base_model.get_input_embeddings()
        if self.heads.dependent or self.heads.context is not None:
            # next_ids[:, t] is the token after position t: the first token of head paths read at t.
            next_ids = logits.argmax(-1) if greedy_paths else torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)
            next_embeds = embed(next_ids).detach().to(hidden.dtype)
        states = self.heads.features(hidden if train_base else hidden.detach())
        allowed = causal_within_examples(segment_ids)
        if self.heads.context is not None:
            states = self.heads.context(states, embed(input_ids).detach().to(hidden.dtype), next_embeds, allowed)
        head_states = self.heads.states(states, next_embeds, allowed, position_ids)
        loss = None
        if loss_mask is not None:
            projections = [self.heads.projection(k, lm_head) for k in range(self.heads.num_heads)]
            loss = heads_loss(head_states, projections, input_ids, loss_mask, segment_ids, decay,
                              None if draft_targets is None else draft_targets[input_ids],
                              self.base_logits_for_heads(hidden[..., : lm_head.weight.shape[1]].detach())
                              if soft_targets else None)
        return Outputs(head_states, hidden, logits, teacher, loss)

    def base_logits_for_heads(self, hidden: torch.Tensor) -> torch.Tensor:
        """The base's next-token logits from its final hidden states [..., H] over the heads' vocabulary."""
        return base_logits_over(self.base_model, hidden, self.heads.token_map)


@torch.no_grad()
def base_logits_over(base_model: nn.Module, hidden: torch.Tensor, token_map: torch.Tensor | None) -> torch.Tensor:
    """The base's next-token logits (fp32) from its final hidden states [..., H], over a draft vocabulary: only the
    token map's rows of the LM head when it is reduced (`token_map`: draft index -> token id), else all."""
    lm_head = base_model.get_output_embeddings()
    weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
    if token_map is not None:
        rows = token_map.to(weight.device)
        weight, bias = weight[rows], None if bias is None else bias[rows]
    logits = nn.functional.linear(hidden.to(weight.dtype), weight, bias).float()
    cap = getattr(base_model.config, "final_logit_softcapping", None)  # Gemma 2 style
    return logits if not cap else cap * torch.tanh(logits / cap)
