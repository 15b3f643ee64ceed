"""The training loop: Medusa-1 (frozen base, heads trained) or Medusa-2 (LoRA on the base + heads).

One script for one CPU, one GPU or `accelerate launch` on several GPUs (DDP or DeepSpeed ZeRO-1/2):
accelerate places the model, wraps it for data parallelism, applies mixed precision and
accumulates gradients. A step is one optimizer update over grad_accum micro-batches of
batch_size rows on every process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, DistributedType, set_seed
from peft import LoraConfig, get_peft_model

from .. import default_model, eagle3
from ..base import inspect_base_model
from ..config import CONFIG_NAME, MedusaConfig
from ..eagle import draft_layer_shape
from ..folders import check_output_folder
from ..formats import HF_CONFIG
from ..io import LORA_DIR, check_lora_folder
from ..model import MedusaModel
from .checkpoint import (
    DATA_FINGERPRINT,
    keep_trainable_weights_only,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from .config import TrainConfig
from .data import Example, collate, make_rows, read_conversations, tokenize_conversations
from .distill import model_identity
from .draft_vocab import answer_token_counts, coverage, draft_index, frequent_tokens
from .evaluate import evaluate
from .fields import typed
from .hidden_cache import fingerprint, open_hidden_cache, reset_if_stale
from .load import load_model_and_tokenizer
from .loss import kl_to_teacher, shifted_cross_entropy
from .module import Outputs, TrainModule
from .store import recorded_model, recorded_model_differences


@dataclasses.dataclass
class Run:
    """What every training run sets up before its model trains: prepare_run's result."""

    cfg: TrainConfig  # --model resolved
    accelerator: Accelerator
    output_dir: Path
    checkpoint: Path | None  # the latest checkpoint in output_dir, to resume from
    base_model: torch.nn.Module
    dtype: torch.dtype  # the base model's, as loaded (mixed precision's)
    tokenizer: object
    spec: object  # base.inspect_base_model's
    base_name: str | None  # the Hub name a new adapter records for its base, where the base is the default model
    train_rows: list
    eval_rows: list
    replayed: list
    max_steps: int
    learned_before: set  # the conversations --init-heads learned from (its TRAINED_ON), listed beside this run's


