"""Head accuracy against the base model's own greedy tokens, and the tree grown from it.

Head k at position t guesses the token at t + k + 2. At decoding time that guess is accepted when
it equals what the base model itself would emit there, i.e. the base's greedy token from position
t + k + 1; so that token, not the data's, is the target here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..autotree import expected_tokens_per_step
from ..config import CONFIG_NAME, MedusaConfig
from ..io import finish_interrupted_save, staged_save
from ..tree import grow_tree
from .data import collate
from .loss import target_mask


def head_hits(head_logits: torch.Tensor, greedy: torch.Tensor, loss_mask: torch.Tensor, segment_ids: torch.Tensor,
              k: int, top_k: int, token_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Head k, position by position: head_logits [B, T, K, V'], greedy [B, T] (the base's argmax at each position)
    -> (hits [B, T - k - 2, top_k], valid [B, T - k - 2]): hits[b, t, r] is whether head k's rank-r candidate at t
    is the base's greedy token at t + k + 2, valid[b, t] whether that position counts. `token_map` [V']: the heads'
    draft vocabulary (index -> token id), if reduced."""
    shift = k + 2
    candidates = head_logits[:, :-shift, k].topk(top_k, dim=-1).indices  # [B, T - shift, top_k]
    if token_map is not None:
        candidates = token_map[candidates]
    target = greedy[:, shift - 1: -1]  # the argmax at t + shift - 1 is the base's token for t + shift
    return candidates == target[..., None], target_mask(loss_mask, segment_ids, shift)


def count_rank_hits(head_logits: torch.Tensor, base_logits: torch.Tensor, loss_mask: torch.Tensor,
                    segment_ids: torch.Tensor, top_k: int,
                    token_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """head_logits [B, T, K, V'], base_logits [B, T, V] -> (hits [K, top_k], positions [K]):
    hits[k, r] counts positions where head k's rank-r candidate is the base's greedy token (head_hits)."""
    num_heads, length = head_logits.shape[2], head_logits.shape[1]
    hits = torch.zeros(num_heads, top_k, dtype=torch.long, device=head_logits.device)
    positions = torch.zeros(num_heads, dtype=torch.long, device=head_logits.device)
    greedy = base_logits.argmax(dim=-1)
    for k in range(num_heads):
        if length <= k + 2:
            continue
        hit, valid = head_hits(head_logits, greedy, loss_mask, segment_ids, k, top_k, token_map)
        hits[k] = (hit & valid[..., None]).sum(dim=(0, 1))
        positions[k] = valid.sum()
    return hits, positions


def evaluate(module, rows, batch_size: int, pad_token_id: int, top_k: int, accelerator) -> dict:
    """Rank accuracies of the heads on `rows` (split over processes, summed).

    `module` is the unwrapped training module: evaluating outside DDP avoids collectives inside
    forward, which would hang when processes hold different numbers of batches.
    """
    was_training = module.training
    module.eval()
    hits = torch.zeros(module.heads.num_heads, top_k, dtype=torch.long, device=accelerator.device)
    positions = torch.zeros(module.heads.num_heads, dtype=torch.long, device=accelerator.device)
    with torch.no_grad():
        for start in range(accelerator.process_index * batch_size, len(rows), batch_size * accelerator.num_processes):
            batch = collate(rows[start: start + batch_size], pad_token_id)
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            # Dependent heads read the base's own greedy tokens as their path: accuracy given a right parent.
            out = module(batch["input_ids"], batch["position_ids"], batch["segment_ids"], base_logits=True,
                         greedy_paths=True)
            head_logits = module.heads.project(out.head_states, module.base_model.get_output_embeddings())
            batch_hits, batch_positions = count_rank_hits(head_logits, out.base_logits, batch["loss_mask"],
                                                          batch["segment_ids"], top_k, module.heads.token_map)
            hits += batch_hits
            positions += batch_positions
    module.train(was_training)
    return accuracy_metrics(accelerator.reduce(hits, "sum").cpu(), accelerator.reduce(positions, "sum").cpu())


def accuracy_metrics(hits: torch.Tensor, positions: torch.Tensor) -> dict:
    """hits [K, top_k], positions [K] -> rank accuracies (what the tree builder reads) and top-1 / top-k."""
    rank_accuracy = hits.double() / positions.clamp(min=1).double()[:, None]
    top_k = hits.shape[1]

    def rounded(t):
        return [round(x, 4) for x in t.tolist()]

    return {"positions": positions.tolist(), "rank_accuracy": [rounded(row) for row in rank_accuracy],
            "top1": rounded(rank_accuracy[:, 0]), f"top{top_k}": rounded(rank_accuracy.sum(dim=1))}


def calibrate_tree(adapter_dir: str | Path, num_nodes: int, eval_metrics: dict | None = None) -> list[list[int]]:
    """Grow the tree of `num_nodes` nodes (root included) from measured rank accuracies and store it
    as the adapter's default tree, rewriting only its medusa_config.json (atomically).
    `eval_metrics`: fresh measurements (stored too), else those saved by training."""
    finish_interrupted_save(adapter_dir)  # else a save killed midway could pair this config with other weights
    path = Path(adapter_dir) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; point --heads at a folder written by `medusa-spec train`")
    config = MedusaConfig.from_json_file(path)
    metrics = {**config.metrics, **({"eval": eval_metrics} if eval_metrics is not None else {})}
    rank_accuracy = metrics.get("eval", {}).get("rank_accuracy")
    if not rank_accuracy:
        raise ValueError(f"{path} holds no measured rank accuracies (metrics.eval.rank_accuracy); train with "
                         f"--eval-examples > 0, or pass --model and --data to `medusa-spec tree` to measure them")
    tree = grow_tree(rank_accuracy, num_nodes)
    expected = round(expected_tokens_per_step(tree, rank_accuracy), 4)
    metrics["tree"] = {"nodes": num_nodes, "expected_tokens_per_step": expected}
    config = dataclasses.replace(config, tree=tree, metrics=metrics)  # re-validates
    with staged_save(adapter_dir, (CONFIG_NAME,)) as staged:
        config.to_json_file(staged / CONFIG_NAME)
    return tree
