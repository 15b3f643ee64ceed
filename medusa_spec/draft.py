"""Draft-model speculation, the classic protocol: a smaller causal LM drafts K tokens one by one, the base
model verifies the chain in one pass, and draft token i is kept with probability min(1, p_i/q_i)
(accept.accept_draft). Lossless: greedy output equals the base model's greedy output, sampled output
is distributed exactly as the base model's.

The draft model keeps its own KV cache with the same per-slot validity and positions as the base's,
so rows of a batch that accept different numbers of tokens go on from their own positions. K adapts
online (unless fixed): K* = argmax_K E[tokens](alpha, K) / (K c_q + c_p), with the acceptance rate
alpha and the costs c_q (one draft forward) and c_p (one verify pass) measured as generation runs.
"""

from __future__ import annotations

import copy
import time

import torch
from torch import nn

from .accept import accept_draft, draw_targets, processed_probs
from .base import inspect_base_model, model_device_dtype
from .columnwise import columnwise_linears
from .generate import (GenerateOutput, GenerationStats, SequenceWriter, last_position, node_positions, prefill,
                       prepare_inputs, resolve_sampling, special_tokens, stream)
from .kv_cache import keep_accepted, new_cache
from .tree import build_tree
from .verify import forward_block

# Families whose decoder is `model.layers` (a ModuleList) between embeddings and a final norm, checked by tests.
SELF_DRAFT_FAMILIES = ("llama", "qwen2", "gemma")
# K of the first step, before any cost is measured.
FIRST_DRAFT_LENGTH = 4


def expected_tokens(alpha: float, num_draft_tokens: int) -> float:
    """Tokens one step emits (bonus included) when each draft token is kept with probability alpha."""
    return float(num_draft_tokens + 1) if alpha >= 1 else (1 - alpha ** (num_draft_tokens + 1)) / (1 - alpha)


def choose_draft_length(alpha: float, draft_seconds: float, verify_seconds: float, max_draft_tokens: int) -> int:
    """K* = argmax over K in 1..max_draft_tokens of E[tokens](alpha, K) / (K c_q + c_p): tokens per second."""
    return max(range(1, max_draft_tokens + 1),
               key=lambda k: expected_tokens(alpha, k) / (k * draft_seconds + verify_seconds))


def check_draft_model(base_model: nn.Module, draft_model: nn.Module):
    """The draft model's BaseSpec; refuses one with another vocabulary or on another device."""
    spec, draft_spec = inspect_base_model(base_model), inspect_base_model(draft_model)
    if draft_spec.vocab_size != spec.vocab_size:
        raise ValueError(f"the draft model's vocabulary has {draft_spec.vocab_size} tokens but the base model's has "
                         f"{spec.vocab_size}; use a draft model with the same tokenizer and vocabulary size (e.g. a "
                         f"smaller model of the same family, or self_draft(base_model, num_layers))")
    base_device, draft_device = model_device_dtype(base_model)[0], model_device_dtype(draft_model)[0]
    if draft_device != base_device:
        raise ValueError(f"the draft model is on {draft_device} but the base model on {base_device}; "
                         f"move it with draft_model.to({str(base_device)!r})")
    return spec, draft_spec