def prepare_run(cfg: TrainConfig) -> Run:
    """The accelerator, the output folder checked, the data read and checked against the base model, which is loaded,
    and the rows; every check that can fail does so here, before anything trains."""
    # New heads name their base model as the Hub does where it is the default model: transformers names a loaded model
    # by its folder, here a local cache path that would mean nothing on another machine.
    base_name = default_model.HUB_NAME if cfg.model is None else None
    if cfg.model is None:  # as every command reads --model: the default model
        cfg = dataclasses.replace(cfg, model=str(default_model.prepare()))
    medusa2 = cfg.mode == "medusa2"
    # Parameters left without gradient (LoRA during a heads-only warm-up) must be allowed under DDP.
    ddp = DistributedDataParallelKwargs(find_unused_parameters=medusa2 and cfg.heads_warmup_steps > 0)
    accelerator = Accelerator(mixed_precision=cfg.mixed_precision, gradient_accumulation_steps=cfg.grad_accum,
                              kwargs_handlers=[ddp])
    _check_backend(accelerator, cfg.batch_size)
    set_seed(cfg.seed)
    output_dir = check_output_folder(cfg.output)  # before the data and the model load
    checkpoint = latest_checkpoint(output_dir)
    if checkpoint is not None and not cfg.resume:
        raise ValueError(f"{output_dir} already holds checkpoints ({checkpoint.name}); pass --resume to continue "
                         f"that run, or choose a new --output")
    # A finished run's heads, nothing to resume; a DFlash draft is saved as config.json, which a model folder holds
    # too (heads may be saved beside a model, a draft may not).
    kept = (CONFIG_NAME, HF_CONFIG) if cfg.head_type == "dflash" else (CONFIG_NAME,)
    finished = [name for name in kept if (output_dir / name).exists()]
    if checkpoint is None and finished:
        what = "trained heads" if finished[0] == CONFIG_NAME else "a model or a draft"
        further = "" if cfg.head_type == "dflash" else f" (--init-heads {output_dir} trains those heads on)"
        raise ValueError(f"{output_dir} already holds {what} ({finished[0]}), which this run would replace; choose a "
                         f"new --output{further}")
    check_lora_folder(output_dir)  # the adapter is saved there at the end: refuse a lora/ it would delete now
    hidden_dir = output_dir / "hidden_cache"
    if cfg.cache_hidden and hidden_dir.exists() and not hidden_dir.is_dir():
        raise ValueError(f"--cache-hidden keeps the hidden states in {hidden_dir}, which is a file here; move it "
                         f"away, or choose another --output")
    keep_trainable_weights_only(accelerator)
    # What the initial heads learned from, to list beside this run's (read now: a bad record fails before training,
    # not after).
    learned_before = set()
    if cfg.init_heads is not None and (Path(cfg.init_heads) / TRAINED_ON).is_file():
        learned_before = read_trained_on(Path(cfg.init_heads) / TRAINED_ON, "--init-heads")

    # 1. Data (read first: a bad file fails before a big model loads) and base model. Trainable
    # weights stay fp32; the base takes the mixed-precision dtype.
    everything = [messages for path in cfg.data
                  for messages in read_conversations(path, refuse_degenerate=not cfg.allow_degenerate_data)]
    conversations = without_excluded(everything, cfg.exclude, accelerator.print)
    replayed = replay_sample(everything, cfg.exclude, cfg.init_heads, cfg.replay, cfg.seed, accelerator.print)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
    base_model, tokenizer = load_model_and_tokenizer(cfg.model, dtype, cfg.plain_text)
    identity = model_identity(base_model, tokenizer)
    for path in cfg.data:  # self-distillation: the heads learn what this model answers
        recorded = recorded_model(path)
        if recorded is not None and not recorded.keys() & identity.keys():  # a served model's answers
            accelerator.print(f"--data {path}: answered through a server ({recorded}), which cannot be checked "
                              f"against --model here; it must be the same model")
            continue
        differences = recorded_model_differences(path, identity)
        if differences:
            raise ValueError(f"--data {path} holds another model's answers ({'; '.join(differences)}): train heads "
                             f"for the model that wrote them (--model), or distill this one's")
    spec = inspect_base_model(base_model)
    train_rows, eval_rows = build_rows(tokenizer, conversations, cfg, replayed)
    output_dir.mkdir(parents=True, exist_ok=True)
    per_epoch = len(train_rows) // (cfg.batch_size * accelerator.num_processes)
    if per_epoch == 0:
        raise ValueError(f"only {len(train_rows)} training rows, fewer than one batch ({cfg.batch_size} rows x "
                         f"{accelerator.num_processes} processes); lower --batch-size or distill more")
    max_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * per_epoch / cfg.grad_accum))
    return Run(cfg, accelerator, output_dir, checkpoint, base_model, dtype, tokenizer, spec, base_name, train_rows,
               eval_rows, replayed, max_steps, learned_before)


