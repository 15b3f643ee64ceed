"""The speculative loop: prefill -> (propose -> verify -> accept -> commit)* -> sequences.

One host sync per step (the per-row counts that decide streaming, stopping and how many
cache slots to keep); everything else stays on the model's device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from .accept import Sampling, accept, draw_targets
from .base import BaseSpec, model_device_dtype
from .kv_cache import check_cache, keep_accepted, new_cache
from .propose import propose
from .tree import Tree
from .verify import forward_block


@dataclass
class GenerationStats:
    """What one generate() call did. A step is one forward pass of the base model (prefill included)."""

    steps: int = 0
    new_tokens: list[int] = field(default_factory=list)   # per row
    row_steps: list[int] = field(default_factory=list)    # per row: steps in which the row was still generating
    accepted_at_depth: list[int] = field(default_factory=list)  # [d]: row-steps whose accepted path reached depth d+1
    wall_time: float = 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean new tokens per forward pass, the bonus token included (1.0 = no speculation gain)."""
        return sum(self.new_tokens) / max(sum(self.row_steps), 1)

    @property
    def tokens_per_second(self) -> float:
        return sum(self.new_tokens) / self.wall_time if self.wall_time > 0 else 0.0

    def to_dict(self) -> dict:
        return {"steps": self.steps, "new_tokens": self.new_tokens, "row_steps": self.row_steps,
                "accepted_at_depth": self.accepted_at_depth, "tokens_per_step": self.tokens_per_step,
                "tokens_per_second": self.tokens_per_second, "wall_time": self.wall_time}


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # [B, prompt + new], prompt included; finished rows padded with pad_token_id
    stats: GenerationStats


def _check_inputs(input_ids, attention_mask, max_new_tokens, streamer):
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
        raise ValueError("input_ids must be a LongTensor of shape [batch, prompt_length] (e.g. tokenizer(..., return_tensors='pt').input_ids)")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}); give at least one prompt token per row")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} differs from input_ids {tuple(input_ids.shape)}")
        if not bool((attention_mask.sum(-1) > 0).all()):
            raise ValueError("a row of attention_mask is all padding: every prompt needs at least one token")
        if not bool(attention_mask[:, -1].bool().all()):
            raise ValueError("prompts must be left-padded (attention_mask[:, -1] must be 1): set tokenizer.padding_side = 'left'")
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError("a streamer works with one prompt (batch size 1), as in transformers")


