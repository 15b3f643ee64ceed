"""Other proposers through the same verifier: a draft model (the classic protocol, adaptive K) and prompt
lookup (alone, or as a chain beside the Medusa tree). Greedy output equals transformers' greedy output;
sampled output follows the base model's distribution (chi-square, with a wrong rule shown rejected)."""

import json
import sys

import pytest
import torch

import medusa_spec.accept
import medusa_spec.lookup
from medusa_spec import autotree, generate_with_draft, generate_with_lookup, self_draft
from medusa_spec.accept import Sampling, processed_probs
from medusa_spec.cli import main
from medusa_spec.draft import choose_draft_length, expected_tokens
from medusa_spec.lookup import (
    UNREACHABLE,
    NgramIndex,
    PromptLookup,
    WithLookup,
    add_chain,
    lookup_chain,
    next_chain_length,
    tree_with_chain,
)
from medusa_spec.loop import accepted_path, decode
from medusa_spec.output import GenerationStats
from medusa_spec.propose import Candidates, HostStep, Prompt, Proposer, RootOnly, StepResult, heads_proposer
from medusa_spec.tree import Tree, build_tree, chain_tree
from test_bench import layers_move_the_clock
from test_cli import model_dir  # noqa: F401 (fixture: a tiny model and tokenizer on disk)
from test_eagle import eagle_heads
from test_generate import TREE, OracleHeads, left_padded, medusa, prompt, reference_generate
from test_sampling import SETTINGS, chi_square_p_value, exact_joint, triple_counts
from tiny_models import VOCAB, tiny_model

SMALL_VOCAB, ROWS, NEW = 6, 6000, 3  # the chi-square setting of test_sampling.py


# --- draft model -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_draft_tokens", [None, 1, 3], ids=["adaptive", "K=1", "K=3"])
@pytest.mark.parametrize("draft", ["other_model", "self_draft"])
def test_draft_greedy_identity(draft, num_draft_tokens):
    model = tiny_model("llama")
    # Another architecture, other weights, the same vocabulary; or the base model's first layer.
    draft_model = tiny_model("qwen2", seed=1) if draft == "other_model" else self_draft(model, 1)
    ids = prompt(seed=2)
    expected = reference_generate(model, ids, max_new_tokens=30, eos_token_id=None)
    out = generate_with_draft(model, draft_model, ids, max_new_tokens=30, eos_token_id=[],
                              num_draft_tokens=num_draft_tokens)
    assert torch.equal(out.sequences, expected)
    assert out.stats.new_tokens == [30]
    assert len(out.stats.draft_lengths) == out.stats.steps - 1
    if num_draft_tokens is not None:
        # The last K steps at most draft fewer: no draft is longer than the tokens left - 1.
        assert set(out.stats.draft_lengths[:-num_draft_tokens]) == {num_draft_tokens}


def test_draft_that_is_always_right_gives_k_plus_one_tokens_per_step():
    model = tiny_model("llama")
    ids = prompt(seed=3)
    out = generate_with_draft(model, model, ids, max_new_tokens=26, eos_token_id=[], num_draft_tokens=4)
    assert torch.equal(out.sequences, reference_generate(model, ids, max_new_tokens=26, eos_token_id=None))
    assert out.stats.acceptance_rate == 1.0
    assert out.stats.row_steps == [1 + 5]  # prefill (1 token), then 5 per verify pass (4 drafts + bonus)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma"])
def test_self_draft_is_the_truncated_model_and_leaves_the_base_alone(arch):
    model = tiny_model(arch)
    ids = prompt(seed=4)
    with torch.no_grad():
        before = model(ids).logits
        draft = self_draft(model, 1)
        one_layer = tiny_model(arch, num_hidden_layers=1)
        one_layer.load_state_dict({k: v for k, v in model.state_dict().items() if ".layers.1." not in k})
        torch.testing.assert_close(draft(ids).logits, one_layer(ids).logits)
        assert draft.model.layers[0] is model.model.layers[0] and draft.lm_head is model.lm_head  # shared, no copy
        assert len(model.model.layers) == 2 and model.config.num_hidden_layers == 2
        torch.testing.assert_close(model(ids).logits, before)
    out = generate_with_draft(model, draft, ids, max_new_tokens=20, eos_token_id=[])
    assert torch.equal(out.sequences, reference_generate(model, ids, max_new_tokens=20, eos_token_id=None))
    # What is done to the draft's own structure, hooks or generation settings stays on the draft.
    for module in (draft, draft.model):
        module.register_forward_pre_hook(lambda *args: pytest.fail("a hook on the draft ran on the base model"))
        module.register_buffer("scratch", torch.zeros(1))
    draft.generation_config.max_new_tokens = 3
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before)
    assert "scratch" not in model._buffers and "scratch" not in model.model._buffers
    assert model.generation_config.max_new_tokens != 3


