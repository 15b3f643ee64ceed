"""scripts/simulate_trees.py: the dynamic tree follows the heads' confidence; a step accepts the longest right path."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from simulate_trees import accepted_length, dynamic_draft, head_inputs, tree_of  # noqa: E402

from medusa_spec import build_tree  # noqa: E402
from medusa_spec.kv_cache import new_cache  # noqa: E402
from medusa_spec.propose import HeadsProposer, Prompt, draft_with_heads  # noqa: E402
from medusa_spec.slots import prefill  # noqa: E402
from medusa_spec.train.module import TrainModule  # noqa: E402
from test_dependent_heads import TREE, random_heads  # noqa: E402
from test_generate import prompt  # noqa: E402
from tiny_models import tiny_model  # noqa: E402

VOCAB = 10


class Heads:
    """Two heads whose probabilities are tables: head k's by the last token on the path (the path's embedding here
    is its token id)."""

    num_heads = 2

    def __init__(self, first: dict[int, float], second: dict[int, dict[int, float]]):
        self.first, self.second = first, second

    def head_logits(self, k, states, path_embeds, lm_head):
        last = path_embeds[..., -1, 0].long()  # [B, n]
        probs = torch.full((*last.shape, VOCAB), 1e-9)
        for b, n in torch.cartesian_prod(torch.arange(last.shape[0]), torch.arange(last.shape[1])).tolist():
            for token, p in (self.first if k == 0 else self.second.get(int(last[b, n]), {})).items():
                probs[b, n, token] = p
        return probs.log()

    def token_ids(self, indices):
        return indices


def draft(heads, nodes):
    return dynamic_draft(heads, lambda ids: ids.float()[..., None], None, torch.tensor([1]), torch.zeros(1, 4),
                         nodes=nodes, top_k=3, beam=2)


def test_a_confident_first_head_gets_a_chain_an_unsure_one_siblings():
    confident = Heads({5: 0.9, 6: 0.06, 7: 0.04}, {5: {8: 0.9, 9: 0.1}})
    tree, tokens = draft(confident, nodes=3)
    assert tree.choices == ((0,), (0, 0)) and tokens.tolist() == [[1, 5, 8]]
    unsure = Heads({5: 0.4, 6: 0.35, 7: 0.25}, {t: {8: 0.3, 9: 0.3, 3: 0.3} for t in (5, 6, 7)})
    tree, tokens = draft(unsure, nodes=4)
    assert tree.choices == ((0,), (1,), (2,)) and tokens.tolist() == [[1, 5, 6, 7]]
    # A fourth node hangs off the best one: 0.4 * 0.3 beats 0.35 * 0.3.
    tree, _ = draft(unsure, nodes=5)
    assert tree.choices[:3] == ((0,), (1,), (2,)) and tree.choices[3][:1] == (0,)
    # A child as likely as its parent (probability 1) comes after it; node tokens follow the tree's node order
    # (by depth), not the order the nodes were picked in ([0, 0] before [1]).
    tree, tokens = draft(Heads({5: 0.6, 6: 0.4}, {5: {8: 1.0}, 6: {9: 0.1}}), nodes=4)
    assert tree.choices == ((0,), (1,), (0, 0)) and tokens.tolist() == [[1, 5, 6, 8]]


def test_a_step_accepts_the_deepest_path_the_text_continues():
    tree = tree_of(((0,), (1,), (0, 0)))
    tokens = torch.tensor([1, 5, 6, 8])  # root, [0] = 5, [1] = 6, [0, 0] = 8
    assert accepted_length(tree, tokens, [5, 8, 2]) == 2
    assert accepted_length(tree, tokens, [6, 8]) == 1  # 8 hangs off 5, not 6
    assert accepted_length(tree, tokens, [7, 5]) == 0
    assert accepted_length(tree, tokens, [5]) == 1  # the text ends


def test_the_heads_read_the_state_they_read_at_decoding_time_fused_layers_included():
    """Fused heads (feature_layers) draft from a projection of several layers' states, not the final one alone: the
    simulation must draft what the loop's proposer drafts."""
    model = tiny_model("llama")
    mm = random_heads(model, head_type="dependent", feature_layers=[0, 1])
    module = TrainModule(model, mm.heads, mm.spec.bool_mask, mm.spec.takes_logits_to_keep).eval()
    tree = build_tree(TREE)
    ids = prompt(batch=2)
    mask = torch.ones_like(ids, dtype=torch.bool)
    root = torch.tensor([5, 17])
    with torch.no_grad():
        _, hidden, _ = prefill(model, mm.spec, ids, mask, new_cache(), feature_layers=(0, 1))
        proposer = HeadsProposer(model, mm.heads, tree)
        proposer.start(Prompt(ids, mask, hidden, root, None))
        simulated = draft_with_heads(mm.heads, model, root, head_inputs(module, ids)[:, -1], tree)
        assert torch.equal(simulated, proposer.propose(root).node_tokens)
