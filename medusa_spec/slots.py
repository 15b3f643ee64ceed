"""Per-row slot bookkeeping of one model's KV cache while decoding: which slots hold text, at which positions.

Every cache slot carries a validity flag and a position, so the rows of a batch may hold padding or rejected
candidates anywhere and still go on from their own positions. `Slots` is that state as one value: `prefill`
makes it, `verify_inputs` gives a block's positions and masks (appending the block's slots), `commit` keeps
each row's accepted slots of the block and moves the row on. The decoding loop, the draft model's own cache
and `--tree auto`'s timing all go through it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from .base import BaseSpec, cache_argument, model_device_dtype
from .compiled import CompiledSteps, adopt
from .kv_cache import check_cache, keep_accepted, select_rows
from .verify import attention_masks, base_features, forward_block


def last_position(model: nn.Module, attention_mask: torch.Tensor, max_new_tokens: int) -> int | None:
    """The highest position `model` embeds (config.max_position_embeddings - 1; None where it declares no limit),
    after checking that the longest prompt and max_new_tokens fit below it."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    limit = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    if not limit:
        return None
    longest = int(attention_mask.sum(-1).max())
    if longest + max_new_tokens > limit:
        fix = (f"lower max_new_tokens to {limit - longest} or shorten the prompt" if longest < limit
               else f"shorten the prompt to at most {limit - max_new_tokens} tokens")
        raise ValueError(f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} needs "
                         f"{longest + max_new_tokens} positions, but {type(model).__name__} has "
                         f"max_position_embeddings={limit}; {fix}")
    return limit - 1


def node_positions(next_pos: torch.Tensor, depth: torch.Tensor, max_position: int | None) -> torch.Tensor:
    """Positions of a block's nodes: next_pos [B] + depth [N] (or each row's, [B, N]) -> [B, N], capped at
    max_position.

    The cap only moves nodes past max_new_tokens (last_position checked that the prompt and the budget fit),
    whose tokens are never emitted; without it a model with a position table would index past its end.
    """
    positions = next_pos[:, None] + depth
    return positions if max_position is None else positions.clamp(max=max_position)


