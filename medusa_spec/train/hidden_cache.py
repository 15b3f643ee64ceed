"""A file-backed cache of the frozen base model's final hidden states (Medusa-1 only).

The base then runs once per training row instead of once per epoch. The cache is a memory-mapped
file of shape [rows, max_length, hidden] (sparse on disk until written) plus one flag per row;
processes write disjoint rows, and it survives a kill, so --resume does not recompute it.
Size when full: rows x max_length x hidden x 2 bytes in bf16/fp16 (4 in fp32).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from dataclasses import dataclass
from pathlib import Path

import torch

from .data import Example

META, STATES, FILLED = "meta.json", "hidden.bin", "filled.bin"


@dataclass(frozen=True)
class HiddenCache:
    states: torch.Tensor  # [rows, max_length, hidden], memory-mapped
    filled: torch.Tensor  # [rows] bool, memory-mapped

    def get(self, rows: list[int], length: int) -> torch.Tensor | None:
        """[len(rows), length, hidden], or None while any of the rows is not cached yet."""
        index = torch.tensor(rows)
        if not bool(self.filled[index].all()):
            return None
        return self.states[index, :length]

    def put(self, rows: list[int], hidden: torch.Tensor) -> None:
        index = torch.tensor(rows)
        self.states[index, : hidden.shape[1]] = hidden.detach().to("cpu", self.states.dtype)
        self.filled[index] = True  # after the states: a kill in between only loses this batch


def fingerprint(rows: list[list[Example] | None], *keys: object) -> str:
    """A hash of the rows' tokens and `keys`; for the hidden-state cache (keys: the model's path and the dtype) it
    changes whenever the cached values would. A None row separates groups."""
    digest = hashlib.sha256("|".join(map(str, keys)).encode())
    for row in rows:
        for example in row or ():
            digest.update(array("q", example.input_ids).tobytes())
        digest.update(b"|" if row is not None else b"/")
    return digest.hexdigest()


def reset_if_stale(directory: Path, key: str, shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    """Main process only: start an empty cache unless the one in `directory` matches `key` and shape."""
    meta = {"fingerprint": key, "shape": list(shape), "dtype": str(dtype)}
    meta_file = directory / META
    if meta_file.is_file() and json.loads(meta_file.read_text()) == meta:
        return
    directory.mkdir(parents=True, exist_ok=True)
    meta_file.unlink(missing_ok=True)  # written last: a reset cut short is redone next time
    item = torch.empty((), dtype=dtype).element_size()
    for name, size in ((STATES, shape[0] * shape[1] * shape[2] * item), (FILLED, shape[0])):
        with open(directory / name, "wb") as f:
            f.truncate(size)  # zero-filled and sparse
    meta_file.write_text(json.dumps(meta))


def open_hidden_cache(directory: Path, shape: tuple[int, int, int], dtype: torch.dtype) -> HiddenCache:
    rows, length, hidden = shape
    states = torch.from_file(str(directory / STATES), shared=True, size=rows * length * hidden, dtype=dtype)
    filled = torch.from_file(str(directory / FILLED), shared=True, size=rows, dtype=torch.bool)
    return HiddenCache(states.view(rows, length, hidden), filled)
