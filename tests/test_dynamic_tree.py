"""Eagle heads on dynamic trees (tree.DynamicTree, propose.DynamicDraftLayerProposer): each step's tree is the
candidates a plain per-row beam search rates best, each node holds what the draft layer drafts down its own path,
decoding through such trees is lossless, and with step costs the size follows the draft's confidence."""

from __future__ import annotations

import time

import pytest
import torch

from medusa_spec import DynamicTree, MedusaConfig, MedusaModel, autotree, loop
from medusa_spec.eagle import DraftLayer
from medusa_spec.inputs import resolve_sampling
from medusa_spec.kv_cache import new_cache
from medusa_spec.lookup import with_lookup
from medusa_spec.loop import decode
from medusa_spec.propose import DynamicDraftLayerProposer, Prompt
from medusa_spec.slots import prefill
from test_dependent_heads import assert_samples_follow_the_base, random_heads
from test_eagle import eagle_heads, run_chain
from test_generate import left_padded, prompt, reference_generate
from test_sampling import SETTINGS
from tiny_models import tiny_model


def reference_tree(mm, ids, mask, hidden, root, nodes, top_k, beam):
    """The step's tree by brute force: every candidate's tokens and path log-probabilities row by row, each beam
    node's draft-layer output from running the layer down the node's own path alone (run_chain); candidates rank
    by their probability summed over the rows, never above their parent's. Returns (parent and depth of each node,
    node tokens [B, N], {(row, path of candidate indices): output} for the beam's slots). The proposer gives each
    row what this gives for that row alone."""
    embed, lm_head = mm.base_model.get_input_embeddings(), mm.base_model.get_output_embeddings()
    rows = range(ids.shape[0])
    real = [mask[b].bool() for b in rows]
    texts = [torch.cat([ids[b, real[b]], root[b: b + 1]]) for b in rows]

    def down(b, path_tokens):
        next_embeds = embed(torch.cat([texts[b][1:], torch.tensor(path_tokens, dtype=torch.long)]))
        states = mm.heads.features(hidden[b, real[b]])
        return run_chain(mm.heads.draft_layer, states, next_embeds, torch.arange(len(states)), len(path_tokens) + 1)[-1]

    candidates = []  # dicts: parent (candidate index or None), depth, tokens [per row], logp [per row], value
    beam_nodes = [None]
    outputs = {}
    for d in range(1, mm.heads.num_heads + 1):
        level = []
        for parent in beam_nodes:
            path = [] if parent is None else path_of(candidates, parent)
            per_row = []
            for b in rows:
                out = down(b, [candidates[c]["tokens"][b] for c in path])
                if path:
                    outputs[b, tuple(path)] = out
                logp = mm.heads.draft_logits(d - 1, out, lm_head).float().log_softmax(-1).topk(top_k)
                base = 0.0 if parent is None else candidates[parent]["logp"][b]
                per_row.append([(int(mm.heads.token_ids(i)), base + float(v))
                                for v, i in zip(logp.values, logp.indices)])
            for r in range(top_k):
                logps = [per_row[b][r][1] for b in rows]
                value = sum(torch.tensor(logps).exp().tolist())
                if parent is not None:
                    value = min(value, candidates[parent]["value"])
                level.append({"parent": parent, "depth": d, "tokens": [per_row[b][r][0] for b in rows],
                              "logp": logps, "value": value})
        first = len(candidates)
        candidates += level
        beam_nodes = sorted(range(first, len(candidates)), key=lambda c: -candidates[c]["value"])[:beam]
    best = sorted(sorted(range(len(candidates)), key=lambda c: -candidates[c]["value"])[: nodes - 1])
    node_of = {None: 0} | {c: i + 1 for i, c in enumerate(best)}
    parents = [0] + [node_of[candidates[c]["parent"]] for c in best]
    depths = [0] + [candidates[c]["depth"] for c in best]
    tokens = torch.tensor([[int(root[b])] + [candidates[c]["tokens"][b] for c in best] for b in rows])
    return parents, depths, tokens, outputs


def path_of(candidates, c):
    path = []
    while c is not None:
        path.insert(0, c)
        c = candidates[c]["parent"]
    return path


