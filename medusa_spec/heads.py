"""Medusa heads: residual SiLU blocks on the base model's final hidden state, then a vocabulary projection.

Weight names follow vLLM's Medusa layout (`blocks.{h}.layers.{l}.weight`, `lm_heads.{h}.weight`)
so exporting is a rename-free copy.
"""

from __future__ import annotations

import torch
from torch import nn


class ResidualBlock(nn.Module):
    """`num_layers` distinct blocks x <- x + SiLU(W x + b); W starts at zero so a new head
    initially reproduces the base model's next-token prediction."""

    def __init__(self, hidden_size: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers))
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + nn.functional.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    """`num_heads` heads; head k predicts the token k + 2 positions ahead of its input state."""

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int, share_lm_head: bool):
        super().__init__()
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size, num_layers) for _ in range(num_heads))
        # With a shared LM head the heads own no vocab-sized matrix; the base's is passed to forward().
        self.lm_heads = None if share_lm_head else nn.ModuleList(
            nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads)
        )

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def init_projections_from(self, output_embeddings: nn.Module) -> None:
        """Original Medusa: every head's own projection starts as a copy of the base LM head."""
        if self.lm_heads is None:
            return
        with torch.no_grad():
            for lm_head in self.lm_heads:
                lm_head.weight.copy_(output_embeddings.weight)

    def hidden(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., num_heads, H]: each head's state before its vocabulary projection."""
        return torch.stack([block(hidden_states) for block in self.blocks], dim=-2)

    def forward(self, hidden_states: torch.Tensor, base_lm_head: nn.Module) -> torch.Tensor:
        """[..., H] -> logits [..., num_heads, V]."""
        states = self.hidden(hidden_states)
        if self.lm_heads is None:
            # One matmul through the shared LM head for all heads: the big matrix is read once.
            return base_lm_head(states)
        return torch.stack([lm_head(states[..., k, :]) for k, lm_head in enumerate(self.lm_heads)], dim=-2)
