"""Heads + a tree -> the candidate token at every tree node.

Plain Medusa heads do not see their parent, so one call gives every head's top-k list and
siblings at one depth share it. Dependent heads read the tokens on the path to their parent,
so the tree is drafted level by level: one batched head call over all nodes of depth d - 1
gives the candidates of depth d.
"""

from __future__ import annotations

import torch
from torch import nn

from .tree import Tree


def propose(heads: nn.Module, base_model: nn.Module, root: torch.Tensor, last_hidden: torch.Tensor, tree: Tree) -> torch.Tensor:
    """root [B] (the token the base model just chose), last_hidden [B, H] (the base's final hidden
    state before root) -> node_tokens [B, N]; node 0 is the root."""
    lm_head = base_model.get_output_embeddings()
    if not heads.dependent:
        top = heads.token_ids(heads(last_hidden, lm_head).topk(tree.top_k, dim=-1).indices)  # [B, K, top_k]
        node_tokens = top[:, tree.head, tree.rank]  # [B, N]; node 0's entry is overwritten
        node_tokens[:, 0] = root
        return node_tokens
    embed = base_model.get_input_embeddings()
    node_tokens = root[:, None].expand(-1, tree.num_nodes).clone()
    bounds = tree.level_bounds
    for d in range(1, len(bounds)):
        start, end = bounds[d - 1]  # parents: every node of depth d - 1 (nodes are ordered by depth)
        path_tokens = node_tokens[:, tree.node_paths[start:end, :d]]             # [B, n, d]: root .. parent
        states = last_hidden[:, None].expand(-1, end - start, -1)
        logits = heads.head_logits(d - 1, states, embed(path_tokens), lm_head)   # [B, n, V']
        top = heads.token_ids(logits.topk(tree.top_k, dim=-1).indices)          # [B, n, top_k]
        level = slice(*bounds[d])
        node_tokens[:, level] = top[:, tree.parent[level] - start, tree.rank[level]]
    return node_tokens