def test_draft_batch_of_mixed_lengths_with_eos_equals_per_row_generation():
    model, draft = tiny_model("llama"), self_draft(tiny_model("llama"), 1)
    lengths = [13, 4, 7]
    rows = [prompt(n, seed=20 + i)[0] for i, n in enumerate(lengths)]
    ids, mask = left_padded(rows)
    width = ids.shape[1]
    free = reference_generate(model, rows[1][None], max_new_tokens=25, eos_token_id=None)[0, len(rows[1]):]
    eos = int(free[9])  # stops row 1 early; the other rows may or may not meet it
    out = generate_with_draft(model, draft, ids, attention_mask=mask, max_new_tokens=25, eos_token_id=eos,
                              pad_token_id=0, num_draft_tokens=3)
    for b, row in enumerate(rows):
        expected = reference_generate(model, row[None], max_new_tokens=25, eos_token_id=eos,
                                      pad_token_id=0)[0, len(row):]
        got = out.sequences[b, width:]
        assert torch.equal(got[: len(expected)], expected), f"row {b}"
        assert (got[len(expected):] == 0).all()
    assert out.stats.new_tokens[1] == int((free == eos).nonzero()[0]) + 1


def test_adaptive_k_reports_its_estimates(monkeypatch):
    """On a clock that only the decoder layers move (a second a call), the estimates are exact: a draft forward runs
    the one layer of self_draft(model, 1), a verify pass the base's two."""
    model = tiny_model("llama")
    layers_move_the_clock(monkeypatch)
    out = generate_with_draft(model, self_draft(model, 1), prompt(seed=5), max_new_tokens=30, eos_token_id=[],
                              max_draft_tokens=5)
    monkeypatch.undo()
    stats = out.stats
    assert stats.draft_seconds == 1.0 and stats.verify_seconds == 2.0
    assert 0 < stats.acceptance_rate < 1  # drafts both kept and rejected
    assert all(1 <= k <= 5 for k in stats.draft_lengths)
    assert {"acceptance_rate", "draft_seconds", "verify_seconds", "draft_lengths"} <= set(stats.to_dict())


def test_choose_draft_length_follows_the_expected_speed():
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 3) == 4
    assert choose_draft_length(0.9, draft_seconds=0.01, verify_seconds=1.0, max_draft_tokens=8) == 8  # cheap, good
    assert choose_draft_length(0.1, draft_seconds=0.2, verify_seconds=1.0, max_draft_tokens=8) == 1   # mostly wrong
    # As slow as the base:
    assert choose_draft_length(0.8, draft_seconds=1.0, verify_seconds=1.0, max_draft_tokens=8) == 1
    best = choose_draft_length(0.8, draft_seconds=0.05, verify_seconds=1.0, max_draft_tokens=16)
    speed = [expected_tokens(0.8, k) / (k * 0.05 + 1.0) for k in range(1, 17)]
    assert best == 1 + speed.index(max(speed)) and 4 <= best <= 12


def sample_draft_triples(monkeypatch_rule=None, sampling=SETTINGS[0], num_draft_tokens=2, seed=0):
    model = tiny_model("llama", vocab_size=SMALL_VOCAB)
    draft = tiny_model("llama", seed=1, vocab_size=SMALL_VOCAB)
    start = torch.tensor([[3, 5, 4, 1]])
    torch.manual_seed(seed)
    # One token past the NEW counted: a draft is capped at the tokens left - 1, and the first step's 2-token draft
    # is what the rule's deeper acceptance needs.
    out = generate_with_draft(model, draft, start.expand(ROWS, -1), max_new_tokens=NEW + 1, do_sample=True,
                              temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                              eos_token_id=[], num_draft_tokens=num_draft_tokens)
    counted = out.sequences[:, start.shape[1]: start.shape[1] + NEW]
    return triple_counts(counted), exact_joint(model, start, sampling), out.stats


@pytest.mark.parametrize("sampling", SETTINGS, ids=str)
def test_draft_sampling_matches_base_distribution(sampling):
    counts, probs, stats = sample_draft_triples(sampling=sampling)
    assert 0.2 < stats.acceptance_rate < 0.9, "both acceptance and rejection must be exercised"
    assert stats.accepted_at_depth[1] > ROWS // 10
    assert chi_square_p_value(counts, probs) > 1e-3


def test_draft_sampling_with_adaptive_k_matches_base_distribution():
    counts, probs, _ = sample_draft_triples(sampling=SETTINGS[1], num_draft_tokens=None)
    assert chi_square_p_value(counts, probs) > 1e-3


