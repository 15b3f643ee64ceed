"""The training loop: Medusa-1 (frozen base, heads trained) or Medusa-2 (LoRA on the base + heads).

One script for one CPU, one GPU or `accelerate launch` on several GPUs (DDP or DeepSpeed ZeRO-1/2):
accelerate places the model, wraps it for data parallelism, applies mixed precision and
accumulates gradients. A step is one optimizer update over grad_accum micro-batches of
batch_size rows on every process.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, DistributedType, set_seed
from peft import LoraConfig, get_peft_model
from torch import nn

from ..base import inspect_base_model
from ..config import HEAD_TYPES, MedusaConfig
from ..model import MedusaModel
from ..verify import model_mask
from .checkpoint import keep_trainable_weights_only, latest_checkpoint, load_checkpoint, save_checkpoint
from .data import collate, make_rows, read_conversations, tokenize_conversation
from .draft_vocab import answer_token_counts, coverage, draft_index, frequent_tokens
from .evaluate import evaluate
from .hidden_cache import fingerprint, open_hidden_cache, reset_if_stale
from .load import load_model_and_tokenizer
from .loss import heads_loss, kl_to_teacher, shifted_cross_entropy
from .options import option


@dataclass
class TrainConfig:
    """Settings of `medusa-spec train` (the flags are generated from these fields)."""

    model: str = option(None, "local folder of the base model and tokenizer (save_pretrained layout)", required=True)
    data: list[str] = option(None, "conversation JSONL files written by `medusa-spec distill`", required=True)
    output_dir: str = option(None, "where the adapter, checkpoints/ and train_log.jsonl go", required=True)
    mode: str = option("medusa1", "medusa1: frozen base, heads only; medusa2: LoRA on the base too",
                       choices=("medusa1", "medusa2"))
    num_heads: int = option(4, "number of heads (head k predicts the token k + 2 ahead)")
    num_layers: int = option(1, "residual blocks per head")
    share_lm_head: bool = option(True, "project through the base LM head (no per-head vocabulary matrix)")
    head_type: str = option("medusa", "medusa: heads read the hidden state; dependent (Hydra-style): also the "
                            "embeddings of the tokens on the path before their guess", choices=HEAD_TYPES)
    context_heads: int = option(0, "attention heads of a context layer the heads read through (attention over the "
                                "text so far, with each position's next token; e.g. hidden_size / 64); 0: none")
    draft_vocab: int | None = option(None, "heads score only the N most frequent answer tokens of the training data "
                                     "(a token map saved with them); default: the full vocabulary")
    head_decay: float = option(0.8, "weight decay^k of head k in the heads' loss")
    heads_target: str = option("tokens", "what the heads learn at each position: tokens, the data's token "
                               "(cross-entropy); teacher, the base model's whole next-token distribution there "
                               "(soft targets from its own logits: more signal per position, and right for data "
                               "the base did not write)", choices=("tokens", "teacher"))
    max_length: int = option(1024, "tokens per row; longer conversations are truncated")
    pack: bool = option(True, "pack several conversations per row (else one per row, padded)")
    batch_size: int = option(8, "rows per micro-batch and process")
    grad_accum: int = option(1, "micro-batches per optimizer step")
    epochs: float = option(1.0, "passes over the training rows (unless --max-steps)")
    max_steps: int | None = option(None, "optimizer steps; overrides --epochs")
    lr: float = option(1e-3, "peak learning rate of the heads")
    base_lr: float = option(1e-4, "peak learning rate of the LoRA weights (medusa2)")
    weight_decay: float = option(0.0, "AdamW weight decay")
    warmup_steps: int = option(50, "linear warm-up steps before the cosine decay")
    min_lr_ratio: float = option(0.1, "final learning rate as a fraction of the peak")
    max_grad_norm: float = option(1.0, "gradient clipping (0 = off)")
    seed: int = option(0, "seed of initialisation, data order and dropout")
    mixed_precision: str | None = option(None, "no / fp16 / bf16 (default: accelerate's config); the base is loaded "
                                         "in that dtype, trainable weights stay fp32", choices=("no", "fp16", "bf16"))
    cache_hidden: bool = option(False, "medusa1: cache the base's hidden states on disk (output_dir/hidden_cache) "
                                "so the base runs once per row, not once per epoch")
    eval_examples: int = option(64, "conversations held out to measure head accuracy")
    eval_every: int = option(0, "evaluate every N steps (0 = at the end only)")
    top_k: int = option(10, "ranks measured per head (the tree builder's candidates)")
    save_every: int = option(500, "checkpoint every N steps (0 = never)")
    keep_checkpoints: int = option(2, "checkpoints kept on disk")
    log_every: int = option(10, "log every N steps")
    resume: bool = option(False, "continue from the latest checkpoint in output_dir (start fresh if there is none)")
    plain_text: bool = option(False, "the tokenizer has no chat template: use the plain 'User:/Assistant:' format")
    base_loss: str = option("kl", "medusa2 base loss: kl to the untouched base (self-distillation) or ce on the data",
                            choices=("kl", "ce"))
    heads_loss_weight: float = option(0.2, "medusa2: lambda in base_loss + lambda * heads_loss")
    heads_warmup_steps: int = option(0, "medusa2: train the heads alone for the first N steps")
    lora_r: int = option(16, "LoRA rank (medusa2)")
    lora_alpha: int = option(32, "LoRA alpha (medusa2)")
    lora_dropout: float = option(0.05, "LoRA dropout (medusa2)")
    lora_target_modules: str = option("all-linear", "comma-separated module names for LoRA, or all-linear (medusa2)")

    def __post_init__(self):
        if self.mode == "medusa2" and self.cache_hidden:
            raise ValueError("--cache-hidden needs a frozen base (medusa1); medusa2 changes the base's hidden states")
        for name in ("num_heads", "max_length", "batch_size", "grad_accum", "top_k", "keep_checkpoints", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class Outputs(NamedTuple):  # a NamedTuple: DDP finds the tensors in it
    head_states: torch.Tensor            # [B, T, K, H], before the heads' vocabulary projection
    hidden: torch.Tensor                 # [B, T, H], the base's final hidden state
    base_logits: torch.Tensor | None     # [B, T, V], when asked for
    teacher_logits: torch.Tensor | None  # [B, T, V] with the LoRA adapter disabled, when asked for
    heads_loss: tuple[torch.Tensor, torch.Tensor] | None  # (loss, per-head CE [K]), when a loss_mask is given


def causal_within_examples(segment_ids: torch.Tensor) -> torch.Tensor:
    """segment_ids [B, T] -> [B, T, T] bool: causal within each example of a packed row. A padding
    position sees only itself (an all-masked query row would give NaN in sdpa)."""
    length = segment_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    allowed = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal & (segment_ids[:, None, :] > 0)
    return allowed | torch.eye(length, dtype=torch.bool, device=segment_ids.device)


def attention_mask(segment_ids: torch.Tensor, bool_mask: bool, dtype: torch.dtype) -> torch.Tensor:
    """segment_ids [B, T] -> the base model's [B, 1, T, T] mask, causal within each example."""
    return model_mask(causal_within_examples(segment_ids), bool_mask, dtype)


