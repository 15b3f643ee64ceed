"""The decoding loop's cache: updates append in place, and it holds what a plain DynamicCache holds through every
operation the loop and transformers apply."""

import torch
from transformers import DynamicCache

from medusa_spec.kv_cache import RESERVE, fork_cache, keep_accepted, new_cache


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


def test_a_forks_updates_leave_the_cache_alone():
    cache = new_cache()
    cache.update(*states(1, 5, seed=0), layer_idx=0)
    before = [t.clone() for t in (cache.layers[0].keys, cache.layers[0].values)]
    fork = fork_cache(cache)
    fork.update(*states(1, 3, seed=1), layer_idx=0)
    assert fork.layers[0].keys.shape[-2] == 8 and cache.layers[0].keys.shape[-2] == 5
    cache.update(*states(1, 2, seed=2), layer_idx=0)
    assert torch.equal(cache.layers[0].keys[..., :5, :], before[0])
    assert torch.equal(fork.layers[0].keys[..., 5:, :], states(1, 3, seed=1)[0])  # the cache's update did not reach it
