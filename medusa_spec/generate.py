"""The speculative loop: prefill -> (propose -> verify -> accept -> commit)* -> sequences.

One host sync per step (the per-row counts that decide streaming, stopping and how many
cache slots to keep); everything else stays on the model's device.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from .accept import Sampling, accept, draw_targets
from .base import BaseSpec, inspect_base_model, model_device_dtype
from .columnwise import columnwise_linears
from .kv_cache import check_cache, keep_accepted, new_cache
from .lookup import PromptLookup, add_chain, check_documents, check_lookup_tokens, tree_with_chain
from .propose import propose
from .tree import Tree, build_tree
from .verify import attention_masks, forward_block


@dataclass
class GenerationStats:
    """What one generate() call did. A step is one forward pass of the base model (prefill included)."""

    steps: int = 0
    new_tokens: list[int] = field(default_factory=list)   # per row
    row_steps: list[int] = field(default_factory=list)    # per row: steps in which the row was still generating
    accepted_at_depth: list[int] = field(default_factory=list)  # [d]: row-steps whose accepted path reached depth d+1
    wall_time: float = 0.0
    # Lookup (generate with lookup_tokens): candidate tokens accepted from the lookup chain (bonus not counted).
    lookup_accepted: int | None = None
    # Draft model (generate_with_draft): per-token acceptance estimate alpha, mean seconds of one draft forward
    # (c_q) and of one verify pass (c_p), and the number of draft tokens K of every step.
    acceptance_rate: float | None = None
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    draft_lengths: list[int] | None = None

    @property
    def tokens_per_step(self) -> float:
        """Mean new tokens per forward pass, the bonus token included (1.0 = no speculation gain)."""
        return sum(self.new_tokens) / max(sum(self.row_steps), 1)

    @property
    def tokens_per_second(self) -> float:
        return sum(self.new_tokens) / self.wall_time if self.wall_time > 0 else 0.0

    def to_dict(self) -> dict:
        optional = {name: getattr(self, name) for name in _OPTIONAL_STATS if getattr(self, name) is not None}
        return {"steps": self.steps, "new_tokens": self.new_tokens, "row_steps": self.row_steps,
                "accepted_at_depth": self.accepted_at_depth, "tokens_per_step": self.tokens_per_step,
                "tokens_per_second": self.tokens_per_second, "wall_time": self.wall_time, **optional}


_OPTIONAL_STATS = ("lookup_accepted", "acceptance_rate", "draft_seconds", "verify_seconds", "draft_lengths")


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


# What transformers' generate uses for a sampling argument that neither the call nor the model's
# generation_config sets (GenerationConfig._get_default_generation_params; tests compare the two).
TRANSFORMERS_SAMPLING_DEFAULTS = (("do_sample", False), ("temperature", 1.0), ("top_k", 50), ("top_p", 1.0))
# Sampling warpers transformers' generate would also apply, with the value at which each does nothing;
# medusa_spec draws only through temperature, top-k and top-p.
UNSUPPORTED_WARPERS = (("min_p", None), ("top_h", None), ("typical_p", 1.0), ("epsilon_cutoff", 0.0),
                       ("eta_cutoff", 0.0))


def resolve_sampling(base_model: nn.Module, do_sample=None, temperature=None, top_k=None, top_p=None) -> Sampling:
    """The distribution `base_model.generate` would sample with the same arguments: each one given here,
    else the model's generation_config, else transformers' default (top_k=50); top_k=0 / top_p=1 disable."""
    gen_config = getattr(base_model, "generation_config", None)
    given = {"do_sample": do_sample, "temperature": temperature, "top_k": top_k, "top_p": top_p}
    resolved = {}
    for name, default in TRANSFORMERS_SAMPLING_DEFAULTS:
        value = given[name]
        if value is None:
            value = getattr(gen_config, name, None)
        resolved[name] = default if value is None else value
    if resolved["do_sample"]:
        for name, neutral in UNSUPPORTED_WARPERS:
            value = getattr(gen_config, name, None)
            if value is not None and value != neutral:
                raise ValueError(f"the base model's generation_config sets {name}={value!r}, which transformers applies "
                                 f"when sampling and medusa_spec does not (it samples with temperature, top_k and "
                                 f"top_p only); set base_model.generation_config.{name} = {neutral!r} to sample "
                                 f"without it")
    return Sampling(bool(resolved["do_sample"]), resolved["temperature"], resolved["top_k"], resolved["top_p"])


def special_tokens(base_model: nn.Module, eos_token_id, pad_token_id) -> tuple[list[int], int | None]:
    """(eos ids, pad id), defaulting to the base model's generation_config; eos_token_id=[] never stops early."""
    gen_config = getattr(base_model, "generation_config", None)
    if eos_token_id is None:
        eos_token_id = getattr(gen_config, "eos_token_id", None)
    if pad_token_id is None:
        pad_token_id = getattr(gen_config, "pad_token_id", None)
    return ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])), pad_token_id


