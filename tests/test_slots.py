"""Slots alone: a padded batch's block positions and masks, and commit keeping exactly each row's accepted path,
with rows at different lengths (checked against plain forwards of each row's text)."""

import pytest
import torch
from transformers import DynamicCache

from medusa_spec.base import cache_argument, inspect_base_model
from medusa_spec.kv_cache import new_cache
from medusa_spec.slots import prefill
from medusa_spec.tree import build_tree
from medusa_spec.verify import attention_masks, forward_block
from tiny_models import tiny_model

PROMPTS = [[5, 6, 7], [3, 4, 5, 6, 7]]  # row 0 is left-padded by 2
TREE = build_tree([[0], [1], [0, 0], [1, 0]])  # nodes 1: [0], 2: [1], 3: [0, 0], 4: [1, 0]


def left_padded(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    return ids, mask


def test_verify_inputs_places_each_rows_block_after_its_own_text():
    model = tiny_model("llama")
    spec = inspect_base_model(model)
    ids, mask = left_padded(PROMPTS)
    with torch.no_grad():
        _, _, slots = prefill(model, spec, ids, mask, new_cache())
    # Padding slots are invalid; positions count real tokens only.
    assert torch.equal(slots.valid, mask) and slots.past == 5
    assert slots.pos[0, 2:].tolist() == [0, 1, 2] and slots.pos[1].tolist() == [0, 1, 2, 3, 4]
    assert slots.next_pos.tolist() == [3, 5]

    q_pos, kv_valid, kv_pos = slots.verify_inputs(TREE.depth)
    assert q_pos.tolist() == [[3, 4, 4, 5, 5], [5, 6, 6, 7, 7]]  # next_pos + depth, per row
    assert torch.equal(kv_valid, torch.cat([mask, torch.ones(2, 5, dtype=torch.bool)], dim=1))
    assert torch.equal(kv_pos[:, 5:], q_pos) and torch.equal(kv_pos[:, :5], slots.pos[:, :5])
    assert slots.valid.shape == (2, 10) and slots.past == 5  # the block is appended, not committed

    mask_4d = attention_masks(spec, kv_valid, kv_pos, q_pos, TREE.tree_mask, torch.float32)
    allowed = mask_4d if mask_4d.dtype == torch.bool else mask_4d == 0
    for b in range(2):
        # Every node sees the row's text (never its padding) and its own ancestry in the block, nothing else.
        expected = torch.cat([mask[b].expand(5, -1), TREE.tree_mask], dim=1)
        assert torch.equal(allowed[b, 0], expected), f"row {b}"
    assert not allowed[0, 0, :, :2].any()
    assert allowed[0, 0, 3, 5:].tolist() == [True, True, False, True, False]  # [0, 0] sees root and [0] only

    # A block may be built in several calls (a draft model's chain), with its own validity.
    q_pos, kv_valid, _ = slots.verify_inputs(torch.tensor([3]), torch.tensor([[True], [False]]))
    assert q_pos.tolist() == [[6], [8]] and kv_valid[:, -1].tolist() == [True, False]


def test_verify_inputs_caps_positions_at_the_models_last():
    model = tiny_model("llama")
    ids, mask = left_padded(PROMPTS)
    with torch.no_grad():
        _, _, slots = prefill(model, inspect_base_model(model), ids, mask, new_cache(), max_position=6)
    q_pos, _, _ = slots.verify_inputs(TREE.depth)
    assert q_pos.tolist() == [[3, 4, 4, 5, 5], [5, 6, 6, 6, 6]]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_commit_keeps_exactly_each_rows_accepted_path(arch):
    """Row 0 accepts root -> [1] -> [1, 0], row 1 only its root, row 2 has finished (keeps nothing and stands
    still). The cache's valid slots then equal a plain forward of each row's text, and the next block's logits
    equal the plain model's, though the rows now differ in length and hold invalid slots in between."""
    model = tiny_model(arch)
    spec = inspect_base_model(model)
    prompts = PROMPTS + [[8, 9, 10, 11]]
    ids, mask = left_padded(prompts)
    node_tokens = torch.tensor([[20, 21, 22, 23, 24], [30, 31, 32, 33, 34], [40, 41, 42, 43, 44]])
    keep = TREE.node_paths[torch.tensor([4, 0, 0])]  # [3, 3]: root, accepted nodes, then repeats
    n_kept = torch.tensor([3, 1, 0])
    texts = [prompts[0] + [20, 22, 24], prompts[1] + [30], prompts[2]]
    with torch.no_grad():
        _, _, slots = prefill(model, spec, ids, mask, new_cache())
        q_pos, kv_valid, kv_pos = slots.verify_inputs(TREE.depth)
        forward_block(model, spec, node_tokens, q_pos, TREE.tree_mask, slots.cache, kv_valid, kv_pos)
        slots.commit(keep, n_kept, n_kept)

        assert slots.past == 5 + 3 and slots.valid.shape == slots.pos.shape == (3, 8)
        assert slots.next_pos.tolist() == [6, 6, 4]
        assert slots.valid[:, 5:].tolist() == [[True, True, True], [True, False, False], [False, False, False]]
        for b, text in enumerate(texts):
            valid = slots.valid[b].nonzero().flatten()
            assert slots.pos[b, valid].tolist() == list(range(len(text))), f"row {b}"
            reference = DynamicCache()
            model(torch.tensor([text]), use_cache=True, **{cache_argument(model.forward): reference})
            assert len(slots.cache.layers) == len(reference.layers)
            for ours, theirs in zip(slots.cache.layers, reference.layers):
                assert ours.keys.shape[2] == slots.past  # the rejected nodes' slots are gone
                torch.testing.assert_close(ours.keys[b, :, valid], theirs.keys[0], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(ours.values[b, :, valid], theirs.values[0], atol=1e-5, rtol=1e-5)

        # The next step goes on from each row's own position, over its own valid slots only.
        next_tokens = torch.tensor([[50, 51], [52, 53], [54, 55]])
        chain = build_tree([[0]])
        q_pos, kv_valid, kv_pos = slots.verify_inputs(chain.depth)
        logits, _ = forward_block(model, spec, next_tokens, q_pos, chain.tree_mask, slots.cache, kv_valid, kv_pos)
        for b, text in enumerate(texts):
            expected = model(torch.tensor([text + next_tokens[b].tolist()])).logits[0, -2:]
            torch.testing.assert_close(logits[b], expected, atol=2e-4, rtol=1e-4, msg=f"{arch}: row {b}")