def generate(base_model: nn.Module, spec: BaseSpec, heads: nn.Module, tree: Tree, input_ids: torch.Tensor,
             attention_mask: torch.Tensor | None = None, max_new_tokens: int = 128, sampling: Sampling = Sampling(),
             eos_token_id: list[int] | None = None, pad_token_id: int | None = None, streamer=None) -> GenerateOutput:
    _check_inputs(input_ids, attention_mask, max_new_tokens, streamer)
    device, _ = model_device_dtype(base_model)
    start = time.perf_counter()
    input_ids = input_ids.to(device=device, dtype=torch.long)
    attention_mask = (torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device)).bool()
    batch, prompt_length = input_ids.shape
    tree = tree.to(device)
    eos = torch.tensor(eos_token_id or [], dtype=torch.long, device=device)
    pad = pad_token_id if pad_token_id is not None else (eos_token_id[0] if eos_token_id else 0)

    # Output buffer; one spare column takes the writes of tokens that are not emitted.
    sequences = torch.full((batch, prompt_length + max_new_tokens + 1), pad, dtype=torch.long, device=device)
    sequences[:, :prompt_length] = input_ids
    n_generated = torch.zeros(batch, dtype=torch.long, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    stats = GenerationStats()
    accepted_at_depth = torch.zeros(tree.max_depth, dtype=torch.long, device=device)
    row_steps = torch.zeros(batch, dtype=torch.long, device=device)

    def emit(new_tokens, n_new):
        """Append up to n_new [B] of new_tokens [B, M] per row, stopping after an eos or the budget."""
        nonlocal n_generated, finished
        offsets = torch.arange(new_tokens.shape[1], device=device)
        is_eos = torch.isin(new_tokens, eos) & (offsets < n_new[:, None])
        until_eos = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, n_new)
        count = torch.minimum(until_eos, max_new_tokens - n_generated).masked_fill(finished, 0)
        columns = prompt_length + n_generated[:, None] + offsets
        columns = columns.masked_fill(offsets >= count[:, None], sequences.shape[1] - 1)
        sequences.scatter_(1, columns, new_tokens)
        row_steps.add_((~finished).long())
        finished = finished | (is_eos & (offsets < count[:, None])).any(-1) | (n_generated + count >= max_new_tokens)
        n_generated = n_generated + count
        return count

    def stream(new_tokens, count):
        if streamer is not None and count > 0:
            streamer.put(new_tokens[0, :count].cpu())

    with torch.inference_mode():
        if streamer is not None:
            streamer.put(input_ids.cpu())
        # 1. Prefill: the prompt is a chain; its last logits give the first token (the first root).
        cache = new_cache()
        slot_valid = attention_mask
        slot_pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones(prompt_length, prompt_length, dtype=torch.bool, device=device).tril()
        logits, hidden = forward_block(base_model, spec, input_ids, slot_pos, causal, cache, slot_valid, slot_pos, last_only=True)
        check_cache(cache, prompt_length)
        root = draw_targets(logits, sampling)[:, -1]
        last_hidden = hidden[:, -1]
        next_pos = slot_pos[:, -1] + 1
        count = emit(root[:, None], torch.ones(batch, dtype=torch.long, device=device))
        stats.steps = 1
        host_count, done = count[0].item(), bool(finished.all())
        stream(root[:, None], host_count)

        while not done:
            # 2. Propose: the heads read only the last accepted node's hidden state.
            node_tokens = propose(heads, base_model, root, last_hidden, tree) if tree.num_nodes > 1 else root[:, None]
            # 3. Verify: one pass over every node; node i sits at position next_pos + depth(i).
            q_pos = next_pos[:, None] + tree.depth
            past_length = slot_valid.shape[1]
            kv_valid = torch.cat([slot_valid, torch.ones_like(node_tokens, dtype=torch.bool)], dim=1)
            logits, hidden = forward_block(base_model, spec, node_tokens, q_pos, tree.tree_mask, cache, kv_valid,
                                           torch.cat([slot_pos, q_pos], dim=1))
            # 4. Accept: the longest path the base model agrees with, plus its own next token.
            last_node, accept_length, bonus = accept(node_tokens, logits, tree, sampling)
            path = tree.node_paths[last_node]  # [B, D+1]: root, accepted nodes, then repeats
            new_tokens = torch.cat([node_tokens.gather(1, path)[:, 1:], bonus[:, None]], dim=1)
            new_tokens.scatter_(1, accept_length[:, None], bonus[:, None])
            accepted_at_depth += (accept_length[:, None] > torch.arange(tree.max_depth, device=device)).masked_fill(
                finished[:, None], False).sum(0)
            count = emit(new_tokens, accept_length + 1)
            # The one host sync of the step.
            synced = torch.cat([count[:1], accept_length.max()[None], finished.all()[None].long()]).tolist()
            host_count, longest, done = synced[0], synced[1] + 1, bool(synced[2])
            stream(new_tokens, host_count)
            stats.steps += 1
            # 5. Commit: keep each row's accepted path in the cache (rows that accepted fewer
            # than the longest get invalid slots: sync points), then move the root forward.
            keep_accepted(cache, past_length, path[:, :longest])
            slot_offsets = torch.arange(longest, device=device)
            slot_valid = torch.cat([slot_valid, slot_offsets < (accept_length + 1)[:, None]], dim=1)
            slot_pos = torch.cat([slot_pos, next_pos[:, None] + slot_offsets], dim=1)
            next_pos = next_pos + accept_length + 1
            root = bonus
            last_hidden = hidden.gather(1, last_node[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0]

    if streamer is not None:
        streamer.end()
    stats.new_tokens = n_generated.tolist()
    stats.row_steps = row_steps.tolist()
    stats.accepted_at_depth = accepted_at_depth.tolist()
    stats.wall_time = time.perf_counter() - start
    return GenerateOutput(sequences[:, : prompt_length + max(stats.new_tokens)], stats)