def train(cfg: TrainConfig) -> dict:
    """Train, checkpoint, evaluate, and save the adapter into cfg.output; returns a summary."""
    if cfg.head_type == "dflash":
        raise ValueError("a DFlash draft is no heads: train it with medusa_spec.train.train_dflash(cfg) (medusa-spec "
                         "train --head-type dflash does)")
    run = prepare_run(cfg)
    cfg, accelerator, output_dir, checkpoint = run.cfg, run.accelerator, run.output_dir, run.checkpoint
    base_model, tokenizer, spec, base_name = run.base_model, run.tokenizer, run.spec, run.base_name
    train_rows, eval_rows, replayed, max_steps = run.train_rows, run.eval_rows, run.replayed, run.max_steps
    medusa2 = cfg.mode == "medusa2"
    hidden_dir, dtype, learned_before = output_dir / "hidden_cache", run.dtype, run.learned_before

    # 2. Heads (+ LoRA), optimizer with one learning rate per group, schedule.
    if cfg.init_heads is not None:
        medusa, cfg = continued_heads(base_model, cfg, accelerator.print)
    else:
        # eagle heads: the base's shape (MedusaModel.from_base), unless the MLP width is set; eagle3 heads: the
        # base's shape too, with the norms speculators' trainer gives a new draft unless flags say otherwise.
        draft_layer, text_config = None, base_model.config.get_text_config(decoder=True)
        if cfg.draft_layer_mlp is not None:
            draft_layer = {**draft_layer_shape(text_config, spec.hidden_size), "intermediate_size": cfg.draft_layer_mlp}
        if cfg.head_type == "eagle3":
            draft_layer = {**eagle3.default_spec(text_config, spec.hidden_size, spec.vocab_size, cfg.num_layers),
                           **cfg.eagle3_norms()}
        medusa = MedusaModel.from_base(base_model, MedusaConfig(
            num_heads=cfg.num_heads, num_layers=cfg.num_layers, share_lm_head=cfg.share_lm_head,
            head_type=cfg.head_type, draft_vocab_size=cfg.draft_vocab, context_heads=cfg.context_heads,
            feature_layers=cfg.feature_layers, draft_layer=draft_layer, base_model_name_or_path=base_name))
    # What a head ranks (with --init-heads, known once their draft vocabulary is read); checked now, not after
    # the training.
    guesses = cfg.draft_vocab or spec.vocab_size
    if cfg.eval_ranks > guesses:
        raise ValueError(f"--eval-ranks {cfg.eval_ranks} asks for more ranks than the heads have guesses ({guesses}: "
                         f"{'--draft-vocab' if cfg.draft_vocab else 'the vocabulary'}); use at most {guesses}")
    heads = medusa.heads.float()
    draft_targets, vocab_summary = None, {}
    if cfg.draft_vocab is not None:
        counts = answer_token_counts(train_rows, spec.vocab_size)
        if cfg.init_heads is None:
            heads.set_token_map(frequent_tokens(counts, cfg.draft_vocab), base_model.get_output_embeddings())
            heads.init_projections_from(base_model.get_output_embeddings())  # own projections: the map's rows
        draft_targets = draft_index(heads.token_map.cpu(), spec.vocab_size).to(accelerator.device)
        sizes = sorted({cfg.draft_vocab, *(s for s in (1024, 2048, 4096, 8192, 16384) if s < spec.vocab_size)})
        vocab_summary = {"draft_vocab": {"size": cfg.draft_vocab, "coverage": coverage(counts, sizes)}}
    base_model.requires_grad_(False)
    if heads.head_type == "eagle3":
        heads.draft_layer.lm_head.requires_grad_(False)  # the base's rows, frozen as speculators keeps them
    groups = [{"params": [p for p in heads.parameters() if p.requires_grad], "lr": cfg.lr}]
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
    # The rows themselves, not only the flags that chose them: a data folder distilled further since, or another
    # tokenizer, would shift the held-out split and the rows each step reads under a resumed run.
    config_dict = {**dataclasses.asdict(cfg), DATA_FINGERPRINT: fingerprint([*train_rows, None, *eval_rows])}
    start_step = load_checkpoint(accelerator, checkpoint, config_dict) if checkpoint is not None else 0

    cache = None
    if cfg.cache_hidden:
        shape = (len(train_rows), cfg.max_length, spec.hidden_size * (1 + len(cfg.feature_layers)))
        if accelerator.is_main_process:
            key = fingerprint(train_rows, Path(cfg.model).resolve(), dtype)
            reset_if_stale(hidden_dir, key, shape, dtype)
        accelerator.wait_for_everyone()
        cache = open_hidden_cache(hidden_dir, shape, dtype)

    log = train_log(accelerator, output_dir, start_step)

    def run_eval():
        if not eval_rows:
            return {}
        return evaluate(accelerator.unwrap_model(module), eval_rows, cfg.batch_size, tokenizer.pad_token_id,
                        cfg.eval_ranks, accelerator)

    # 3. The loop.
    accelerator.print(f"{cfg.mode}: {len(train_rows)} train rows, {len(eval_rows)} eval rows, steps {start_step} -> "
                      f"{max_steps}, {accelerator.num_processes} process(es) on {accelerator.device}")
    module.train()
    loss_sum = torch.zeros((), device=accelerator.device)
    head_ce_sum = torch.zeros(cfg.num_heads, device=accelerator.device)
    micro_batches, tokens, since, last_loss = 0, 0, time.perf_counter(), float("nan")
    began, done, timed_out = since, start_step, False
    seen = answer_tokens_seen(train_rows, start_step * cfg.grad_accum, cfg.batch_size, accelerator.num_processes,
                              cfg.seed)
    for step in range(start_step, max_steps):
        heads_only = not medusa2 or step < cfg.heads_warmup_steps
        for micro in range(cfg.grad_accum):
            rows = batch_indices(step * cfg.grad_accum + micro, len(train_rows), cfg.batch_size,
                                 accelerator.num_processes, accelerator.process_index, cfg.seed)
            batch = collate([train_rows[i] for i in rows], tokenizer.pad_token_id)
            tokens += int(batch["segment_ids"].gt(0).sum())  # counted on the host: no device sync
            seen += answer_tokens_seen(train_rows, 1, cfg.batch_size, accelerator.num_processes, cfg.seed,
                                       first=step * cfg.grad_accum + micro)
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
        if cfg.time_limit is not None and done < max_steps:
            timed_out = past_time_limit(accelerator, began, cfg.time_limit)
        if done % cfg.log_every == 0 or done == max_steps or timed_out:
            last_loss = accelerator.reduce(loss_sum, "mean").item() / micro_batches
            log({"step": done, "loss": round(last_loss, 4),
                 "head_ce": [round(x / micro_batches, 3) for x in accelerator.reduce(head_ce_sum, "mean").tolist()],
                 "lr": [float(f"{lr:.3g}") for lr in scheduler.get_last_lr()],
                 "tokens_per_s": round(tokens * accelerator.num_processes / (time.perf_counter() - since)),
                 "eta": clock(eta_seconds(time.perf_counter() - began, done - start_step,
                                          0 if timed_out else max_steps - done, cfg.time_limit))})
            loss_sum.zero_()
            head_ce_sum.zero_()
            micro_batches, tokens, since = 0, 0, time.perf_counter()
        if cfg.eval_every and done % cfg.eval_every == 0 and done < max_steps and not timed_out:
            log({"step": done, "answer_tokens_seen": seen, "eval": run_eval()})
        if cfg.save_every and (done % cfg.save_every == 0 or timed_out):  # a stopped run can be resumed from here
            save_checkpoint(accelerator, output_dir, done, config_dict, cfg.keep_checkpoints)
        if timed_out:
            accelerator.print(f"--time-limit {cfg.time_limit:g} minutes reached at step {done} of {max_steps}")
            break

    # 4. Final evaluation; the adapter (heads, config with metrics, and the LoRA adapter for medusa2).
    metrics = run_eval()
    log({"step": done, "answer_tokens_seen": seen, "eval": metrics})
    summary = {"mode": cfg.mode, "start_step": start_step, "steps": done, "planned_steps": max_steps,
               "train_rows": len(train_rows),
               "eval_rows": len(eval_rows), "answer_tokens_seen": seen,
               "answer_tokens_in_data": sum(sum(e.loss_mask) for row in train_rows for e in row),
               "replayed_conversations": len(replayed),
               "final_loss": last_loss, **vocab_summary}
    if accelerator.is_main_process:
        medusa.config = dataclasses.replace(medusa.config, metrics={"eval": metrics, "train": summary})
        medusa.save_heads(output_dir, lora=base_model if medusa2 else None)  # Medusa-2: the peft model -> lora/
        # The conversations of the rows the steps read: a run stopped short of its sample (--max-steps, --time-limit)
        # lists only those, so a later --exclude of this file leaves the rest to learn from.
        read = rows_read(done * cfg.grad_accum, len(train_rows), cfg.batch_size, accelerator.num_processes, cfg.seed)
        write_trained_on(output_dir / TRAINED_ON, learned_before | {e.source for i in read for e in train_rows[i]})
    accelerator.wait_for_everyone()
    accelerator.print(f"saved the adapter to {output_dir}")
    return {**summary, "eval": metrics}


