"""Lossless acceptance on a candidate tree (see THEORY.md, "Lossless acceptance on a tree").

At each visited node the base model's next token x is drawn from its processed distribution
(argmax when greedy). If x is one of the node's children, the walk moves there; otherwise x is
emitted as the bonus token and the step ends. Every emitted token is therefore an exact draw
from the base model. Drawing one x per node up front is the same process, because a walk
visits each node at most once; it makes acceptance a few tensor ops with no loop over nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .propose import Candidates
from .tree import Tree


@dataclass(frozen=True)
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if not self.do_sample:
            return
        if not isinstance(self.temperature, (int, float)) or not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when do_sample=True, got {self.temperature!r}; "
                             f"use do_sample=False for greedy")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise ValueError(f"top_k must be an integer >= 1 (0 or None: no top-k filter, as in transformers), "
                             f"got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (or None to disable), got {self.top_p!r}")


def _filter_whole_vocabulary(scores: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """transformers' top-k then top-p warpers, step for step, on [..., V] scores."""
    if sampling.top_k and sampling.top_k < scores.shape[-1]:
        kth = scores.topk(sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1:
        sorted_scores, order = scores.sort(dim=-1)
        remove = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= 1 - sampling.top_p
        remove[..., -1] = False
        scores = scores.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return scores


def kept_scores(logits: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores after temperature, top-k and top-p (nucleus: the smallest set with mass >= top_p, at
    least one token), as transformers applies them, -inf where filtered out: ([..., V], None), or
    ([..., M], their token ids [..., M]) when top-k narrows the vocabulary to a window of its 2 * top_k
    best scores. The window is the point: top-p then sorts M scores per node instead of the whole
    vocabulary (sorting the whole vocabulary at every node cost more than the default model's verify
    pass). Where the window could keep other tokens than transformers' sort
    (more than top_k scores tied with the k-th, or equal scores on both sides of the top-p cut, whose
    order torch.sort leaves open, as in bf16 logits) the whole vocabulary is filtered instead."""
    scores = logits.float() / sampling.temperature
    k = sampling.top_k
    if not k or 2 * k >= scores.shape[-1]:
        return _filter_whole_vocabulary(scores, sampling), None
    window, ids = scores.topk(2 * k, dim=-1)  # highest first
    kth = window[..., k - 1 : k]
    ambiguous = window[..., -1:] == kth  # top-k's ties may reach past the window
    window = window.masked_fill(window < kth, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1:
        ascending = window.flip(-1)
        remove = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - sampling.top_p
        remove[..., -1] = False
        cut = remove.sum(dim=-1, keepdim=True)  # tokens removed: the lowest kept one sits at `cut`
        last_removed = ascending.gather(-1, (cut - 1).clamp(min=0))
        ambiguous |= (cut > 0) & last_removed.isfinite() & (last_removed == ascending.gather(-1, cut))
        window = window.masked_fill(remove.flip(-1), float("-inf"))
    if bool(ambiguous.any()):  # a host sync; on CPU free, on GPU cheap beside the sort it saves
        return _filter_whole_vocabulary(scores, sampling), None
    return window, ids


def processed_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """[..., V] logits -> the distribution transformers samples from (see kept_scores)."""
    scores, ids = kept_scores(logits, sampling)
    probs = scores.softmax(dim=-1)
    if ids is None:
        return probs
    return torch.zeros(logits.shape, dtype=probs.dtype, device=probs.device).scatter_(-1, ids, probs)


def draw_targets(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The base model's next token at every node: logits [B, N, V] -> tokens [B, N]. Sampling draws
    inside top-k's window where there is one: the same distribution, without a pass over V."""
    if not sampling.do_sample:
        return logits.argmax(dim=-1)
    scores, ids = kept_scores(logits, sampling)
    drawn = torch.multinomial(scores.softmax(dim=-1).flatten(0, -2), 1).view(*scores.shape[:-1], 1)
    return (drawn if ids is None else ids.gather(-1, drawn)).squeeze(-1)


def repeats_a_sibling(node_tokens: torch.Tensor, tree: Tree) -> torch.Tensor:
    """[B, N] bool: the node holds the same token as a sibling earlier in the tree.

    Two siblings with one token are reached together; walking on into whichever subtree goes deeper would
    pick a continuation by its own draws, a biased sample. Keeping only the first of them reachable is
    decided by the tokens alone, before any draw, so every emitted token stays an exact draw.
    """
    index = torch.arange(tree.num_nodes, device=node_tokens.device)
    parent = tree.rows().parent  # [B or 1, N]
    earlier_sibling = (parent[:, :, None] == parent[:, None, :]) & (index[None, :] < index[:, None])  # [B or 1, N, N]
    earlier_sibling[:, :, 0] = False  # the root is its own parent, not a sibling of depth-1 nodes
    return ((node_tokens[:, :, None] == node_tokens[:, None, :]) & earlier_sibling).any(dim=-1)


def accept(node_tokens: torch.Tensor, logits: torch.Tensor, tree: Tree,
           sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk the tree along the base model's own tokens.

    node_tokens [B, N]: candidates (node 0 = root, already emitted; a negative id, which no draw
    equals, keeps a node and its subtree out of reach, and so does a token an earlier sibling already
    holds: siblings may repeat tokens); logits [B, N, V]: the base model's logits
    after each node. Returns (last_node [B], accept_length [B], bonus [B]): the
    deepest node reached, how many candidates were accepted (its depth; bonus not counted), and
    the base model's token after it.
    """
    targets = draw_targets(logits, sampling)  # [B, N]
    rows = tree.rows()  # a shared tree as one row, or each row's own tree
    # Node i is reached iff it and every ancestor below the root equal their parent's target.
    matches = (node_tokens == targets.gather(1, rows.parent.expand_as(targets))) & ~repeats_a_sibling(node_tokens,
                                                                                                        tree)
    matches[:, 0] = True  # the root was emitted before this step
    reached = (rows.tree_mask & ~matches[:, None, :]).sum(-1) == 0  # [B, N]: no mismatched ancestor
    # Reachable siblings hold distinct tokens, so reached nodes form one chain; take its deepest.
    accept_length, last_node = (reached * (rows.depth + 1)).max(dim=-1)
    return last_node, accept_length - 1, targets.gather(1, last_node[:, None])[:, 0]


def accept_draft(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, logits: torch.Tensor,
                 sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """The classic draft-model rule on a chain (THEORY.md, "The classic protocol"); names match the paper.

    draft_tokens [B, K], drawn from the draft model's processed distribution q = draft_probs [B, K, V]
    (None when greedy: the drafts are the draft model's argmax); logits [B, K+1, V]: the base model's
    logits after the root and after each draft token. Token i is kept with probability min(1, p_i/q_i);
    the first rejected one is replaced by a draw from norm(max(0, p_i - q_i)); when all K are kept the
    bonus is a draw from p_K. Greedy: keep while the draft equals the base model's argmax.
    Returns (accept_length [B], bonus [B]): draft tokens kept (bonus not counted) and the token after them.
    """
    if not sampling.do_sample:
        targets = logits.argmax(dim=-1)  # [B, K+1]
        accept_length = (draft_tokens == targets[:, :-1]).long().cumprod(dim=-1).sum(dim=-1)
        return accept_length, targets.gather(1, accept_length[:, None])[:, 0]
    p = processed_probs(logits, sampling)  # [B, K+1, V]
    p_draft = p[:, :-1].gather(2, draft_tokens[..., None])[..., 0]          # p_i(x_i)
    q_draft = draft_probs.gather(2, draft_tokens[..., None])[..., 0]         # q_i(x_i) > 0: x_i was drawn from q_i
    kept = torch.rand_like(p_draft) * q_draft < p_draft                      # u < p/q, without dividing
    accept_length = kept.long().cumprod(dim=-1).sum(dim=-1)
    # q after the last draft is 0, so the same residual formula gives p_K when every draft was kept.
    q = torch.cat([draft_probs.float(), torch.zeros_like(draft_probs[:, :1], dtype=torch.float)], dim=1)
    at = accept_length[:, None, None].expand(-1, 1, p.shape[-1])
    p_at = p.gather(1, at)[:, 0]
    residual = (p_at - q.gather(1, at)[:, 0]).clamp(min=0)
    # A rejection means p < q at the draft, so p > q elsewhere; only float rounding can leave no mass.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)
    return accept_length, torch.multinomial(residual, 1)[:, 0]


def accept_candidates(candidates: Candidates, logits: torch.Tensor,
                      sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rule the candidates call for: the classic min(1, p/q) rule where the proposer drew them from a
    distribution it reports (draft_probs, a chain), else the tree rule. Both walk a chain alike when greedy.
    logits [B, N, V] -> (last_node [B], accept_length [B], bonus [B]) as in accept."""
    if candidates.draft_probs is not None:
        accept_length, bonus = accept_draft(candidates.node_tokens[:, 1:], candidates.draft_probs, logits, sampling)
        return accept_length, accept_length, bonus  # on a chain, node i is at depth i
    tokens = candidates.node_tokens if candidates.accept_tokens is None else candidates.accept_tokens
    return accept(tokens, logits, candidates.tree, sampling)
