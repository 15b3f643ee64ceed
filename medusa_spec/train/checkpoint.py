"""Atomic training checkpoints under <output>/checkpoints/ (train --output).

A checkpoint is accelerate's state (trainable weights, optimizer, scheduler, RNG states of every
process, grad scaler) plus trainer_state.json (the step and the config). It is written to a
temporary folder, renamed into place, and only then named in `latest`: a kill at any moment
leaves the previous checkpoint intact. The data position needs no saving: which rows a step
reads is a pure function of the step (see loop.batch_indices).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from accelerate.utils import DistributedType

from ..eagle3 import NORM_FLAGS

CHECKPOINTS, LATEST, STATE = "checkpoints", "latest", "trainer_state.json"
DATA_FINGERPRINT = "data_fingerprint"  # beside the settings in a checkpoint's config: loop.train's hash of the rows
# Settings that may differ on --resume without changing the weights reached (eval_ranks was top_k in checkpoints
# written before its rename: what evaluation counts, not what trains; output, output_dir before its rename, is the
# folder the checkpoint is read from, wherever it was moved).
RESUMABLE_CHANGES = {"resume", "save_every", "keep_checkpoints", "log_every", "eval_every", "eval_ranks", "top_k",
                     "output", "output_dir", "time_limit"}


def keep_trainable_weights_only(accelerator) -> None:
    """Checkpoint only parameters that train (heads, LoRA), not the frozen base, in the plain and
    DDP cases; DeepSpeed writes its own checkpoint format with everything."""
    def hook(models, weights, output_dir):
        for i, model in enumerate(models):
            trainable = {name for name, p in model.named_parameters() if p.requires_grad}
            weights[i] = {k: v for k, v in weights[i].items() if k in trainable}
    accelerator.register_save_state_pre_hook(hook)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(accelerator, output_dir: str | Path, step: int, config: dict, keep: int) -> Path:
    """Save the state after `step` optimizer steps; keep the newest `keep` checkpoints."""
    root = Path(output_dir) / CHECKPOINTS
    final, tmp = root / f"step-{step:08d}", root / f".tmp-step-{step:08d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a kill during an earlier save
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))  # every process writes its own RNG state
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE).write_text(json.dumps({"step": step, "config": config}, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_atomically(root / LATEST, final.name)
        for old in sorted(root.glob("step-*"))[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    pointer = Path(output_dir) / CHECKPOINTS / LATEST
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    if not (path / STATE).is_file():
        raise ValueError(f"{pointer} names {path.name}, which is missing or incomplete; "
                         f"point it at another checkpoint in {pointer.parent} or delete {pointer} to start over")
    return path


def _saved(config: dict, key: str):
    """A setting of a checkpoint's config. speculators' norm flags came later: eagle3 heads trained before them had
    them all off, so such a checkpoint resumes with them off and names them if they are not."""
    if key not in config and key in NORM_FLAGS and config.get("head_type") == "eagle3":
        return False
    return config.get(key)


def load_checkpoint(accelerator, path: Path, config: dict) -> int:
    """Restore the state saved in `path` (refusing a different config); returns its step."""
    state = json.loads((path / STATE).read_text())
    saved = state["config"].pop(DATA_FINGERPRINT, None)  # checkpoints from before it have none
    rows = config.get(DATA_FINGERPRINT)
    config = {k: v for k, v in config.items() if k != DATA_FINGERPRINT}
    changed = sorted(k for k in set(config) | set(state["config"])
                     if k not in RESUMABLE_CHANGES and config.get(k) != _saved(state["config"], k))
    if changed:  # first: a setting that changes the rows is named, not blamed on the data
        diff = ", ".join(f"{k}: {_saved(state['config'], k)!r} -> {config.get(k)!r}" for k in changed)
        raise ValueError(f"--resume: the settings differ from those of {path} ({diff}); resume with the same "
                         f"settings, or train into a new --output")
    if saved is not None and saved != rows:
        raise ValueError(f"--resume: the training rows differ from those of {path} (the data folder has changed "
                         f"since, e.g. distilled further, or the tokenizer has): the held-out split and the rows each "
                         f"step reads would shift; resume on the data as it was, or train into a new --output")
    # Plain/DDP checkpoints hold the trainable weights only (see keep_trainable_weights_only).
    strict = {} if accelerator.distributed_type == DistributedType.DEEPSPEED else {"strict": False}
    accelerator.load_state(str(path), **strict)
    return state["step"]