def started(mm, ids, mask, root, tree):
    """A DynamicDraftLayerProposer on mm's own heads, started after a prefill of ids, as the decoding loop starts it."""
    _, hidden, _ = prefill(mm.base_model, mm.spec, ids, mask, new_cache(), feature_layers=mm.heads.feature_layers)
    proposer = DynamicDraftLayerProposer(mm.base_model, mm.heads, tree)
    proposer.start(Prompt(ids, mask, hidden, root, None))
    return proposer, hidden


@pytest.mark.parametrize("nodes, top_k, beam", [(6, 2, 2), (10, 3, 2), (12, 4, 3)])
def test_the_tree_is_what_a_per_row_beam_search_rates_best(nodes, top_k, beam):
    """A left-padded batch of two rows, each with its own beam and tree: each row's tree shape, node tokens and the
    draft layer's output at each of its beam slots against reference_tree for that row alone (so the beam's slots,
    masks and positions are right for siblings and cousins, each row on its own paths), and each row's tree masks
    against its parents."""
    model = tiny_model("llama")
    # Heads sharp enough that the two rows rank the candidates below depth 1 differently: their trees differ.
    mm = random_heads(model, seed=2, scale=1.0, head_type="eagle", num_heads=3, draft_vocab_size=40)
    ids, mask = left_padded([prompt(seed=4)[0, :9], prompt(seed=5)[0, :6]])
    mask, root = mask.bool(), torch.tensor([11, 3])
    slot_outputs = []
    forward = mm.heads.draft_layer.forward
    with torch.no_grad():
        proposer, hidden = started(mm, ids, mask, root, DynamicTree(nodes, top_k, beam))
        mm.heads.draft_layer.forward = lambda *args, **kwargs: slot_outputs.append(forward(*args, **kwargs)) or \
            slot_outputs[-1]
        candidates = proposer.propose(root)
        del mm.heads.draft_layer.forward
        alone = [reference_tree(mm, ids[b: b + 1], mask[b: b + 1], hidden[b: b + 1], root[b: b + 1], nodes, top_k,
                                beam) for b in range(2)]
    tree = candidates.tree
    drafted = torch.cat(slot_outputs, dim=1)  # [B, beam slots, H], in the order they were drafted
    for b, (parents, depths, tokens, outputs) in enumerate(alone):
        assert tree.parent[b].tolist() == parents and tree.depth[b].tolist() == depths and max(depths) >= 2
        assert torch.equal(candidates.node_tokens[b], tokens[0])
        expected_mask = torch.eye(nodes, dtype=torch.bool)
        for i in range(1, nodes):
            expected_mask[i] |= expected_mask[parents[i]]
        assert torch.equal(tree.tree_mask[b], expected_mask)
        assert torch.equal(tree.node_paths[b, torch.arange(nodes), tree.depth[b]], torch.arange(nodes))
        paths = list(outputs.values())  # by depth, then as the beam ranked them
        assert drafted.shape[1] == len(paths)
        for i, output in enumerate(paths):
            # 1e-3: the beam's batched pass and the reference's one-path passes sum in other orders (on an x86 CPU
            # without AVX-512 they differed by up to 1.1e-4 on values near 2); a wrong slot differs by about 1.
            assert torch.allclose(drafted[b, i], output, atol=1e-3), (b, i)
    assert alone[0][0] != alone[1][0]  # the rows' trees differ: one shared tree would fail the checks above


# Seeds whose random heads draft something the base accepts (asserted below).
@pytest.mark.parametrize(("arch", "head_type", "seed"), [("llama", "eagle", 1), ("qwen3", "eagle", 1),
                                                         ("llama", "eagle3", 2), ("gemma3", "eagle3", 9)])