class SequenceWriter:
    """The output buffer: appends each row's new tokens, stopping a row after its eos or at max_new_tokens."""

    def __init__(self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: list[int], pad_token_id: int | None):
        device = input_ids.device
        pad = pad_token_id if pad_token_id is not None else (eos_token_id[0] if eos_token_id else 0)
        batch, self.prompt_length = input_ids.shape
        self.max_new_tokens = max_new_tokens
        self.eos = torch.tensor(eos_token_id, dtype=torch.long, device=device)
        # One spare column takes the writes of tokens that are not emitted.
        self.sequences = torch.full((batch, self.prompt_length + max_new_tokens + 1), pad, dtype=torch.long, device=device)
        self.sequences[:, : self.prompt_length] = input_ids
        self.n_generated = torch.zeros(batch, dtype=torch.long, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.row_steps = torch.zeros(batch, dtype=torch.long, device=device)

    def append(self, new_tokens: torch.Tensor, n_new: torch.Tensor) -> torch.Tensor:
        """Append up to n_new [B] of new_tokens [B, M] per row; returns how many each row took [B]."""
        offsets = torch.arange(new_tokens.shape[1], device=new_tokens.device)
        is_eos = torch.isin(new_tokens, self.eos) & (offsets < n_new[:, None])
        until_eos = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, n_new)
        count = torch.minimum(until_eos, self.max_new_tokens - self.n_generated).masked_fill(self.finished, 0)
        columns = self.prompt_length + self.n_generated[:, None] + offsets
        columns = columns.masked_fill(offsets >= count[:, None], self.sequences.shape[1] - 1)
        self.sequences.scatter_(1, columns, new_tokens)
        self.row_steps.add_((~self.finished).long())
        self.finished = (self.finished | (is_eos & (offsets < count[:, None])).any(-1)
                         | (self.n_generated + count >= self.max_new_tokens))
        self.n_generated = self.n_generated + count
        return count

    def output(self, stats: GenerationStats) -> GenerateOutput:
        stats.new_tokens = self.n_generated.tolist()
        stats.row_steps = self.row_steps.tolist()
        return GenerateOutput(self.sequences[:, : self.prompt_length + max(stats.new_tokens)], stats)


def stream(streamer, new_tokens: torch.Tensor, count: int) -> None:
    if streamer is not None and count > 0:
        streamer.put(new_tokens[0, :count].cpu())