def accept_resampling_from_p(draft_tokens, draft_probs, logits, sampling):
    """A wrong rule: min(1, p/q) acceptance, but a rejected token is replaced by a draw from p instead of
    the residual norm(max(0, p - q)), so tokens the draft favours come out too often."""
    p = processed_probs(logits, sampling)
    p_draft = p[:, :-1].gather(2, draft_tokens[..., None])[..., 0]
    q_draft = draft_probs.gather(2, draft_tokens[..., None])[..., 0]
    accept_length = (torch.rand_like(p_draft) * q_draft < p_draft).long().cumprod(-1).sum(-1)
    p_at = p.gather(1, accept_length[:, None, None].expand(-1, 1, p.shape[-1]))[:, 0]
    return accept_length, torch.multinomial(p_at, 1)[:, 0]


def test_chi_square_rejects_a_wrong_draft_rule(monkeypatch):
    monkeypatch.setattr(medusa_spec.accept, "accept_draft", accept_resampling_from_p)
    counts, probs, _ = sample_draft_triples()
    assert chi_square_p_value(counts, probs) < 1e-6


# --- prompt lookup -----------------------------------------------------------------------------------------

def test_ngram_search_prefers_the_longest_suffix_and_copies_past_the_end():
    context = NgramIndex([7, 8, 9, 1, 8, 9, 2, 5, 8, 9])
    assert lookup_chain(context, [], 3) == [2, 5, 8]  # "8 9" last seen before "2"; longest match wins over "9"
    assert lookup_chain(NgramIndex([1, 2, 1, 2]), [], 5) == [1, 2, 1, 2, 1]  # the copy runs on, period 2
    document = NgramIndex([40, 41, 42, 43])
    assert lookup_chain(NgramIndex([5, 41, 42]), [document], 4) == [43]  # a document's copy stops at its end
    assert lookup_chain(NgramIndex([5, 6]), [document], 4) == []


def test_chains_are_as_long_as_the_longest_match():
    lookup = PromptLookup([[5, 6, 7, 5, 6], [9, 8], [1, 2, 3, 1]], documents=[[8, 40]], chain_length=4)
    chain_tokens, has_match = lookup.chains("cpu")
    assert has_match.tolist() == [True, True, True]
    assert chain_tokens.tolist() == [[7, 5, 6, 7], [40, 40, 40, 40], [2, 3, 1, 2]]  # short copies repeat their end
    lookup = PromptLookup([[5, 6], [9, 8]], documents=[], chain_length=4)
    assert lookup.chains("cpu")[0].shape == (2, 0)  # nothing to copy: the step verifies the heads' tree alone
    lookup.extend([[5], []])
    chain_tokens, has_match = lookup.chains("cpu")
    assert chain_tokens.tolist() == [[6, 5, 6, 5], [8, 8, 8, 8]] and has_match.tolist() == [True, False]


def test_beside_a_tree_a_chain_needs_a_three_token_match_and_then_replaces_the_tree():
    """A 1- or 2-token match guesses too rarely to pay for its rows beside the heads' tree; lookup alone (the
    root-only tree) copies after one. A 3-token match's chain is right far more often than the heads' first guess:
    when every row has one, the step verifies the root and the chain alone, at least as many nodes as the tree had
    (rows the step would have paid for anyway). With a row that has none, the chain hangs beside the tree."""
    assert lookup_chain(NgramIndex([5, 6, 7, 8, 9, 6]), [], 4) == [7, 8, 9, 6]
    assert lookup_chain(NgramIndex([5, 6, 7, 8, 9, 6]), [], 4, min_ngram=2) == []
    assert lookup_chain(NgramIndex([5, 6, 7, 8, 5, 6]), [], 4, min_ngram=2) == [7, 8, 5, 6]

    class Heads(Proposer):  # any proposer with a tree of its own, as the heads: 5 nodes
        def start(self, prompt):
            self.tree = build_tree([[0], [1], [0, 0], [0, 0, 0]])

        def propose(self, root):
            return Candidates(torch.full((root.shape[0], 5), 3), self.tree)

    def candidates(rows, root, inner=None, chain_length=10, length=None):
        ids = torch.tensor(rows)
        proposer = WithLookup(inner or Heads(), [], chain_length)
        proposer.start(Prompt(ids, torch.ones_like(ids, dtype=torch.bool), torch.zeros(*ids.shape, 4), root, None))
        proposer.length = length or chain_length
        return proposer.propose(root).node_tokens.tolist()

    seven = torch.tensor([7])
    # "6 7" seen before: a chain for lookup alone, none beside the tree.
    assert candidates([[5, 6, 7, 8, 6]], seven, RootOnly(), chain_length=3) == [[7, 8, 6, 7]]
    assert candidates([[5, 6, 7, 8, 6]], seven, chain_length=3) == [[3, 3, 3, 3, 3]]
    # "5 6 7" seen before: root and chain alone, the chain copying on past the end ...
    assert candidates([[5, 6, 7, 8, 9, 5, 6]], seven, chain_length=6) == [[7, 8, 9, 5, 6, 7, 8]]
    # ... and a chain shortened to 1 by misses still takes the tree's 4 nodes beyond the root.
    assert candidates([[5, 6, 7, 8, 9, 5, 6]], seven, length=1) == [[7, 8, 9, 5, 6]]
    # A batch whose second row has no chain: the tree's 5 nodes, then the first row's chain (the second row pads
    # with its last token and cannot reach its copy: add_chain).
    batch = candidates([[5, 6, 7, 8, 9, 5, 6], [2, 1, 5, 6, 4, 8, 6]], torch.tensor([7, 7]), chain_length=3)
    assert batch == [[3, 3, 3, 3, 3, 8, 9, 5], [3, 3, 3, 3, 3, 7, 7, 7]]