def test_decoding_on_dynamic_trees_is_lossless(arch, head_type, seed):
    """A left-padded batch of rows of different lengths, each row's greedy text as transformers gives it alone: on
    fixed-size dynamic trees, beside a lookup chain, and with tree=None (one row: step costs measured, the size
    chosen each step)."""
    model = tiny_model(arch)
    mm = eagle_heads(model, num_heads=3, head_type=head_type, seed=seed)
    rows = [prompt(seed=6)[0, :10], prompt(seed=7)[0, :5]]
    ids, mask = left_padded(rows)
    new = 24
    texts = [reference_generate(model, row[None], max_new_tokens=new, eos_token_id=None)[0] for row in rows]
    documents = [text[len(row) + 8:].tolist() for text, row in zip(texts, rows)]
    runs = {"dynamic 9": dict(tree=DynamicTree(9)), "dynamic 5, top-2 beam-2": dict(tree=DynamicTree(5, 2, 2)),
            "with lookup": dict(tree=DynamicTree(9), lookup_tokens=4, documents=documents)}
    for name, options in runs.items():
        out = mm.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=[], **options)
        for b, row in enumerate(rows):
            assert torch.equal(out.sequences[b, ids.shape[1]:], texts[b][len(row):]), (name, b)
        assert out.stats.tree_sizes and len(out.stats.tree_sizes) == out.stats.steps - 1, name
        assert sum(out.stats.accepted_at_depth) > 0, name  # some row took a node: the trees' tokens were read
    # tree=None: one row drafts a dynamic tree, a batch keeps the static trees (see MedusaModel.generate).
    out = mm.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=[])
    assert all(torch.equal(out.sequences[b, ids.shape[1]:], texts[b][len(row):]) for b, row in enumerate(rows))
    dynamic_costs = (torch.device("cpu"), torch.float32, True)  # the dynamic tree's step costs, on this device
    assert dynamic_costs not in mm._trees.costs
    out = mm.generate(rows[0][None], max_new_tokens=new, eos_token_id=[])
    assert torch.equal(out.sequences[0], texts[0]) and len(out.stats.tree_sizes) == out.stats.steps - 1
    assert set(mm._trees.costs) == {dynamic_costs}


@pytest.mark.parametrize("head_type", ["eagle", "eagle3"])
@pytest.mark.parametrize("sampling", SETTINGS[1:3], ids=str)
def test_sampling_on_dynamic_trees_matches_the_base(sampling, head_type):
    model = tiny_model("llama", vocab_size=6)
    mm = MedusaModel.from_base(model, MedusaConfig(num_heads=2, head_type=head_type, draft_vocab_size=4,
                                                   share_lm_head=head_type != "eagle3"))
    mm.heads.set_token_map(torch.tensor([4, 1, 0, 3]), model.get_output_embeddings())
    assert_samples_follow_the_base(mm, torch.tensor([[3, 5, 4, 1]]), sampling, tree=DynamicTree(5, top_k=2, beam=2))


def test_the_size_is_the_one_with_the_most_expected_tokens_per_ms():
    """Two rows generating: n nodes expect 2 tokens plus the n - 1 best probabilities, times the scale (matched + 8)
    / (foretold + 8)."""
    model = tiny_model("llama")
    mm = eagle_heads(model, num_heads=3)
    ids, mask = left_padded([prompt(seed=4)[0, :9], prompt(seed=5)[0, :6]])
    step_ms = (10.0, 11.0, 12.0, 13.0, 30.0)
    proposer, _ = started(mm, ids, mask.bool(), torch.tensor([1, 2]), DynamicTree(5, step_ms=step_ms))
    ordered = [1.6, 1.2, 0.5, 0.4, 0.3]
    rates = lambda scale: [(2 + scale * sum(ordered[: n - 1])) / step_ms[n - 1] for n in range(1, 6)]  # noqa: E731
    assert proposer.size(ordered, matched=0.0) == 1 + max(range(5), key=lambda i: rates(1.0)[i]) == 4
    proposer.foretold = 120.0  # the probabilities foretold 120 tokens where none matched: no node pays
    assert proposer.size(ordered, matched=0.0) == 1 + max(range(5), key=lambda i: rates(8 / 128)[i]) == 1
    assert proposer.size(ordered, matched=112.0) == 1 + max(range(5), key=lambda i: rates(120 / 128)[i]) == 4
    unpriced, _ = started(mm, ids, mask.bool(), torch.tensor([1, 2]), DynamicTree(4))
    assert unpriced.size(ordered, matched=0.0) == 4


