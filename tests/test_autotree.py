"""--tree auto: the tree with the most expected tokens per second for measured costs and accuracies."""

import time

import pytest
import torch

from medusa_spec import MedusaConfig, MedusaModel, autotree, loop, propose
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
    """The decoding loop's verify stage moves the clock a millisecond a node."""
    verify = loop.verify

    def timed(model, spec, slots, candidates, *args, **kwargs):
        clock[0] += 0.001 * candidates.node_tokens.shape[1]
        return verify(model, spec, slots, candidates, *args, **kwargs)

    monkeypatch.setattr(loop, "verify", timed)


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
    assert {row["nodes"] for row in table} == {1, 2, 4, 7} == {min(n, 7) for n in autotree.AUTO_SIZES}
    assert tree in [row["tree"] for row in table]
    out = mm.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=5, eos_token_id=[], tree=tree)
    assert out.stats.new_tokens == [5]
    for without_accuracies in (lambda mm: mm.auto_tree(), lambda mm: mm.tree_table(4)):
        with pytest.raises(ValueError, match="no measured rank accuracies"):
            without_accuracies(MedusaModel.from_base(tiny_model("llama")))


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


def with_accuracies() -> MedusaModel:
    return MedusaModel.from_base(tiny_model("llama"),
                                 MedusaConfig(num_heads=2, metrics={"eval": {"rank_accuracy": ACCURACY}}))


def counting(monkeypatch, module, name: str) -> list:
    """Replace module.name with a wrapper that records each call's arguments, then calls it."""
    calls, function = [], getattr(module, name)

    def recorded(*args, **kwargs):
        calls.append((args, kwargs))
        return function(*args, **kwargs)

    monkeypatch.setattr(module, name, recorded)
    return calls


def test_timing_runs_the_decoding_loops_own_stages(monkeypatch):
    """autotree times the loop's verify and commit stages themselves, not a copy of them: replacing loop.verify and
    loop.commit reaches every timed pass (a warm-up, then each repeat, per size) and every decoding step alike."""
    mm = with_accuracies()
    verified, committed = counting(monkeypatch, loop, "verify"), counting(monkeypatch, loop, "commit")
    autotree.measure_step_costs(mm, sizes=(1, 2, 4), context=16, repeats=2, rank_accuracy=ACCURACY)
    assert len(verified) == len(committed) == 3 * (1 + 2)
    assert sorted({args[3].node_tokens.shape[1] for args, _ in verified}) == [1, 2, 4]
    verified.clear()
    out = mm.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=6, eos_token_id=[], tree=[[0], [0, 0]])
    assert len(verified) == out.stats.steps - 1  # one verify pass a step after the prefill


def test_a_new_batch_size_times_nothing(monkeypatch):
    """The step costs are timed once: for one row at the first call, for PROBE_ROWS rows at the first call with a
    batch; a call at any other batch size after it runs only its own decoding steps: no timing pass, its tree
    modelled from those costs."""
    mm = with_accuracies()
    measured = counting(monkeypatch, autotree, "measure_step_costs")
    verified = counting(monkeypatch, loop, "verify")
    ids = torch.randint(3, 100, (8, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = mm.base_model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    mm.generate(ids[:1], max_new_tokens=6, eos_token_id=[])
    assert [kwargs["batch"] for _, kwargs in measured] == [1]  # the probe's rows wait for a batch
    assert torch.equal(mm.generate(ids[:2], max_new_tokens=6, eos_token_id=[]).sequences, reference[:2])
    assert [kwargs["batch"] for _, kwargs in measured] == [1, autotree.PROBE_ROWS]
    for rows in (3, 8, 5, 2):
        verified.clear()
        out = mm.generate(ids[:rows], max_new_tokens=6, eos_token_id=[])
        assert len(verified) == out.stats.steps - 1, rows  # the decoding steps alone
        assert torch.equal(out.sequences, reference[:rows])
    assert len(measured) == 2
    assert len(mm.tree_table(7)) > 0 and len(measured) == 2


def test_a_batchs_step_costs_are_modelled_from_one_row_and_the_probe():
    """StepCosts.at: the measured figures at one row and at the probe's rows; for another batch the one-row cost plus
    each row past the first at the probe's cost per row, never less than one row's (a probe timed below it)."""
    costs = autotree.StepCosts(verify={1: {1: 0.010, 2: 0.012, 4: 0.020}, 4: {1: 0.013, 2: 0.024}},
                               draft={1: {1: 0.0, 2: 0.002, 4: 0.003}, 4: {1: 0.0, 2: 0.001}}, probe_rows=4)
    assert costs.at(1) == ({1: 0.010, 2: 0.012, 4: 0.020}, {1: 0.0, 2: 0.002, 4: 0.003})
    assert costs.at(4) == ({1: 0.013, 2: 0.024}, {1: 0.0, 2: 0.001})
    verify, draft = costs.at(7)  # 6 rows more, each a third of what the probe's 3 added
    assert verify == pytest.approx({1: 0.010 + 6 * 0.001, 2: 0.012 + 6 * 0.004}) and draft == {1: 0.0, 2: 0.002}
    verify, _ = costs.at(2)
    assert verify == pytest.approx({1: 0.011, 2: 0.016})


def test_a_batch_where_no_tree_pays_decodes_without_drafting(monkeypatch):
    """Step costs flat in the nodes for one row and steep for the probe's rows: one row speculates, while a batch,
    whose modelled costs say no tree pays even at the held-out accuracies, runs as tree=[] does: no drafting at all
    (not even AdaptiveTree's one guess a step), output still transformers' greedy."""
    def costs(*args, sizes, batch, **kwargs):
        if batch == 1:
            return dict.fromkeys(sizes, 0.01), dict.fromkeys(sizes, 0.0)
        return {n: 0.01 + 0.04 * (n - 1) for n in sizes}, dict.fromkeys(sizes, 0.0)

    monkeypatch.setattr(autotree, "measure_step_costs", costs)
    mm = with_accuracies()
    drafted = counting(monkeypatch, propose, "draft_with_heads")
    ids = torch.randint(3, 100, (3, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = mm.base_model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    one = mm.generate(ids[:1], max_new_tokens=8, eos_token_id=[])
    assert drafted and one.stats.tree_sizes and max(one.stats.tree_sizes) > 1
    drafted.clear()
    for rows in (2, 3):
        out = mm.generate(ids[:rows], max_new_tokens=8, eos_token_id=[])
        off = mm.generate(ids[:rows], max_new_tokens=8, eos_token_id=[], tree=[])
        assert torch.equal(out.sequences, reference[:rows]) and torch.equal(out.sequences, off.sequences)
        assert out.stats.tree_sizes is None and out.stats.steps == off.stats.steps
    assert drafted == [] and mm.default_choices(2) == []