def prefill(model: nn.Module, spec: BaseSpec, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache):
    """The prompt as a chain into `cache`: returns (last logits [B, 1, V], final hidden states [B, S, H],
    slot_valid [B, S], slot_pos [B, S]); padding slots are invalid and positions count only real tokens.

    Only the final hidden states are kept: all but the last token go through the decoder body
    (`model.base_model`, whose output is the LM head's input), the last one through the whole model,
    whose logits are its own (softcapping or scaling included); asking the whole model for the prompt's
    hidden states would hold every layer's, S x layers x H per row.
    """
    prompt_length = input_ids.shape[1]
    slot_valid = attention_mask
    slot_pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    causal = torch.ones(prompt_length, prompt_length, dtype=torch.bool, device=input_ids.device).tril()
    body = model.base_model
    if body is model:  # no separate decoder body to run: the whole prompt in one pass
        logits, hidden = forward_block(model, spec, input_ids, slot_pos, causal, cache, slot_valid, slot_pos,
                                       last_only=True)
    else:
        leading = []
        if prompt_length > 1:
            mask = attention_masks(spec, slot_valid[:, :-1], slot_pos[:, :-1], slot_pos[:, :-1], causal[:-1, :-1],
                                   model_device_dtype(model)[1])
            leading = [body(input_ids=input_ids[:, :-1], attention_mask=mask, position_ids=slot_pos[:, :-1],
                            cache=cache, use_cache=True, return_dict=True).last_hidden_state]
        logits, last = forward_block(model, spec, input_ids[:, -1:], slot_pos[:, -1:], causal[-1:, -1:], cache,
                                     slot_valid, slot_pos)
        hidden = torch.cat([*leading, last], dim=1)
    check_cache(cache, prompt_length)
    return logits, hidden, slot_valid, slot_pos


def prepare_inputs(model: nn.Module, input_ids, attention_mask, max_new_tokens, streamer):
    """Checked inputs on the model's device: (input_ids, attention_mask as bool)."""
    _check_inputs(input_ids, attention_mask, max_new_tokens, streamer)
    device, _ = model_device_dtype(model)
    input_ids = input_ids.to(device=device, dtype=torch.long)
    attention_mask = (torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device)).bool()
    return input_ids, attention_mask


@contextmanager
def eval_mode(module: nn.Module | None):
    """`module` and all its submodules in eval mode for the block, then each in the mode it had before
    (a caller training the heads between generations keeps training them)."""
    modes = [(m, m.training) for m in module.modules()] if module is not None else []
    for m, _ in modes:
        m.training = False
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def last_position(model: nn.Module, attention_mask: torch.Tensor, max_new_tokens: int) -> int | None:
    """The highest position `model` embeds (config.max_position_embeddings - 1; None where it declares no limit),
    after checking that the longest prompt and max_new_tokens fit below it."""
    config = getattr(model, "config", None)
    limit = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None) if config is not None else None
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
    """Positions of a block's nodes: next_pos [B] + depth [N] -> [B, N], capped at max_position.

    The cap only moves nodes past max_new_tokens (last_position checked that the prompt and the budget fit),
    whose tokens are never emitted; without it a model with a position table would index past its end.
    """
    positions = next_pos[:, None] + depth
    return positions if max_position is None else positions.clamp(max=max_position)


