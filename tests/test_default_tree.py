"""generate(tree=None) picks the tree with the most expected tokens per second, its step costs measured once per
MedusaModel."""

import pytest
import torch

from medusa_spec import MedusaConfig, MedusaModel, autotree, propose
from test_eagle import eagle_heads
from tiny_models import tiny_model

ACCURACY = [[0.8, 0.1], [0.6, 0.1]]
STORED = [[1]]  # the adapter's own tree: what tree=None used before it measured, and still does without accuracies


def paths(choices):
    """Rank paths in one order (a MedusaTree sorts them by depth)."""
    return sorted(tuple(path) for path in choices)


@pytest.fixture
def measured(monkeypatch):
    """Counts the step costs' measurements (measure_costs: one row and the probe's rows), records the trees
    tree=None starts from (best_tree of choose_tree's table) and the tree each generate() drafts on."""
    calls = {"measure": 0, "chosen": [], "drafted": []}
    measure, choose, proposer = autotree.measure_costs, autotree.choose_tree, autotree.heads_proposer

    def counting_measure(*args, **kwargs):
        calls["measure"] += 1
        calls["measuring"] = True  # the timed proposers are not the ones generate drafts with
        try:
            return measure(*args, **kwargs)
        finally:
            calls["measuring"] = False

    def recording_choose(rank_accuracy, *args, **kwargs):
        tree, table = choose(rank_accuracy, *args, **kwargs)
        # tree=None starts from best_tree's row, which charges the root alone its one drafted guess: on close
        # timings it can differ from choose_tree's own pick.
        calls["chosen"].append(autotree.best_tree(table, rank_accuracy)["tree"])
        return tree, table

    def recording_proposer(base_model, heads, tree, packs=None, graphs=None):
        if not calls.get("measuring"):
            calls["drafted"].append(paths(tree.choices))
        return proposer(base_model, heads, tree, packs, graphs)

    monkeypatch.setattr(autotree, "measure_costs", counting_measure)
    monkeypatch.setattr(autotree, "choose_tree", recording_choose)
    monkeypatch.setattr(autotree, "heads_proposer", recording_proposer)
    return calls


def speculates(mm, batch=1) -> bool:
    """Whether some tree beats the root alone at the held-out accuracies for `mm`'s measured costs."""
    return autotree.choose_tree(ACCURACY, *mm._trees.step_costs(mm).at(batch))[0] != []


def with_accuracies(**config):
    return MedusaModel.from_base(tiny_model("llama"), MedusaConfig(
        num_heads=2, tree=STORED, metrics={"eval": {"rank_accuracy": ACCURACY}}, **config))


def test_tree_none_is_the_measured_tree_measured_once(measured):
    mm = with_accuracies()
    attributes = set(vars(mm.base_model))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        reference = mm.base_model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    for _ in range(2):
        out = mm.generate(ids, max_new_tokens=16, eos_token_id=[])
        assert torch.equal(out.sequences, reference)
    assert measured["measure"] == 1  # the second call reuses the costs
    chosen = mm.default_choices()
    assert {tuple(paths(c)) for c in measured["chosen"]} == {tuple(paths(chosen))}  # each call, one start
    # (Where this machine's timings choose the root alone, the heads still draft their top guess, [[0]], unless no
    # tree pays even at the held-out accuracies: then nothing is drafted, as with tree=[].)
    assert measured["drafted"] == ([paths(chosen or [[0]])] * 2 if speculates(mm) else [])
    assert measured["measure"] == 1
    # The measured tree is this MedusaModel's: nothing is set on the base model; a new MedusaModel measures again.
    assert set(vars(mm.base_model)) == attributes
    with_accuracies().default_choices()
    assert measured["measure"] == 2


def test_the_choice_follows_the_measured_costs(monkeypatch, measured):
    """With every verify pass and drafting step costing the same, the largest tree the accuracies allow wins."""
    flat = {n: 0.01 for n in autotree.CANDIDATE_SIZES}
    monkeypatch.setattr(autotree, "measure_step_costs", lambda *args, **kwargs: (flat, dict.fromkeys(flat, 0.0)))
    mm = with_accuracies()
    mm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4)
    largest, _ = autotree.choose_tree(ACCURACY, flat, dict.fromkeys(flat, 0.0))
    assert measured["drafted"] == [paths(largest)] and len(largest) == 5  # 6 nodes: CANDIDATE_SIZES' most for 2 x 2


