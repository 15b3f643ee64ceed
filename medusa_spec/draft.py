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
from transformers import GenerationConfig

from .accept import Sampling, processed_probs
from .base import inspect_base_model, model_device_dtype
from .columnwise import MODULE_CONTAINERS, columnwise_copy
from .inputs import resolve_sampling, special_tokens
from .kv_cache import new_cache
from .loop import StepTimer, decode
from .output import GenerateOutput, GenerationStats
from .propose import Candidates, Prompt, Proposer, StepResult, tokens_left, tokens_left_after
from .slots import prefill
from .tree import Tree, chain_tree
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
    draft_decoder = _own_containers(decoder)
    draft_decoder.layers = nn.ModuleList(list(layers)[:num_layers])
    draft_decoder.config = draft_config
    draft = _own_containers(base_model)
    draft.model = draft_decoder
    draft.config = draft_config
    if getattr(base_model, "generation_config", None) is not None:
        draft.generation_config = copy.deepcopy(base_model.generation_config)
    return draft


def _own_containers(module: nn.Module) -> nn.Module:
    """A shallow copy of `module` with its own nn.Module containers (children, parameters, buffers, hooks): copy.copy
    alone shares them, so a child replaced or a hook registered on the copy would reach `module`."""
    clone = copy.copy(module)
    for name in MODULE_CONTAINERS & vars(module).keys():
        vars(clone)[name] = type(vars(module)[name])(vars(module)[name])
    return clone


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


# The most draft tokens an adaptive K (num_draft_tokens None) chooses, unless max_draft_tokens says.
MAX_DRAFT_TOKENS = 8


def _check_draft_lengths(num_draft_tokens, max_draft_tokens) -> int:
    """The bound of the adaptive K, after checking both lengths."""
    def positive_int(value):
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    if num_draft_tokens is not None and not positive_int(num_draft_tokens):
        raise ValueError(f"num_draft_tokens must be an integer >= 1 (draft tokens per step), or None to choose it "
                         f"each step, got {num_draft_tokens!r}")
    if num_draft_tokens is not None and max_draft_tokens is not None:
        raise ValueError(f"max_draft_tokens={max_draft_tokens} bounds the draft length chosen each step, but "
                         f"num_draft_tokens={num_draft_tokens} fixes it: give one of them")
    if max_draft_tokens is not None and not positive_int(max_draft_tokens):
        raise ValueError(f"max_draft_tokens must be an integer >= 1 (the most draft tokens per step), "
                         f"got {max_draft_tokens!r}")
    return MAX_DRAFT_TOKENS if max_draft_tokens is None else max_draft_tokens


