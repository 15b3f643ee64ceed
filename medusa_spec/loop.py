"""The speculative loop: prefill -> (propose -> verify -> accept -> commit)* -> sequences.

Any proposer (propose.py) drafts the candidates; one verify pass of the base model checks them all,
acceptance keeps the longest path the base model agrees with plus its own next token, and the cache
keeps that path. One host sync per step (the per-row counts that decide streaming, stopping and how
many cache slots to keep, and the new tokens for proposers that search the text on the host);
everything else stays on the model's device.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn

from .accept import Sampling, accept_candidates, draw_targets
from .base import BaseSpec
from .columnwise import PackedWeights, columnwise_copy
from .compiled import CompiledSteps
from .inputs import prepare_inputs
from .kv_cache import new_cache
from .output import GenerateOutput, GenerationStats, SequenceWriter, stream
from .propose import Candidates, HostStep, Prompt, Proposer, StepResult
from .slots import Slots, last_position, prefill
from .verify import forward_block


class Streamer(Protocol):
    """What `streamer` needs, as transformers' TextStreamer has: the prompt, then each step's new tokens, then end."""

    def put(self, value: torch.Tensor) -> None: ...

    def end(self) -> None: ...


class StepTimer:
    """Where decoding time goes, for `decode(..., timer=StepTimer())`: seconds per stage, summed over every
    call it times, and `steps`, the verify passes after prefill (one per step).

    Stages: prefill (the prompt and the proposer's start, once a call), propose (drafting: the proposer's
    propose and its update after the verify pass), verify (the base model's pass over the candidates),
    accept (acceptance, the output buffer and the step's host sync), commit (the cache keeps the accepted
    path; streaming). Laps follow each other, so the stages add up to the time decoding took. Each lap
    first waits for the device (CPU ops are done when they return), so a stage is charged its own work,
    not the next one's wait; that wait removes the overlap of host and device work between stages, which
    is why decoding without a timer takes no laps.
    """

    STAGES = ("prefill", "propose", "verify", "accept", "commit")

    def __init__(self):
        self.seconds = dict.fromkeys(self.STAGES, 0.0)
        self.steps = 0

    def start(self, device: torch.device) -> None:
        self.device = device
        self.last = self._now()

    def lap(self, stage: str) -> None:
        """Charge the time since the last lap to `stage`."""
        now = self._now()
        self.seconds[stage] += now - self.last
        self.last = now
        self.steps += stage == "verify"

    def _now(self) -> float:
        wait_for(self.device)
        return time.perf_counter()


def wait_for(device: torch.device) -> None:
    """Return once `device` has run every op queued on it: before reading a clock, so a time covers the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":  # mps, xpu: their ops, too, return before they have run; CPU ops are done
        getattr(torch, device.type).synchronize()


def _no_lap(stage: str) -> None:
    pass


@contextmanager
def eval_mode(module: nn.Module | None) -> Iterator[None]:
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


def decode(base_model: nn.Module, spec: BaseSpec, proposer: Proposer, input_ids: torch.Tensor,
           attention_mask: torch.Tensor | None, max_new_tokens: int | None, sampling: Sampling, eos_token_id: list[int],
           pad_token_id: int | None, streamer: Streamer | None = None,
           timer: StepTimer | None = None, packs: PackedWeights | None = None,
           generation_config=None, compiled: CompiledSteps | None = None) -> GenerateOutput:
    """Generate with `proposer`'s candidates; `sequences` [B, prompt + new] as transformers' generate.
    `timer`: a StepTimer to charge each stage's time to (None: no laps, no extra device syncs). `packs`: the base
    model's packed weights, kept by the caller from call to call (see columnwise.PackedWeights). `generation_config`:
    where max_new_tokens=None is read (inputs.settings_of). `compiled`: verify through its compiled graphs (see
    compiled), prepared by the caller for the base model and the proposer's feature layers and kept from call to
    call."""
    start = time.perf_counter()
    input_ids, attention_mask, max_new_tokens = prepare_inputs(base_model, input_ids, attention_mask, max_new_tokens,
                                                               streamer, eos_token_id, pad_token_id, generation_config,
                                                               spec.sliding_window)
    # Every model that sees the positions (the base, a draft model) must embed them: the lowest limit caps them.
    limits = [last_position(m, attention_mask, max_new_tokens) for m in (base_model, *proposer.modules)]
    max_position = min((limit for limit in limits if limit is not None), default=None)
    device = input_ids.device
    batch = input_ids.shape[0]
    writer = SequenceWriter(input_ids, max_new_tokens, eos_token_id, pad_token_id)
    stats = GenerationStats()
    accepted_at_depth = torch.zeros(proposer.max_depth, dtype=torch.long, device=device)
    lap = _no_lap if timer is None else timer.lap
    if timer is not None:
        timer.start(device)

    with torch.inference_mode():
        layers = proposer.feature_layers
        # The base model runs in eval mode and, on CPU, its candidates' few rows column-wise: both through a copy
        # (see columnwise), so no mode is written on the caller's model, which another thread may be training.
        # The proposers' modules are such copies of their own. With compiled graphs the copy runs the prompt's body
        # alone, where packed weights save less than checking them costs (SmolLM2-135M, 2-core CPU: 15 ms against
        # 48 a call).
        base_model = columnwise_copy(base_model, packs=packs if compiled is None else None, eval_mode=True)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        # 1. Prefill: the prompt is a chain; its last logits give the first token (the first root).
        logits, hidden, slots = prefill(base_model, spec, input_ids, attention_mask, new_cache(), max_position, layers,
                                        compiled, max_new_tokens)
        root = draw_targets(logits, sampling)[:, -1]
        count = writer.append(root[:, None], torch.ones(batch, dtype=torch.long, device=device))
        stats.steps = 1
        synced = torch.cat([writer.finished.all()[None].long(), count[:1]]).tolist()
        done = bool(synced[0])
        stream(streamer, root[:, None], synced[1])
        proposer.start(Prompt(input_ids, attention_mask, hidden, root, max_position, max_new_tokens - 1))
        lap("prefill")

        while not done:
            # 2. Propose.
            candidates = proposer.propose(root)
            tree = candidates.tree
            lap("propose")
            # 3. Verify: one pass over every node.
            logits, hidden = verify(base_model, spec, slots, candidates, layers, compiled)
            lap("verify")
            # 4. Accept: the longest path the base model agrees with, plus its own next token.
            last_node, accept_length, bonus = accept_candidates(candidates, logits, sampling)
            path, new_tokens = accepted_path(candidates, last_node, accept_length, bonus)
            active = ~writer.decoded_finished
            accepted_at_depth[: tree.max_depth] += (
                accept_length[:, None] > torch.arange(tree.max_depth, device=device)).masked_fill(
                ~active[:, None], False).sum(0)
            count = writer.append(new_tokens, accept_length + 1)
            going = ~writer.decoded_finished
            # Whether each going row's accepted nodes are the block's first slots (a chain, a root alone): the
            # commit then keeps them where the verify pass wrote them, with no copy of every layer's keys and values.
            depths = torch.arange(path.shape[1], device=device)
            in_place = ((path == depths) | (depths > accept_length[:, None]) | ~going[:, None]).all()
            # The one host sync of the step.
            width = new_tokens.shape[1]
            synced = torch.cat([count, accept_length, active.long(), going.long(), new_tokens.flatten(),
                                in_place[None].long()]).tolist()
            counts, accept_lengths = synced[:batch], synced[batch: 2 * batch]
            going_rows = [bool(g) for g in synced[3 * batch: 4 * batch]]
            done = not any(going_rows)
            host_tokens, in_place = synced[4 * batch: -1], bool(synced[-1])
            emitted = [host_tokens[b * width: b * width + counts[b]] for b in range(batch)]
            longest = max(accept_lengths) + 1
            stats.steps += 1
            host = HostStep(accept_lengths, [bool(a) for a in synced[2 * batch: 3 * batch]], emitted, going_rows)
            lap("accept")
            proposer.update(StepResult(candidates, hidden, last_node, accept_length, path[:, :longest],
                                       new_tokens[:, :longest], active, going, host))
            lap("propose")  # the proposer's own bookkeeping (a state, a cache, an index) is drafting work
            # 5. Commit: keep each row's accepted path in the cache, then move the root forward. A finished row
            # stands still, and leaves the batch: a batch runs until its slowest row is done, and a finished row
            # would cost every later pass its share (compiled graphs keep it: their cache's rows are fixed).
            commit(slots, longest if in_place else path[:, :longest], accept_length, going)
            root = bonus
            stream(streamer, new_tokens, counts[0])
            if not done and not all(going_rows) and compiled is None:
                rows = torch.tensor([b for b, g in enumerate(going_rows) if g], device=device)
                slots, root, batch = slots.select(rows), root[rows], len(rows)
                proposer.keep_rows(rows)
                writer.keep_rows(rows)
            lap("commit")

    if streamer is not None:
        streamer.end()
    stats.accepted_at_depth = accepted_at_depth.tolist()
    proposer.finish(stats)
    stats.wall_time = time.perf_counter() - start
    return writer.output(stats)


def verify(base_model: nn.Module, spec: BaseSpec, slots: Slots, candidates: Candidates,
           feature_layers: tuple[int, ...] = (),
           compiled: CompiledSteps | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The verify stage: one pass of the base model over every node of `candidates`, node i at position
    next_pos + depth(i), its slots appended to `slots` until commit. -> logits [B, N, V], hidden [B, N, H]
    (then the feature layers' states). With `compiled`, through its graphs, on the static cache it adopted.
    autotree times this very function."""
    tree = candidates.tree
    q_pos, kv_valid, kv_pos = slots.verify_inputs(tree.depth)
    if compiled is not None:
        return compiled.forward_block(spec, candidates.node_tokens, q_pos, tree.tree_mask, slots.cache, kv_valid,
                                      kv_pos, feature_layers)
    return forward_block(base_model, spec, candidates.node_tokens, q_pos, tree.tree_mask, slots.cache, kv_valid,
                         kv_pos, feature_layers=feature_layers)


def accepted_path(candidates: Candidates, last_node: torch.Tensor, accept_length: torch.Tensor,
                  bonus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What acceptance keeps: last_node, accept_length, bonus [B] -> (path [B, D+1]: the root, the accepted nodes,
    then repeats; new_tokens [B, D+1]: the accepted tokens, the bonus at accept_length, then the path's)."""
    node_paths = candidates.tree.rows().node_paths  # [B or 1, N, D+1]
    path = node_paths.expand(last_node.shape[0], -1, -1).gather(1, last_node[:, None, None].expand(
        -1, 1, node_paths.shape[-1]))[:, 0]
    new_tokens = torch.cat([candidates.node_tokens.gather(1, path)[:, 1:], bonus[:, None]], dim=1)
    new_tokens.scatter_(1, accept_length[:, None], bonus[:, None])
    return path, new_tokens


def commit(slots: Slots, kept: torch.Tensor | int, accept_length: torch.Tensor, going: torch.Tensor) -> None:
    """The commit stage: keep each going row's root and accepted nodes, kept [B, m] (the path's first m slots; an
    int m: the block's first m slots, where each going row's path is that), in the cache; a row that accepted
    fewer gets invalid slots (sync points), a finished row keeps none and stands still (no valid slots, no new
    positions)."""
    n_kept = (accept_length + 1) * going
    slots.commit(kept, n_kept, n_kept)
