"""Draft heads on the base model's final hidden state: residual SiLU blocks, then a vocabulary projection.

Two head types share everything but their input:
- Medusa heads: head k reads only the hidden state h_t and guesses the token at t + k + 2.
- Dependent heads (Hydra-style): head k also reads the embeddings of the k + 1 tokens between,
  x = h_t + W_k [E(x_t+1), ..., E(x_t+k+1)] (its own input layer, zero at the start), so a far
  guess knows the nearer ones.

Eagle heads (EAGLE-style, see eagle.py): a draft layer, one small decoder layer with its own cache, turns the base's
state and the next token into the state one position on, and reads its own output as it drafts deeper; head k's
block reads the layer's output k slots down the drafted path.

Eagle3 heads (EAGLE-3 as speculators defines it, see eagle3.py): the same drafting by level, with speculators' draft
(its fc over the feature_layers' states, its decoder layers, norm and LM head) as the draft layer; "head" k is its
k-th level, with no block or projection of its own.

Optionally the heads read a context layer's output instead of h_t (`context`: attention over the text
so far, see context.py; the callers apply it, as it needs the whole sequence or its cache).

Optionally the heads read more than the final state (`feature_layers`, EAGLE-3's feature fusion): the hidden
states of some decoder layers, each scaled to unit RMS, are projected and added to it. The projection starts at
zero, so such heads start as plain ones; the callers pass the states concatenated (see `features`).

Optionally the heads score a reduced draft vocabulary (`token_map`: the draft index -> token id of
the most frequent tokens); verification still uses the full vocabulary, so output is unchanged.

Weight names follow vLLM's Medusa layout (`blocks.{h}.layers.{l}.weight`, `lm_heads.{h}.weight`,
`token_map`) so exporting plain heads is a rename-free copy; dependent heads add `inputs.{h}`, a context
layer `context.*`, feature fusion `fuse`, the draft layer `draft_layer.*`.
"""

from __future__ import annotations

import torch
from torch import nn

