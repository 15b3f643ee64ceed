"""The reduced draft vocabulary: the answer tokens the heads may propose, chosen by frequency.

A head can only be right when the next token is in its vocabulary, so the size is a trade of
coverage (the fraction of answer tokens inside it) against the cost of the heads' projection.
"""

from __future__ import annotations

import torch

from .data import Example


def answer_token_counts(rows: list[list[Example]], vocab_size: int) -> torch.Tensor:
    """[V] how often each token appears as a trained (assistant) token in `rows`."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in rows:
        for example in row:
            ids = torch.tensor(example.input_ids, dtype=torch.long)[torch.tensor(example.loss_mask, dtype=torch.bool)]
            counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def frequent_tokens(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent token ids, most frequent first (ties by id, so the choice is reproducible)."""
    if not 1 <= size <= counts.numel():
        raise ValueError(f"--draft-vocab must be between 1 and the vocabulary size {counts.numel()}, got {size}")
    order = torch.argsort(-counts * counts.numel() + torch.arange(counts.numel()), stable=True)  # by count, then id
    return order[:size].clone()


def coverage(counts: torch.Tensor, sizes) -> dict[int, float]:
    """{size: fraction of answer tokens among the `size` most frequent}."""
    ranked = counts.sort(descending=True).values.cumsum(0).double() / max(int(counts.sum()), 1)
    return {size: round(float(ranked[min(size, counts.numel()) - 1]), 4) for size in sizes}


def draft_index(token_map: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] token id -> its index in the draft vocabulary, -1 where it has none (the loss skips those)."""
    index = torch.full((vocab_size,), -1, dtype=torch.long)
    index[token_map] = torch.arange(token_map.numel())
    return index