class Recording(DynamicDraftLayerProposer):
    """Keeps, per step, the increase of the matched count, and what it should be: summed over the rows generating,
    the depth of the deepest node whose path's tokens are the row's first emitted tokens (accepted ones and the
    bonus, cut at the budget)."""

    def start(self, prompt):
        super().start(prompt)
        self.counted, self.expected = [], []

    def update(self, step):
        expected = 0
        if self.tree.num_nodes > 1:
            parents, tokens = self.tree.parent.tolist(), self.node_tokens.tolist()  # each row's own tree
            for b, active in enumerate(step.host.active):
                emitted, reached = step.host.emitted[b], 0
                for i in range(1, len(parents[b])):
                    path, node = [], i
                    while node:
                        path.insert(0, tokens[b][node])
                        node = parents[b][node]
                    if emitted[: len(path)] == path:
                        reached = max(reached, len(path))
                expected += reached if active else 0
        self.expected.append(expected)
        before = float(self.matched)
        super().update(step)
        self.counted.append(float(self.matched) - before)


def test_the_scale_counts_how_deep_the_emitted_tokens_run_along_the_tree():
    """Beside a lookup chain into the base's own text (so some steps emit what the chain, not the tree, held) and
    rows that finish at different steps."""
    model = tiny_model("llama")
    mm = eagle_heads(model, num_heads=3)
    rows = [prompt(seed=8)[0, :9], prompt(seed=9)[0, :6]]
    ids, mask = left_padded(rows)
    texts = [reference_generate(model, row[None], max_new_tokens=20, eos_token_id=None)[0] for row in rows]
    documents = [text[len(row) + 6:].tolist() for text, row in zip(texts, rows)]
    recording = Recording(model, mm.heads, DynamicTree(7))
    out = decode(model, mm.spec, with_lookup(recording, 4, documents, mm.spec.vocab_size), ids, mask.bool(), 20,
                 resolve_sampling(model, False, None, None, None), [], 0)
    for b, row in enumerate(rows):
        assert torch.equal(out.sequences[b, ids.shape[1]:], texts[b][len(row):])
    assert recording.counted == recording.expected and sum(recording.expected) > 0
    assert out.stats.lookup_accepted > 0


def test_a_dynamic_tree_needs_eagle_heads_and_sound_settings():
    model = tiny_model("llama")
    mm = MedusaModel.from_base(model, MedusaConfig(num_heads=2))
    with pytest.raises(ValueError, match=r"a DynamicTree needs eagle heads \(head_type='eagle'\)"):
        mm.generate(prompt(), max_new_tokens=4, tree=DynamicTree(4))
    eagle = eagle_heads(model, num_heads=2, draft_vocab_size=40)
    with pytest.raises(ValueError, match=r"DynamicTree top_k=41 is more than the heads' 40 candidate tokens; use "
                                         r"top_k <= 40"):
        eagle.generate(prompt(), max_new_tokens=4, tree=DynamicTree(4, top_k=41))
    with pytest.raises(ValueError, match="DynamicTree: beam must be an integer >= 1, got 0"):
        DynamicTree(4, beam=0)
    with pytest.raises(ValueError, match=r"step_ms holds 2 costs, one per tree size 1 .. nodes=4 needed"):
        DynamicTree(4, step_ms=(1.0, 2.0))


