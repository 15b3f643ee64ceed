"""Load the base model and its tokenizer from a local folder (the save_pretrained layout)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from ..folders import DTYPES, check_model_folder
from .data import require_chat_template


def load_model_and_tokenizer(path: str | Path, dtype="auto", plain_text: bool = False):
    """(base_model, tokenizer) from `path`; the tokenizer must be a fast one (offsets locate the
    assistant tokens) with a chat template, unless plain_text (see data.PLAIN_TEXT_TEMPLATE)."""
    path = check_model_folder(path)
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not tokenizer.is_fast:
        raise ValueError(f"{path}: the tokenizer is a slow (Python) one; training needs a fast tokenizer "
                         f"(tokenizer.json), e.g. re-save it with AutoTokenizer.from_pretrained(..., use_fast=True)")
    require_chat_template(tokenizer, plain_text, source=f"the tokenizer in {path}")
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"{path}: the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token")
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out everywhere, any id will do
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model, tokenizer