class DraftModelProposer(Proposer):
    """A draft model drafting a chain of K tokens one forward at a time, K fixed or adaptive.

    It keeps its own cache (Slots, the same positions as the base's). The token before the root that it
    has not seen is the last draft of a step that kept all K (it never ran on it); the next step feeds it
    first, and a row without one carries an invalid slot in its place.
    """

    def __init__(self, draft_model: nn.Module, draft_spec, sampling: Sampling, num_draft_tokens: int | None,
                 max_draft_tokens: int):
        # A column-wise copy in eval mode (see columnwise), as the loop runs the base model.
        self.draft_model = columnwise_copy(draft_model, eval_mode=True)
        self.draft_spec, self.sampling = draft_spec, sampling
        self.modules = (self.draft_model,)
        self.num_draft_tokens, self.max_draft_tokens = num_draft_tokens, max_draft_tokens
        self.max_depth = num_draft_tokens or max_draft_tokens
        self.draft_length = num_draft_tokens or min(FIRST_DRAFT_LENGTH, max_draft_tokens)
        self.chain_trees: dict[int, Tree] = {}  # K -> the chain tree root -> x_1 -> ... -> x_K, built on first use
        self.accepted = self.rejected = 0  # draft tokens kept / rejected in the steps so far (rows still generating)
        self.draft_time = self.verify_time = 0.0
        self.draft_forwards = 0
        self.draft_lengths: list[int] = []

    def start(self, prompt: Prompt) -> None:
        device = prompt.root.device
        self.clock = StageClock(device)
        _, _, self.slots = prefill(self.draft_model, self.draft_spec, prompt.input_ids, prompt.attention_mask,
                                   new_cache(), prompt.max_position)
        self.unseen, self.unseen_valid = prompt.root, torch.zeros_like(prompt.root, dtype=torch.bool)
        self.first_offsets = torch.tensor([-1, 0], device=device)  # the unseen token and the root
        self.two_causal = torch.ones(2, 2, dtype=torch.bool, device=device).tril()
        self.one = torch.ones(1, 1, dtype=torch.bool, device=device)
        self.tokens_left = tokens_left(prompt)

    def propose(self, root: torch.Tensor) -> Candidates:
        """K forwards of the draft model, each drawing x_i from q_i; the first one also feeds the unseen token,
        so the block's slots are [unseen, root, x_1, ..., x_{K-1}]."""
        k = max(0, min(self.draft_length, max(self.tokens_left) - 1))
        if k not in self.chain_trees:
            self.chain_trees[k] = chain_tree(k).to(root.device)
        chain = self.chain_trees[k]
        if not k:  # one token left in every row (the call's last step): the base's own, nothing to draft
            self.draft_tokens = root.new_empty((root.shape[0], 0))
            return Candidates(root[:, None], chain)
        self.step_start = self.clock.mark()
        model, spec, slots = self.draft_model, self.draft_spec, self.slots
        q_pos, kv_valid, kv_pos = slots.verify_inputs(
            self.first_offsets, torch.stack([self.unseen_valid, torch.ones_like(self.unseen_valid)], dim=1))
        logits, _ = forward_block(model, spec, torch.stack([self.unseen, root], dim=1), q_pos, self.two_causal,
                                  slots.cache, kv_valid, kv_pos, last_only=True)
        draft_tokens, draft_probs = [], []
        for i in range(k):
            if i > 0:  # x_i: feed x_{i-1} at position next_pos + i (a chain's depth i is i)
                q_pos, kv_valid, kv_pos = slots.verify_inputs(chain.depth[i: i + 1])
                logits, _ = forward_block(model, spec, draft_tokens[-1][:, None], q_pos, self.one, slots.cache,
                                          kv_valid, kv_pos)
            if self.sampling.do_sample:
                q = processed_probs(logits[:, -1], self.sampling)
                draft_probs.append(q)
                draft_tokens.append(torch.multinomial(q, 1)[:, 0])
            else:
                draft_tokens.append(logits[:, -1].argmax(dim=-1))
        self.draft_tokens = torch.stack(draft_tokens, dim=1)  # [B, K]
        self.drafted = self.clock.mark()
        return Candidates(torch.cat([root[:, None], self.draft_tokens], dim=1), chain,
                          draft_probs=torch.stack(draft_probs, dim=1) if draft_probs else None)

    def update(self, step: StepResult) -> None:
        # The verify pass's time runs to here: it includes acceptance and the step's host sync.
        k = self.draft_tokens.shape[1]
        self.draft_lengths.append(k)
        if not k:  # nothing drafted, nothing timed; no row goes on
            return
        verified = self.clock.mark()
        host = step.host
        self.tokens_left = tokens_left_after(self.tokens_left, host)
        self.accepted += sum(a for a, active in zip(host.accept_length, host.active) if active)
        self.rejected += sum(a < k for a, active in zip(host.accept_length, host.active) if active)
        self.draft_time += self.clock.seconds(self.step_start, self.drafted)
        self.draft_forwards += k
        self.verify_time += self.clock.seconds(self.drafted, verified)
        # Keep [unseen, root, x_1 .. x_min(a, K-1)]; x_K, never fed, becomes next step's unseen token.
        accept_length, going = step.accept_length, step.going
        draft_kept = (torch.clamp(accept_length, max=k - 1) + 2) * going  # slots to keep, the unseen one included
        self.slots.commit(min(step.kept.shape[1], k) + 1, draft_kept, (accept_length + 1) * going)  # a chain, in place
        self.unseen, self.unseen_valid = self.draft_tokens[:, -1], (accept_length == k) & going
        if self.num_draft_tokens is None:
            # One pseudo-token each way (Laplace) keeps alpha inside (0, 1): one unlucky first step
            # does not read as "never accepted", nor a lucky one as "always".
            alpha = (self.accepted + 1) / (self.accepted + self.rejected + 2)
            self.draft_length = choose_draft_length(alpha, self.draft_time / self.draft_forwards,
                                                    self.verify_time / len(self.draft_lengths), self.max_draft_tokens)

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.slots, self.unseen, self.unseen_valid = self.slots.select(rows), self.unseen[rows], self.unseen_valid[rows]
        self.tokens_left = [self.tokens_left[r] for r in rows.tolist()]

    def finish(self, stats: GenerationStats) -> None:
        stats.draft_lengths = self.draft_lengths
        drafted = sum(k > 0 for k in self.draft_lengths)
        if drafted:
            stats.acceptance_rate = self.accepted / max(self.accepted + self.rejected, 1)
            stats.draft_seconds = self.draft_time / self.draft_forwards
            stats.verify_seconds = self.verify_time / drafted


def generate_with_draft(base_model: nn.Module, draft_model: nn.Module, input_ids: torch.Tensor,
                        attention_mask: torch.Tensor | None = None, max_new_tokens: int | None = None,
                        do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
                        top_p: float | None = None,
                        eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
                        num_draft_tokens: int | None = None, max_draft_tokens: int | None = None,
                        streamer=None, timer: StepTimer | None = None,
                        generation_config: GenerationConfig | None = None) -> GenerateOutput:
    """Speculative generation with a draft model (any causal LM with the base model's vocabulary, or
    self_draft(base_model, n)); `sequences` [B, prompt + new] as transformers' generate.

    num_draft_tokens: K, fixed; None (default) chooses K in 1..max_draft_tokens (default 8) each step from the measured
    acceptance rate and costs. Other arguments (timer and generation_config too) as in MedusaModel.generate. The draft
    model samples from its distribution processed like the base model's (temperature, top-k, top-p), or takes its
    argmax when greedy.
    """
    max_draft_tokens = _check_draft_lengths(num_draft_tokens, max_draft_tokens)
    spec, draft_spec = check_draft_model(base_model, draft_model)
    sampling = resolve_sampling(base_model, do_sample, temperature, top_k, top_p, generation_config)
    eos, pad = special_tokens(base_model, eos_token_id, pad_token_id, generation_config)
    proposer = DraftModelProposer(draft_model, draft_spec, sampling, num_draft_tokens, max_draft_tokens)
    return decode(base_model, spec, proposer, input_ids, attention_mask, max_new_tokens, sampling, eos, pad, streamer,
                  timer, generation_config=generation_config)