def test_tree_none_prices_every_size_from_timed_dynamic_steps(monkeypatch):
    """dynamic_tree times dynamic steps at 1, 2, 4, ... nodes up to as many as the beam drafts (3 heads, top-4,
    beam 4: 4 + 2 x 16 candidates), takes for each size the least time of it or any larger one (a smaller tree never
    costs more; a larger timing below it was a busy moment), interpolates between them; at the first batch the
    probe's rows time the sizes up to 64 / PROBE_ROWS nodes once, and another batch size is priced from both without
    timing."""
    mm = eagle_heads(tiny_model("llama"), num_heads=3)
    calls = []
    seconds = {1: 0.040, 2: 0.050, 4: 0.030, 8: 0.050, 16: 0.060, 32: 0.080, 37: 0.090}

    def measure(model, sizes, context, repeats, rank_accuracy, batch, packs, dynamic, time_verify):
        calls.append((tuple(sizes), batch, dynamic))
        return {n: seconds[n] * (1 if batch == 1 else 2) for n in sizes}, dict.fromkeys(sizes, 0.005)

    monkeypatch.setattr(autotree, "measure_step_costs", measure)
    tree = mm.dynamic_tree(1)
    assert calls == [((1, 2, 4, 8, 16, 32, 37), 1, True)]
    assert tree.nodes == 37 and len(tree.step_ms) == 37
    assert [round(tree.step_ms[n - 1], 6) for n in (1, 2, 3, 4, 6, 8, 16, 24, 37)] == \
        [35.0, 35.0, 35.0, 35.0, 45.0, 55.0, 65.0, 75.0, 95.0]
    assert mm.dynamic_tree(1) == tree and len(calls) == 1
    # Two rows: each row past the first adds a third of what the probe's 3 added, up to the probe's 16 nodes.
    two = mm.dynamic_tree(2)
    assert calls[1:] == [((1, 2, 4, 8, 16), autotree.PROBE_ROWS, True)] and two.nodes == 16
    assert mm.dynamic_tree(3) and len(calls) == 2
    assert [round(two.step_ms[n - 1], 6) for n in (1, 4, 8, 16)] == \
        [round(1000 * (4 / 3 * seconds[4] + 0.005), 6)] * 2 + [round(1000 * (4 / 3 * s + 0.005), 6)
                                                              for s in (seconds[8], seconds[16])]


def test_eagle_batches_time_only_their_drafting_after_the_dynamic_trees(monkeypatch):
    """A batch's static trees verify as the dynamic trees do: after a one-row call (whose dynamic trees timed the
    verify passes; the probe's rows at the first batch), a batch times its trees' drafting alone and prices them with
    the dynamic trees' verify passes;
    another batch size times nothing; every row's text is transformers'."""
    model = tiny_model("llama")
    mm = eagle_heads(model, num_heads=3, metrics={"eval": {"rank_accuracy": [[0.6, 0.2, 0.1, 0.05]] * 3}})
    calls, passes, measure, verify, prefill = [], [], autotree.measure_step_costs, loop.verify, autotree.prefill

    def counting(*args, **kwargs):
        calls.append((kwargs["batch"], kwargs["dynamic"], kwargs.get("time_verify", True)))
        before = len(passes)
        costs = measure(*args, **kwargs)
        assert calls[-1][2] or len(passes) == before  # timing the drafting alone runs the base model not once
        return costs

    monkeypatch.setattr(autotree, "measure_step_costs", counting)
    monkeypatch.setattr(loop, "verify", lambda *args, **kwargs: passes.append(1) or verify(*args, **kwargs))
    monkeypatch.setattr(autotree, "prefill", lambda *args, **kwargs: passes.append(1) or prefill(*args, **kwargs))
    rows = [prompt(seed=6)[0, :10], prompt(seed=7)[0, :5], prompt(seed=8)[0, :7]]
    texts = [reference_generate(model, row[None], max_new_tokens=16, eos_token_id=None)[0] for row in rows]
    assert torch.equal(mm.generate(rows[0][None], max_new_tokens=16, eos_token_id=[]).sequences[0], texts[0])
    probe = autotree.PROBE_ROWS
    assert calls == [(1, True, True)]  # the probe's rows wait for a batch
    for batch in (2, 3):
        ids, mask = left_padded(rows[:batch])
        out = mm.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=[])
        for b, row in enumerate(rows[:batch]):
            assert torch.equal(out.sequences[b, ids.shape[1]:], texts[b][len(row):]), (batch, b)
        # Once, at the first batch: the probe's verify passes (dynamic trees), then the static trees' drafting alone.
        assert calls[1:] == [(probe, True, True), (1, False, False), (probe, False, False)]
    static, dynamic = (mm._trees.costs[torch.device("cpu"), torch.float32, kind] for kind in (False, True))
    # The sizes a batch chooses from (those the probe timed), at the dynamic trees' verify seconds.
    sizes = set(dynamic.verify[probe])
    assert set(static.verify[1]) == set(static.draft[1]) == set(static.verify[probe]) == set(static.draft[probe]) \
        == sizes
    assert all(static.verify[rows][n] == dynamic.verify[rows][n] for rows in (1, probe) for n in sizes)


# Step costs under which these random heads' trees take 1 to 4 nodes and never 5 or more (a fifth node costs 4x).
PRICED = DynamicTree(8, step_ms=(10.0, 10.2, 10.4, 10.6, 40.0, 60.0, 80.0, 100.0))