def test_a_model_moved_to_another_dtype_measures_again(monkeypatch):
    """The measured table is kept per device and dtype. Costs that favour the largest tree in float32 and no
    speculation in float64 (verify time growing with the nodes) make the two choices differ whatever this
    machine's timings are."""
    dtypes = []

    def by_dtype(mm, *args, sizes, **kwargs):
        dtype = next(mm.base_model.parameters()).dtype
        dtypes.append(dtype)
        latency = {n: 0.01 if dtype == torch.float32 else 0.01 * n for n in sizes}
        return latency, dict.fromkeys(sizes, 0.0)

    monkeypatch.setattr(autotree, "measure_step_costs", by_dtype)
    mm = with_accuracies()
    first = mm.default_choices()
    assert len(first) > 1  # flat costs choose the largest tree AUTO_SIZES and the accuracies allow
    mm.to(torch.float64)
    timed = [torch.float32, torch.float64]  # one row for each (a batch would time the probe's rows)
    assert mm.default_choices() == [] and dtypes == timed
    mm.to(torch.float32)
    assert mm.default_choices() == first and dtypes == timed  # kept, not measured again


def test_a_batch_is_modelled_from_the_costs_timed_once(monkeypatch, measured):
    """A batch of B verifies B x nodes rows: the costs are timed once, for one row and for the probe's rows (the real
    passes), and every batch size's tree is modelled from them (here: flat costs for one row favour the largest tree,
    a probe whose rows each add a pass's cost a node favours no speculation for a batch, which then drafts nothing)."""
    sizes = []
    measure = autotree.measure_step_costs

    def by_batch(*args, batch=1, **kwargs):
        sizes.append(batch)
        latency, draft = measure(*args, batch=batch, **kwargs)  # the real passes, with B rows
        if batch == 1:
            return dict.fromkeys(latency, 0.01), dict.fromkeys(latency, 0.0)
        return {n: 0.01 + 0.04 * (n - 1) for n in latency}, dict.fromkeys(latency, 0.0)

    monkeypatch.setattr(autotree, "measure_step_costs", by_batch)
    mm = with_accuracies()
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    for rows in (ids[:1], ids, ids, ids[1:]):
        mm.generate(rows, max_new_tokens=4, eos_token_id=[])
    assert sizes == [1, autotree.PROBE_ROWS]
    assert measured["drafted"] == [paths(mm.default_choices(1))] * 2
    assert len(mm.default_choices(1)) > 1 and mm.default_choices(2) == []


def test_without_accuracies_the_stored_tree_and_no_measurement(measured):
    mm = MedusaModel.from_base(tiny_model("llama"), MedusaConfig(num_heads=2, tree=STORED))
    mm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4)
    assert measured["measure"] == 0 and measured["drafted"] == [paths(STORED)]


def test_measuring_leaves_seeded_sampling_as_with_the_tree_passed(measured):
    """The timing passes draw random tokens from their own generator, so a seeded first call samples what a
    call given the chosen tree explicitly samples (8 tokens: fewer steps than the first re-choice takes)."""
    mm = with_accuracies()
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.manual_seed(0)
    first = mm.generate(ids, max_new_tokens=autotree.ADAPT_EVERY, eos_token_id=[], do_sample=True, temperature=1.5)
    assert measured["measure"] == 1
    # The tree the first call started from: default_choices (best_tree, which charges the root alone its one
    # drafted guess, so it may differ from choose_tree's pick on a busy machine), and [[0]] for the root alone;
    # none where no tree pays at the held-out accuracies (then it ran as tree=[]).
    started = (mm.default_choices() or [[0]]) if speculates(mm) else []
    assert measured["drafted"] == ([paths(started)] if started else [])
    torch.manual_seed(0)
    again = mm.generate(ids, max_new_tokens=autotree.ADAPT_EVERY, eos_token_id=[], do_sample=True, temperature=1.5,
                        tree=started)
    assert torch.equal(first.sequences, again.sequences)