def test_a_chain_hangs_beside_the_tree_the_proposer_gave_that_step():
    """Trees of one size but other shapes from step to step (a dynamic tree's, or rank paths): each step's merged
    tree begins with that step's tree, not with a merged tree built for an earlier tree of the same size."""
    shapes = [build_tree([[0], [1]]), build_tree([[0], [0, 0]]), chain_tree(2), build_tree([[0], [1]])]

    class Shifting(Proposer):
        def start(self, prompt):
            self.trees = iter(shapes)

        def propose(self, root):
            return Candidates(torch.full((root.shape[0], 3), 3), next(self.trees))

    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6], [2, 1, 5, 6, 4, 8, 6]])  # a chain in the first row only
    proposer = WithLookup(Shifting(), [], 3)
    root = torch.tensor([7, 7])
    proposer.start(Prompt(ids, torch.ones_like(ids, dtype=torch.bool), torch.zeros(*ids.shape, 4), root, None))
    for tree in shapes:
        merged = proposer.propose(root).tree
        assert merged.num_nodes == 6 and torch.equal(merged.tree_mask[:3, :3], tree.tree_mask)
    assert len(proposer.merged_trees) == 2  # trees of rank paths, each merged once; the plain tree merged anew


def test_chain_length_adapts_as_assisted_decoding_does():
    """A step where a row took its whole chain: the next chain 2 longer (at most lookup_tokens); a miss or a part
    taken: 1 shorter (at least 1); a step without a chain changes nothing."""
    assert [next_chain_length(4, True, 10), next_chain_length(9, True, 10)] == [6, 10]
    assert [next_chain_length(4, False, 10), next_chain_length(1, False, 10)] == [3, 1]
    proposer = WithLookup(RootOnly(), [], 4)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 5]])
    proposer.start(Prompt(ids, torch.ones_like(ids, dtype=torch.bool), torch.zeros(1, 9, 4), torch.tensor([6]), None))

    def step(emitted):  # the row took emitted[:-1] from the chain, then a bonus token
        candidates = proposer.propose(torch.tensor([6]))
        taken = torch.tensor([len(emitted) - 1])
        one = torch.tensor([True])
        proposer.update(StepResult(candidates, None, taken, taken, None, None, one, one,
                                   HostStep([len(emitted) - 1], [True], [emitted], [True])))
        return candidates.node_tokens[0, 1:].tolist()

    assert step([7, 5]) == [7, 8, 9, 10]  # "5 6" seen before: the chain copies what followed; 1 of 4 taken
    assert step([6, 7, 5, 6]) == [6, 7, 5]  # 3 long now, taken whole
    stats = GenerationStats()
    proposer.finish(stats)
    assert stats.draft_lengths == [4, 3] and stats.lookup_accepted == 4
    assert proposer.propose(torch.tensor([6])).node_tokens.shape[1] == 1 + 4  # back to 4 (3 + 2, capped)


def test_merged_tree_tensors():
    tree = build_tree([[0], [1], [0, 0]])
    merged = tree_with_chain(tree, 3)
    assert merged.num_nodes == 7 and merged.max_depth == 3
    assert merged.depth.tolist() == [0, 1, 1, 2, 1, 2, 3] and merged.parent.tolist() == [0, 0, 0, 1, 0, 4, 5]
    assert torch.equal(merged.depth, merged.tree_mask.sum(-1) - 1)
    assert merged.node_paths[6].tolist() == [0, 4, 5, 6] and merged.node_paths[3].tolist() == [0, 1, 3, 3]
    assert torch.equal(merged.tree_mask[:4, :4], tree.tree_mask) and not merged.tree_mask[4:, 1:4].any()


