"""The local folders a command is given, checked before the work: the one holding a model (transformers would take a
missing folder for a Hub repo id and try the network) and the one it writes (mkdir would fail only when the results
are written); and the dtypes a model is loaded in, by the names --dtype takes."""

from __future__ import annotations

from pathlib import Path

import torch

from .formats import heads_without_model

DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_model_folder(path: str | Path, flag: str = "--model", tokenizer: bool = True) -> Path:
    """`path` if it is a local folder holding a transformers model (and, with `tokenizer`, its tokenizer), else an
    error naming `flag` and what to give: transformers reads a missing folder as a Hub repo id (and tries the
    network), and a folder without a tokenizer as a reason to install sentencepiece."""
    path = Path(path)
    what = "the model and its tokenizer" if tokenizer else "the model"
    if not path.is_dir():
        raise FileNotFoundError(f"{flag} {path}: no such folder; give a local folder holding {what}, as written by "
                                f"save_pretrained (nothing is downloaded)")
    heads = heads_without_model(path)
    if heads is not None:
        raise ValueError(f"{flag} {path} holds Medusa heads ({heads} format), not a model: heads go with --heads "
                         f"(--init-heads in train); give {flag} the folder holding {what}, as written by "
                         f"save_pretrained")
    missing = [] if (path / "config.json").is_file() else ["no model (config.json)"]
    # Any one of these makes a tokenizer AutoTokenizer loads: save_pretrained writes the first two, older checkpoints
    # may hold only a vocabulary file.
    tokenizer_files = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
    if tokenizer and not any((path / name).is_file() for name in tokenizer_files):
        missing.append("no tokenizer (tokenizer_config.json, tokenizer.json)")
    if missing:
        raise ValueError(f"{flag} {path} holds {' and '.join(missing)}; give the folder holding {what}, as written "
                         f"by save_pretrained")
    return path


def check_output_folder(path: str | Path, flag: str = "--output", file_ok: bool = False) -> Path:
    """`path` unless it is an existing file (`file_ok`: an output file, which may exist) or lies under one, where the
    folder the command writes cannot be made: checked before the work, since mkdir would only fail (FileExistsError,
    NotADirectoryError) when the results are written."""
    path = Path(path)
    if path.exists() and not path.is_dir() and not file_ok:
        raise ValueError(f"{flag} {path} is a file; give a folder (made if missing)")
    blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ValueError(f"{flag} {path} lies under {blocking}, which is a file; give a folder (made if missing)")
    return path