# Costs that grow with the tree: worth a large tree for the held-out ACCURACY, not for heads that guess wrong.
GROWING = {n: 0.010 * (1 + 0.3 * n) for n in autotree.CANDIDATE_SIZES}


def growing_table():
    return autotree.choose_tree(ACCURACY, GROWING, dict.fromkeys(GROWING, 0.0))[1]


def test_the_heads_accuracy_on_the_text_moves_the_choice():
    """calibrated_accuracy weighs the held-out rate as PRIOR_ROW_STEPS row-steps: a few misses move little, many
    move the choice to the root alone; guesses right more often than held out move it to a larger tree."""
    table = growing_table()
    prior = autotree.best_tree(table, ACCURACY)
    assert prior["nodes"] > 1
    assert autotree.calibrated_accuracy(ACCURACY, hits=0, seen=0) == ACCURACY
    assert autotree.best_tree(table, autotree.calibrated_accuracy(ACCURACY, hits=0, seen=4))["nodes"] > 1
    assert autotree.best_tree(table, autotree.calibrated_accuracy(ACCURACY, hits=0, seen=64))["tree"] == []
    low = [[0.2, 0.05], [0.2, 0.05]]  # held out: the root alone, until the heads prove better on this text
    assert autotree.best_tree(table, low)["tree"] == []
    right = autotree.calibrated_accuracy(low, hits=64, seen=64)
    assert right[0][0] == pytest.approx((64 + 16 * 0.2) / (80 * 0.2) * 0.2)
    assert autotree.best_tree(table, right)["nodes"] > 1