class TrainModule(nn.Module):
    """The base model and the heads behind one forward: the unit accelerate wraps (DDP needs every
    trained parameter reached through a single module's forward)."""

    def __init__(self, base_model: nn.Module, heads: nn.Module, bool_mask: bool, takes_logits_to_keep: bool):
        super().__init__()
        self.base_model = base_model
        self.heads = heads
        self.bool_mask = bool_mask
        self.takes_logits_to_keep = takes_logits_to_keep

    def forward(self, input_ids, position_ids, segment_ids, hidden=None, base_logits=False, teacher_logits=False,
                train_base=False, greedy_paths=False, loss_mask=None, draft_targets=None, soft_targets=False,
                decay=0.8) -> Outputs:
        """hidden: cached final hidden states (then the base does not run; base_logits must be False).
        train_base: let gradients reach the base (the LoRA weights); else the heads read a detached state.
        Dependent heads read the data's next tokens as their path (teacher forcing), or with
        greedy_paths (needs base_logits) the base model's own greedy tokens, as at decoding time.
        loss_mask: also the heads' loss (heads_loss in loss.py, with decay), computed here because the
        projections it applies may be trained weights, which DDP sees only if forward uses them.
        draft_targets [V]: token id -> index in the heads' reduced vocabulary (-1: none), if reduced;
        soft_targets: the heads learn the base's distribution over their vocabulary, not the data's token."""
        lm_head = self.base_model.get_output_embeddings()
        mask = attention_mask(segment_ids, self.bool_mask, lm_head.weight.dtype)
        inputs = {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids, "use_cache": False}
        logits = teacher = None
        if hidden is None:
            # Without base logits, skip the vocabulary projection of the base (the heads make their own).
            keep = {"logits_to_keep": 1} if not base_logits and self.takes_logits_to_keep else {}
            with torch.set_grad_enabled(train_base and torch.is_grad_enabled()):
                out = self.base_model(**inputs, output_hidden_states=True, **keep)
            hidden, logits = out.hidden_states[-1], (out.logits if base_logits else None)
        if teacher_logits:
            with torch.no_grad(), self.base_model.disable_adapter():
                teacher = self.base_model(**inputs).logits
        next_embeds = None
        embed = self.base_model.get_input_embeddings()
        if self.heads.dependent or self.heads.context is not None:
            # next_ids[:, t] is the token after position t: the first token of head paths read at t.
            next_ids = logits.argmax(-1) if greedy_paths else torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)
            next_embeds = embed(next_ids).detach().to(hidden.dtype)
        states = hidden if train_base else hidden.detach()
        if self.heads.context is not None:
            states = self.heads.context(states, embed(input_ids).detach().to(hidden.dtype), next_embeds,
                                        causal_within_examples(segment_ids))
        head_states = self.heads.states(states, next_embeds)
        loss = None
        if loss_mask is not None:
            projections = [self.heads.projection(k, lm_head) for k in range(self.heads.num_heads)]
            loss = heads_loss(head_states, projections, input_ids, loss_mask, segment_ids, decay,
                              None if draft_targets is None else draft_targets[input_ids],
                              self.base_logits_for_heads(hidden.detach()) if soft_targets else None)
        return Outputs(head_states, hidden, logits, teacher, loss)

    @torch.no_grad()
    def base_logits_for_heads(self, hidden: torch.Tensor) -> torch.Tensor:
        """The base's next-token logits from its final hidden states [..., H], over the heads' vocabulary
        (only the token map's rows of the LM head when the vocabulary is reduced)."""
        lm_head = self.base_model.get_output_embeddings()
        weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
        if self.heads.token_map is not None:
            rows = self.heads.token_map.to(weight.device)
            weight, bias = weight[rows], None if bias is None else bias[rows]
        logits = nn.functional.linear(hidden.to(weight.dtype), weight, bias).float()
        cap = getattr(self.base_model.config, "final_logit_softcapping", None)  # Gemma 2 style
        return logits if not cap else cap * torch.tanh(logits / cap)