def continued_heads(base_model, cfg: TrainConfig, say=print) -> tuple[MedusaModel, TrainConfig]:
    """The heads saved in cfg.init_heads on `base_model`, and cfg with their architecture (a head flag given with
    another value than theirs is refused, but for three that grow them: --feature-layers on heads that fuse none, a
    larger --num-layers, a larger --num-heads; they take it on). Their tree is dropped: it was chosen for their old
    accuracies. A recipe's head settings count as given (`"num_heads": null` there: theirs); `say` tells what grew."""
    path = Path(cfg.init_heads)
    if (path / LORA_DIR).exists():
        raise ValueError(f"--init-heads {path} holds a Medusa-2 LoRA adapter ({LORA_DIR}/); training goes on from "
                         f"heads trained on a frozen base only: pass the heads of a medusa1 run")
    medusa = MedusaModel.from_pretrained(base_model, path)
    config = medusa.config
    draft_layer_mlp = config.draft_layer["intermediate_size"] if config.head_type == "eagle" else None
    theirs = {"num_heads": config.num_heads, "num_layers": config.num_layers, "share_lm_head": config.share_lm_head,
              "head_type": config.head_type, "draft_vocab": config.draft_vocab_size,
              "context_heads": config.context_heads, "feature_layers": list(config.feature_layers),
              "draft_layer_mlp": draft_layer_mlp}
    if config.head_type == "eagle3":
        theirs.update({name: config.draft_layer[name] for name in cfg.eagle3_norms()})
    else:
        given = cfg.norms_given()
        if given:
            raise ValueError(f"--init-heads {path}: {', '.join(given)} shape eagle3 heads only, and these are "
                             f"{config.head_type} heads; drop them")
    # What the heads take on, each new weight starting so that the grown heads begin as exactly the old ones (same
    # guesses) and only learn what is added: feature fusion (a projection of the lower layers' states, added to the
    # final one, at zero), residual blocks after theirs (x + SiLU(0) = x), and heads after theirs (see _new_heads).
    grow = {}
    if cfg.feature_layers and not config.feature_layers:
        grow["feature_layers"] = list(cfg.feature_layers)
    if cfg.num_layers is not None and cfg.num_layers > config.num_layers:
        grow["num_layers"] = cfg.num_layers
    if cfg.num_heads is not None and cfg.num_heads > config.num_heads:
        grow["num_heads"] = cfg.num_heads
    if config.head_type == "eagle3" and grow.keys() - {"num_heads"}:
        raise ValueError(f"--init-heads {path}: eagle3 heads grow by levels only (--num-heads; their draft then runs "
                         f"one more step); --num-layers and --feature-layers would change their draft's weights")
    for name, value in theirs.items():
        given = getattr(cfg, name)  # None: left out (TrainConfig's head flags stay None with --init-heads)
        if name not in grow and given is not None and given != value:
            flag = "--" + name.replace("_", "-")
            more = {"num_layers": " (fewer residual blocks than theirs: give more, or as many)",
                    "num_heads": " (fewer heads than theirs: give more, or as many)"}.get(name, "")
            raise ValueError(f"--init-heads {path}: its heads have {typed(flag, value)}, but {typed(flag, given)} "
                             f"was given{more}; leave {flag} out (of the command line and any --config recipe) to "
                             f"train them on as they are, or drop --init-heads to train new heads")
    if grow:
        say(f"--init-heads {path}: growing the heads to " + ", ".join(
            f"{typed('--' + name.replace('_', '-'), value)} (theirs: {theirs[name]})" for name, value in grow.items()))
        theirs.update(grow)
        medusa = grown_heads(base_model, medusa, grow)
    medusa.config = dataclasses.replace(medusa.config, tree=None)
    return medusa, dataclasses.replace(cfg, **theirs)