def generate(base_model: nn.Module, spec: BaseSpec, heads: nn.Module | None, tree: Tree, input_ids: torch.Tensor,
             attention_mask: torch.Tensor | None = None, max_new_tokens: int = 128, sampling: Sampling = Sampling(),
             eos_token_id: list[int] | None = None, pad_token_id: int | None = None, streamer=None,
             lookup_tokens: int = 0, documents=None) -> GenerateOutput:
    """The speculative loop. `lookup_tokens` > 0 adds a prompt-lookup chain of that length to `tree`'s root
    (candidates copied from the prompt, the generated text and `documents`, lists of token ids); `heads` may be
    None when `tree` is root-only; they run in eval mode and get their own mode back on return."""
    check_lookup_tokens(lookup_tokens)
    documents = check_documents(documents, spec.vocab_size)
    if documents and not lookup_tokens:
        raise ValueError("documents are only searched by prompt lookup: pass lookup_tokens >= 1 (e.g. 10) with them")
    start = time.perf_counter()
    input_ids, attention_mask = prepare_inputs(base_model, input_ids, attention_mask, max_new_tokens, streamer)
    max_position = last_position(base_model, attention_mask, max_new_tokens)
    device = input_ids.device
    batch = input_ids.shape[0]
    num_tree_nodes = tree.num_nodes
    lookup = None
    if lookup_tokens:
        prompts = [row[mask].tolist() for row, mask in zip(input_ids, attention_mask)]  # real tokens, no padding
        lookup = PromptLookup(prompts, documents, lookup_tokens)
    tree = tree.to(device)
    chain_trees = {}  # chain length -> the heads' tree plus a lookup chain that long off its root
    writer = SequenceWriter(input_ids, max_new_tokens, eos_token_id or [], pad_token_id)
    stats = GenerationStats()
    accepted_at_depth = torch.zeros(max(tree.max_depth, lookup_tokens), dtype=torch.long, device=device)
    lookup_accepted = torch.zeros((), dtype=torch.long, device=device)

    # The tree's and the heads' few rows run column-wise on CPU (see columnwise).
    with torch.inference_mode(), columnwise_linears(base_model, heads), eval_mode(heads):
        if streamer is not None:
            streamer.put(input_ids.cpu())
        # 1. Prefill: the prompt is a chain; its last logits give the first token (the first root).
        cache = new_cache()
        logits, hidden, slot_valid, slot_pos = prefill(base_model, spec, input_ids, attention_mask, cache)
        root = draw_targets(logits, sampling)[:, -1]
        # What the heads read: the last hidden state, or the context layer's output there (it takes every
        # prompt position with its token and the token after it, the last one with the root).
        context = getattr(heads, "context", None) if tree.num_nodes > 1 else None  # heads may be any module
        if context is None:
            head_state = hidden[:, -1]
        else:
            embed = base_model.get_input_embeddings()
            context_cache, head_state = context.extend(
                None, hidden, embed(input_ids), embed(torch.cat([input_ids[:, 1:], root[:, None]], dim=1)),
                attention_mask, torch.full_like(root, input_ids.shape[1] - 1))
        next_pos = slot_pos[:, -1] + 1
        count = writer.append(root[:, None], torch.ones(batch, dtype=torch.long, device=device))
        stats.steps = 1
        synced = torch.cat([writer.finished.all()[None].long(), count, root]).tolist()
        done, counts = bool(synced[0]), synced[1: 1 + batch]
        stream(streamer, root[:, None], counts[0])
        if lookup:
            lookup.extend([[token] for token in synced[1 + batch:]])

        while not done:
            # 2. Propose: the heads read only the last accepted node's state; the lookup chain comes from
            # the host-side n-gram search.
            node_tokens = propose(heads, base_model, root, head_state, tree) if tree.num_nodes > 1 else root[:, None]
            candidates, verify_tree = node_tokens, tree
            if lookup:
                chain_tokens, has_match = lookup.propose(device)
                chain_length = chain_tokens.shape[1]
                if chain_length:
                    if chain_length not in chain_trees:
                        chain_trees[chain_length] = tree_with_chain(tree, chain_length).to(device)
                    verify_tree = chain_trees[chain_length]
                    node_tokens, candidates = add_chain(node_tokens, chain_tokens, has_match, num_tree_nodes,
                                                        verify_tree.depth)
            # 3. Verify: one pass over every node; node i sits at position next_pos + depth(i).
            q_pos = node_positions(next_pos, verify_tree.depth, max_position)
            past_length = slot_valid.shape[1]
            kv_valid = torch.cat([slot_valid, torch.ones_like(node_tokens, dtype=torch.bool)], dim=1)
            logits, hidden = forward_block(base_model, spec, node_tokens, q_pos, verify_tree.tree_mask, cache, kv_valid,
                                           torch.cat([slot_pos, q_pos], dim=1))
            # 4. Accept: the longest path the base model agrees with, plus its own next token.
            last_node, accept_length, bonus = accept(candidates, logits, verify_tree, sampling)
            path = verify_tree.node_paths[last_node]  # [B, D+1]: root, accepted nodes, then repeats
            new_tokens = torch.cat([node_tokens.gather(1, path)[:, 1:], bonus[:, None]], dim=1)
            new_tokens.scatter_(1, accept_length[:, None], bonus[:, None])
            active = ~writer.finished
            accepted_at_depth[: verify_tree.max_depth] += (
                accept_length[:, None] > torch.arange(verify_tree.max_depth, device=device)).masked_fill(
                ~active[:, None], False).sum(0)
            if lookup:
                lookup_accepted += (accept_length * ((last_node >= num_tree_nodes) & active)).sum()
            count = writer.append(new_tokens, accept_length + 1)
            # The one host sync of the step (with lookup it also brings the new tokens to the host search).
            synced = torch.cat([accept_length.max()[None], writer.finished.all()[None].long(), count,
                                new_tokens.flatten() if lookup else count[:0]]).tolist()
            longest, done, counts = synced[0] + 1, bool(synced[1]), synced[2: 2 + batch]
            stream(streamer, new_tokens, counts[0])
            if lookup:
                width = new_tokens.shape[1]
                lookup.extend([synced[2 + batch + b * width: 2 + batch + b * width + counts[b]] for b in range(batch)])
            stats.steps += 1
            # 5. Commit: keep each row's accepted path in the cache (rows that accepted fewer
            # than the longest get invalid slots: sync points), then move the root forward. A finished
            # row stays in the batch but stands still: no valid slots, no new positions.
            keep_accepted(cache, past_length, path[:, :longest])
            slot_offsets = torch.arange(longest, device=device)
            going = ~writer.finished
            slot_valid = torch.cat([slot_valid, (slot_offsets < (accept_length + 1)[:, None]) & going[:, None]], dim=1)
            slot_pos = torch.cat([slot_pos, node_positions(next_pos, slot_offsets, max_position)], dim=1)
            next_pos = next_pos + (accept_length + 1) * going
            root = bonus
            if context is None:
                head_state = hidden.gather(1, last_node[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0]
            else:  # the kept slots: root and accepted nodes, each with the token after it (the last: the bonus)
                kept = path[:, :longest]
                context_cache, head_state = context.extend(
                    context_cache, hidden.gather(1, kept[:, :, None].expand(-1, -1, hidden.shape[-1])),
                    embed(node_tokens.gather(1, kept)), embed(new_tokens[:, :longest]),
                    slot_offsets < (accept_length + 1)[:, None], accept_length)

    if streamer is not None:
        streamer.end()
    stats.accepted_at_depth = accepted_at_depth.tolist()
    if lookup:
        stats.lookup_accepted = int(lookup_accepted)
    stats.wall_time = time.perf_counter() - start
    return writer.output(stats)


def generate_with_lookup(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                         max_new_tokens: int = 128, do_sample: bool | None = None, temperature: float | None = None,
                         top_k: int | None = None, top_p: float | None = None, eos_token_id: int | list[int] | None = None,
                         pad_token_id: int | None = None, lookup_tokens: int = 10, documents=None, tree=None,
                         streamer=None) -> GenerateOutput:
    """Prompt-lookup speculation through this library's verifier, lossless like the rest: each step also
    checks a chain of `lookup_tokens` candidates copied from where the text's last n-gram (n = 3 down to 1)
    occurred before in the prompt, the generated text or `documents` (lists of token ids).

    model: a transformers causal LM (lookup alone), or a MedusaModel (its heads' tree plus the chain, one
    verify pass for both; `tree` as in MedusaModel.generate). Other arguments as in MedusaModel.generate;
    `sequences` [B, prompt + new] as transformers' generate.
    """
    from .model import MedusaModel  # model.py imports this module

    if lookup_tokens == 0:
        raise ValueError("generate_with_lookup needs lookup_tokens >= 1 (the lookup chain's length, e.g. 10)")
    if isinstance(model, MedusaModel):
        base_model, spec, heads, tree = model.base_model, model.spec, model.heads, model.tree(tree)
    elif tree is not None:
        raise ValueError("tree needs Medusa heads: pass a MedusaModel (MedusaModel.from_pretrained(base_model, heads_dir))")
    else:
        base_model, spec, heads, tree = model, inspect_base_model(model), None, build_tree([])
    eos, pad = special_tokens(base_model, eos_token_id, pad_token_id)
    return generate(base_model, spec, heads, tree, input_ids, attention_mask, max_new_tokens,
                    resolve_sampling(base_model, do_sample, temperature, top_k, top_p), eos, pad, streamer, lookup_tokens,
                    documents)
