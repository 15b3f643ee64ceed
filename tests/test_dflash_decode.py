"""DFlash drafts through the decode loop (medusa_spec.dflash_propose): greedy output identical to transformers'
greedy with every fixture draft, alone and in a left-padded batch, on a chain and a tree; the context's keys and
values kept from step to step equal to those recomputed for the whole context; sampling distributed as the base
model's; bad drafts and trees refused; the user's model and draft left as they were."""

from __future__ import annotations

import copy
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from medusa_spec import DynamicTree, MedusaModel, Sampling, generate_with_dflash
from medusa_spec.dflash import DFlashConfig, DFlashDraft, block_logits, context_features, load_dflash
from medusa_spec.dflash_propose import DFlashProposer, DynamicDFlashProposer, dflash_tree
from medusa_spec.propose import Prompt, StepResult
from medusa_spec.verify import base_features
from test_sampling import NEW, ROWS, VOCAB, chi_square_p_value, exact_joint, triple_counts
from tiny_models import tiny_model

FIXTURES = Path(__file__).parent / "fixtures" / "dflash"
VERIFIER = Path(__file__).parent / "fixtures" / "eagle3" / "tiny-verifier"
EXPECTED = json.loads((FIXTURES / "expected_blocks.json").read_text())
DRAFTS = sorted(EXPECTED["drafts"])
TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]  # depth 3: every fixture drafts at least 3 slots


@pytest.fixture(scope="module")
def verifier():
    return AutoModelForCausalLM.from_pretrained(VERIFIER).eval()


def reference(model, ids, mask=None, new=24):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new)


def random_draft(base, block_size=4, seed=0, sample_from_anchor=False) -> DFlashDraft:
    """A random DFlash draft of the whole vocabulary for `base`, its embeddings and LM head shared as load_dflash
    shares them."""
    config = base.config
    layer = Qwen3Config(hidden_size=config.hidden_size, intermediate_size=48, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, num_hidden_layers=1, vocab_size=config.vocab_size)
    torch.manual_seed(seed)
    draft = DFlashDraft(DFlashConfig(layer, block_size, mask_token_id=3, aux_layer_ids=[0, 1],
                                     draft_vocab_size=config.vocab_size, sample_from_anchor=sample_from_anchor))
    draft.verifier_weights = (base.get_input_embeddings().weight, base.get_output_embeddings().weight)
    return draft.eval()


# --- greedy: the base model's own output ----------------------------------------------------------------------------

@pytest.mark.parametrize("tree", [None, TREE, DynamicTree(6)], ids=["chain", "tree", "dynamic"])
@pytest.mark.parametrize("name", DRAFTS)
def test_greedy_output_is_the_base_models(verifier, name, tree):
    draft = load_dflash(FIXTURES / name, verifier)
    ids = torch.tensor([EXPECTED["texts"][0][:10]])
    out = generate_with_dflash(verifier, draft, ids, max_new_tokens=24, tree=tree)
    expected = reference(verifier, ids)
    assert torch.equal(out.sequences, expected)
    assert out.sequences.shape[1] == 34  # no eos: all 24 tokens compared
    depth = 3 if isinstance(tree, list) else draft.config.block_size - draft.config.drafted_slots.start
    assert len(out.stats.accepted_at_depth) == depth
    if isinstance(tree, DynamicTree):
        assert set(out.stats.tree_sizes) == {6}  # no step costs: every step its `nodes`


@pytest.mark.parametrize("name", DRAFTS)
def test_a_left_padded_batch_is_the_base_models_batch(verifier, name):
    draft = load_dflash(FIXTURES / name, verifier)
    text = EXPECTED["texts"][0]
    ids = torch.tensor([text[:11], [0] * 4 + text[2:9]])
    mask = (torch.arange(11) >= torch.tensor([[0], [4]])).long()
    for tree in (TREE, DynamicTree(5, top_k=2, beam=2)):
        out = generate_with_dflash(verifier, draft, ids, mask, max_new_tokens=20, tree=tree)
        assert torch.equal(out.sequences, reference(verifier, ids, mask, new=20))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_long_accepted_runs_keep_the_output_the_base_models(arch):
    """Every token of a 6-token vocabulary at depths 1 and 2 (and rank 0's child below): each step accepts at least
    2 tokens, so the context grows by several slots a step, rows of a batch by different numbers."""
    base = tiny_model(arch, vocab_size=6)
    draft = random_draft(base)
    tree = [[r] for r in range(6)] + [[r, s] for r in range(6) for s in range(6)] + [[0, 0, 0]]
    ids = torch.tensor([[3, 5, 4, 1, 5, 4, 3], [0, 0, 4, 4, 1, 3, 5]])
    mask = (ids != 0).long()
    out = generate_with_dflash(base, draft, ids, mask, max_new_tokens=30, tree=tree)
    expected = reference(base, ids, mask, new=30)
    assert torch.equal(out.sequences, expected)
    assert out.stats.accepted_at_depth[1] == sum(out.stats.row_steps) - 2  # all but each row's last step