def grown_heads(base_model, medusa: MedusaModel, grow: dict) -> MedusaModel:
    """A new MedusaModel on `base_model` whose heads are `medusa`'s grown by `grow` (feature_layers on heads that fuse
    none, a larger num_layers or num_heads), starting from exactly their weights; the added ones as continued_heads
    says."""
    config = medusa.config
    grown = MedusaModel.from_base(base_model, dataclasses.replace(config, **grow))
    missing, unexpected = grown.heads.load_state_dict(medusa.heads.state_dict(), strict=False)
    new = [name for name in missing if not (name.startswith("fuse.") or _added_block(name, config.num_layers)
                                            or _added_head(name, config.num_heads))]
    if unexpected or new:
        raise RuntimeError(f"heads grown by {sorted(grow)}: weights {sorted(unexpected)} unused and {sorted(new)} "
                           f"missing; only the added layers should be new")
    _new_heads(grown.heads, config.num_heads)
    grown.heads.bind_lm_head(base_model.get_output_embeddings())
    return grown


def _new_heads(heads, old_heads: int) -> None:
    """Heads past the first `old_heads` start as copies of the last of those (residual blocks, own LM head), so a new
    head starts from the last head's guess; eagle heads' draft layer runs one level more before it, so there it
    starts as an untrained guess one token further. A dependent head's input over its path keeps its fresh zeros,
    as every new head's starts."""
    for module in (heads.blocks, heads.lm_heads):
        for k in range(old_heads, len(module) if module is not None else 0):
            module[k].load_state_dict(module[old_heads - 1].state_dict())