def self_draft(base_model: nn.Module, num_layers: int) -> nn.Module:
    """A draft model made of the base model's first `num_layers` decoder layers, its final norm and LM head.

    Weights are shared, not copied: the draft is a shallow copy of the model whose layer list is cut
    and whose config says so (num_hidden_layers, layer_types); `base_model` is left as it was.
    """
    config = getattr(base_model, "config", None)
    model_type = getattr(config, "model_type", None)
    decoder = getattr(base_model, "model", None)
    layers = getattr(decoder, "layers", None)
    if model_type not in SELF_DRAFT_FAMILIES or not isinstance(layers, nn.ModuleList):
        raise ValueError(f"self_draft supports {', '.join(SELF_DRAFT_FAMILIES)} models, not {model_type!r} "
                         f"({type(base_model).__name__}); pass a separate draft_model with the same vocabulary instead")
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or not 1 <= num_layers < len(layers):
        raise ValueError(f"num_layers must be an integer from 1 to {len(layers) - 1} (the base model has {len(layers)} "
                         f"layers; a draft needs fewer), got {num_layers!r}")
    draft_config = copy.deepcopy(config)
    draft_config.num_hidden_layers = num_layers
    if getattr(draft_config, "layer_types", None) is not None:
        draft_config.layer_types = list(draft_config.layer_types[:num_layers])
    # copy.copy shares the module's child dict; give each copy its own before replacing children.
    draft_decoder = copy.copy(decoder)
    draft_decoder._modules = dict(decoder._modules)
    draft_decoder.layers = nn.ModuleList(list(layers)[:num_layers])
    draft_decoder.config = draft_config
    draft = copy.copy(base_model)
    draft._modules = dict(base_model._modules)
    draft.model = draft_decoder
    draft.config = draft_config
    return draft