@pytest.mark.parametrize(("tree", "rows"), [(DynamicTree(3), 1), (PRICED, 1), (PRICED, 2)])
def test_drafting_stops_where_no_deeper_candidate_could_enter_the_tree(monkeypatch, tree, rows):
    """4 levels of heads, a tree of 3 nodes or a priced tree of up to 8: drafting stops at the level past which no
    candidate could be chosen or, priced, no larger size could pay (fewer draft-layer passes than the first test
    alone gives), and every step's tree is the one that drafting every level gives, in each row of a batch too."""
    model = tiny_model("llama")
    mm = eagle_heads(model, num_heads=4)
    texts = [prompt(seed=6)[0, :10], prompt(seed=7)[0, :6]][:rows]
    ids, mask = left_padded(texts)
    texts = [reference_generate(model, row[None], max_new_tokens=24, eos_token_id=None)[0, len(row):] for row in texts]
    propose, forward = DynamicDraftLayerProposer.propose, DraftLayer.forward
    runs = {}
    for stop in ("as it is", "nodes only", "never"):
        steps, passes = [], []

        def recording_propose(self, root):
            candidates = propose(self, root)
            steps.append((candidates.node_tokens.clone(), candidates.tree.parent.clone()))
            return candidates

        monkeypatch.setattr(DynamicDraftLayerProposer, "propose", recording_propose)
        monkeypatch.setattr(DraftLayer, "forward", lambda *args, **kwargs: passes.append(1) or forward(*args, **kwargs))
        if stop == "never":
            monkeypatch.setattr(DynamicDraftLayerProposer, "complete", lambda self, values, value: False)
        if stop == "nodes only":
            monkeypatch.setattr(DynamicDraftLayerProposer, "size_settled", lambda *args: False)
        out = mm.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=[], tree=tree)
        assert all(torch.equal(out.sequences[b, ids.shape[1]:], text) for b, text in enumerate(texts))
        runs[stop] = steps, len(passes), out.stats.tree_sizes
        monkeypatch.undo()
    (stopped, stopped_passes, sizes), (full, full_passes, _) = runs["as it is"], runs["never"]
    assert len(stopped) == len(full)
    assert all(torch.equal(a, b) for step, other in zip(stopped, full) for a, b in zip(step, other))
    assert stopped_passes < full_passes
    if tree.step_ms is not None:
        assert len(set(sizes)) > 2 and max(sizes) < 5  # sizes chosen, below the costly ones
        assert stopped_passes < runs["nodes only"][1]


def test_a_settled_size_is_what_any_deeper_candidates_would_give():
    """size_settled against brute force: two rows, two levels drafted, then random deeper candidates, each worth at
    most its row's best at the last level. Where the size is settled, the size and each row's chosen candidates
    with the deeper ones are those without them."""
    model = tiny_model("llama")
    mm = eagle_heads(model, num_heads=3)
    ids, mask = left_padded([prompt(seed=4)[0, :9], prompt(seed=5)[0, :6]])
    # A millisecond a node: whether a node pays depends on its probability.
    proposer, _ = started(mm, ids, mask.bool(), torch.tensor([1, 2]),
                          DynamicTree(8, step_ms=tuple(10.0 + n for n in range(8))))
    proposer.matched, proposer.foretold = torch.tensor(6.0), 9.0
    generator = torch.Generator().manual_seed(0)

    def choice(values):
        order = torch.sort(values, dim=1, descending=True, stable=True)
        n = proposer.size(order.values.sum(0).tolist(), float(proposer.matched))
        return n, [set(row) for row in order.indices[:, : n - 1].tolist()]

    settled = 0
    for _ in range(400):
        levels = [torch.rand(2, 4, generator=generator) ** 3 for _ in range(2)]
        levels[1] = torch.minimum(levels[1], levels[0].amax(1, keepdim=True))  # below a parent of the level above
        so_far, level_best = torch.cat(levels, dim=1), levels[1].amax(1)
        if not proposer.size_settled(so_far, level_best, torch.zeros(2, dtype=torch.bool)):
            continue
        settled += 1
        for low in (0.0, 0.9, 0.99):  # deeper candidates anywhere below the bound, then close to it
            deeper = (low + (1 - low) * torch.rand(2, 8, generator=generator)) * level_best[:, None]
            assert choice(torch.cat([so_far, deeper], dim=1)) == choice(so_far)
    assert 5 < settled < 395  # both answers came up


