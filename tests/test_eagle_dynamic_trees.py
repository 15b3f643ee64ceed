"""scripts/eagle_dynamic_trees.py: each node of a step's dynamic tree holds what the draft layer drafts for it on that
tree's shape, the tree is the best-scoring nodes, and decoding through it is lossless."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from eagle_dynamic_trees import DynamicDraftLayerProposer  # noqa: E402

from medusa_spec import build_tree  # noqa: E402
from medusa_spec.inputs import resolve_sampling  # noqa: E402
from medusa_spec.loop import decode  # noqa: E402
from test_eagle import eagle_heads, started  # noqa: E402
from test_generate import prompt, reference_generate  # noqa: E402
from tiny_models import tiny_model  # noqa: E402


def dynamic_proposer(mm, ids, root, nodes, top_k, beam):
    """A DynamicDraftLayerProposer started after a prefill of ids, as the decoding loop starts it."""
    proposer, _ = started(mm, ids, torch.ones_like(ids), root, build_tree([[0]]))
    dynamic = DynamicDraftLayerProposer(mm.base_model, mm.heads, nodes, top_k, beam)
    dynamic.slots, dynamic.root_output = proposer.slots, proposer.root_output
    return dynamic


def test_each_node_holds_what_the_static_drafting_gives_it(monkeypatch):
    """The dynamic tree against DraftLayerProposer on a static tree holding its nodes and its drafted slots (each with
    a child, so that the static drafting makes a slot for it too; each slot sees its ancestors'): the same token at
    every node, and the same draft-layer output at every drafted slot, so the beam's slots, masks and positions are
    right. Several widths and beams, so siblings and cousins mix."""
    model = tiny_model("llama")
    mm = eagle_heads(model, draft_vocab_size=40)
    ids, root = prompt(seed=4)[:, :9], torch.tensor([11])
    outputs = []
    forward = mm.heads.draft_layer.forward
    monkeypatch.setattr(mm.heads.draft_layer, "forward",
                        lambda *args, **kwargs: outputs.append(forward(*args, **kwargs)) or outputs[-1])
    deeper = 0
    with torch.no_grad():
        for nodes, top_k, beam in ((6, 2, 2), (10, 3, 2), (12, 4, 3)):
            dynamic = dynamic_proposer(mm, ids, root, nodes, top_k, beam)
            outputs.clear()
            candidates = dynamic.propose(root)
            drafted = dict(zip(dynamic.slot_paths, torch.cat(outputs, dim=1)[0]))
            assert candidates.tree.num_nodes == nodes and candidates.tree.max_depth <= mm.heads.num_heads
            shape = sorted({*candidates.tree.choices, *drafted, *(path + (0,) for path in drafted)},
                           key=lambda path: (len(path), path))
            static, _ = started(mm, ids, torch.ones_like(ids), root, build_tree([list(p) for p in shape]))
            outputs.clear()
            static_tokens = dict(zip(((), *shape), static.propose(root).node_tokens[0].tolist()))
            static_outputs = dict(zip(shape, torch.cat(outputs, dim=1)[0]))
            assert candidates.node_tokens[0].tolist() == [static_tokens[p] for p in ((), *candidates.tree.choices)]
            for path, output in drafted.items():
                assert torch.allclose(output, static_outputs[path], atol=1e-5), (nodes, top_k, beam, path)
                deeper += len(path) > 1
    assert deeper >= 3  # slots below depth 1, which saw the beam's own slots above them


def test_the_tree_is_the_best_scoring_nodes():
    """With one level's worth of nodes the tree is the root's most likely children, best first; a chain where one
    child is far more likely than its siblings needs the scores of deeper levels, checked by the shape above."""
    model = tiny_model("llama")
    mm = eagle_heads(model, num_heads=1)
    ids, root = prompt(seed=5)[:, :9], torch.tensor([7])
    with torch.no_grad():
        dynamic = dynamic_proposer(mm, ids, root, nodes=4, top_k=4, beam=2)
        candidates = dynamic.propose(root)
        first = mm.heads.draft_logits(0, dynamic.root_output, model.get_output_embeddings()).log_softmax(-1)[0]
    assert candidates.tree.choices == ((0,), (1,), (2,))
    assert candidates.node_tokens[0, 1:].tolist() == first.topk(3).indices.tolist()


def test_decoding_on_dynamic_trees_is_lossless():
    model = tiny_model("llama")
    mm = eagle_heads(model)
    ids = prompt(seed=6)
    expected = reference_generate(model, ids, max_new_tokens=24, eos_token_id=None)
    for nodes, top_k, beam in ((5, 2, 2), (9, 4, 4)):
        proposer = DynamicDraftLayerProposer(model, mm.heads, nodes, top_k, beam)
        with torch.no_grad():
            out = decode(model, mm.spec, proposer, ids, None, 24, resolve_sampling(model, False), [], None)
        assert torch.equal(out.sequences, expected)
        assert out.stats.steps < 24  # the trees were used: some steps took more than one token