class StageClock:
    """Timestamps for the stage costs that add no host sync: CUDA events on a GPU (read after the step's
    sync, when they have completed), host time elsewhere (CPU work runs synchronously)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1000 if self.cuda else end - start


def _check_draft_lengths(num_draft_tokens, max_draft_tokens) -> None:
    def positive_int(value):
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    if num_draft_tokens is not None and not positive_int(num_draft_tokens):
        raise ValueError(f"num_draft_tokens must be an integer >= 1 (draft tokens per step), or None to choose it "
                         f"each step, got {num_draft_tokens!r}")
    if not positive_int(max_draft_tokens):
        raise ValueError(f"max_draft_tokens must be an integer >= 1 (the most draft tokens per step), got {max_draft_tokens!r}")


def generate_with_draft(base_model: nn.Module, draft_model: nn.Module, input_ids: torch.Tensor,
                        attention_mask: torch.Tensor | None = None, max_new_tokens: int = 128, do_sample: bool | None = None,
                        temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                        eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
                        num_draft_tokens: int | None = None, max_draft_tokens: int = 8,
                        streamer=None) -> GenerateOutput:
    """Speculative generation with a draft model (any causal LM with the base model's vocabulary, or
    self_draft(base_model, n)); `sequences` [B, prompt + new] as transformers' generate.

    num_draft_tokens: K, fixed; None (default) chooses K in 1..max_draft_tokens each step from the measured
    acceptance rate and costs. Other arguments as in MedusaModel.generate. The draft model samples from its
    distribution processed like the base model's (temperature, top-k, top-p), or takes its argmax when greedy.
    """
    _check_draft_lengths(num_draft_tokens, max_draft_tokens)
    spec, draft_spec = check_draft_model(base_model, draft_model)
    sampling = resolve_sampling(base_model, do_sample, temperature, top_k, top_p)
    eos, pad = special_tokens(base_model, eos_token_id, pad_token_id)
    start = time.perf_counter()
    input_ids, attention_mask = prepare_inputs(base_model, input_ids, attention_mask, max_new_tokens, streamer)
    # Both models see the same positions: the lower limit caps them.
    limits = [last_position(m, attention_mask, max_new_tokens) for m in (base_model, draft_model)]
    max_position = min((limit for limit in limits if limit is not None), default=None)
    device = input_ids.device
    batch = input_ids.shape[0]
    max_k = num_draft_tokens or max_draft_tokens
    chains = {}  # K -> the chain tree root -> x_1 -> ... -> x_K, built on first use
    writer = SequenceWriter(input_ids, max_new_tokens, eos, pad)
    stats = GenerationStats(draft_lengths=[])
    accepted_at_depth = torch.zeros(max_k, dtype=torch.long, device=device)
    clock = StageClock(device)
    accepted = rejected = 0  # draft tokens kept / rejected in the steps so far (rows still generating)
    draft_time = draft_forwards = verify_time = 0.0
    draft_length = num_draft_tokens or min(FIRST_DRAFT_LENGTH, max_draft_tokens)

    with torch.inference_mode(), columnwise_linears(base_model, draft_model):  # a chain's few rows (see columnwise)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        # 1. Prefill both models; the base model's last logits give the first token (the first root).
        cache, draft_cache = new_cache(), new_cache()
        logits, _, slot_valid, slot_pos = prefill(base_model, spec, input_ids, attention_mask, cache)
        _, _, draft_valid, draft_pos = prefill(draft_model, draft_spec, input_ids, attention_mask, draft_cache)
        root = draw_targets(logits, sampling)[:, -1]
        next_pos = slot_pos[:, -1] + 1
        count = writer.append(root[:, None], torch.ones(batch, dtype=torch.long, device=device))
        stats.steps = 1
        synced = torch.cat([writer.finished.all()[None].long(), count[:1]]).tolist()
        done = bool(synced[0])
        stream(streamer, root[:, None], synced[1])
        # The token before the root that the draft model has not seen: the last draft of a step that kept all
        # K (the draft model never ran on it). A row without one carries an invalid slot in its place.
        unseen, unseen_valid = root, torch.zeros(batch, dtype=torch.bool, device=device)
        two_causal = torch.ones(2, 2, dtype=torch.bool, device=device).tril()
        one = torch.ones(1, 1, dtype=torch.bool, device=device)

        while not done:
            k = draft_length
            if k not in chains:
                chains[k] = build_tree([[0] * depth for depth in range(1, k + 1)]).to(device)
            chain = chains[k]
            step_start = clock.mark()
            # 2. Draft: K forwards of the draft model, each drawing x_i from q_i. The first one also
            # feeds the unseen token; the draft block's slots are [unseen, root, x_1, ..., x_{K-1}].
            draft_past = draft_valid.shape[1]
            block_tokens = torch.stack([unseen, root], dim=1)
            block_pos = torch.stack([next_pos - 1, next_pos], dim=1)
            block_valid = torch.stack([unseen_valid, torch.ones_like(unseen_valid)], dim=1)
            draft_valid = torch.cat([draft_valid, block_valid], dim=1)
            draft_pos = torch.cat([draft_pos, block_pos], dim=1)
            draft_logits, _ = forward_block(draft_model, draft_spec, block_tokens, block_pos, two_causal, draft_cache,
                                            draft_valid, draft_pos, last_only=True)
            draft_tokens, draft_probs = [], []
            for i in range(k):
                if i > 0:  # x_i: feed x_{i-1} at position next_pos + i
                    position = node_positions(next_pos, chain.depth[i: i + 1], max_position)  # a chain's depth i is i
                    draft_valid = torch.cat([draft_valid, torch.ones_like(position, dtype=torch.bool)], dim=1)
                    draft_pos = torch.cat([draft_pos, position], dim=1)
                    draft_logits, _ = forward_block(draft_model, draft_spec, draft_tokens[-1][:, None], position, one,
                                                    draft_cache, draft_valid, draft_pos)
                if sampling.do_sample:
                    q = processed_probs(draft_logits[:, -1], sampling)
                    draft_probs.append(q)
                    draft_tokens.append(torch.multinomial(q, 1)[:, 0])
                else:
                    draft_tokens.append(draft_logits[:, -1].argmax(dim=-1))
            draft_tokens = torch.stack(draft_tokens, dim=1)  # [B, K]
            drafted = clock.mark()
            # 3. Verify: one base-model pass over the chain [root, x_1 .. x_K] at positions next_pos + 0..K.
            node_tokens = torch.cat([root[:, None], draft_tokens], dim=1)
            q_pos = node_positions(next_pos, chain.depth, max_position)
            past_length = slot_valid.shape[1]
            kv_valid = torch.cat([slot_valid, torch.ones_like(node_tokens, dtype=torch.bool)], dim=1)
            logits, _ = forward_block(base_model, spec, node_tokens, q_pos, chain.tree_mask, cache, kv_valid,
                                      torch.cat([slot_pos, q_pos], dim=1))
            # 4. Accept: keep x_i with probability min(1, p_i/q_i); the bonus comes from the residual or p_K.
            accept_length, bonus = accept_draft(draft_tokens, torch.stack(draft_probs, dim=1) if draft_probs else None,
                                                logits, sampling)
            new_tokens = torch.cat([draft_tokens, bonus[:, None]], dim=1)
            new_tokens.scatter_(1, accept_length[:, None], bonus[:, None])
            active = ~writer.finished
            accepted_at_depth[:k] += (accept_length[:, None] > torch.arange(k, device=device)).masked_fill(
                ~active[:, None], False).sum(0)
            kept_total = (accept_length * active).sum()
            rejected_total = ((accept_length < k) & active).sum()
            count = writer.append(new_tokens, accept_length + 1)
            verified = clock.mark()
            # The one host sync of the step.
            synced = torch.cat([accept_length.max()[None], writer.finished.all()[None].long(), count[:1],
                                kept_total[None], rejected_total[None]]).tolist()
            longest, done, first_count = synced[0] + 1, bool(synced[1]), synced[2]
            stream(streamer, new_tokens, first_count)
            stats.steps += 1
            stats.draft_lengths.append(k)
            accepted, rejected = accepted + synced[3], rejected + synced[4]
            draft_time += clock.seconds(step_start, drafted)
            draft_forwards += k
            verify_time += clock.seconds(drafted, verified)
            # 5. Commit. Base cache: the accepted chain [root, x_1 .. x_a] (a contiguous prefix of the block).
            keep_accepted(cache, past_length, torch.arange(longest, device=device).expand(batch, -1))
            # A finished row stays in the batch but stands still: no valid slots, no new positions.
            going = ~writer.finished
            slot_offsets = torch.arange(longest, device=device)
            slot_valid = torch.cat([slot_valid, (slot_offsets < (accept_length + 1)[:, None]) & going[:, None]], dim=1)
            slot_pos = torch.cat([slot_pos, node_positions(next_pos, slot_offsets, max_position)], dim=1)
            # Draft cache: [unseen, root, x_1 .. x_min(a, K-1)]; x_K, never fed, becomes next step's unseen token.
            draft_kept = torch.clamp(accept_length, max=k - 1) + 2  # slots of the block to keep, the unseen one included
            draft_longest = min(longest, k) + 1
            keep_accepted(draft_cache, draft_past, torch.arange(draft_longest, device=device).expand(batch, -1))
            draft_offsets = torch.arange(draft_longest, device=device)
            kept_valid = (draft_valid[:, draft_past: draft_past + draft_longest] & (draft_offsets < draft_kept[:, None])
                          & going[:, None])
            draft_valid = torch.cat([draft_valid[:, :draft_past], kept_valid], dim=1)
            draft_pos = draft_pos[:, : draft_past + draft_longest]
            unseen, unseen_valid = draft_tokens[:, -1], (accept_length == k) & going
            next_pos = next_pos + (accept_length + 1) * going
            root = bonus
            if num_draft_tokens is None:
                # One pseudo-token each way (Laplace) keeps alpha inside (0, 1): one unlucky first step
                # does not read as "never accepted", nor a lucky one as "always".
                alpha = (accepted + 1) / (accepted + rejected + 2)
                draft_length = choose_draft_length(alpha, draft_time / draft_forwards,
                                                   verify_time / len(stats.draft_lengths), max_draft_tokens)

    if streamer is not None:
        streamer.end()
    stats.accepted_at_depth = accepted_at_depth.tolist()
    if stats.draft_lengths:
        stats.acceptance_rate = accepted / max(accepted + rejected, 1)
        stats.draft_seconds = draft_time / draft_forwards
        stats.verify_seconds = verify_time / len(stats.draft_lengths)
    stats.wall_time = time.perf_counter() - start
    return writer.output(stats)