def test_equal_siblings_leave_only_one_reachable():
    merged = tree_with_chain(build_tree([[0], [1], [0, 0]]), 2)
    medusa_tokens = torch.tensor([[10, 11, 12, 13], [10, 11, 12, 13]])
    chains = torch.tensor([[12, 20], [12, 20]])  # first token equals the rank-1 depth-1 candidate
    has_match = torch.tensor([True, False])
    node_tokens, candidates = add_chain(medusa_tokens, chains, has_match, 4, merged.depth)
    assert node_tokens.tolist() == [[10, 11, 12, 13, 12, 20]] * 2
    assert candidates.tolist() == [[10, 11, UNREACHABLE, 13, 12, 20],      # a matched chain wins the tie
                                   [10, 11, 12, 13, UNREACHABLE, UNREACHABLE]]  # no match: the chain is out of reach


def test_a_per_row_tree_is_read_as_each_row_alone():
    """A batch whose rows have trees of different shapes (a per-row Tree, as dynamic trees give): acceptance, the
    accepted path and the tree merged with a lookup chain are, row by row, what that row's own tree gives alone."""
    trees = [build_tree([[0], [1], [0, 0], [0, 0, 0]]), build_tree([[0], [0, 0], [0, 0, 0], [0, 1]])]
    per_row = Tree(*(torch.stack([getattr(tree, name) for tree in trees])
                     for name in ("depth", "parent", "tree_mask", "node_paths")))
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, VOCAB, generator=generator)
    targets = logits.argmax(-1)
    # Each row's node tokens follow the base's targets down its tree (the first row's nodes 1 and 3, the second
    # row's 1, 2 and 4), and each row's node 2 or 3 repeats its earlier sibling's token (out of reach).
    t = targets.tolist()
    tokens = torch.tensor([[5, t[0][0], t[0][0], t[0][1], 9],
                           [5, t[1][0], t[1][1], t[1][1], t[1][2]]])
    greedy = Sampling(do_sample=False)
    last_node, accept_length, bonus = medusa_spec.accept.accept(tokens, logits, per_row, greedy)
    path, new_tokens = accepted_path(Candidates(tokens, per_row), last_node, accept_length, bonus)
    assert accept_length.tolist() == [2, 3] and last_node.tolist() == [3, 4]
    for b, tree in enumerate(trees):
        alone = medusa_spec.accept.accept(tokens[b: b + 1], logits[b: b + 1], tree, greedy)
        assert [int(x) for x in alone] == [int(last_node[b]), int(accept_length[b]), int(bonus[b])]
        path_alone, new_alone = accepted_path(Candidates(tokens[b: b + 1], tree), *alone)
        assert torch.equal(path[b], path_alone[0]) and torch.equal(new_tokens[b], new_alone[0])
        merged, merged_alone = tree_with_chain(per_row, 2), tree_with_chain(tree, 2)
        for name in ("depth", "parent", "tree_mask", "node_paths"):
            assert torch.equal(getattr(merged, name)[b], getattr(merged_alone, name)), name


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "gemma3"])
def test_lookup_alone_greedy_identity(arch):
    model = tiny_model(arch)
    ids = prompt(seed=0)
    expected = reference_generate(model, ids, max_new_tokens=40, eos_token_id=None)
    out = generate_with_lookup(model, ids, max_new_tokens=40, eos_token_id=[], lookup_tokens=6)
    assert torch.equal(out.sequences, expected)
    assert out.stats.lookup_accepted > 0  # random tiny models fall into loops that lookup copies


def test_lookup_chain_accepted_on_a_prompt_with_a_repeated_pattern():
    model = tiny_model("qwen2")
    # This model's greedy output from prompt(seed=2) turns periodic; the prompt holds three periods.
    ids = reference_generate(model, prompt(seed=2), max_new_tokens=24, eos_token_id=None)
    expected = reference_generate(model, ids, max_new_tokens=40, eos_token_id=None)
    out = generate_with_lookup(model, ids, max_new_tokens=40, eos_token_id=[], lookup_tokens=8)
    assert torch.equal(out.sequences, expected)
    assert out.stats.tokens_per_step > 4 and out.stats.lookup_accepted >= 30


def test_lookup_copies_from_documents():
    model = tiny_model("llama")
    ids = prompt(seed=6)
    expected = reference_generate(model, ids, max_new_tokens=40, eos_token_id=None)
    document = expected[0, 3:].tolist()  # the prompt's tail and the continuation, e.g. a retrieved passage
    out = generate_with_lookup(model, ids, max_new_tokens=40, eos_token_id=[], lookup_tokens=10,
                               documents=[torch.tensor(document)])
    assert torch.equal(out.sequences, expected)
    assert out.stats.tokens_per_step > 5