def cosine_with_warmup(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Learning-rate multiplier: linear warm-up, then cosine decay to min_ratio at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def batch_indices(micro_step: int, num_rows: int, batch_size: int, num_processes: int, process_index: int,
                  seed: int) -> list[int]:
    """The rows of one micro-batch on one process: a pure function of the micro-step (a fresh seeded
    shuffle per epoch, the last partial batch dropped), so resuming needs only the step count."""
    per_epoch = num_rows // (batch_size * num_processes)
    epoch, i = divmod(micro_step, per_epoch)
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    start = (i * num_processes + process_index) * batch_size
    return order[start: start + batch_size].tolist()


def build_rows(tokenizer, conversations: list[list[dict]], cfg: TrainConfig):
    """Conversations -> (train rows, eval rows); the held-out conversations are a seeded sample."""
    if cfg.eval_examples >= len(conversations):
        raise ValueError(f"--eval-examples {cfg.eval_examples} leaves nothing to train on: the data holds "
                         f"{len(conversations)} conversations; lower --eval-examples or distill more")
    examples = [tokenize_conversation(tokenizer, messages) for messages in conversations]
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    held_out = [examples[i] for i in order[: cfg.eval_examples]]
    return (make_rows([examples[i] for i in order[cfg.eval_examples:]], cfg.max_length, cfg.pack),
            make_rows(held_out, cfg.max_length, cfg.pack))


def train(cfg: TrainConfig) -> dict:
    """Train, checkpoint, evaluate, and save the adapter into cfg.output_dir; returns a summary."""
    medusa2 = cfg.mode == "medusa2"
    # Parameters left without gradient (LoRA during a heads-only warm-up) must be allowed under DDP.
    ddp = DistributedDataParallelKwargs(find_unused_parameters=medusa2 and cfg.heads_warmup_steps > 0)
    accelerator = Accelerator(mixed_precision=cfg.mixed_precision, gradient_accumulation_steps=cfg.grad_accum,
                              kwargs_handlers=[ddp])
    _check_backend(accelerator, cfg.batch_size)
    set_seed(cfg.seed)
    output_dir = Path(cfg.output_dir)
    checkpoint = latest_checkpoint(output_dir)
    if checkpoint is not None and not cfg.resume:
        raise ValueError(f"{output_dir} already holds checkpoints ({checkpoint.name}); pass --resume to continue "
                         f"that run, or choose a new --output-dir")
    keep_trainable_weights_only(accelerator)

    # 1. Data (read first: a bad file fails before a big model loads) and base model. Trainable
    # weights stay fp32; the base takes the mixed-precision dtype.
    conversations = [messages for path in cfg.data for messages in read_conversations(path)]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
    base_model, tokenizer = load_model_and_tokenizer(cfg.model, dtype, cfg.plain_text)
    spec = inspect_base_model(base_model)
    train_rows, eval_rows = build_rows(tokenizer, conversations, cfg)
    output_dir.mkdir(parents=True, exist_ok=True)
    per_epoch = len(train_rows) // (cfg.batch_size * accelerator.num_processes)
    if per_epoch == 0:
        raise ValueError(f"only {len(train_rows)} training rows, fewer than one batch ({cfg.batch_size} rows x "
                         f"{accelerator.num_processes} processes); lower --batch-size or distill more")
    max_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * per_epoch / cfg.grad_accum))

    # 2. Heads (+ LoRA), optimizer with one learning rate per group, schedule.
    medusa = MedusaModel.from_base(base_model, MedusaConfig(num_heads=cfg.num_heads, num_layers=cfg.num_layers,
                                                            share_lm_head=cfg.share_lm_head, head_type=cfg.head_type,
                                                            draft_vocab_size=cfg.draft_vocab,
                                                            context_heads=cfg.context_heads))
    heads = medusa.heads.float()
    draft_targets, vocab_summary = None, {}
    if cfg.draft_vocab is not None:
        counts = answer_token_counts(train_rows, spec.vocab_size)
        token_map = frequent_tokens(counts, cfg.draft_vocab)
        heads.set_token_map(token_map, base_model.get_output_embeddings())
        heads.init_projections_from(base_model.get_output_embeddings())  # own projections: the map's rows
        draft_targets = draft_index(token_map, spec.vocab_size).to(accelerator.device)
        sizes = sorted({cfg.draft_vocab, *(s for s in (1024, 2048, 4096, 8192, 16384) if s < spec.vocab_size)})
        vocab_summary = {"draft_vocab": {"size": cfg.draft_vocab, "coverage": coverage(counts, sizes)}}
    base_model.requires_grad_(False)
    groups = [{"params": list(heads.parameters()), "lr": cfg.lr}]
    schedules = [lambda s: cosine_with_warmup(s, cfg.warmup_steps, max_steps, cfg.min_lr_ratio)]
    if medusa2:
        targets = cfg.lora_target_modules
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, task_type="CAUSAL_LM",
                          target_modules=targets if targets == "all-linear" else targets.split(","))
        base_model = get_peft_model(base_model, lora)  # injects LoRA layers into base_model itself
        groups.append({"params": [p for p in base_model.parameters() if p.requires_grad], "lr": cfg.base_lr})
        # The LoRA weights start (with their own warm-up) once the heads-only warm-up is over.
        warm = cfg.heads_warmup_steps
        schedules.append(lambda s: 0.0 if s < warm else cosine_with_warmup(s - warm, cfg.warmup_steps, max_steps - warm,
                                                                           cfg.min_lr_ratio))
    optimizer = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedules)
    module = TrainModule(base_model, heads, spec.bool_mask, spec.takes_logits_to_keep)
    module, optimizer = accelerator.prepare(module, optimizer)
    accelerator.register_for_checkpointing(scheduler)  # stepped by hand: once per optimizer step
    config_dict = dataclasses.asdict(cfg)
    start_step = load_checkpoint(accelerator, checkpoint, config_dict) if checkpoint is not None else 0

    cache = None
    if cfg.cache_hidden:
        shape = (len(train_rows), cfg.max_length, spec.hidden_size)
        if accelerator.is_main_process:
            reset_if_stale(output_dir / "hidden_cache", fingerprint(train_rows, cfg.model, dtype), shape, dtype)
        accelerator.wait_for_everyone()
        cache = open_hidden_cache(output_dir / "hidden_cache", shape, dtype)

    def log(record):
        accelerator.print(" ".join(f"{k}={v}" for k, v in record.items()))
        if accelerator.is_main_process:
            with open(output_dir / "train_log.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def run_eval():
        if not eval_rows:
            return {}
        return evaluate(accelerator.unwrap_model(module), eval_rows, cfg.batch_size, tokenizer.pad_token_id, cfg.top_k,
                        accelerator)

    # 3. The loop.
    accelerator.print(f"{cfg.mode}: {len(train_rows)} train rows, {len(eval_rows)} eval rows, steps {start_step} -> "
                      f"{max_steps}, {accelerator.num_processes} process(es) on {accelerator.device}")
    module.train()
    loss_sum = torch.zeros((), device=accelerator.device)
    head_ce_sum = torch.zeros(cfg.num_heads, device=accelerator.device)
    micro_batches, tokens, since, last_loss = 0, 0, time.perf_counter(), float("nan")
    for step in range(start_step, max_steps):
        heads_only = not medusa2 or step < cfg.heads_warmup_steps
        for micro in range(cfg.grad_accum):
            rows = batch_indices(step * cfg.grad_accum + micro, len(train_rows), cfg.batch_size,
                                 accelerator.num_processes, accelerator.process_index, cfg.seed)
            batch = collate([train_rows[i] for i in rows], tokenizer.pad_token_id)
            tokens += int(batch["segment_ids"].gt(0).sum())  # counted on the host: no device sync
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            hidden = cache.get(rows, batch["input_ids"].shape[1]) if cache is not None else None
            with accelerator.accumulate(module):
                out = module(batch["input_ids"], batch["position_ids"], batch["segment_ids"],
                             hidden=None if hidden is None else hidden.to(accelerator.device),
                             base_logits=not heads_only, teacher_logits=not heads_only and cfg.base_loss == "kl",
                             train_base=not heads_only, loss_mask=batch["loss_mask"], draft_targets=draft_targets,
                             soft_targets=cfg.heads_target == "teacher", decay=cfg.head_decay)
                if cache is not None and hidden is None:
                    cache.put(rows, out.hidden)
                loss, head_ce = combined_loss(out, batch, cfg, heads_only)
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(module.parameters(), cfg.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            loss_sum += loss.detach()
            head_ce_sum += head_ce
            micro_batches += 1
        scheduler.step()

        done = step + 1
        if done % cfg.log_every == 0 or done == max_steps:
            last_loss = accelerator.reduce(loss_sum, "mean").item() / micro_batches
            log({"step": done, "loss": round(last_loss, 4),
                 "head_ce": [round(x / micro_batches, 3) for x in accelerator.reduce(head_ce_sum, "mean").tolist()],
                 "lr": [float(f"{lr:.3g}") for lr in scheduler.get_last_lr()],
                 "tokens_per_s": round(tokens * accelerator.num_processes / (time.perf_counter() - since))})
            loss_sum.zero_()
            head_ce_sum.zero_()
            micro_batches, tokens, since = 0, 0, time.perf_counter()
        if cfg.eval_every and done % cfg.eval_every == 0 and done < max_steps:
            log({"step": done, "eval": run_eval()})
        if cfg.save_every and done % cfg.save_every == 0:
            save_checkpoint(accelerator, output_dir, done, config_dict, cfg.keep_checkpoints)

    # 4. Final evaluation; the adapter (heads, config with metrics, and the LoRA adapter for medusa2).
    metrics = run_eval()
    log({"step": max_steps, "eval": metrics})
    summary = {"mode": cfg.mode, "start_step": start_step, "steps": max_steps, "train_rows": len(train_rows),
               "eval_rows": len(eval_rows), "final_loss": last_loss, **vocab_summary}
    if accelerator.is_main_process:
        medusa.config = dataclasses.replace(medusa.config, metrics={"eval": metrics, "train": summary})
        medusa.save_heads(output_dir, lora=base_model if medusa2 else None)  # Medusa-2: the peft model -> lora/
    accelerator.wait_for_everyone()
    accelerator.print(f"saved the adapter to {output_dir}")
    return {**summary, "eval": metrics}


def combined_loss(out: Outputs, batch: dict, cfg: TrainConfig, heads_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Medusa-1 (and the heads-only warm-up): the heads' loss. Medusa-2: base loss + lambda * heads' loss.
    Returns (loss, per-head CE [K] for logging)."""
    ids, mask, segments = batch["input_ids"], batch["loss_mask"], batch["segment_ids"]
    loss, head_ce = out.heads_loss
    if heads_only:
        return loss, head_ce
    if cfg.base_loss == "kl":
        base = kl_to_teacher(out.base_logits, out.teacher_logits, mask, segments)
    else:
        base = shifted_cross_entropy(out.base_logits, ids, mask, segments, shift=1)
    return base + cfg.heads_loss_weight * loss, head_ce


def _check_backend(accelerator, batch_size: int) -> None:
    """The adapter is saved, and evaluation run, from each process's own full copy of the model, so
    parameters must not be sharded (FSDP, ZeRO-3); DDP and ZeRO-1/2 keep full copies."""
    plugin = accelerator.state.deepspeed_plugin
    if accelerator.distributed_type == DistributedType.FSDP or (plugin is not None and plugin.zero_stage == 3):
        raise ValueError("FSDP and DeepSpeed ZeRO-3 shard the parameters, which this trainer does not gather; "
                         "launch with training/accelerate/multi_gpu.yaml (DDP) or deepspeed_zero2.yaml")
    if plugin is not None:
        # No DataLoader goes through prepare(), so DeepSpeed learns the micro-batch size here.
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = batch_size