def test_compiled_dynamic_trees_price_each_block_plus_one_drafting_figure(monkeypatch):
    """generate(tree=None, compile=True) prices a size at its block's compiled pass plus the least drafting time
    timed: every size drafts the same levels, and a larger timing was a busy moment."""
    mm = eagle_heads(tiny_model("llama"), num_heads=3)
    verify = {1: 0.020, 2: 0.021, 4: 0.025, 8: 0.033}
    monkeypatch.setattr(autotree, "measure_compiled_verify", lambda mm, compiled, blocks, repeats: verify)
    tree = autotree.compiled_dynamic_tree(mm, None, {1: 0.012, 2: 0.003, 8: 0.004})
    assert tree.nodes == 8
    assert [round(ms, 6) for ms in tree.step_ms] == [23.0, 24.0, 28.0, 28.0, 36.0, 36.0, 36.0, 36.0]


def test_measured_dynamic_steps_time_the_dynamic_drafting(monkeypatch):
    """On a clock that only the dynamic proposer's propose moves (a millisecond a node of its size), each size's
    drafting time is its node count in milliseconds."""
    mm = eagle_heads(tiny_model("llama"), num_heads=2)
    proposed, clock = [], [0.0]
    propose = DynamicDraftLayerProposer.propose

    def timed_propose(self, root):
        proposed.append(self.dynamic.nodes)
        clock[0] += 0.001 * self.dynamic.nodes
        return propose(self, root)

    monkeypatch.setattr(DynamicDraftLayerProposer, "propose", timed_propose)
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    latency, drafting = autotree.measure_step_costs(mm, sizes=(1, 3, 5), context=16, repeats=2, dynamic=True)
    monkeypatch.undo()
    assert set(latency) == set(drafting) == {1, 3, 5}
    assert drafting == pytest.approx({1: 0.001, 3: 0.003, 5: 0.005})
    assert latency == {1: 0, 3: 0, 5: 0}  # the clock stood still through the verify passes
    assert sorted(set(proposed)) == [1, 3, 5] and len(proposed) == 3 * (1 + 2)  # a warm-up, then each repeat


def test_nan_draft_scores_rank_last_and_every_node_keeps_its_parent(monkeypatch):
    """Draft logits with NaN under every beam slot but the best (an overflow in a bf16 draft, say): their candidates
    rank last, as if improbable, so no child is chosen without its parent (one would hang off the root, and its
    root token be emitted twice if accepted), and decoding stays lossless."""
    model = tiny_model("llama")
    mm = eagle_heads(model, num_heads=3)
    draft_logits = type(mm.heads).draft_logits

    def nan_below_the_best_slot(heads, k, outputs, lm_head):
        logits = draft_logits(heads, k, outputs, lm_head)
        return torch.cat([logits[:, :1], torch.full_like(logits[:, 1:], float("nan"))], dim=1) if k else logits

    trees, propose = [], DynamicDraftLayerProposer.propose

    def recording(proposer, root):
        candidates = propose(proposer, root)
        trees.append(candidates.tree)
        return candidates

    monkeypatch.setattr(type(mm.heads), "draft_logits", nan_below_the_best_slot)
    monkeypatch.setattr(DynamicDraftLayerProposer, "propose", recording)
    ids = prompt(seed=6)[:, :10]
    expected = reference_generate(model, ids, max_new_tokens=16, eos_token_id=None)
    out = mm.generate(ids, max_new_tokens=16, eos_token_id=[], tree=DynamicTree(6, top_k=2, beam=2))
    assert torch.equal(out.sequences, expected)
    assert any(int(tree.depth.max()) >= 2 for tree in trees)  # the best slot's children were drafted and chosen
    for tree in trees:
        rows = tree.rows()  # one row: its own tree
        parent, depth = rows.parent[0, 1:], rows.depth[0, 1:]
        assert bool((rows.depth[0, parent] == depth - 1).all()), (tree.parent.tolist(), tree.depth.tolist())