def _added_block(name: str, old_layers: int) -> bool:
    """Whether weight `name` belongs to a residual block past the first `old_layers` of its head."""
    parts = name.split(".")  # blocks.{head}.layers.{layer}.{weight|bias}
    return parts[0] == "blocks" and parts[2] == "layers" and int(parts[3]) >= old_layers


def _added_head(name: str, old_heads: int) -> bool:
    """Whether weight `name` belongs to a head past the first `old_heads` (a per-head module list's entry)."""
    parts = name.split(".")  # {blocks|lm_heads|inputs}.{head}....
    return parts[0] in ("blocks", "lm_heads", "inputs") and int(parts[1]) >= old_heads


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


def build_rows(tokenizer, conversations: list[list[dict]], cfg: TrainConfig, replayed: list[list[dict]] = ()):
    """Conversations -> (train rows, eval rows), each train example knowing its conversation's key (source); the
    held-out conversations are a seeded sample. `replayed` conversations train beside the sample (the rows are shuffled
    each epoch), never held out."""
    if cfg.eval_examples >= len(conversations):
        raise ValueError(f"--eval-examples {cfg.eval_examples} leaves nothing to train on: the data holds "
                         f"{len(conversations)} conversations{' not excluded' if cfg.exclude else ''}; lower "
                         f"--eval-examples or distill more")
    if cfg.max_conversations is not None and cfg.max_conversations < 1:
        raise ValueError(f"--max-conversations {cfg.max_conversations}: give at least 1, or leave it out to train on "
                         f"every conversation")
    train, held_out = split_held_out(conversations, cfg.eval_examples, cfg.seed, cfg.max_conversations)
    train = [conversations[i] for i in train] + list(replayed)
    examples = tokenize_conversations(tokenizer, train, cfg.keep_loops)
    examples = [dataclasses.replace(e, source=conversation_key(m)) for e, m in zip(examples, train)]
    evaluated = tokenize_conversations(tokenizer, [conversations[i] for i in held_out], cfg.keep_loops)
    return make_rows(examples, cfg.max_length, cfg.pack), make_rows(evaluated, cfg.max_length, cfg.pack)


# ---------------------------------------------------------------- which conversations a run learned from

# Written beside the adapter: the key of every conversation its heads trained on, so a later run (--init-heads
# plus --exclude) learns from other answers and is measured on answers the heads never saw.
TRAINED_ON = "trained_conversations.txt"
_KEY = re.compile(r"[0-9a-f]{16}")


def conversation_key(messages: list[dict]) -> str:
    """A conversation's name in a TRAINED_ON file: a hash of its first exchange, so conversations that begin alike
    (a prompt answered alone and as a multi-turn conversation's first turn) share it, as in split_held_out."""
    return hashlib.sha256(json.dumps(first_exchange(messages)).encode()).hexdigest()[:16]


def write_trained_on(path: Path, keys: set[str]) -> None:
    header = (f"# {len(keys)} conversation beginnings these heads trained on (in rows their steps read): sha256 of "
              f"each one's first exchange (its messages through the first answer, as JSON [[role, content], ...]), "
              f"16 hex digits\n")
    path.write_text(header + "".join(f"{k}\n" for k in sorted(keys)))


