"""Training a DFlash block drafter (dflash.py) as speculators 0.9.0 trains one: `medusa-spec train --head-type dflash`.

What the reference does, and this loop with it (speculators/models/dflash/core.py _backbone_forward, utils.py
select_anchors, metrics.py compute_metrics, losses/utils.py dflash_loss_decay and loss_function, losses/eager.py
kl_div_loss):
- Anchors: up to max_anchors answer positions of a row (loss mask set, the row's last block_size positions left
  out), drawn at random without replacement.
- A block per anchor a: [x_a, m, ..., m] (m the mask token) at positions a .. a + block_size - 1; it sees the
  context's auxiliary features before a, in a's own example of a packed row, and its whole block (full attention).
- Slot k >= 1 learns the base model's distribution of the token at a + k: its logits at a + k - 1 over the draft
  vocabulary (the LM head's t2d rows), by KL divergence; slot 0 (the anchor) is not trained. Slot k weighs
  exp(-(k - 1) / gamma); a row's loss is its weighted sum over counted slots / (their number + 1e-5), the batch's
  the mean over rows. A slot counts where its token is an answer token of the anchor's example (speculators counts
  the loss mask alone; a block crossing into the next example of its packed row reads that example's prompt, which
  the loss mask leaves out, so the two agree on chat data).
- Trained: fc, hidden_norm, the layers, norm. The LM head is the base's rows, frozen, and the embeddings the base's.

The base runs frozen under no_grad once per batch; its hidden states are not cached (--cache-hidden is for heads).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..columnwise import columnwise_copy
from ..dflash import DFlashDraft, load_dflash, new_dflash, save_dflash
from ..eagle3 import default_feature_layers
from .checkpoint import DATA_FINGERPRINT, load_checkpoint, save_checkpoint
from .config import TrainConfig
from .data import collate
from .draft_vocab import answer_token_counts, coverage, frequent_tokens
from .hidden_cache import fingerprint
from .loop import (
    TRAINED_ON,
    answer_tokens_seen,
    batch_indices,
    clock,
    cosine_with_warmup,
    eta_seconds,
    past_time_limit,
    prepare_run,
    rows_read,
    train_log,
    write_trained_on,
)
from .module import attention_mask, base_logits_over

LOSS_EPS = 1e-5  # speculators' _LOSS_REDUCTION_EPS


class BlockStats(NamedTuple):
    """A batch's slots, for logs and evaluation: per slot and rank r, hits (the draft's rank-r token is the base's
    argmax) and per slot the slots counted; over blocks whose first drafted slot counts, the sum of their accepted
    lengths (1 + the leading rank-0 hits: the tokens a step verifying the block's argmax chain would emit) and their
    number. Per-slot rank accuracies are what tree.grow_tree builds a tree from, as for Medusa heads: a slot drafts a
    depth without seeing the tokens drafted above it."""

    hits: torch.Tensor     # [block_size, ranks]
    counted: torch.Tensor  # [block_size]
    accepted: torch.Tensor  # []
    blocks: torch.Tensor   # []


def select_anchors(loss_mask: torch.Tensor, block_size: int, max_anchors: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """loss_mask [B, T] -> (anchors [B, A], valid [B, A]): each row's anchors, up to max_anchors of its answer
    positions outside its last block_size, drawn at random without replacement (`generator`, on the CPU); A is the
    most any row has, a row with fewer padded with invalid anchors at 0."""
    allowed = loss_mask.bool().cpu().clone()
    allowed[:, -block_size:] = False
    most = max(1, min(max_anchors, int(allowed.sum(1).max())))
    draw = torch.rand(allowed.shape, generator=generator).masked_fill(~allowed, 2.0)  # the A smallest: a sample
    picked = draw.topk(most, dim=1, largest=False)
    valid = picked.values < 2.0
    return picked.indices.masked_fill(~valid, 0).to(loss_mask.device), valid.to(loss_mask.device)


def slot_weights(block_size: int, gamma: float, device: torch.device) -> torch.Tensor:
    """[block_size]: slot k's loss weight, exp(-(k - 1) / gamma) for k >= 1 and 0 for the anchor's slot."""
    slot = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.exp(-(slot - 1).clamp(min=0) / gamma) * (slot != 0)


class DFlashTrainModule(nn.Module):
    """The frozen base model and the DFlash draft behind one forward (what accelerate wraps)."""

    def __init__(self, base_model: nn.Module, draft: DFlashDraft, bool_mask: bool, takes_logits_to_keep: bool):
        super().__init__()
        if any(layer.sliding_window is not None for layer in draft.layers):
            raise ValueError("training DFlash drafts with sliding-window layers is not supported: new drafts have "
                             "full-attention layers")
        self.base_model = base_model
        self.draft = draft
        self.bool_mask = bool_mask
        self.takes_logits_to_keep = takes_logits_to_keep

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, segment_ids: torch.Tensor,
                loss_mask: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, gamma: float,
                ranks: int = 1) -> tuple[torch.Tensor, BlockStats]:
        """A packed batch [B, T] (data.collate's) and its anchors [B, A] -> (loss, stats with `ranks` ranks)."""
        draft, config = self.draft, self.draft.config
        size = config.block_size
        with torch.no_grad():
            # A frozen base through a columnwise_copy: oneDNN's kernels on x86 CPUs, as TrainModule runs it.
            mask = attention_mask(segment_ids, self.bool_mask, self.base_model.get_output_embeddings().weight.dtype)
            keep = {"logits_to_keep": 1} if self.takes_logits_to_keep else {}
            states = columnwise_copy(self.base_model)(input_ids=input_ids, attention_mask=mask,
                                                      position_ids=position_ids, use_cache=False,
                                                      output_hidden_states=True, **keep).hidden_states
            features = torch.cat([states[i] for i in config.aux_layer_ids], dim=-1)
        rows, length = input_ids.shape
        count = anchors.shape[1]
        slot = torch.arange(size, device=input_ids.device)
        at = (anchors[:, :, None] + slot).flatten(1)  # [B, A * S]: each slot's position in the row
        anchor_segment = segment_ids.gather(1, anchors)  # [B, A]
        counted = (valid[:, :, None] & (slot >= config.drafted_slots.start)
                   & loss_mask.gather(1, at).view(rows, count, size)
                   & (segment_ids.gather(1, at).view(rows, count, size) == anchor_segment[:, :, None]))
        # The base's distribution of each slot's token: its logits one position earlier (at the anchor's own
        # position for slot 0, which is not counted), over the draft vocabulary.
        before = (at - 1).clamp(min=0)
        final = states[-1].gather(1, before[:, :, None].expand(-1, -1, states[-1].shape[-1]))
        targets = base_logits_over(self.base_model, final, draft.token_map)  # [B, A * S, V']

        context = draft.context(features, position_ids, segment_ids > 0)
        tokens = torch.full((rows, count, size), config.mask_token_id, dtype=torch.long, device=input_ids.device)
        tokens[:, :, 0] = input_ids.gather(1, anchors)
        positions = position_ids.gather(1, anchors)[:, :, None] + slot
        # Slot i of block j sees context slots t < anchor j of its example, and block j: [B, 1, A * S, T + A * S].
        sees_context = ((torch.arange(length, device=input_ids.device) < anchors[:, :, None])
                        & (segment_ids[:, None, :] == anchor_segment[:, :, None]))  # [B, A, T]
        sees_context = sees_context[:, :, None, :].expand(-1, -1, size, -1).reshape(rows, count * size, length)
        block = torch.arange(count, device=input_ids.device).repeat_interleave(size)
        sees_block = (block[:, None] == block[None, :]).expand(rows, -1, -1)
        layer_mask = torch.cat([sees_context, sees_block], dim=-1)[:, None]
        out = draft.block_states(context, tokens.flatten(1), positions.flatten(1), lambda window: layer_mask)
        logits = draft.project(out).float()  # [B, A * S, V']

        kl = F.kl_div(logits.log_softmax(-1), targets.softmax(-1), reduction="none").sum(-1).view(rows, count, size)
        weight = slot_weights(size, gamma, logits.device)
        counted_f = counted.float()
        loss = ((kl * counted_f * weight).flatten(1).sum(1) / (counted_f.flatten(1).sum(1) + LOSS_EPS)).mean()
        with torch.no_grad():
            ranked = logits.topk(min(ranks, logits.shape[-1]), dim=-1).indices  # [B, A * S, ranks]
            hit = (ranked == targets.argmax(-1, keepdim=True)).view(rows, count, size, -1) & counted[..., None]
            first = config.drafted_slots.start
            run = hit[:, :, first:, 0].long().cumprod(-1).sum(-1)  # leading hits of each block
            scored = counted[:, :, first]
            stats = BlockStats(hit.sum((0, 1)), counted.sum((0, 1)), (run + 1)[scored].sum(), scored.sum())
        return loss, stats


def new_stats(size: int, ranks: int, device: torch.device) -> BlockStats:
    zero = torch.zeros((), dtype=torch.long, device=device)
    return BlockStats(torch.zeros(size, ranks, dtype=torch.long, device=device),
                      torch.zeros(size, dtype=torch.long, device=device), zero, zero.clone())


def add_stats(total: BlockStats, more: BlockStats) -> BlockStats:
    return BlockStats(*(a + b for a, b in zip(total, more)))


def stats_summary(stats: BlockStats, first: int) -> dict:
    """Per drafted slot top-1 (the draft's argmax is the base's), with more ranks each slot's rank accuracies, and
    the blocks' mean accepted length."""
    hits, counted = stats.hits.tolist()[first:], stats.counted.tolist()[first:]
    accuracy = [[round(h / max(c, 1), 4) for h in row] for row, c in zip(hits, counted)]
    summary = {"slot_top1": [row[0] for row in accuracy],
               "accepted_length": round(int(stats.accepted) / max(int(stats.blocks), 1), 4),
               "blocks": int(stats.blocks)}
    return summary if stats.hits.shape[1] == 1 else {**summary, "rank_accuracy": accuracy}


@torch.no_grad()
def evaluate_dflash(module: DFlashTrainModule, rows: list, batch_size: int, pad_token_id: int, cfg: TrainConfig,
                    device: torch.device) -> dict:
    """The draft on held-out rows over seeded anchors (the same every time): slot top-1, each slot's accuracy at
    ranks 0 .. eval_ranks - 1 (tree.grow_tree's rank_accuracy) and the mean accepted length."""
    if not rows:
        return {}
    was_training = module.training
    module.eval()
    size = module.draft.config.block_size
    total = new_stats(size, cfg.eval_ranks, device)
    generator = torch.Generator().manual_seed(cfg.seed)
    for start in range(0, len(rows), batch_size):
        batch = {k: v.to(device) for k, v in collate(rows[start: start + batch_size], pad_token_id).items()}
        anchors, valid = select_anchors(batch["loss_mask"], size, cfg.max_anchors, generator)
        _, stats = module(batch["input_ids"], batch["position_ids"], batch["segment_ids"], batch["loss_mask"],
                          anchors, valid, cfg.dflash_decay_gamma, cfg.eval_ranks)
        total = add_stats(total, stats)
    module.train(was_training)
    return stats_summary(total, module.draft.config.drafted_slots.start)


def mask_token(tokenizer, cfg: TrainConfig, vocab_size: int) -> int:
    """--mask-token-id, else the tokenizer's mask, unk or pad token: what a block's slots after the anchor hold."""
    chosen = cfg.mask_token_id
    if chosen is None:
        chosen = next((t for t in (tokenizer.mask_token_id, tokenizer.unk_token_id, tokenizer.pad_token_id)
                       if t is not None), None)
    if chosen is None or not 0 <= chosen < vocab_size:
        raise ValueError(f"--mask-token-id {chosen!r}: give a token id of the base's vocabulary [0, {vocab_size}) "
                         f"for the block's masked slots (the tokenizer has no mask, unk or pad token)")
    return chosen


def continued_dflash(base_model: nn.Module, cfg: TrainConfig) -> tuple[DFlashDraft, TrainConfig]:
    """The DFlash draft saved in cfg.init_heads (a speculators DFlash folder) on `base_model`, in fp32 with its LM
    head frozen as new_dflash makes it, and cfg with its shape: a flag given with another value than the draft's is
    refused, naming both."""
    path = Path(cfg.init_heads)
    draft = load_dflash(path, base_model)
    config = draft.config
    reduced = config.draft_vocab_size < config.vocab_size
    theirs = {"num_layers": len(draft.layers), "feature_layers": list(config.aux_layer_ids),
              "draft_vocab": config.draft_vocab_size if reduced else None, "block_size": config.block_size,
              "mask_token_id": config.mask_token_id}
    defaults = type(cfg).__dataclass_fields__
    for name, value in theirs.items():
        given = getattr(cfg, name)  # None, or block_size's default: left out
        left_out = given is None or (name == "block_size" and given == defaults[name].default)
        if not left_out and given != value:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"--init-heads {path}: its DFlash draft has {flag} {value}, but {given} was given; leave "
                             f"{flag} out to train it on as it is, or drop --init-heads to train a new draft")
    if config.sample_from_anchor or config.sliding_window_non_causal:
        raise ValueError(f"--init-heads {path}: a draft with sample_from_anchor or sliding_window_non_causal set is "
                         f"decoded here but not trained (speculators trains neither setting)")
    draft = draft.float()  # trained in fp32, whatever dtype the folder keeps
    for param in draft.parameters():  # its own copies: training updates them in place, not the tensors as read
        param.data = param.data.clone()
    if draft.lm_head is not None:
        draft.lm_head.requires_grad_(False)  # the base's rows, frozen (new_dflash)
    return draft, dataclasses.replace(cfg, **{k: v for k, v in theirs.items() if k != "draft_vocab" or reduced})


def train_dflash(cfg: TrainConfig) -> dict:
    """Train a new DFlash draft for cfg.model on cfg.data, checkpointing as heads do, and save it into cfg.output as a
    speculators DFlash folder (load_dflash reads it; vLLM and SGLang serve the format); returns a summary."""
    run = prepare_run(cfg)
    cfg, accelerator, output_dir = run.cfg, run.accelerator, run.output_dir
    base_model, tokenizer, spec, train_rows, eval_rows = run.base_model, run.tokenizer, run.spec, run.train_rows, \
        run.eval_rows
    vocab = spec.vocab_size
    base_model.requires_grad_(False)
    vocab_summary = {}
    if cfg.init_heads is not None:
        draft, cfg = continued_dflash(base_model, cfg)
    else:
        token_ids = None
        if cfg.draft_vocab is not None:  # the most frequent answer tokens, in token-id order as speculators' t2d
            counts = answer_token_counts(train_rows, vocab)
            token_ids = frequent_tokens(counts, cfg.draft_vocab).sort().values
            sizes = sorted({cfg.draft_vocab, *(s for s in (1024, 2048, 4096, 8192, 16384) if s < vocab)})
            vocab_summary = {"draft_vocab": {"size": cfg.draft_vocab, "coverage": coverage(counts, sizes)}}
        aux = list(cfg.feature_layers) or default_feature_layers(spec.num_layers or 1)
        draft = new_dflash(base_model, cfg.num_layers, cfg.block_size, aux, mask_token(tokenizer, cfg, vocab),
                           token_ids, run.base_name).float()
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)
    max_steps = run.max_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: cosine_with_warmup(s, cfg.warmup_steps, max_steps, cfg.min_lr_ratio))
    module = DFlashTrainModule(base_model, draft, spec.bool_mask, spec.takes_logits_to_keep)
    module, optimizer = accelerator.prepare(module, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    config_dict = {**dataclasses.asdict(cfg), DATA_FINGERPRINT: fingerprint([*train_rows, None, *eval_rows])}
    start_step = load_checkpoint(accelerator, run.checkpoint, config_dict) if run.checkpoint is not None else 0
    log = train_log(accelerator, output_dir, start_step)

    def run_eval():
        return evaluate_dflash(accelerator.unwrap_model(module), eval_rows, cfg.batch_size, tokenizer.pad_token_id,
                               cfg, accelerator.device)

    size, first = cfg.block_size, draft.config.drafted_slots.start
    accelerator.print(f"dflash: {len(train_rows)} train rows, {len(eval_rows)} eval rows, steps {start_step} -> "
                      f"{max_steps}, {accelerator.num_processes} process(es) on {accelerator.device}")
    module.train()
    loss_sum, stats = torch.zeros((), device=accelerator.device), new_stats(size, 1, accelerator.device)
    micro_batches, tokens, since, last_loss = 0, 0, time.perf_counter(), float("nan")
    began, done, timed_out = since, start_step, False
    seen = answer_tokens_seen(train_rows, start_step * cfg.grad_accum, cfg.batch_size, accelerator.num_processes,
                              cfg.seed)
    for step in range(start_step, max_steps):
        for micro in range(cfg.grad_accum):
            micro_step = step * cfg.grad_accum + micro
            rows = batch_indices(micro_step, len(train_rows), cfg.batch_size, accelerator.num_processes,
                                 accelerator.process_index, cfg.seed)
            batch = collate([train_rows[i] for i in rows], tokenizer.pad_token_id)
            tokens += int(batch["segment_ids"].gt(0).sum())
            seen += answer_tokens_seen(train_rows, 1, cfg.batch_size, accelerator.num_processes, cfg.seed,
                                       first=micro_step)
            # The anchors are a function of the micro-step and process, as the rows are: a resumed run draws the same.
            draw = torch.Generator().manual_seed(
                (cfg.seed * 1_000_003 + micro_step) * accelerator.num_processes + accelerator.process_index)
            anchors, valid = select_anchors(batch["loss_mask"], size, cfg.max_anchors, draw)
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            with accelerator.accumulate(module):
                loss, batch_stats = module(batch["input_ids"], batch["position_ids"], batch["segment_ids"],
                                           batch["loss_mask"], anchors.to(accelerator.device),
                                           valid.to(accelerator.device), cfg.dflash_decay_gamma)
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(module.parameters(), cfg.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            loss_sum += loss.detach()
            stats = add_stats(stats, batch_stats)
            micro_batches += 1
        scheduler.step()

        done = step + 1
        if cfg.time_limit is not None and done < max_steps:
            timed_out = past_time_limit(accelerator, began, cfg.time_limit)
        if done % cfg.log_every == 0 or done == max_steps or timed_out:
            last_loss = accelerator.reduce(loss_sum, "mean").item() / micro_batches
            summed = BlockStats(*(accelerator.reduce(t, "sum") for t in stats))
            log({"step": done, "loss": round(last_loss, 4), **stats_summary(summed, first),
                 "lr": [float(f"{lr:.3g}") for lr in scheduler.get_last_lr()],
                 "tokens_per_s": round(tokens * accelerator.num_processes / (time.perf_counter() - since)),
                 "eta": clock(eta_seconds(time.perf_counter() - began, done - start_step,
                                          0 if timed_out else max_steps - done, cfg.time_limit))})
            loss_sum.zero_()
            stats = new_stats(size, 1, accelerator.device)
            micro_batches, tokens, since = 0, 0, time.perf_counter()
        if cfg.eval_every and done % cfg.eval_every == 0 and done < max_steps and not timed_out:
            log({"step": done, "answer_tokens_seen": seen, "eval": run_eval()})
        if cfg.save_every and (done % cfg.save_every == 0 or timed_out):
            save_checkpoint(accelerator, output_dir, done, config_dict, cfg.keep_checkpoints)
        if timed_out:
            accelerator.print(f"--time-limit {cfg.time_limit:g} minutes reached at step {done} of {max_steps}")
            break

    metrics = run_eval()
    log({"step": done, "answer_tokens_seen": seen, "eval": metrics})
    summary = {"head_type": "dflash", "start_step": start_step, "steps": done, "planned_steps": max_steps,
               "train_rows": len(train_rows), "eval_rows": len(eval_rows), "answer_tokens_seen": seen,
               "final_loss": last_loss if not math.isnan(last_loss) else None, **vocab_summary}
    if accelerator.is_main_process:
        save_dflash(accelerator.unwrap_model(module).draft, output_dir)
        read = rows_read(done * cfg.grad_accum, len(train_rows), cfg.batch_size, accelerator.num_processes, cfg.seed)
        write_trained_on(output_dir / TRAINED_ON, run.learned_before | {e.source for i in read for e in train_rows[i]})
    accelerator.wait_for_everyone()
    accelerator.print(f"saved the DFlash draft to {output_dir}")
    return {**summary, "eval": metrics}