def test_sample_from_anchor_drafts_depth_d_from_slot_d_minus_1():
    """With sample_from_anchor every slot drafts (the chain is block_size deep); the output stays the base's."""
    base = tiny_model("llama", vocab_size=6)
    draft = random_draft(base, block_size=3, sample_from_anchor=True)
    assert dflash_tree(draft, None).max_depth == 3
    ids = torch.tensor([[3, 5, 4, 1]])
    out = generate_with_dflash(base, draft, ids, max_new_tokens=20,
                               tree=[[r] for r in range(6)] + [[0, r] for r in range(6)])
    assert torch.equal(out.sequences, reference(base, ids, new=20))
    assert out.stats.accepted_at_depth[0] == out.stats.steps - 1  # every depth-1 token is in the tree


# --- the candidates are speculators' drafts ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", DRAFTS)
def test_the_chain_is_the_block_speculators_drafts(verifier, name):
    """Started on a prompt as the loop starts it (its states with the feature layers' after the final one), the
    default chain after the root is speculators' own block at that anchor, every drafted slot at its depth."""
    draft = load_dflash(FIXTURES / name, verifier)
    proposer = DFlashProposer(draft, dflash_tree(draft, None))
    for text, expected in zip(EXPECTED["texts"], EXPECTED["drafts"][name]):
        ids = torch.tensor([text])
        with torch.no_grad():
            states = verifier(ids, output_hidden_states=True).hidden_states
        hidden = base_features(states, proposer.feature_layers)
        for anchor in (1, len(text) - draft.config.block_size - 1):
            proposer.start(Prompt(ids[:, :anchor], torch.ones(1, anchor, dtype=torch.bool), hidden[:, :anchor],
                                  ids[:, anchor], None))
            with torch.no_grad():
                chain = proposer.propose(ids[:, anchor]).node_tokens[0]
            drafted = len(chain) - 1
            assert chain[0] == text[anchor] and chain[1:].tolist() == expected["tokens"][anchor][-drafted:]


def test_a_dynamic_tree_holds_the_paths_of_highest_probability():
    """With a beam that keeps every path, each row's tree is the n - 1 rank paths with the highest product of their
    slots' probabilities (a brute force over every path 3 deep), each with its tokens; per row in a batch."""
    base = tiny_model("llama", vocab_size=12)
    draft = random_draft(base, block_size=4, seed=2)
    proposer = DynamicDFlashProposer(draft, DynamicTree(7, top_k=3, beam=27))
    # A random draft's slots rank the tokens much alike: a bias per slot (on the proposer's own copy) sets them apart,
    # so that a slot's tokens at another depth show.
    bias, project = torch.randn(4, 12, generator=torch.Generator().manual_seed(0)) * 2, proposer.draft.project
    proposer.draft.project = lambda states: project(states) + bias[-states.shape[1]:]
    ids = torch.tensor([[3, 5, 4, 1, 7], [9, 2, 2, 6, 1]])
    with torch.no_grad():
        states = base(ids, output_hidden_states=True).hidden_states
        hidden = base_features(states, proposer.feature_layers)
        proposer.start(Prompt(ids[:, :4], torch.ones(2, 4, dtype=torch.bool), hidden[:, :4], ids[:, 4], None))
        candidates = proposer.propose(ids[:, 4])
        slots = proposer.draft.project(proposer.draft(proposer.context, ids[:, 4], proposer.next_pos))
    probs = slots[:, 1:].float().softmax(-1)  # [B, 3 drafted slots, V]
    assert all(len({tuple(t) for t in probs[row].topk(3, dim=-1).indices.tolist()}) == 3 for row in range(2))
    tree = candidates.tree
    for row in range(2):
        top = probs[row].topk(3, dim=-1)
        paths = [p for d in (1, 2, 3) for p in itertools.product(range(3), repeat=d)]
        value = {p: math.prod(top.values[d, r].item() for d, r in enumerate(p)) for p in paths}
        best = sorted(paths, key=value.get, reverse=True)[:6]
        want = {tuple(top.indices[d, r].item() for d, r in enumerate(p)) for p in best}
        got = set()
        for node in range(1, 7):
            depth = int(tree.depth[row, node])
            got.add(tuple(candidates.node_tokens[row, tree.node_paths[row, node, 1: depth + 1]].tolist()))
        assert got == want
        assert torch.equal(tree.parent[row, 1:] < torch.arange(1, 7), torch.ones(6, dtype=torch.bool))