def test_draft_no_longer_than_the_tokens_left():
    """As transformers' assisted decoding caps its draft: 4 new tokens, the root takes one, so the draft model
    drafts 3 - 1 = 2 tokens, not the 5 asked for (which it would draft one forward at a time, for nothing)."""
    model = tiny_model("llama")
    ids = prompt(seed=6)
    out = generate_with_draft(model, model, ids, max_new_tokens=4, eos_token_id=[], num_draft_tokens=5)
    assert torch.equal(out.sequences, reference_generate(model, ids, max_new_tokens=4, eos_token_id=None))
    assert out.stats.draft_lengths == [2]  # the draft is the model itself: 2 accepted and the bonus, done
    # One token left: nothing drafted (transformers drafts none either), the base's own token; sampling too.
    for do_sample in (False, True):
        torch.manual_seed(0)
        out = generate_with_draft(model, model, ids, max_new_tokens=2, eos_token_id=[], num_draft_tokens=5,
                                  do_sample=do_sample)
        assert out.stats.draft_lengths == [0] and out.stats.new_tokens == [2] and out.stats.acceptance_rate is None


def test_lookup_chain_no_longer_than_the_tokens_left():
    """A step emits its accepted tokens and one more, so a chain past the tokens left - 1 verifies rows that can
    never be kept: with 7 new tokens the root takes one, and the first chain has 6 - 1 = 5 tokens, not 10."""
    model = tiny_model("llama")
    ids = prompt(seed=6)
    expected = reference_generate(model, ids, max_new_tokens=7, eos_token_id=None)
    document = reference_generate(model, ids, max_new_tokens=40, eos_token_id=None)[0, 3:].tolist()
    out = generate_with_lookup(model, ids, max_new_tokens=7, eos_token_id=[], lookup_tokens=10,
                               documents=[torch.tensor(document)])
    assert torch.equal(out.sequences, expected)
    assert out.stats.draft_lengths == [5] and out.stats.steps == 2  # prefill, then one step takes all 6


@pytest.mark.parametrize("arch", ["llama", "mistral", "opt"])
def test_medusa_tree_plus_lookup_greedy_identity(arch):
    model = tiny_model(arch)
    ids = prompt(seed=1)
    expected = reference_generate(model, ids, max_new_tokens=40, eos_token_id=None)
    out = generate_with_lookup(medusa(model), ids, max_new_tokens=40, eos_token_id=[], lookup_tokens=5, tree=TREE)
    assert torch.equal(out.sequences, expected)
    # MedusaModel.generate takes the same lookup arguments and runs the same loop.
    same = medusa(model).generate(ids, max_new_tokens=40, eos_token_id=[], lookup_tokens=5, tree=TREE)
    assert torch.equal(same.sequences, expected) and same.stats.lookup_accepted == out.stats.lookup_accepted


def test_medusa_and_lookup_proposing_the_same_tokens():
    """Heads and documents both know the continuation: the chain's first token equals the heads' rank-0
    candidate at depth 1 in nearly every step; the chain wins the tie and carries long runs."""
    model = tiny_model("llama")
    lengths = [11, 6]
    rows = [prompt(n, seed=30 + i)[0] for i, n in enumerate(lengths)]
    ids = torch.zeros(2, 11, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, 11 - len(row):], mask[b, 11 - len(row):] = row, 1
    full = [reference_generate(model, row[None], max_new_tokens=40, eos_token_id=None)[0] for row in rows]
    out = generate_with_lookup(medusa(model, OracleHeads(model, full, sabotage=1000)), ids, attention_mask=mask,
                               max_new_tokens=40, eos_token_id=[], lookup_tokens=8, tree=TREE,
                               documents=[sequence.tolist() for sequence in full])
    for b, row in enumerate(rows):
        assert torch.equal(out.sequences[b, 11:], full[b][len(row):]), f"row {b}"
    assert out.stats.lookup_accepted > 40 and out.stats.tokens_per_step > 4


def sample_lookup_triples(sampling, monkeypatch):
    from medusa_spec import MedusaConfig, MedusaModel

    # Chains after 1-token matches too: with 3 new tokens after a 4-token prompt, 2-token matches are rare, and
    # what is tested here is the merge of a chain into the heads' tree, whatever match made the chain.
    monkeypatch.setattr(medusa_spec.lookup, "MIN_NGRAM_WITH_TREE", 1)

    model = tiny_model("llama", vocab_size=SMALL_VOCAB)
    mm = MedusaModel.from_base(model, MedusaConfig(num_heads=2))  # zero-init heads guess plausible tokens
    start = torch.tensor([[3, 5, 4, 1]])
    torch.manual_seed(0)
    # Two tokens past the NEW counted: a chain is capped at the tokens left - 1, and the first step's 3-token chain
    # (2 deeper than the heads' nodes) is what the tie-breaks guard.
    out = generate_with_lookup(mm, start.expand(ROWS, -1), max_new_tokens=NEW + 2, do_sample=True,
                               temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                               eos_token_id=[], lookup_tokens=3, tree=[[0], [1], [2], [0, 0], [1, 0]])
    counted = out.sequences[:, start.shape[1]: start.shape[1] + NEW]
    return triple_counts(counted), exact_joint(model, start, sampling), out.stats


