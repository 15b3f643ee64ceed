"""Heads' logits + a tree -> the candidate token at every tree node."""

from __future__ import annotations

import torch

from .tree import Tree


def propose(root: torch.Tensor, head_logits: torch.Tensor, tree: Tree) -> torch.Tensor:
    """root [B], head_logits [B, K, V] -> node_tokens [B, N].

    A node at depth d with rank r takes head d-1's r-th best token (Medusa's heads do not see
    their parent, so siblings at one depth share one top-k list).
    """
    top = head_logits.topk(tree.top_k, dim=-1).indices  # [B, K, top_k]
    node_tokens = top[:, tree.head, tree.rank]           # [B, N]; node 0's entry is overwritten
    node_tokens[:, 0] = root
    return node_tokens
