"""Adapter files: medusa_config.json + medusa_heads.safetensors, written atomically."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .config import CONFIG_NAME, MedusaConfig

WEIGHTS_NAME = "medusa_heads.safetensors"


def save_adapter(path: str | Path, config: MedusaConfig, state_dict: dict[str, torch.Tensor]) -> None:
    """Write both files under temporary names in the target folder, then rename them into place:
    a failure while writing (the slow part) leaves the previous adapter untouched, and other
    files in the folder (a card, a LoRA adapter) are left alone."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".saving-", dir=path))
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in state_dict.items()}, str(tmp / WEIGHTS_NAME),
                  metadata={"format": "pt"})
        config.to_json_file(tmp / CONFIG_NAME)
        for name in (WEIGHTS_NAME, CONFIG_NAME):  # renames within one filesystem are atomic
            os.replace(tmp / name, path / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_adapter(path: str | Path) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no adapter folder at {path}; save one with MedusaModel.save_heads({str(path)!r})")
    config_file, weights_file = path / CONFIG_NAME, path / WEIGHTS_NAME
    for file in (config_file, weights_file):
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing; an adapter folder holds {CONFIG_NAME} and {WEIGHTS_NAME} "
                                    f"(re-save it with save_heads)")
    config = MedusaConfig.from_json_file(config_file)
    try:
        state_dict = load_file(str(weights_file))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{weights_file} is truncated or corrupt ({err}); re-save or re-download the adapter") from None
    return config, state_dict


def load_state_dict_checked(heads: nn.Module, state_dict: dict[str, torch.Tensor], source) -> None:
    """Copy weights into `heads`, naming every missing, unexpected or misshapen tensor."""
    expected = heads.state_dict()
    problems = [f"missing {k}" for k in expected if k not in state_dict]
    problems += [f"unexpected {k}" for k in state_dict if k not in expected]
    problems += [f"{k} has shape {tuple(state_dict[k].shape)}, expected {tuple(v.shape)}"
                 for k, v in expected.items() if k in state_dict and state_dict[k].shape != v.shape]
    if problems:
        raise ValueError(f"{source}: weights do not match its {CONFIG_NAME} ({'; '.join(problems[:5])}"
                         f"{'; ...' if len(problems) > 5 else ''}); the config and weights come from different adapters")
    heads.load_state_dict(state_dict)
