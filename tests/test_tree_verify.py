"""One verify pass over a tree equals sequential decoding, and compaction leaves the cache a
sequential run would have, on every architecture claimed (sliding-window ones past the window)."""

import pytest
import torch
from transformers import DynamicCache

from medusa_spec.base import cache_argument, inspect_base_model
from medusa_spec.columnwise import columnwise_copy
from medusa_spec.kv_cache import keep_accepted, new_cache
from medusa_spec.tree import build_tree
from medusa_spec.verify import forward_block
from tiny_models import ARCHITECTURES, VOCAB, WINDOW, tiny_model

CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]]
PROMPT, PAD = 3 * WINDOW, 4  # row 1 is left-padded by PAD


def prefill_and_verify(model, tree, prompts, attention_mask, node_tokens):
    """Prefill, then one tree pass, as the decoding loop runs them (column-wise linears included)."""
    model = columnwise_copy(model)
    spec = inspect_base_model(model)
    cache = new_cache()
    valid = attention_mask.bool()
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    causal = torch.ones(prompts.shape[1], prompts.shape[1], dtype=torch.bool).tril()
    forward_block(model, spec, prompts, pos, causal, cache, valid, pos, last_only=True)
    q_pos = pos[:, -1:] + 1 + tree.depth
    logits, _ = forward_block(model, spec, node_tokens, q_pos, tree.tree_mask, cache,
                              torch.cat([valid, torch.ones_like(node_tokens, dtype=torch.bool)], 1),
                              torch.cat([pos, q_pos], 1))
    return logits, cache


def make_inputs(tree, seed):
    """Two prompts (row 1 left-padded) and random node tokens for `tree`."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, VOCAB, (2, PROMPT), generator=g)
    attention_mask = torch.ones_like(prompts)
    attention_mask[1, :PAD] = 0
    prompts[1, :PAD] = 0
    return prompts, attention_mask, torch.randint(3, VOCAB, (2, tree.num_nodes), generator=g)


def row_prompt(prompts, attention_mask, b):
    return prompts[b][attention_mask[b].bool()]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tree_logits_equal_sequential_logits(arch):
    model = tiny_model(arch)
    tree = build_tree(CHOICES)
    prompts, attention_mask, node_tokens = make_inputs(tree, seed=1)
    with torch.no_grad():
        logits, _ = prefill_and_verify(model, tree, prompts, attention_mask, node_tokens)
        for b in range(2):
            for node in range(tree.num_nodes):
                path = tree.node_paths[node, : tree.depth[node] + 1]
                sequence = torch.cat([row_prompt(prompts, attention_mask, b), node_tokens[b, path]])[None]
                expected = model(sequence).logits[0, -1]
                torch.testing.assert_close(logits[b, node], expected, atol=2e-4, rtol=1e-4,
                                           msg=f"{arch}: row {b} node {node} differs from sequential decoding")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_compacted_cache_equals_sequential_cache(arch):
    model = tiny_model(arch)
    tree = build_tree(CHOICES)
    prompts, attention_mask, node_tokens = make_inputs(tree, seed=2)
    # Row 0 accepts the deepest node (4 candidates), row 1 a depth-2 node on another branch.
    accepted = torch.tensor([tree.num_nodes - 1, 6])
    assert tree.depth[accepted].tolist() == [4, 2]
    paths = tree.node_paths[accepted]
    with torch.no_grad():
        _, cache = prefill_and_verify(model, tree, prompts, attention_mask, node_tokens)
        keep_accepted(cache, PROMPT, paths)
        for b in range(2):
            n_kept = int(tree.depth[accepted[b]]) + 1
            sequence = torch.cat([row_prompt(prompts, attention_mask, b), node_tokens[b, paths[b, :n_kept]]])[None]
            reference = DynamicCache()
            model(sequence, use_cache=True, **{cache_argument(model.forward): reference})
            # Valid slots of this row: its unpadded prompt, then its accepted path.
            slots = torch.cat([torch.nonzero(attention_mask[b]).flatten(), PROMPT + torch.arange(n_kept)])
            for ours, theirs in zip(cache.layers, reference.layers):
                torch.testing.assert_close(ours.keys[b, :, slots], theirs.keys[0], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(ours.values[b, :, slots], theirs.values[0], atol=1e-5, rtol=1e-5)
