"""The only module that touches KV-cache internals.

The cache is a transformers `DynamicCache` built without a config, so every layer, sliding
window or not, keeps the whole past: the tree verifier masks the window itself, and a cache
that dropped old slots could not be gathered back to the accepted path.
"""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, StaticLayer

# Slots an AppendLayer allocates beyond what it holds, at least: a reallocation copies the past once.
RESERVE = 256


class AppendLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are a prefix of a longer buffer: an update writes the new slots into
    the room after them. DynamicLayer concatenates the whole past into a new tensor at every update, in each layer,
    twice, a cost that grows with the context and shows in a long text's verify passes.
    Whenever the keys are not that prefix any more (a row dropped, the batch repeated), the next update copies them
    into a new buffer."""

    buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, new = (self.keys.shape[-2] if self.keys.dim() == 4 else 0), key_states.shape[-2]
        if not self._room_for(length + new, key_states):
            shape = (*key_states.shape[:-2], length + new + max(RESERVE, length // 2), key_states.shape[-1])
            self.buffers = (key_states.new_empty(shape), value_states.new_empty(shape))
            for buffer, states in zip(self.buffers, (self.keys, self.values)):
                if length:
                    buffer[..., :length, :] = states
        for buffer, states in zip(self.buffers, (key_states, value_states)):
            buffer[..., length:length + new, :] = states
        self.keys, self.values = (buffer[..., :length + new, :] for buffer in self.buffers)
        return self.keys, self.values

    def _room_for(self, length: int, key_states: torch.Tensor) -> bool:
        if self.buffers is None or length > self.buffers[0].shape[-2]:
            return False
        return all(states.data_ptr() == buffer.data_ptr() and states.stride() == buffer.stride()
                   and states.shape[:-2] == key_states.shape[:-2] == buffer.shape[:-2] and states.dtype == buffer.dtype
                   for states, buffer in zip((self.keys, self.values), self.buffers))


def new_cache() -> DynamicCache:
    cache = DynamicCache()
    cache.layer_class_to_replicate = AppendLayer  # the layers are made at the first update of each
    return cache


def fork_prefix(cache: DynamicCache, length: int) -> DynamicCache:
    """A cache holding `cache`'s first `length` slots, whose updates leave those in `cache` as they are: each layer
    is a shallow copy narrowed to them, and an AppendLayer's copy writes its new slots into the room after them in
    the buffer both share. So `cache`'s slots past `length` may be overwritten: for a caller that drops them anyway
    (the eagle proposer drops a step's drafted slots, see propose.DraftLayerProposer.update). A fork of plain
    DynamicLayers copied the whole past at each update instead: the eagle proposer's three draft-layer calls a step
    spent a visible share of their time in torch.cat, growing with the text. The fork is of `cache`'s own class (a
    compiled graph guards on it: compiled.DraftGraphs)."""
    fork = copy.copy(cache)
    fork.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in fork.layers:
        if layer.is_initialized:
            layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]
    return fork


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> DynamicCache:
    """A cache of `cache`'s batch rows `rows` [B'] alone (copies; `cache` is left as it is): each layer a shallow copy
    holding those rows' keys and values, whose next update writes them into a new buffer (see AppendLayer)."""
    kept = DynamicCache()
    kept.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in kept.layers:
        if layer.is_initialized:
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]
    return kept


def check_cache(cache: DynamicCache, expected_length: int) -> None:
    """Refuse caches whose layers are not plain, full-length key/value tensors (e.g. a model that
    swapped in its own cache type): compaction could not keep the accepted path in them."""
    for i, layer in enumerate(cache.layers):
        keys = getattr(layer, "keys", None)
        plain = type(layer) in (DynamicLayer, AppendLayer)
        if not plain or not torch.is_tensor(keys) or keys.shape[-2] != expected_length:
            raise ValueError(
                f"cache layer {i} is a {type(layer).__name__} holding {None if keys is None else tuple(keys.shape)}; "
                f"medusa_spec needs every layer to keep all {expected_length} slots as a DynamicLayer")


def keep_accepted(cache: DynamicCache, past_length: int, keep: torch.Tensor | int) -> None:
    """Keep the first `past_length` slots, then for each row the tree slots `keep` [B, m] (node indices into the
    block appended after `past_length`), gathered contiguously; or, `keep` an int m, the block's first m slots where
    they are (a chain's accepted tokens, a root alone: no copy)."""
    in_place = isinstance(keep, int)
    kept = past_length + (keep if in_place else keep.shape[1])
    if not in_place:
        index = (past_length + keep)[:, None, :, None]  # [B, 1, m, 1], broadcast over heads and head_dim
    for layer in cache.layers:
        for name in ("keys", "values"):
            states = getattr(layer, name)  # [B, kv_heads, S + N, head_dim]
            if not in_place:
                gathered = states.gather(2, index.expand(-1, states.shape[1], -1, states.shape[3]))
                # Written over the block's first slots in place: the past is not copied.
                states[:, :, past_length:kept] = gathered
            # Narrowed to a view (the cache's next update concatenates into a new tensor anyway). A static layer
            # (compiled's buffer) is left as it is: each pass sets the slots it attends to (BufferLayer.window).
            if not isinstance(layer, StaticLayer):
                setattr(layer, name, states[:, :, :kept])
