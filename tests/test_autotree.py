"""--tree auto: the tree with the most expected tokens per second for measured costs and accuracies."""

import time

import pytest
import torch

from medusa_spec import MedusaConfig, MedusaModel, autotree, model, propose
from medusa_spec.autotree import choose_tree, expected_tokens_per_step
from medusa_spec.context import ContextLayer
from tiny_models import tiny_model

ACCURACY = [[0.8, 0.1], [0.6, 0.1]]


def test_expected_tokens_per_step_is_the_sum_of_path_products():
    assert expected_tokens_per_step([[0], [1], [0, 0]], ACCURACY) == pytest.approx(1 + 0.8 + 0.1 + 0.8 * 0.6)


def test_choose_tree_trades_acceptance_against_measured_latency():
    flat = {1: 0.010, 2: 0.010, 3: 0.010, 4: 0.010, 5: 0.010}
    tree, table = choose_tree(ACCURACY, flat, draft_seconds=0.001)
    assert len(tree) == 4  # verification is free: the biggest tree wins
    steep = {1: 0.010, 2: 0.020, 3: 0.030, 4: 0.040, 5: 0.050}
    tree, _ = choose_tree(ACCURACY, steep, draft_seconds=0.001)
    assert tree == []  # every node costs more than it brings: no speculation
    middle = {1: 0.010, 2: 0.011, 3: 0.030, 4: 0.031, 5: 0.032}
    tree, table = choose_tree(ACCURACY, middle, draft_seconds=0.0)
    assert tree == [[0]] and {row["nodes"] for row in table} == {1, 2, 3, 4, 5}


def fake_clock(monkeypatch) -> list[float]:
    """time.perf_counter reads [seconds], which only the test moves: timings then come out exact."""
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    return clock


def verify_a_millisecond_a_node(monkeypatch, clock: list[float]) -> None:
    forward_block = autotree.forward_block

    def verify(model, spec, node_tokens, *args, **kwargs):
        clock[0] += 0.001 * node_tokens.shape[1]
        return forward_block(model, spec, node_tokens, *args, **kwargs)

    monkeypatch.setattr(autotree, "forward_block", verify)


def test_auto_tree_measures_this_machine(monkeypatch):
    """The table's verify times are what the clock says the verify passes took: on a clock that only a verify pass
    moves, a millisecond a node, each size's verify_ms is its node count and no drafting is charged."""
    mm = MedusaModel.from_base(tiny_model("llama"),
                               MedusaConfig(num_heads=2, metrics={"eval": {"rank_accuracy": ACCURACY}}))
    verify_a_millisecond_a_node(monkeypatch, fake_clock(monkeypatch))
    tree, table = mm.auto_tree(context=32)
    monkeypatch.undo()
    for row in table:
        assert row["verify_ms"] == pytest.approx(row["nodes"]) and row["draft_ms"] == 0, row
        assert row["step_ms"] == pytest.approx(row["nodes"]), row
    # The CLI's --tree auto and tree=None time the same short grid (2 s for SmolLM2-135M, not 8.6 s).
    # (A size larger than the accuracies' 7 candidates gives the 7-node tree.)
    assert {row["nodes"] for row in table} == {1, 2, 4, 7} == {min(n, 7) for n in model.AUTO_SIZES}
    assert tree in [row["tree"] for row in table]
    out = mm.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=5, eos_token_id=[], tree=tree)
    assert out.stats.new_tokens == [5]
    with pytest.raises(ValueError, match="no measured rank accuracies"):
        MedusaModel.from_base(tiny_model("llama")).auto_tree()


def test_auto_tree_counts_the_context_layers_step_in_the_drafting_cost(monkeypatch):
    """On a clock that the context layer's step moves a second and the verify pass a millisecond a node, each drafted
    tree's draft_ms is that second: the step over the slots a step kept is charged to drafting."""
    mm = MedusaModel.from_base(tiny_model("llama"), MedusaConfig(num_heads=2, head_type="dependent", context_heads=2,
                                                                 metrics={"eval": {"rank_accuracy": ACCURACY}}))
    steps = []
    clock, extend = fake_clock(monkeypatch), ContextLayer.extend
    verify_a_millisecond_a_node(monkeypatch, clock)

    def a_second_a_step(self, cache, *args):
        steps.append(cache)
        clock[0] += cache is not None
        return extend(self, cache, *args)

    monkeypatch.setattr(ContextLayer, "extend", a_second_a_step)
    _, table = mm.auto_tree(context=32)
    monkeypatch.undo()
    # Each tree's proposer takes the prompt (no cache yet); every timed step then extends the prompt's 32 slots.
    timed = [cache for cache in steps if cache is not None]
    assert steps[0] is None and timed and all(cache.keys.shape[2] == 32 for cache in timed)
    assert all(row["draft_ms"] == pytest.approx(1000.0) for row in table if row["nodes"] > 1), table


def test_auto_tree_times_the_trees_its_accuracies_grow(monkeypatch):
    """Dependent heads draft one call per tree depth, so a size's cost depends on the tree's shape: the
    trees timed are the ones choose_tree weighs (here a chain, where equal accuracies give a fan)."""
    chain_first = [[0.9, 0.05, 0.01], [0.9, 0.05, 0.01]]
    mm = MedusaModel.from_base(tiny_model("llama"), MedusaConfig(num_heads=2, head_type="dependent",
                                                                 metrics={"eval": {"rank_accuracy": chain_first}}))
    depths = {}
    drafting = propose.draft_with_heads

    def recording(heads, base_model, root, state, tree):
        depths[tree.num_nodes] = tree.max_depth
        return drafting(heads, base_model, root, state, tree)

    monkeypatch.setattr(propose, "draft_with_heads", recording)
    mm.auto_tree(context=32, sizes=(1, 2, 3, 4))
    assert depths[3] == 2 and depths[4] == 2  # [[0], [0, 0]] and [[0], [0, 0], [1]], not [[0], [1], [2]]
