"""Hardware-aware tree choice: measure what a verify pass of n nodes costs on this machine and pick
the tree with the most expected tokens per second for the heads' measured rank accuracies."""

from __future__ import annotations

import math
import time
from functools import partial

import torch

from .columnwise import columnwise_linears
from .kv_cache import new_cache
from .propose import draft_tree
from .slots import prefill
from .tree import build_tree, grow_tree
from .verify import forward_block

CANDIDATE_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)


def expected_tokens_per_step(choices, rank_accuracy) -> float:
    """1 (the base model's own token) + every node's chance to be reached: its path's accuracies' product."""
    return 1.0 + sum(math.prod(rank_accuracy[d][r] for d, r in enumerate(path)) for path in choices)


def _fastest_seconds(fns: dict, repeats: int) -> dict:
    """{key: the fastest of `repeats` runs of fns[key]}. Other work on the machine only ever adds time, so
    the minimum is the least noisy estimate (a median let one busy moment pick a far too large tree);
    and the functions take turns, round by round, so a machine that slows down for a while slows them
    all (timed one after the other, a 16-node verify once came out cheaper than a 4-node one)."""
    times = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    return {key: min(seconds) for key, seconds in times.items()}


@torch.inference_mode()
def measure_step_costs(mm, sizes=CANDIDATE_SIZES, context: int = 256, repeats: int = 5,
                       rank_accuracy=None) -> tuple[dict[int, float], dict[int, float]]:
    """Seconds of one verify pass of n nodes after `context` cached tokens, and of drafting n nodes with
    the heads (one call for Medusa heads, one per level for dependent heads; with a context layer, its
    step over the slots a step may keep too), for each n in sizes. The verified slots are dropped
    again after each pass. The trees timed are those choose_tree weighs, grown from `rank_accuracy`
    (default: equal accuracies): a dependent head's drafting cost is one call per tree depth, so a
    tree of the same size but another shape costs another time (over a full 49k vocabulary, a one-level
    4-node tree drafted in 13 ms, the two-level one the accuracies chose in 43-47 ms)."""
    with columnwise_linears(mm.base_model, mm.heads):  # as the decoding loop runs (see columnwise)
        base, spec = mm.base_model, mm.spec
        device = base.get_output_embeddings().weight.device
        ids = torch.randint(0, spec.vocab_size, (1, context), device=device)
        valid = torch.ones_like(ids, dtype=torch.bool)
        _, hidden, slots = prefill(base, spec, ids, valid, new_cache())
        root = ids[:, -1]
        context_layer = getattr(mm.heads, "context", None)
        if context_layer is not None:
            embed = base.get_input_embeddings()
            context_cache, _ = context_layer.extend(None, hidden, embed(ids), embed(ids), valid,
                                                      torch.full_like(root, context - 1))

        def draft(tree):
            state = hidden[:, -1]
            if context_layer is not None:  # a step keeps up to max_depth + 1 slots
                kept = slice(context - tree.max_depth - 1, context)
                _, state = context_layer.extend(context_cache, hidden[:, kept], embed(ids[:, kept]), embed(ids[:, kept]),
                                                valid[:, kept], torch.full_like(root, tree.max_depth))
            draft_tree(mm.heads, base, root, state, tree)

        def verify(tree):  # as the decoding loop verifies, then commits nothing: the cache stays at `context`
            tokens = torch.randint(0, spec.vocab_size, (1, tree.num_nodes), device=device)
            q_pos, kv_valid, kv_pos = slots.verify_inputs(tree.depth)
            forward_block(base, spec, tokens, q_pos, tree.tree_mask, slots.cache, kv_valid, kv_pos)
            slots.commit(keep_nothing, no_rows, no_rows)

        keep_nothing = torch.zeros(1, 0, dtype=torch.long, device=device)
        no_rows = torch.zeros(1, dtype=torch.long, device=device)
        accuracy = rank_accuracy or [[0.5] * max(sizes)] * mm.config.num_heads
        trees = {tree.num_nodes: tree for tree in (build_tree(grow_tree(accuracy, n)).to(device) for n in sizes)}
        for tree in trees.values():
            verify(tree)  # warm-up
        latency = _fastest_seconds({n: partial(verify, tree) for n, tree in trees.items()}, repeats)
        head_seconds = _fastest_seconds({n: partial(draft, tree) for n, tree in trees.items() if n > 1}, repeats)
        return latency, {**head_seconds, **({1: 0.0} if 1 in trees else {})}


def choose_tree(rank_accuracy, latency: dict[int, float], head_seconds: float | dict[int, float]) -> tuple[list[list[int]], list[dict]]:
    """The tree (rank paths) maximising expected tokens / (verify + heads seconds), and the table behind it.
    head_seconds: drafting cost, one figure or one per tree size. A root-only tree (no speculation)
    needs no heads and is always a candidate."""
    table = []
    for n, seconds in sorted(latency.items()):
        choices = grow_tree(rank_accuracy, n)
        if len(choices) + 1 != n:
            continue  # the accuracies allow no tree this large
        expected = expected_tokens_per_step(choices, rank_accuracy)
        draft = head_seconds.get(n, 0.0) if isinstance(head_seconds, dict) else head_seconds
        step = seconds + (draft if n > 1 else 0.0)
        table.append({"nodes": n, "expected_tokens_per_step": round(expected, 3), "verify_ms": round(1000 * seconds, 2),
                      "draft_ms": round(1000 * (step - seconds), 2), "step_ms": round(1000 * step, 2),
                      "expected_tokens_per_second": round(expected / step, 2), "tree": choices})
    best = max(table, key=lambda row: row["expected_tokens_per_second"])
    return best["tree"], table
