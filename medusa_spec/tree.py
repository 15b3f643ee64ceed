"""Candidate trees as tensors. Pure.

`Tree` is what the verifier and acceptance read, from any proposer; `MedusaTree` adds the layout Medusa
heads draft it from, given as a list of rank paths ("choices"): `[1, 0]` is the node reached by taking the first head's
second-best token, then the second head's best. Node 0 is the root (the token the base
model already chose); nodes are ordered by depth, so every parent precedes its children.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from typing import TypeVar

import torch

TreeT = TypeVar("TreeT", bound="Tree")  # Tree.to returns the tree's own class (a MedusaTree stays one)


@dataclass(frozen=True)
class Tree:
    """A candidate tree as the verifier and acceptance read it, N nodes including the root; nodes are ordered
    by depth, so every parent precedes its children. Any proposer (heads, a lookup chain, a draft model)
    hands one over with its node tokens.

    depth       [N]     0 for the root
    parent      [N]     parent's node index (the root points at itself)
    tree_mask   [N, N]  tree_mask[i, j]: node j is node i or one of its ancestors
    node_paths  [N, D+1] node_paths[i, d]: node i's ancestor at depth d; past depth[i] it repeats i

    A per-row tree (each row of a batch its own tree of N nodes: a dynamic tree chosen from each row's own draft
    probabilities) has every field with a leading [B] dimension; readers take `rows()`.
    """

    depth: torch.Tensor
    parent: torch.Tensor
    tree_mask: torch.Tensor
    node_paths: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return self.depth.shape[-1]

    @property
    def max_depth(self) -> int:
        return self.node_paths.shape[-1] - 1

    def rows(self) -> Tree:
        """The fields with a leading row dimension: a per-row tree's as they are, a tree every row shares as one
        row, which broadcasts over a batch."""
        if self.depth.dim() == 2:
            return self
        return Tree(self.depth[None], self.parent[None], self.tree_mask[None], self.node_paths[None])

    def to(self: TreeT, device: torch.device | str) -> TreeT:
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                            if torch.is_tensor(getattr(self, f.name))})


@dataclass(frozen=True)
class MedusaTree(Tree):
    """A Tree laid out for Medusa heads: node i takes rank `rank[i]` of head `head[i]`'s top-k list.

    choices     the rank paths, sorted by (depth, path)
    head        [N]     head whose top-k list gives the node's token (depth - 1; 0 for the root)
    rank        [N]     rank of the node's token in that head's top-k list
    """

    choices: tuple[tuple[int, ...], ...]
    head: torch.Tensor
    rank: torch.Tensor

    @property
    def top_k(self) -> int:
        """How many candidates per head the tree reads (0 for a root-only tree)."""
        return max((path[-1] for path in self.choices), default=-1) + 1

    @cached_property  # read every decoding step by dependent heads' drafting: computed once per tree
    def level_bounds(self) -> list[tuple[int, int]]:
        """[(start, end)] node index range of each depth 0..D (nodes are ordered by depth)."""
        counts = [1] + [0] * self.max_depth
        for path in self.choices:
            counts[len(path)] += 1
        ends = [sum(counts[: d + 1]) for d in range(len(counts))]
        return [(end - count, end) for count, end in zip(counts, ends)]


def chain_tree(length: int) -> Tree:
    """The root followed by a chain of `length` nodes (a draft model's or a lookup's candidates)."""
    n = length + 1
    depth = torch.arange(n)
    parent = (depth - 1).clamp(min=0)
    tree_mask = torch.ones(n, n, dtype=torch.bool).tril()
    return Tree(depth, parent, tree_mask, torch.minimum(depth[None, :], depth[:, None]))


def validate_choices(choices: Sequence[Sequence[int]], num_heads: int | None = None,
                     top_k: int | None = None) -> list[tuple[int, ...]]:
    """Check a tree given as rank paths and return it sorted by (depth, path); raises ValueError."""
    if not isinstance(choices, (list, tuple)):
        raise ValueError(f"tree must be a list of rank paths such as [[0], [1], [0, 0]], got {type(choices).__name__}")
    paths = []
    for path in choices:
        rank_list = isinstance(path, (list, tuple)) and bool(path)
        if not rank_list or not all(isinstance(r, int) and not isinstance(r, bool) for r in path):
            raise ValueError(f"tree: each entry must be a non-empty list of integer ranks, got {path!r}")
        if any(r < 0 for r in path):
            raise ValueError(f"tree: ranks must be >= 0, got {list(path)}")
        if top_k is not None and any(r >= top_k for r in path):
            raise ValueError(f"tree: rank in {list(path)} is outside the top-{top_k} candidates; use ranks < {top_k}")
        paths.append(tuple(path))
    seen = set()
    for path in paths:
        if path in seen:
            raise ValueError(f"tree: duplicate path {list(path)}; list every node once")
        seen.add(path)
    for path in paths:
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(f"tree: path {list(path)} has no parent {list(path[:-1])}; "
                             f"every prefix of a path must be in the tree")
        if num_heads is not None and len(path) > num_heads:
            raise ValueError(f"tree: path {list(path)} is {len(path)} deep but there are only {num_heads} heads; "
                             f"use paths of length <= {num_heads}")
    return sorted(paths, key=lambda p: (len(p), p))


def build_tree(choices: Sequence[Sequence[int]], num_heads: int | None = None, top_k: int | None = None) -> MedusaTree:
    """Rank paths -> MedusaTree (on CPU; move it with .to(device) once); `top_k`: how many guesses a head ranks."""
    paths = validate_choices(choices, num_heads, top_k)
    index = {(): 0} | {path: i + 1 for i, path in enumerate(paths)}
    n = len(index)
    max_depth = max((len(p) for p in paths), default=0)
    depth = torch.zeros(n, dtype=torch.long)
    parent = torch.zeros(n, dtype=torch.long)
    head = torch.zeros(n, dtype=torch.long)
    rank = torch.zeros(n, dtype=torch.long)
    tree_mask = torch.eye(n, dtype=torch.bool)
    node_paths = torch.zeros(n, max_depth + 1, dtype=torch.long)
    for path, i in index.items():  # built once per tree, not per step
        depth[i] = len(path)
        node_paths[i, :] = i
        if path:
            parent[i] = index[path[:-1]]
            head[i] = len(path) - 1
            rank[i] = path[-1]
        for d in range(len(path)):
            ancestor = index[path[:d]]
            tree_mask[i, ancestor] = True
            node_paths[i, d] = ancestor
    return MedusaTree(depth, parent, tree_mask, node_paths, tuple(paths), head, rank)


def grow_tree(rank_accuracy: Sequence[Sequence[float]], num_nodes: int) -> list[list[int]]:
    """Greedy sparse tree of `num_nodes` nodes (root included) maximising expected accepted length.

    rank_accuracy[k][r] is the probability that head k's rank-r candidate is the right token
    (for dependent heads: given that its parent was right). A node's value is the product of
    the accuracies along its path; the expected accepted length is the sum of node values, and
    since a child is never worth more than its parent, taking the best frontier node each time
    yields a valid (prefix-closed) tree that is optimal for that sum.
    """
    num_heads = len(rank_accuracy)
    chosen: list[list[int]] = []
    frontier = [(-float(rank_accuracy[0][r]), (r,)) for r in range(len(rank_accuracy[0]))] if num_heads else []
    heapq.heapify(frontier)
    while frontier and len(chosen) < num_nodes - 1:
        neg_value, path = heapq.heappop(frontier)
        chosen.append(list(path))
        if len(path) < num_heads:
            for r, acc in enumerate(rank_accuracy[len(path)]):
                heapq.heappush(frontier, (neg_value * float(acc), path + (r,)))
    return chosen


# Rank accuracies of the shape Medusa reports for chat models (top-1 of head k decaying with k,
# lower ranks sharply less likely): only used to lay out the built-in default trees.
_PRIOR_TOP1 = (0.6, 0.4, 0.3, 0.25, 0.2)
_PRIOR_RANK_DECAY = (1.0, 0.25, 0.12, 0.07, 0.05, 0.035, 0.025, 0.02, 0.015, 0.01)

DEFAULT_TREE_SIZES = (8, 16, 32, 64)


def default_tree(num_heads: int, num_nodes: int = 16) -> list[list[int]]:
    """A built-in tree of about `num_nodes` nodes (root included) for `num_heads` heads."""
    prior = [[_PRIOR_TOP1[min(k, len(_PRIOR_TOP1) - 1)] * decay for decay in _PRIOR_RANK_DECAY]
             for k in range(num_heads)]
    return grow_tree(prior, num_nodes)


@dataclass(frozen=True)
class DynamicTree:
    """Eagle heads' tree chosen anew each step from their own confidence (EAGLE-2), in place of a fixed layout.

    Level by level, the `beam` candidates with the highest path probability (the product of the draft's probabilities
    along the path) take `top_k` children each, drafted by one draft-layer pass over the beam; the step's tree is the
    best candidates by that probability (a child never scores above its parent, so they form a tree). In a batch each
    row has its own beam and tree, of one size. How many nodes: `nodes` (root included), or with `step_ms` the size
    n <= nodes with the most expected tokens per millisecond, step_ms[n - 1] being a step's cost with n nodes and the
    expected tokens the rows' own ones plus their chosen candidates' probabilities, scaled by how well they have
    foretold the tokens the trees' nodes matched so far in the call (see propose.DynamicDraftLayerProposer).
    """

    nodes: int
    top_k: int = 4
    beam: int = 4
    step_ms: tuple[float, ...] | None = None

    def __post_init__(self):
        for name in ("nodes", "top_k", "beam"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DynamicTree: {name} must be an integer >= 1, got {value!r}")
        if self.step_ms is not None and len(self.step_ms) < self.nodes:
            raise ValueError(f"DynamicTree: step_ms holds {len(self.step_ms)} costs, one per tree size 1 .. nodes="
                             f"{self.nodes} needed")
