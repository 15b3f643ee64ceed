"""The decoding loop's cache: updates append in place, and it holds what a plain DynamicCache holds through every
operation the loop and transformers apply."""

import torch
from transformers import DynamicCache

from medusa_spec.kv_cache import RESERVE, fork_prefix, keep_accepted, new_cache


def states(batch, length, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, length, 4, generator=g), torch.randn(batch, 2, length, 4, generator=g)


def assert_same(cache, reference):
    for layer, ref in zip(cache.layers, reference.layers, strict=True):
        assert torch.equal(layer.keys, ref.keys) and torch.equal(layer.values, ref.values)


def test_updates_write_in_place_and_hold_what_a_dynamic_cache_holds():
    cache, reference = new_cache(), DynamicCache()
    for c in (cache, reference):
        c.update(*states(2, 7, seed=0), layer_idx=0)
    pointer = cache.layers[0].keys.data_ptr()
    for step in range(1, 6):  # a tree block, then its accepted path kept, as in the decoding loop
        for c in (cache, reference):
            keys, values = c.update(*states(2, 4, seed=step), layer_idx=0)
            keep_accepted(c, 7 + 2 * (step - 1), torch.tensor([[0, 2], [0, 3]]))
        assert keys.shape[-2] == 7 + 2 * step + 2  # the update returned the whole past and the block
        assert_same(cache, reference)
        assert cache.layers[0].keys.data_ptr() == pointer  # no new tensor: the slots went into the room left
    for c in (cache, reference):
        c.crop(-3)
        c.batch_select_indices(torch.tensor([1]))  # a copy: the next update moves to a new buffer
        c.update(*states(1, 2 * RESERVE, seed=9), layer_idx=0)  # past the room left
    assert_same(cache, reference)


def test_a_prefix_fork_appends_without_copying_the_past_and_leaves_the_prefix_alone():
    """The eagle proposer's step: the committed slots in a fork, the drafted ones (past them) dropped; the fork's
    slots go into the room after the prefix, and a second fork from the same cache (--tree auto times each step
    from one started proposer) starts from the same prefix."""
    cache = new_cache()
    cache.update(*states(1, 8, seed=0), layer_idx=0)  # 5 committed slots, then 3 the caller drops
    prefix = [t[..., :5, :].clone() for t in (cache.layers[0].keys, cache.layers[0].values)]
    pointer = cache.layers[0].keys.data_ptr()
    for seed in (1, 2):
        fork = fork_prefix(cache, 5)
        assert fork.layers[0].keys.shape[-2] == 5
        new = states(1, 3, seed=seed)
        keys, values = fork.update(*new, layer_idx=0)
        assert keys.data_ptr() == pointer  # into the room: the past was not copied
        assert torch.equal(keys[..., :5, :], prefix[0]) and torch.equal(values[..., :5, :], prefix[1])
        assert torch.equal(keys[..., 5:, :], new[0]) and torch.equal(values[..., 5:, :], new[1])
        assert cache.layers[0].keys.shape[-2] == 8  # the cache itself still holds its 8 slots
        assert torch.equal(cache.layers[0].keys[..., :5, :], prefix[0])
    plain = DynamicCache()  # a plain layer's fork copies on update, as a DynamicLayer does
    plain.update(*states(1, 8, seed=0), layer_idx=0)
    fork = fork_prefix(plain, 5)
    fork.update(*states(1, 3, seed=1), layer_idx=0)
    assert torch.equal(plain.layers[0].keys, states(1, 8, seed=0)[0])
