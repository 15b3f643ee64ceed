"""The only module that touches KV-cache internals.

The cache is a transformers `DynamicCache` built without a config, so every layer, sliding
window or not, keeps the whole past: the tree verifier masks the window itself, and a cache
that dropped old slots could not be gathered back to the accepted path.
"""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def new_cache() -> DynamicCache:
    return DynamicCache()


def fork_cache(cache: DynamicCache) -> DynamicCache:
    """A cache holding the same slots as `cache`, whose changes leave `cache` as it is: both share the key/value
    tensors, which keep_accepted only writes past the slots it keeps and an update replaces by a longer one."""
    fork = DynamicCache()
    fork.layers = [copy.copy(layer) for layer in cache.layers]
    return fork


def check_cache(cache: DynamicCache, expected_length: int) -> None:
    """Refuse caches whose layers are not plain, full-length key/value tensors (e.g. a model that
    swapped in its own cache type): compaction could not keep the accepted path in them."""
    for i, layer in enumerate(cache.layers):
        keys = getattr(layer, "keys", None)
        if type(layer) is not DynamicLayer or not torch.is_tensor(keys) or keys.shape[-2] != expected_length:
            raise ValueError(
                f"cache layer {i} is a {type(layer).__name__} holding {None if keys is None else tuple(keys.shape)}; "
                f"medusa_spec needs every layer to keep all {expected_length} slots as a DynamicLayer")


def keep_accepted(cache: DynamicCache, past_length: int, keep: torch.Tensor) -> None:
    """Keep the first `past_length` slots, then for each row the tree slots `keep` [B, m]
    (node indices into the block appended after `past_length`), gathered contiguously."""
    kept = past_length + keep.shape[1]
    index = (past_length + keep)[:, None, :, None]  # [B, 1, m, 1], broadcast over heads and head_dim
    for layer in cache.layers:
        for name in ("keys", "values"):
            states = getattr(layer, name)  # [B, kv_heads, S + N, head_dim]
            gathered = states.gather(2, index.expand(-1, states.shape[1], -1, states.shape[3]))
            # Written over the block's first slots in place and narrowed to a view: the past is not copied
            # (the cache's next update concatenates into a new tensor anyway).
            states[:, :, past_length:kept] = gathered
            setattr(layer, name, states[:, :, :kept])