from .columnwise import linear
from .config import HEAD_TYPES
from .context import ContextLayer, unit_rms
from .eagle import DraftLayer
from .eagle3 import Eagle3Draft


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

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int, share_lm_head: bool,
                 head_type: str = "medusa", draft_vocab_size: int | None = None, context_heads: int = 0,
                 feature_layers: tuple[int, ...] = (), draft_layer: dict | None = None):
        super().__init__()
        if head_type not in HEAD_TYPES:
            raise ValueError(f"head_type must be one of {', '.join(HEAD_TYPES)}, got {head_type!r}")
        if (head_type in ("eagle", "eagle3")) != (draft_layer is not None):
            raise ValueError("draft_layer (the draft layer's description) must be given for head_type 'eagle' and "
                             "'eagle3', and only then")
        self.head_type = head_type
        # They draft level by level: a guess depends on the drafted path to it.
        self.dependent = head_type in ("dependent", "eagle", "eagle3")
        eagle3 = head_type == "eagle3"
        if eagle3:
            self.draft_layer = Eagle3Draft(draft_layer, len(feature_layers), draft_vocab_size or vocab_size)
            # No block or projection per level: the draft's own norm and LM head serve every one.
            num_layers, share_lm_head = 0, True
        else:
            self.draft_layer = DraftLayer(hidden_size, draft_layer) if draft_layer is not None else None
        if head_type == "dependent":
            # Head k adds a projection of its k + 1 path embeddings to h. It starts at zero (a plain Medusa
            # head), and h passes through untouched: a layer over [h, path] instead, with fan-in (k + 2) H,
            # made the far heads' training unstable at the learning rates plain heads use.
            self.inputs = nn.ModuleList(nn.Linear((k + 1) * hidden_size, hidden_size) for k in range(num_heads))
            for layer in self.inputs:
                nn.init.zeros_(layer.weight)
                nn.init.zeros_(layer.bias)
        self.context = ContextLayer(hidden_size, context_heads) if context_heads else None
        self.feature_layers = tuple(feature_layers)
        # Eagle3 heads fuse the feature layers' states in their draft (its fc), without the final state.
        self.fuse = nn.Linear(len(feature_layers) * hidden_size, hidden_size) if feature_layers and not eagle3 else None
        if self.fuse is not None:
            nn.init.zeros_(self.fuse.weight)
            nn.init.zeros_(self.fuse.bias)
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size, num_layers) for _ in range(num_heads))
        out_size = draft_vocab_size or vocab_size
        # With a shared LM head the heads own no vocabulary matrix; the base's is passed to forward()
        # (with a token map, only its rows for the draft vocabulary are used).
        self.lm_heads = None if share_lm_head else nn.ModuleList(
            nn.Linear(hidden_size, out_size, bias=False) for _ in range(num_heads))
        if draft_vocab_size is not None:
            self.register_buffer("token_map", torch.arange(draft_vocab_size))
        else:
            self.token_map = None
        # The base LM head's rows for the token map, taken once (bind_lm_head) instead of per call.
        self.register_buffer("draft_lm_weight", None, persistent=False)
        # draft_lm_weight in oneDNN's layout (columnwise.PackedWeights): set on the decoding loops' copy of the heads
        # only (propose.heads_proposer), never here.
        self.draft_lm_packed: torch.Tensor | None = None

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def set_token_map(self, token_map: torch.Tensor, base_lm_head: nn.Module) -> None:
        """Use the draft vocabulary `token_map` [V'] (token ids, distinct)."""
        if self.token_map is None or token_map.shape != self.token_map.shape:
            raise ValueError(f"token_map must hold {None if self.token_map is None else self.token_map.numel()} "
                             f"token ids (the heads' draft_vocab_size), got shape {tuple(token_map.shape)}")
        self.token_map.copy_(token_map)
        self.bind_lm_head(base_lm_head)

    @classmethod
    def from_config(cls, config) -> "MedusaHeads":
        """The heads a MedusaConfig describes (its hidden_size and vocab_size set), newly initialised."""
        return cls(config.hidden_size, config.vocab_size or 0, config.num_heads, config.num_layers,
                   config.share_lm_head, config.head_type, config.draft_vocab_size, config.context_heads,
                   config.feature_layers, config.draft_layer)

    def bind_lm_head(self, base_lm_head: nn.Module) -> None:
        """Cache the base LM head's rows for the token map (call after loading a token map)."""
        if self.token_map is not None and self.lm_heads is None and self.head_type != "eagle3":
            weight = base_lm_head.weight.detach()
            dtype = next(self.parameters(), weight).dtype  # the heads' compute dtype (fp32 in training)
            self.draft_lm_weight = weight[self.token_map.to(weight.device)].to(dtype)

    def init_projections_from(self, output_embeddings: nn.Module) -> None:
        """Original Medusa: every head's own projection starts as a copy of the base LM head
        (its rows for the draft vocabulary, with a token map); eagle3's LM head too, as speculators starts it."""
        own = self.lm_heads if self.head_type != "eagle3" else [self.draft_layer.lm_head]
        if own is None:
            return
        weight = output_embeddings.weight
        if self.token_map is not None:
            weight = weight[self.token_map.to(weight.device)]
        with torch.no_grad():
            for lm_head in own:
                lm_head.weight.copy_(weight)

    def features(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The base's states [..., (1 + n) H] (the final one, then those of the n feature_layers; see
        base_features) -> the heads' input [..., H]: the final state plus the projection of the others, each at
        unit RMS (a layer's residual stream grows with depth, the final state is normed). Eagle3 heads: their
        draft's fc over the feature layers' states alone."""
        if self.head_type == "eagle3":
            return self.draft_layer.fuse(hidden_states[..., self.draft_layer.fc.out_features:])
        if self.fuse is None:
            return hidden_states
        width = self.fuse.out_features
        layers = hidden_states[..., width:].unflatten(-1, (len(self.feature_layers), width))
        return hidden_states[..., :width] + self.fuse(unit_rms(layers).flatten(-2))

    def token_ids(self, draft_indices: torch.Tensor) -> torch.Tensor:
        """Indices into the heads' logits -> token ids of the base vocabulary."""
        return draft_indices if self.token_map is None else self.token_map[draft_indices]

    def project(self, states: torch.Tensor, base_lm_head: nn.Module, head: int | None = None) -> torch.Tensor:
        """Head states [..., K, H] (or [..., H] of head `head`) -> logits over the draft vocabulary."""
        if self.head_type == "eagle3":
            return self.draft_layer.lm_head(states)
        if self.lm_heads is not None:
            if head is not None:
                return self.lm_heads[head](states)
            return torch.stack([lm_head(states[..., k, :]) for k, lm_head in enumerate(self.lm_heads)], dim=-2)
        if self.token_map is None:
            # One matmul for all heads: the big matrix is read once (in its dtype: a mixed-precision base's).
            return base_lm_head(states.to(base_lm_head.weight.dtype))
        # The token map's rows, shared by all heads (from their pack where the decoding loop's copy has one).
        return linear(states, self.projection(0, base_lm_head)[0], packed_weight=self.draft_lm_packed)

    def projection(self, head: int, base_lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight [V', H], bias or None) of head `head`'s vocabulary projection: what project() applies,
        for the training loss, which forms logits a chunk of positions at a time."""
        if self.head_type == "eagle3":
            return self.draft_layer.lm_head.weight, None
        if self.lm_heads is not None:
            return self.lm_heads[head].weight, None
        if self.token_map is None:
            return base_lm_head.weight, getattr(base_lm_head, "bias", None)
        if self.draft_lm_weight is None:
            raise RuntimeError("heads with a token map and a shared LM head need bind_lm_head(base_lm_head) first")
        return self.draft_lm_weight, None

    def head_logits(self, k: int, hidden_states: torch.Tensor, path_embeds: torch.Tensor,
                    base_lm_head: nn.Module) -> torch.Tensor:
        """Dependent head k: hidden_states [..., H], path_embeds [..., k + 1, H] -> logits [..., V']."""
        state = self._dependent_state(k, hidden_states, unit_rms(path_embeds).flatten(-2))
        return self.project(state, base_lm_head, head=k)

    def _dependent_state(self, k: int, hidden_states: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
        """Dependent head k's state before projection; path [..., (k + 1) H]: unit-RMS path embeddings, concatenated."""
        return self.blocks[k](hidden_states + self.inputs[k](path))

    def draft_logits(self, k: int, draft_outputs: torch.Tensor, base_lm_head: nn.Module) -> torch.Tensor:
        """Eagle head k: the draft layer's outputs [..., H] k slots down a drafted path -> logits [..., V']."""
        if self.head_type == "eagle3":
            return self.project(self.draft_layer.head_input(draft_outputs), base_lm_head, head=k)
        return self.project(self.blocks[k](draft_outputs), base_lm_head, head=k)

    def forward(self, hidden_states: torch.Tensor, base_lm_head: nn.Module,
                next_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """[..., T, H] -> logits [..., T, K, V'] (next_embeds as in states(); not for eagle heads)."""
        return self.project(self.states(hidden_states, next_embeds), base_lm_head)

    def states(self, hidden_states: torch.Tensor, next_embeds: torch.Tensor | None = None,
               allowed: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[..., T, H] -> every head's state before its projection, [..., T, K, H].

        Dependent and eagle heads need `next_embeds` [..., T, H]: the embedding of the token after each
        position (teacher forcing), so head k at t reads E(x_t+1) .. E(x_t+k+1); positions whose
        path runs past the end see zeros there (their targets are past the end too). Eagle heads also need
        the row's attention, allowed [B, T, T] (causal within each example), and position_ids [B, T]: the
        draft layer is unrolled over the row (DraftLayer.unroll).
        """
        if self.draft_layer is not None:
            if next_embeds is None or allowed is None or position_ids is None:
                raise ValueError("eagle heads need next_embeds, allowed and position_ids: the draft layer runs over "
                                 "the whole row")
            if self.head_type == "eagle3":  # past the row's end the path's tokens are zeros, as in eagle's unroll
                padded = torch.cat([next_embeds, next_embeds.new_zeros(*next_embeds.shape[:-2], self.num_heads - 1,
                                                                       next_embeds.shape[-1])], dim=-2)
                return self.draft_layer.unroll(hidden_states, padded, allowed, position_ids, self.num_heads)
            outputs = self.draft_layer.unroll(hidden_states, next_embeds, allowed, position_ids, self.num_heads)
            return torch.stack([block(outputs[..., k, :]) for k, block in enumerate(self.blocks)], dim=-2)
        if not self.dependent:
            return torch.stack([block(hidden_states) for block in self.blocks], dim=-2)
        if next_embeds is None:
            raise ValueError("dependent heads need next_embeds, the embeddings of the tokens that follow each position")
        shifted = [unit_rms(next_embeds)]
        for _ in range(self.num_heads - 1):
            previous = shifted[-1]
            shifted.append(torch.cat([previous[..., 1:, :], torch.zeros_like(previous[..., :1, :])], dim=-2))
        return torch.stack([self._dependent_state(k, hidden_states, torch.cat(shifted[: k + 1], dim=-1))
                            for k in range(self.num_heads)], dim=-2)
