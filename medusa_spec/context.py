"""The context layer (optional, `context_heads` > 0): one causal attention layer over the text so far,
whose output at the last accepted position the heads read instead of the base's hidden state there.

Slot j holds [h_j, E(x_j), E(x_j+1)]: the base's final hidden state at position j, the token there
and the token that came next; queries, keys and values are linear maps of all three. Heads that read
only h_t and the path from x_t+1 cannot look back at the text; the slot of the last position,
attending over every earlier slot with the root x_t+1 in its query, can (a name, a closing bracket,
a pattern seen a few lines up). With both tokens in a slot one layer can do what induction heads do:
match the root against an earlier x_j and read the x_j+1 that followed it there. It is Hydra++'s
prefix attention with tokens in the slots, as in EAGLE's draft layer.

Training runs it over whole rows under a causal, per-example mask; decoding keeps its keys and values
in a ContextCache that grows by each step's accepted slots, as the base's KV cache does. No position
encoding: the layer matches slots by content.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


def unit_rms(embeds: torch.Tensor) -> torch.Tensor:
    """Token embeddings scaled to unit RMS: input embeddings are often far smaller than the normed final
    hidden state beside them (init std ~0.02), which would leave their input weights learning slowly."""
    return embeds * torch.rsqrt(embeds.pow(2).mean(-1, keepdim=True) + 1e-6)


@dataclass
class ContextCache:
    """The context layer's keys and values while decoding: [B, attention heads, slots, head dim], and
    which slots hold text [B, slots] (not padding, not a rejected candidate)."""

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor


class ContextLayer(nn.Module):
    """f_j = [norm(h_j), E(x_j), E(x_j+1)] (embeddings at unit RMS); q, k, v = W_qkv f;
    out_j = h_j + W_out attention(q_j over k, v of slots <= j). W_out starts at zero, so a new layer passes
    h_j through and heads start as without it."""

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        if num_heads < 1 or hidden_size % num_heads:
            raise ValueError(f"context_heads must divide hidden_size {hidden_size} (e.g. {max(1, hidden_size // 64)}), "
                             f"got {num_heads}")
        self.num_heads = num_heads
        self.norm = nn.RMSNorm(hidden_size, eps=1e-6)
        # Separate inputs, not their sum: a query must find the root among the keys' tokens while the
        # values carry the tokens that followed them, which one summed vector would blur together.
        self.qkv = nn.Linear(3 * hidden_size, 3 * hidden_size, bias=False)
        self.out = nn.Linear(hidden_size, hidden_size, bias=False)
        nn.init.zeros_(self.out.weight)
        # Start as a soft prompt lookup: queries carry the slot's next token (at the last slot, the root),
        # keys the slot's own token, values the token that followed it; so a query finds the earlier places
        # of the root and reads what came after them. From a random start a tiny test model had not found
        # that pattern (an induction head) after 1,500 steps; from this one it learns it in 150.
        h = hidden_size
        with torch.no_grad():
            for rows, columns in ((slice(0, h), slice(2 * h, 3 * h)), (slice(h, 2 * h), slice(h, 2 * h)),
                                  (slice(2 * h, 3 * h), slice(2 * h, 3 * h))):
                self.qkv.weight[rows, columns] += torch.eye(h)

    def _slots(self, hidden: torch.Tensor, token_embeds: torch.Tensor, next_embeds: torch.Tensor):
        """[B, T, H] each -> q, k, v [B, heads, T, head dim]."""
        features = torch.cat([self.norm(hidden), unit_rms(token_embeds), unit_rms(next_embeds)], dim=-1)
        qkv = self.qkv(features).unflatten(-1, (3, self.num_heads, -1))  # [B, T, 3, heads, head dim]
        return qkv.permute(2, 0, 3, 1, 4).unbind(0)

    def _output(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        return hidden + self.out(attended.transpose(1, 2).flatten(-2))

    def forward(self, hidden: torch.Tensor, token_embeds: torch.Tensor, next_embeds: torch.Tensor,
                allowed: torch.Tensor) -> torch.Tensor:
        """Training: hidden, token_embeds, next_embeds [B, T, H] (E of the token at and after each position),
        allowed [B, T, T] bool (query t may see slot j: causal within its example) -> the heads' input
        states [B, T, H]."""
        q, k, v = self._slots(hidden, token_embeds, next_embeds)
        return self._output(hidden, F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None]))

    def extend(self, cache: ContextCache | None, hidden: torch.Tensor, token_embeds: torch.Tensor,
               next_embeds: torch.Tensor, valid: torch.Tensor, last: torch.Tensor) -> tuple[ContextCache, torch.Tensor]:
        """Decoding: append m slots (hidden, token_embeds, next_embeds [B, m, H]; valid [B, m]) and return
        (the cache, each row's output at its new slot `last` [B]). A row's slots after `last` must be
        invalid (they are rejected candidates), so attending over every valid slot is causal."""
        q, k, v = self._slots(hidden, token_embeds, next_embeds)
        if cache is not None:
            k, v = torch.cat([cache.keys, k], dim=2), torch.cat([cache.values, v], dim=2)
            valid = torch.cat([cache.valid, valid], dim=1)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        query = q[rows, :, last][:, :, None]  # [B, heads, 1, head dim]
        attended = F.scaled_dot_product_attention(query, k, v, attn_mask=valid[:, None, None, :])
        return ContextCache(k, v, valid), self._output(hidden[rows, last][:, None], attended)[:, 0]