def read_trained_on(path: str | Path, flag: str = "--exclude") -> set[str]:
    """The keys a TRAINED_ON file lists; errors name `flag`, the setting that gave the file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{flag} {path}: no such file; give the {TRAINED_ON} a `medusa-spec train` run wrote "
                         f"beside its adapter")
    keys = set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not _KEY.fullmatch(line):
            raise ValueError(f"{flag} {path}:{number}: {line[:40]!r} is not a conversation key (16 hex digits); "
                             f"give the {TRAINED_ON} a `medusa-spec train` run wrote beside its adapter")
        keys.add(line)
    return keys


def without_excluded(conversations: list[list[dict]], exclude: list[str], report=print,
                     require_match: bool = True) -> list[list[dict]]:
    """The conversations that begin as none listed in the `exclude` files (TRAINED_ON files) does. With
    `require_match` (training), a file listing none of them is refused: it was meant for other data."""
    if not exclude:
        return conversations
    listed = {path: read_trained_on(path) for path in exclude}
    keys = [conversation_key(m) for m in conversations]
    present = set(keys)
    for path, path_keys in listed.items():
        # Such a file lists another data folder's conversations (or another key scheme's): what it was meant to
        # keep out, a held-out set say, would be trained on without a word.
        if require_match and path_keys and not path_keys & present:
            raise ValueError(f"--exclude {path}: none of its {len(path_keys)} conversation beginnings is in --data's "
                             f"{len(conversations)} conversations, so it would exclude nothing; give the "
                             f"{TRAINED_ON} of a run on this data folder")
    excluded = set().union(*listed.values())
    kept = [m for m, key in zip(conversations, keys) if key not in excluded]
    report(f"--exclude: {len(conversations) - len(kept)} of {len(conversations)} conversations begin as one "
           f"listed ({len(excluded)} listed); {len(kept)} left")
    if not kept:
        raise ValueError(f"--exclude leaves none of the {len(conversations)} conversations of --data: the files list "
                         f"every one (trained on already); distill more, or drop --exclude to use them again")
    return kept


def replay_sample(conversations: list[list[dict]], exclude: list[str], init_heads: str | None, replay: int,
                  seed: int, report=print) -> list[list[dict]]:
    """The conversations that begin as `replay` of the beginnings the heads of `init_heads` learned from (their
    TRAINED_ON file) and `exclude` leaves out: a seeded sample, trained again beside new data so that the heads do
    not forget it. Only what the heads learned: an exclude file may also list conversations kept unseen on purpose
    (another run's held-out set)."""
    if replay < 0:
        raise ValueError(f"--replay {replay}: give a number of conversation beginnings >= 0")
    if not replay:
        return []
    record = Path(init_heads or "") / TRAINED_ON
    if init_heads is None or not record.is_file() or not exclude:
        raise ValueError(f"--replay {replay} trains heads again on conversations they learned from: give --init-heads "
                         f"with the adapter whose {TRAINED_ON} lists them, and --exclude that file")
    learned = read_trained_on(record, "--init-heads") & set().union(*(read_trained_on(path) for path in exclude))
    listed = sorted({conversation_key(m) for m in conversations} & learned)
    if replay > len(listed):
        raise ValueError(f"--replay {replay}: {record} and --exclude have only {len(listed)} beginnings of --data's "
                         f"conversations in common; give --replay {len(listed)} or less")
    order = torch.randperm(len(listed), generator=torch.Generator().manual_seed(seed)).tolist()
    sample = {listed[i] for i in order[:replay]}
    replayed = [m for m in conversations if conversation_key(m) in sample]
    report(f"--replay: {len(replayed)} conversations, beginning as {replay} of the {len(listed)} beginnings the "
           f"initial heads learned from, train again")
    return replayed


def split_held_out(conversations: list[list[dict]], eval_examples: int, seed: int,
                   max_conversations: int | None = None) -> tuple[list[int], list[int]]:
    """(training, held-out) conversation indices: a seeded shuffle's first eval_examples are held out.

    Greedy distillation answers a prompt the same way each time it is asked: alone and as the first turn of a
    multi-turn conversation, or from two prompt pools. So no conversation trains that begins as a held-out one
    does, through its first answer; else held-out accuracy counts answers the heads learned by heart. (Other
    answers to the same prompt, sampled, still train.) The training sample is a prefix of the rest: a larger
    max_conversations adds to a smaller one's, so the points of a scaling curve are nested and share their
    held-out set."""
    order = torch.randperm(len(conversations), generator=torch.Generator().manual_seed(seed)).tolist()
    held_out = order[:eval_examples]
    held_beginnings = {first_exchange(conversations[i]) for i in held_out}
    train = [i for i in order[eval_examples:] if first_exchange(conversations[i]) not in held_beginnings]
    return train[:max_conversations], held_out


def first_exchange(messages: list[dict]) -> tuple[tuple[str, str], ...]:
    """The messages through the first answer, as hashable (role, content) pairs."""
    first_answer = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return tuple((m["role"], m["content"]) for m in messages[: first_answer + 1])


def cosine_with_warmup(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Learning-rate multiplier: linear warm-up, then cosine decay to min_ratio at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def epoch_order(num_rows: int, seed: int, epoch: int) -> torch.Tensor:
    """The seeded shuffle of the rows an epoch reads in (batch_indices, rows_read)."""
    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def batch_indices(micro_step: int, num_rows: int, batch_size: int, num_processes: int, process_index: int,
                  seed: int) -> list[int]:
    """The rows of one micro-batch on one process: a pure function of the micro-step (a fresh seeded
    shuffle per epoch, the last partial batch dropped), so resuming needs only the step count."""
    per_epoch = num_rows // (batch_size * num_processes)
    epoch, i = divmod(micro_step, per_epoch)
    order = epoch_order(num_rows, seed, epoch)
    start = (i * num_processes + process_index) * batch_size
    return order[start: start + batch_size].tolist()


def eta_seconds(elapsed: float, steps_done: int, steps_left: int, time_limit: float | None) -> float:
    """Seconds until the loop ends: `steps_left` more steps at this run's mean step time so far (evaluations and
    checkpoints included), or --time-limit's end (minutes after the loop began) where that comes first."""
    left = elapsed / max(steps_done, 1) * steps_left
    return left if time_limit is None else max(0.0, min(left, 60 * time_limit - elapsed))


def clock(seconds: float) -> str:
    """H:MM:SS, as a log line's eta."""
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


TRAIN_LOG = "train_log.jsonl"


def train_log(accelerator, output_dir: Path, start_step: int):
    """log(record): a record printed by every process and appended to output_dir's TRAIN_LOG by the main one, which
    first drops the records a killed run wrote past `start_step` (keep_log_through)."""
    if accelerator.is_main_process:
        keep_log_through(output_dir / TRAIN_LOG, start_step)

    def log(record: dict) -> None:
        accelerator.print(" ".join(f"{k}={v}" for k, v in record.items()))
        if accelerator.is_main_process:
            with open(output_dir / TRAIN_LOG, "a") as f:
                f.write(json.dumps(record) + "\n")
    return log


def past_time_limit(accelerator, began: float, minutes: float) -> bool:
    """Whether the loop that began at `began` (perf_counter) has run past --time-limit: asked every step by every
    process, and one process's clock decides for all, since a process stopping alone would leave the others
    waiting."""
    late = torch.tensor(float(time.perf_counter() - began > 60 * minutes), device=accelerator.device)
    return bool(accelerator.reduce(late, "sum").item())


def keep_log_through(path: Path, step: int) -> None:
    """Drop the log's records past `step`, where this run starts: a killed run logged steps after its last
    checkpoint, which the resumed run logs again (and a run killed before its first checkpoint, all of them)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except (json.JSONDecodeError, AttributeError):  # a line cut short by the kill
            pass
    path.write_text("".join(f"{line}\n" for line in kept))


def rows_read(micro_steps: int, num_rows: int, batch_size: int, num_processes: int, seed: int) -> set[int]:
    """The rows micro-batches 0 .. micro_steps - 1 of every process read (batch_indices), an epoch at a time."""
    per_epoch = num_rows // (batch_size * num_processes)
    read = set()
    for epoch in range(-(-micro_steps // per_epoch)):
        steps = min(per_epoch, micro_steps - epoch * per_epoch)
        read.update(epoch_order(num_rows, seed, epoch)[: steps * num_processes * batch_size].tolist())
    return read


def answer_tokens_seen(rows: list[list[Example]], micro_steps: int, batch_size: int, num_processes: int, seed: int,
                       first: int = 0) -> int:
    """Answer tokens (the heads' training targets) in micro-batches first .. first + micro_steps - 1 of every
    process: how much data the heads have seen at a point of training (the x axis of a scaling curve), a pure
    function of the step as the rows read are, so a resumed run counts on from where it stopped."""
    return sum(sum(sum(example.loss_mask) for example in rows[i])
               for micro in range(first, first + micro_steps) for process in range(num_processes)
               for i in batch_indices(micro, len(rows), batch_size, num_processes, process, seed))


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