def test_step_costs_size_the_dynamic_tree_and_the_output_stays_the_base_models():
    """step_ms that make every extra node cost more than it could add: the root alone each step, the same output;
    nodes that cost nothing: the whole tree."""
    base = tiny_model("llama", vocab_size=6)
    draft = random_draft(base)
    ids = torch.tensor([[3, 5, 4, 1, 5, 4, 3]])
    expected = reference(base, ids, new=16)
    dear = generate_with_dflash(base, draft, ids, max_new_tokens=16, tree=DynamicTree(4, step_ms=(1.0, 9.0, 9, 9)))
    cheap = generate_with_dflash(base, draft, ids, max_new_tokens=16, tree=DynamicTree(4, step_ms=(1.0, 1, 1, 1)))
    assert torch.equal(dear.sequences, expected) and torch.equal(cheap.sequences, expected)
    assert set(dear.stats.tree_sizes) == {1} and set(cheap.stats.tree_sizes) == {4}


# --- the kept context is the whole context ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", DRAFTS)
def test_the_kept_context_drafts_as_the_whole_context_does(verifier, name):
    """A left-padded batch of 2 whose rows keep different numbers of slots each step (a finished row none): after
    every step each row's block equals block_logits over that row's whole context, recomputed alone, and so the
    block speculators drafts (test_dflash)."""
    draft = load_dflash(FIXTURES / name, verifier)
    text = torch.tensor(EXPECTED["texts"][0])
    features = context_features(verifier, draft, text[None])[0]  # [L, n H]
    width = features.shape[-1] // len(draft.config.aux_layer_ids)
    proposer = DFlashProposer(draft, dflash_tree(draft, None))
    prompt_lengths = [5, 3]
    ids = torch.stack([text[:5], torch.cat([torch.zeros(2, dtype=torch.long), text[:3]])])
    mask = torch.tensor([[True] * 5, [False, False, True, True, True]])
    final = torch.zeros(2, 5, width)  # the loop's hidden starts with the final state, which the draft does not read
    hidden = torch.stack([features[:5], torch.cat([torch.full((2, features.shape[-1]), 7.0), features[:3]])])
    proposer.start(Prompt(ids, mask, torch.cat([final, hidden], dim=-1), text[[5, 3]], None))
    lengths = list(prompt_lengths)

    def check():
        with torch.no_grad():
            got = draft.project(proposer.draft(proposer.context, text[lengths], proposer.next_pos))
            for row, length in enumerate(lengths):
                want = block_logits(draft, features[None, :length], text[length:length + 1])[0]
                torch.testing.assert_close(got[row], want, atol=1e-5, rtol=1e-5)

    check()
    for accepted, going in (([2, 0], [True, True]), ([0, 3], [True, True]), ([1, 1], [False, True])):
        m = max(accepted) + 1
        nodes = torch.full((2, m, features.shape[-1]), -3.0)  # slots past a row's accepted ones hold junk
        for row in range(2):
            if going[row]:
                nodes[row, : accepted[row] + 1] = features[lengths[row]: lengths[row] + accepted[row] + 1]
        accept_length, going_t = torch.tensor(accepted), torch.tensor(going)
        proposer.update(StepResult(None, torch.cat([torch.zeros(2, m, width), nodes], dim=-1), accept_length,
                                   accept_length, torch.arange(m).expand(2, -1), None, torch.ones(2, dtype=torch.bool),
                                   going_t, None))
        lengths = [n + (a + 1 if g else 0) for n, a, g in zip(lengths, accepted, going)]
        check()
    assert lengths == [5 + 3 + 1, 3 + 1 + 4 + 2]


