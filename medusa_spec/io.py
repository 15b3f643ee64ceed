"""Adapter files: medusa_config.json + medusa_heads.safetensors (+ lora/ for Medusa-2), written atomically."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .config import CONFIG_NAME, MedusaConfig
from .heads import MedusaHeads

WEIGHTS_NAME = "medusa_heads.safetensors"
# Medusa-2: the LoRA adapter trained into the base model, in peft's own save_pretrained layout.
LORA_DIR = "lora"


@contextmanager
def staged_save(path: str | Path, names: tuple[str, ...]) -> Iterator[Path]:
    """Yield an empty folder to write into; when the block ends, move each of `names` from it into `path`,
    all or nothing. A name the block did not write is removed from `path` (a stale file must not pair with
    new ones); other files in `path` are left alone.

    The slow writing happens under temporary names, and a failure while moving puts the previous files back,
    so an interrupted save leaves the previous adapter loadable.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # Inside `path`: the same filesystem, so each move is an atomic rename.
    tmp = Path(tempfile.mkdtemp(prefix=".saving-", dir=path))
    try:
        staged, previous = tmp / "new", tmp / "previous"
        staged.mkdir()
        previous.mkdir()
        yield staged
        _swap_in(staged, path, names, previous)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _swap_in(staged: Path, path: Path, names: tuple[str, ...], previous: Path) -> None:
    placed = []
    try:
        for name in names:
            new, old = staged / name, path / name
            if old.is_file() and new.is_file():
                # Keep the old file in place (readers never find it missing) until os.replace swaps in the new one.
                try:
                    os.link(old, previous / name)
                except OSError:  # a filesystem without hard links
                    shutil.copy2(old, previous / name)
            elif old.exists():
                # A folder cannot be replaced in one step, and a file with no new version must go.
                os.replace(old, previous / name)
            if new.exists():
                os.replace(new, old)
                placed.append(name)
    except BaseException:
        for name in placed:
            _remove(path / name)
        for saved in previous.iterdir():
            os.replace(saved, path / saved.name)
        raise


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def save_adapter(path: str | Path, config: MedusaConfig, state_dict: Mapping[str, torch.Tensor],
                 lora: nn.Module | None = None) -> None:
    """Write medusa_config.json + medusa_heads.safetensors and, for Medusa-2, `lora` (a peft model) under lora/,
    atomically (see staged_save). Saving without `lora` removes one left by an earlier save, so new heads are
    never loaded with a stale LoRA adapter."""
    with staged_save(path, (LORA_DIR, WEIGHTS_NAME, CONFIG_NAME)) as staged:
        save_file({k: v.detach().contiguous().cpu() for k, v in state_dict.items()}, str(staged / WEIGHTS_NAME),
                  metadata={"format": "pt"})
        config.to_json_file(staged / CONFIG_NAME)
        if lora is not None:
            lora.save_pretrained(str(staged / LORA_DIR))


def load_adapter(path: str | Path) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    """Read an adapter written by save_adapter; the weights are checked against the config."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no adapter folder at {path}; save one with MedusaModel.save_heads({str(path)!r})")
    config_file, weights_file = path / CONFIG_NAME, path / WEIGHTS_NAME
    for file in (config_file, weights_file):
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing; an adapter folder holds {CONFIG_NAME} and {WEIGHTS_NAME} "
                                    f"(re-save it with save_heads)")
    config = MedusaConfig.from_json_file(config_file)
    state_dict = read_safetensors(weights_file)
    check_weights(expected_shapes(config, config_file), state_dict, weights_file,
                  fix=f"it and {CONFIG_NAME} come from different saves; re-save the adapter with save_heads()")
    return config, state_dict


def read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{file} is truncated or corrupt ({err}); re-save or re-download it") from None


def expected_shapes(config: MedusaConfig, source) -> dict[str, torch.Size]:
    """Name -> shape of every tensor of heads built from `config` (on the meta device: nothing is allocated)."""
    unknown = [name for name in ("hidden_size", "vocab_size")
               if getattr(config, name) is None and (name == "hidden_size" or not config.share_lm_head)]
    if unknown:
        raise ValueError(f"{source}: {' and '.join(unknown)} unknown (null); set them to the base model's values")
    with torch.device("meta"):
        # A shared LM head is the base model's: the heads hold nothing vocabulary-sized, so 0 stands in.
        heads = MedusaHeads(config.hidden_size, config.vocab_size or 0, config.num_heads, config.num_layers,
                            config.share_lm_head, config.head_type, config.draft_vocab_size, config.context_heads)
    return {name: tensor.shape for name, tensor in heads.state_dict().items()}


def check_weights(expected: Mapping[str, torch.Size], state_dict: Mapping[str, torch.Tensor], source, fix: str,
                  name: Callable[[str], str] = lambda key: key) -> None:
    """Raise ValueError naming every missing, unexpected or misshapen tensor; `name` maps a key to the file's own
    naming for the message."""
    problems = [f"missing {name(k)}" for k in expected if k not in state_dict]
    problems += [f"unexpected {name(k)}" for k in state_dict if k not in expected]
    problems += [f"{name(k)} has shape {tuple(state_dict[k].shape)}, expected {tuple(shape)}"
                 for k, shape in expected.items() if k in state_dict and state_dict[k].shape != shape]
    if problems:
        raise ValueError(f"{source}: {'; '.join(problems[:5])}{'; ...' if len(problems) > 5 else ''}; {fix}")


def load_lora(base_model: nn.Module, path: str | Path) -> nn.Module:
    """The model to run: `base_model` with the Medusa-2 LoRA adapter saved under `path`/lora applied through
    peft (which injects its layers into `base_model` itself), or `base_model` as is when there is none."""
    lora_dir = Path(path) / LORA_DIR
    if not lora_dir.exists():
        return base_model
    if not (lora_dir / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{lora_dir} has no adapter_config.json, so it is not a peft adapter; re-save with "
                                f"save_heads(path, lora=peft_model), or delete {lora_dir} to load the heads alone")
    from peft import PeftModel  # imported here: peft is slow to import and only Medusa-2 adapters need it

    return PeftModel.from_pretrained(base_model, str(lora_dir)).get_base_model()
