"""Fixture draft folders copied with their config and tensors changed: the bad folders of the refusal tests of every
draft format read here (speculators' EAGLE-3 and DFlash, EAGLE-3's research layout)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file


def edited_copy(source: Path, folder: Path, config=None, tensors=None, merged=()) -> Path:
    """A copy of the draft folder `source` at `folder`: config.json's fields set (None: removed; a key in `merged`:
    the dict there updated) and model.safetensors' tensors set (None: removed; a callable: applied to the tensor)."""
    shutil.copytree(source, folder)
    meta = json.loads((folder / "config.json").read_text())
    for key, value in (config or {}).items():
        if value is None:
            meta.pop(key, None)
        elif key in merged:
            meta[key].update(value)
        else:
            meta[key] = value
    (folder / "config.json").write_text(json.dumps(meta))
    weights = load_file(folder / "model.safetensors")
    for key, value in (tensors or {}).items():
        if value is None:
            weights.pop(key)
        else:
            weights[key] = value(weights[key]) if callable(value) else value
    save_file(weights, folder / "model.safetensors")
    return folder


def shifted(d2t):
    """A d2t whose draft index 0 maps to the id index 1 maps to: two draft tokens for one id."""
    bad = d2t.clone()
    bad[0] = bad[1] + 1
    return bad