def test_tree_none_drops_to_the_root_alone_where_the_heads_miss(monkeypatch):
    """Untrained heads on a random model almost never guess the next token: a tree chosen for the held-out
    accuracy gives way to the root alone within a few re-choices, the output still transformers' greedy."""
    monkeypatch.setattr(autotree, "measure_step_costs", lambda *args, **kwargs: (GROWING, dict.fromkeys(GROWING, 0.0)))
    mm = with_accuracies()
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.no_grad():
        reference = mm.base_model.generate(ids, max_new_tokens=96, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = mm.generate(ids, max_new_tokens=96, eos_token_id=[])
    assert torch.equal(out.sequences, reference)
    sizes = out.stats.tree_sizes
    assert len(sizes) == out.stats.steps - 1  # every step after the prefill
    assert sizes[0] == autotree.best_tree(growing_table(), ACCURACY)["nodes"] > 1
    assert sizes[-1] == 1 and sizes.index(1) % autotree.ADAPT_EVERY == 0
    # An explicit tree is kept as given.
    fixed = mm.generate(ids, max_new_tokens=96, eos_token_id=[], tree=[[0], [0, 0]])
    assert fixed.stats.tree_sizes is None and torch.equal(fixed.sequences, reference)


class Guesses(propose.Proposer):
    """Drafts `guess[b]` at every node of row b: the test decides which rows' heads are right."""

    def __init__(self, guess: torch.Tensor):
        self.guess = guess

    def propose_on(self, root, tree):
        node_tokens = self.guess[:, None].expand(-1, tree.num_nodes).clone()
        node_tokens[:, 0] = root
        return propose.Candidates(node_tokens, tree)

    def keep_rows(self, rows):
        self.guess = self.guess[rows]


def test_a_batch_adapts_to_the_row_the_heads_serve_worst():
    """A batch runs until its last row is done: with one row always guessed right and one never, the tree follows
    the row that misses (the batch's mean hit rate would keep a tree), and once that row is done, the other."""
    table = growing_table()
    guess = torch.tensor([7, 7])
    adaptive = autotree.AdaptiveTree(Guesses(guess), table, ACCURACY)
    root = torch.tensor([1, 1])
    adaptive.start(propose.Prompt(root[:, None], torch.ones(2, 1, dtype=torch.bool), None, root, None))

    def steps(n, going):
        for _ in range(n):
            adaptive.propose(root)
            new_tokens = torch.tensor([[7], [8]])  # row 0's next token is the guess, row 1's is not
            active = torch.tensor(going)
            host = propose.HostStep([0, 0], going, [[7], [8]], going)
            adaptive.update(propose.StepResult(None, None, None, None, None, new_tokens, active, active, host))

    steps(64, [True, True])
    assert adaptive.sizes[0] > 1 and adaptive.sizes[-1] == 1  # row 1's 0 hits in 64 steps: the root alone
    mean = autotree.calibrated_accuracy(ACCURACY, hits=64, seen=128)
    assert autotree.best_tree(table, mean)["nodes"] > 1  # what the batch's mean would have kept
    steps(8, [True, False])
    adaptive.propose(root)
    assert adaptive.sizes[-1] > 1  # row 1 is done: row 0's guesses, all right, set the tree


@pytest.mark.parametrize("head_type", ["medusa", "eagle"])
def test_the_first_calls_timing_neither_draws_from_nor_rewinds_the_global_generator(head_type, monkeypatch):
    """The timing passes draw their random tokens from a generator of their own: the process-wide one is not drawn
    from, and what another thread draws from it meanwhile stays drawn (fork_rng would rewind it on leaving, and
    fork only the CPU and CUDA generators)."""
    mm = with_accuracies() if head_type == "medusa" else eagle_heads(tiny_model("llama"), num_heads=2)
    prefill, draws = autotree.prefill, []

    def prefill_while_another_thread_draws(*args, **kwargs):
        draws.append(torch.rand(3))  # another thread's draw from the process-wide generator, meanwhile
        return prefill(*args, **kwargs)

    def no_fork(*args, **kwargs):
        raise AssertionError("fork_rng forks the process-wide generators")

    monkeypatch.setattr(autotree, "prefill", prefill_while_another_thread_draws)
    monkeypatch.setattr(torch.random, "fork_rng", no_fork)
    torch.manual_seed(0)
    mm.tree_table() if head_type == "medusa" else mm.dynamic_tree()
    after = torch.get_rng_state()
    torch.manual_seed(0)
    for _ in draws:  # the other thread's draws alone
        torch.rand(3)
    assert draws and torch.equal(after, torch.get_rng_state())


def test_when_rows_leave_the_batch_the_tree_is_chosen_from_the_smaller_batchs_table():
    """Two rows share a small tree (their passes cost more per node); once one finishes and leaves the batch
    (keep_rows), the other's tree is chosen at once from the one-row table, for the evidence of that row alone."""
    one_row = autotree.choose_tree(ACCURACY, {1: 0.01, 2: 0.01, 4: 0.01}, 0.0)[1]
    two_rows = autotree.choose_tree(ACCURACY, {1: 0.01, 2: 0.012, 4: 0.03}, 0.0)[1]
    adaptive = autotree.AdaptiveTree(Guesses(torch.tensor([7, 7])), two_rows, ACCURACY, {1: one_row})
    root = torch.tensor([1, 1])
    adaptive.start(propose.Prompt(root[:, None], torch.ones(2, 1, dtype=torch.bool), None, root, None))
    for _ in range(3):
        adaptive.propose(root)
        new_tokens, going = torch.tensor([[7], [7]]), torch.tensor([True, True])  # both rows' heads right
        host = propose.HostStep([0, 0], [True, True], [[7], [7]], [True, True])
        adaptive.update(propose.StepResult(None, None, None, None, None, new_tokens, going, going, host))
    assert adaptive.sizes == [2, 2, 2]
    adaptive.keep_rows(torch.tensor([1]))
    adaptive.propose(root[1:])
    row_alone = autotree.calibrated_accuracy(ACCURACY, hits=3, seen=3)
    assert adaptive.sizes[-1] == autotree.best_tree(one_row, row_alone)["nodes"] == 4
    assert autotree.best_tree(two_rows, row_alone)["nodes"] == 2  # what the two rows' table would have kept