@pytest.mark.parametrize("sampling", SETTINGS[:3], ids=str)
def test_medusa_plus_lookup_sampling_matches_base_distribution(sampling, monkeypatch):
    counts, probs, stats = sample_lookup_triples(sampling, monkeypatch)
    assert stats.lookup_accepted > ROWS // 20
    assert chi_square_p_value(counts, probs) > 1e-3


def test_chi_square_rejects_equal_siblings_left_both_reachable(monkeypatch):
    """Without the tie-breaks (add_chain's, and acceptance's for any repeated sibling), a chain and a Medusa
    node holding the same token are both reached, get independent draws below them, and the deeper walk
    wins: candidates come out too often."""
    add_chain = medusa_spec.lookup.add_chain

    def add_chain_without_tie_break(node_tokens, chain_tokens, has_match, num_tree_nodes, depth):
        node_tokens, _ = add_chain(node_tokens, chain_tokens, has_match, num_tree_nodes, depth)
        return node_tokens, node_tokens

    monkeypatch.setattr(medusa_spec.lookup, "add_chain", add_chain_without_tie_break)
    monkeypatch.setattr(medusa_spec.accept, "repeats_a_sibling",
                        lambda node_tokens, tree: torch.zeros_like(node_tokens, dtype=torch.bool))
    counts, probs, _ = sample_lookup_triples(SETTINGS[0], monkeypatch)
    assert chi_square_p_value(counts, probs) < 1e-6


# --- bad input ---------------------------------------------------------------------------------------------

IDS = torch.tensor([[5, 6, 7, 8]])


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_draft_tokens=0), "num_draft_tokens must be an integer >= 1"),
    (dict(num_draft_tokens=2.5), "num_draft_tokens must be an integer >= 1"),
    (dict(max_draft_tokens=0), "max_draft_tokens must be an integer >= 1"),
    (dict(num_draft_tokens=3, max_draft_tokens=5), "max_draft_tokens=5 bounds the draft length chosen each step, "
                                                   "but num_draft_tokens=3 fixes it"),
    (dict(do_sample=True, temperature=0.0), "temperature must be > 0"),
])
def test_bad_draft_arguments(kwargs, message):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=message):
        generate_with_draft(model, model, IDS, **kwargs)


def test_draft_with_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match=f"draft model's vocabulary has {VOCAB + 4} tokens but the base model's has "
                                         f"{VOCAB}; use a draft model with the same tokenizer"):
        generate_with_draft(tiny_model("llama"), tiny_model("llama", vocab_size=VOCAB + 4), IDS)


def test_self_draft_refuses_what_it_cannot_build():
    with pytest.raises(ValueError,
                       match="self_draft supports llama, qwen2, gemma models, not 'gpt2'.*separate draft_model"):
        self_draft(tiny_model("gpt2"), 1)
    with pytest.raises(ValueError, match="num_layers must be an integer from 1 to 1"):
        self_draft(tiny_model("llama"), 2)


@pytest.mark.parametrize("kwargs, message", [
    (dict(documents="w5 w6 w7"), "documents must be a list of token id lists.*tokenize them first"),
    (dict(documents=["w5 w6 w7"]), r"documents\[0\] is a str, not a list of token ids.*tokenize them first"),
    (dict(documents=[[5, 6.0]]), r"documents\[0\] holds 6.0, not a token id"),
    (dict(documents=[torch.ones(2, 3, dtype=torch.long)]), r"documents\[0\] is a tensor of shape \(2, 3\)"),
    (dict(documents=[[5, VOCAB]]), rf"token ids \[{VOCAB}\] outside the model's vocabulary \[0, {VOCAB}\)"),
    (dict(lookup_tokens=-1), "lookup_tokens must be an integer >= 0"),
    (dict(lookup_tokens=0), "needs lookup_tokens >= 1"),
    (dict(tree=[[0]]), "tree needs Medusa heads: pass a MedusaModel"),
])
def test_bad_lookup_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate_with_lookup(tiny_model("llama"), IDS, **kwargs)


# --- command line ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("options", [["--lookup", "4"], ["--self-draft-layers", "1"], ["--self-draft-layers", "1",
                                                                                       "--draft-tokens", "2"]])