# --- sampling: the base model's distribution ------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [Sampling(True, 1.0), Sampling(True, 0.7, top_k=3, top_p=0.9)], ids=str)
def test_sampling_matches_the_base_distribution(sampling):
    """6,000 rows of 3 tokens against the exact joint distribution (test_sampling's chi-square, shown there to reject
    a wrong rule), with a tree that accepts often at depths 1 and 2."""
    base = tiny_model("llama", vocab_size=VOCAB)
    prompt = torch.tensor([[3, 5, 4, 1]])
    torch.manual_seed(0)
    out = generate_with_dflash(base, random_draft(base), prompt.expand(ROWS, -1), max_new_tokens=NEW,
                               do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k,
                               top_p=sampling.top_p, eos_token_id=[],
                               tree=[[r] for r in range(3)] + [[r, s] for r in range(3) for s in range(3)])
    assert out.stats.accepted_at_depth[1] > ROWS // 20, "too little acceptance to test the tree path"
    assert chi_square_p_value(triple_counts(out.sequences[:, prompt.shape[1]:]),
                              exact_joint(base, prompt, sampling)) > 1e-3


# --- refusals, and nothing left on the user's modules ----------------------------------------------------------------

def test_bad_drafts_and_trees_are_refused(verifier):
    draft = load_dflash(FIXTURES / "qwen3-1-layer", verifier)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(TypeError, match="draft must be a DFlashDraft.*load_dflash"):
        generate_with_dflash(verifier, FIXTURES / "qwen3-1-layer", ids)
    with pytest.raises(ValueError, match="loaded for another model"):
        generate_with_dflash(copy.deepcopy(verifier), draft, ids)
    with pytest.raises(ValueError, match="hidden_size=32 and vocab_size=96 .* has 48 and 96"):
        generate_with_dflash(tiny_model("llama", hidden_size=48, num_hidden_layers=4), draft, ids)
    with pytest.raises(ValueError, match=r"a path 4 deep, but this DFlash draft drafts 3 tokens a block \(block_size "
                                         r"4, less the anchor slot\)"):
        generate_with_dflash(verifier, draft, ids, tree=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]])
    with pytest.raises(ValueError, match="outside the top-40 candidates"):
        generate_with_dflash(verifier, draft, ids, tree=[[40]])
    with pytest.raises(ValueError, match="speculators_model_type 'dflash' is not supported.*generate_with_dflash"):
        MedusaModel.from_pretrained(verifier, FIXTURES / "qwen3-1-layer")


def test_speculation_off_runs_the_same_loop(verifier):
    draft = load_dflash(FIXTURES / "qwen3-1-layer", verifier)
    ids = torch.tensor([EXPECTED["texts"][0][:10]])
    out = generate_with_dflash(verifier, draft, ids, max_new_tokens=12, tree=[])
    assert torch.equal(out.sequences, reference(verifier, ids, new=12)) and out.stats.accepted_at_depth == []


def module_state(model):
    return {name: dict(vars(module)) for name, module in model.named_modules()}


def test_the_users_model_and_draft_are_left_as_they_were(verifier):
    """No attribute set on any module of the base model or the draft, the draft in train mode stays so, and both
    compute as before."""
    base = copy.deepcopy(verifier)
    draft = load_dflash(FIXTURES / "qwen3-sliding-window", base).train()
    ids = torch.tensor([EXPECTED["texts"][1][:9]])
    with torch.no_grad():
        base(ids, output_hidden_states=True)  # transformers' first forward asking for hidden states sets its hooks
        features = context_features(base, draft, ids)
        before_logits = block_logits(draft.eval(), features, ids[:, -1])
    draft.train()
    before = module_state(base), module_state(draft)
    weights = [{k: v.clone() for k, v in model.state_dict().items()} for model in (base, draft)]
    generate_with_dflash(base, draft, ids, max_new_tokens=10, tree=TREE)
    assert (module_state(base), module_state(draft)) == before
    assert all(m.training for m in draft.modules())
    for model, kept in zip((base, draft), weights):
        assert all(torch.equal(kept[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(block_logits(draft.eval(), context_features(base, draft, ids), ids[:, -1]), before_logits)


@pytest.mark.cuda  # skipped without a device (conftest.py); scripts/gpu_check.py runs `pytest -m cuda`
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_output_is_the_base_models_on_cuda(verifier, dtype):
    """On a GPU, the draft in float32 beside a base in float32 or bfloat16 (no column-wise copies there)."""
    base = copy.deepcopy(verifier).to("cuda", dtype)
    ids = torch.tensor([EXPECTED["texts"][0][:10], EXPECTED["texts"][1][:10]], device="cuda")
    for name in DRAFTS:
        draft = load_dflash(FIXTURES / name, base).to("cuda")
        for row in ids:
            out = generate_with_dflash(base, draft, row[None], max_new_tokens=24, tree=TREE)
            assert torch.equal(out.sequences, reference(base, row[None]))