@dataclass
class Slots:
    """One model's cache and its slots: valid [B, S] bool, pos [B, S] long; next_pos [B], the position of
    each row's next token (the root's); `past` slots are committed, the rest are the block being verified."""

    cache: DynamicCache
    valid: torch.Tensor
    pos: torch.Tensor
    next_pos: torch.Tensor
    max_position: int | None
    past: int

    def verify_inputs(self, offsets: torch.Tensor,
                      valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append a block of N slots at next_pos + offsets [N] or [B, N] (a tree's depths; valid [B, N], default all)
        and return (q_pos [B, N], kv_valid [B, S + N], kv_pos [B, S + N]) for forward_block. Several calls
        may build one block (a draft model feeds its chain one token at a time) until commit."""
        q_pos = node_positions(self.next_pos, offsets, self.max_position)
        if valid is None:
            valid = torch.ones_like(q_pos, dtype=torch.bool)
        self.valid = torch.cat([self.valid, valid], dim=1)
        self.pos = torch.cat([self.pos, q_pos], dim=1)
        return q_pos, self.valid, self.pos

    def commit(self, keep: torch.Tensor | int, n_kept: torch.Tensor, advance: torch.Tensor) -> None:
        """Keep the block's slots `keep` [B, m] (indices into the block, each row's accepted path first),
        gathered contiguously, or, `keep` an int m, its first m slots where they are (each row's slot j < n_kept
        being the one to keep: a chain); slot j of a row stays valid if j < n_kept [B] and it was valid. Rows that
        kept fewer than m get invalid slots (sync points); next_pos moves on by advance [B] (0: a finished
        row stands still)."""
        keep_accepted(self.cache, self.past, keep)
        if isinstance(keep, int):
            m, block = keep, slice(self.past, self.past + keep)
            kept_valid, kept_pos = self.valid[:, block], self.pos[:, block]
        else:
            m, block = keep.shape[1], slice(self.past, None)
            kept_valid, kept_pos = self.valid[:, block].gather(1, keep), self.pos[:, block].gather(1, keep)
        offsets = torch.arange(m, device=self.valid.device)
        self.valid = torch.cat([self.valid[:, : self.past], kept_valid & (offsets < n_kept[:, None])], dim=1)
        self.pos = torch.cat([self.pos[:, : self.past], kept_pos], dim=1)
        self.past += m
        self.next_pos = self.next_pos + advance

    def select(self, rows: torch.Tensor) -> Slots:
        """The slots of the batch rows `rows` [B'] alone, as a new Slots (a batch whose other rows are done)."""
        return Slots(select_rows(self.cache, rows), self.valid[rows], self.pos[rows], self.next_pos[rows],
                     self.max_position, self.past)


def prefill(model: nn.Module, spec: BaseSpec, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            cache: DynamicCache, max_position: int | None = None, feature_layers: tuple[int, ...] = (),
            compiled: CompiledSteps | None = None, room: int = 0) -> tuple[torch.Tensor, torch.Tensor, Slots]:
    """The prompt as a chain into `cache`: returns (last logits [B, 1, V], final hidden states [B, S, H], Slots);
    padding slots are invalid and positions count only real tokens. With feature_layers, those layers' states
    follow the final one ([B, S, (1 + n) H], see verify.base_features).

    Only the states asked for are kept: all but the last token go through the decoder body
    (`model.base_model`, whose output is the LM head's input), the last one through the whole model,
    whose logits are its own (softcapping or scaling included); asking the whole model for the prompt's
    hidden states would hold every layer's, S x layers x H per row.

    With `compiled` (prepared for `model`), the slots end in its static buffer, with room for `room` more
    (compiled.adopt), and where its one-node graph for these rows is compiled already, the last token runs through
    it: an eager one-token pass of SmolLM2-135M took 51-56 ms on a 2-core CPU, the graph 20 (a graph is not
    compiled for this alone: minutes).
    """
    prompt_length = input_ids.shape[1]
    adopted = False
    slot_valid = attention_mask
    slot_pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    causal = torch.ones(prompt_length, prompt_length, dtype=torch.bool, device=input_ids.device).tril()
    body = model.base_model
    if body is model:  # no separate decoder body to run: the whole prompt in one pass
        logits, hidden = forward_block(model, spec, input_ids, slot_pos, causal, cache, slot_valid, slot_pos,
                                       last_only=True, feature_layers=feature_layers)
    else:
        leading = []
        if prompt_length > 1:
            mask = slot_valid[:, :-1].long()
            # Without padding the model builds its own causal mask from that, as transformers' generate prefills
            # (whose attention can then skip the masked half); with padding it takes ours, whose sliding windows
            # count positions, not slots, as every later step's mask does.
            if not bool(mask.all()):
                mask = attention_masks(spec, slot_valid[:, :-1], slot_pos[:, :-1], slot_pos[:, :-1], causal[:-1, :-1],
                                       model_device_dtype(model)[1])
            out = body(input_ids=input_ids[:, :-1], attention_mask=mask, position_ids=slot_pos[:, :-1],
                       use_cache=True, **{cache_argument(body.forward): cache},
                       output_hidden_states=bool(feature_layers), return_dict=True)
            leading = [base_features(out.hidden_states, feature_layers) if feature_layers else out.last_hidden_state]
        last_token = (input_ids[:, -1:], slot_pos[:, -1:], causal[-1:, -1:])
        if compiled is not None and prompt_length > 1 and (input_ids.shape[0], 1) in compiled.shapes:
            check_cache(cache, prompt_length - 1)
            cache, adopted = adopt(cache, prompt_length + room), True  # the graph writes the last token's slot
            logits, last = compiled.forward_block(spec, *last_token, cache, slot_valid, slot_pos, feature_layers)
        else:
            logits, last = forward_block(model, spec, *last_token, cache, slot_valid, slot_pos,
                                         feature_layers=feature_layers)
        hidden = torch.cat([*leading, last], dim=1)
    if not adopted:
        check_cache(cache, prompt_length)
        if compiled is not None:
            cache = adopt(cache, prompt_length + room)
    return logits, hidden, Slots(cache, slot_valid, slot_pos, slot_pos[:, -1] + 1, max_position, prompt_length)