def test_generate_with_other_proposers(model_dir, tmp_path, capsys, options):  # noqa: F811
    document = tmp_path / "doc.txt"
    document.write_text("w5 w9 w11 w7 w30 w31")
    extra = ["--documents", str(document)] if "--lookup" in options else []
    assert main(["generate", "w5 w9 w11 w7", "--model", str(model_dir), "--max-new-tokens", "12", "--compare",
                 *options, *extra]) == 0
    err = capsys.readouterr().err
    assert "identical: True" in err
    assert ("from lookup" in err) if "--lookup" in options else ("draft acceptance" in err)


@pytest.mark.parametrize("options, message", [
    (["--documents", "x.txt", "--lookup", "0"], "--documents are searched by prompt lookup: add --lookup N"),
    (["--lookup", "4", "--self-draft-layers", "1"], "does not combine with a draft model"),
    (["--draft-model", "d", "--self-draft-layers", "1"], "give one of them"),
    (["--draft-tokens", "3"], "add --draft-model DIR or --self-draft-layers N"),
    (["--max-draft-tokens", "3"], "--max-draft-tokens bounds K for a draft model: add --draft-model DIR"),
    (["--self-draft-layers", "1", "--tree", "4"], "--tree shapes the heads' candidates, and a draft model speculates"),
    (["--self-draft-layers", "1", "--draft-tokens", "2", "--max-draft-tokens", "4"], "--draft-tokens fixes K"),
])
def test_generate_refuses_conflicting_proposer_options(model_dir, capsys, options, message):  # noqa: F811
    assert main(["generate", "w5", "--model", str(model_dir), *options]) == 2
    assert message in capsys.readouterr().err


def test_bench_compares_the_new_methods(model_dir, tmp_path, capsys):  # noqa: F811
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text("\n".join(json.dumps({"category": c, "turns": [t]}) for c, t in
                                 [("a", "w5 w6 w7 w5 w6"), ("b", "w11 w12 w13 w14")]))
    out = tmp_path / "report"
    assert main(["bench", "--model", str(model_dir), "--prompts", str(prompts), "--max-new-tokens", "10",
                 "--output", str(out), "--methods", "hf_greedy", "medusa_lookup", "lookup", "self_draft", "draft_model",
                 "--draft-model", str(model_dir), "--lookup", "4"]) == 0
    summary = json.loads((out / "bench.json").read_text())["summary"]["overall"]
    assert set(summary) == {"hf_greedy", "medusa_lookup", "lookup", "self_draft", "draft_model"}
    for method in ("medusa_lookup", "lookup", "self_draft", "draft_model"):
        assert summary[method]["equal_to_reference"] == 1.0, method
    assert summary["draft_model"]["acceptance_rate"] == 1.0  # the model drafting for itself
    assert "| overall | self_draft |" in (out / "bench.md").read_text()


# --- wrappers ----------------------------------------------------------------------------------------------

def watched(proposer: Proposer) -> Proposer:
    """`proposer`, its class now recording each attribute set on it from outside its own methods (set_by_others)."""

    class Watched(type(proposer)):
        def __setattr__(self, name, value):
            caller = sys._getframe(1).f_locals.get("self")
            if caller is not self:
                self.__dict__.setdefault("set_by_others", []).append((type(caller).__name__, name))
            object.__setattr__(self, name, value)

    proposer.__class__ = Watched
    return proposer


@pytest.mark.parametrize("head_type", ["medusa", "eagle"])
def test_wrappers_write_nothing_into_the_proposer_they_wrap(head_type):
    """AdaptiveTree (tree=None's) and WithLookup drive the heads' proposer through its methods only: each step's
    tree is handed to it (propose_on), never set on it, so the wrapped proposer's layout stays its own; decoding
    through both stays transformers' greedy."""
    model = tiny_model("llama")
    mm = medusa(model, num_heads=2) if head_type == "medusa" else eagle_heads(model, num_heads=2)
    accuracy = [[0.8, 0.1], [0.6, 0.1]]
    costs = {n: 0.010 * (1 + 0.3 * n) for n in range(1, 8)}
    table = autotree.choose_tree(accuracy, costs, dict.fromkeys(costs, 0.0))[1]
    inner = watched(heads_proposer(model, mm.heads, build_tree([[0]])))
    proposer = WithLookup(autotree.AdaptiveTree(inner, table, accuracy), [], 4)
    ids = prompt(seed=5, batch=2)
    out = decode(model, mm.spec, proposer, ids, None, 24, Sampling(), [], None)
    assert torch.equal(out.sequences, reference_generate(model, ids, max_new_tokens=24, eos_token_id=None))
    assert max(out.stats.tree_sizes) > 2  # AdaptiveTree drafted on trees other than the wrapped one's
    assert inner.__dict__.get("set_by_others", []) == [] and inner.layout.choices == ((0,),)
