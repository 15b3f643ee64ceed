"""What medusa_spec reads from a base model, and the checks that refuse models it cannot drive.

This is the one place that knows transformers' conventions (config fields, attention
implementations, forward arguments); everything else receives a `BaseSpec`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# Implementations that accept an arbitrary 4D mask; flash/flex kernels take no custom tree mask.
MASKABLE_ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class BaseSpec:
    hidden_size: int          # width of the final hidden state (the LM head's input)
    vocab_size: int           # rows of the LM head = width of the logits
    layer_types: tuple[str, ...]  # distinct attention layer types, a subset of ATTENTION_LAYER_TYPES
    sliding_window: int | None
    bool_mask: bool           # sdpa takes a boolean mask; eager adds a float mask to its scores
    takes_logits_to_keep: bool
    name_or_path: str | None
    num_layers: int | None = None   # decoder layers: hidden_states has num_layers + 1 entries, the last one final
    cache_arg: str = "cache"        # the forward's KV-cache argument (cache_argument)
    layer_width: int | None = None  # width of the decoder layers' hidden states


def cache_argument(forward) -> str | None:
    """The name `forward` takes its KV cache by: `cache` in recent transformers 5.x, `past_key_values` in earlier
    5.x releases (5.17, say), which the pyproject's range admits; None when it takes neither."""
    params = inspect.signature(forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in params), None)


class UnsupportedModelError(ValueError):
    """The base model cannot verify a token tree in one pass (recurrent state, no causal LM head, ...)."""


def inspect_base_model(base_model: nn.Module) -> BaseSpec:
    """Read a BaseSpec from a transformers causal LM, or raise UnsupportedModelError saying why."""
    name = type(base_model).__name__
    if callable(getattr(base_model, "get_base_model", None)) and hasattr(base_model, "peft_config"):
        raise UnsupportedModelError(
            f"{name} is a peft model; pass the transformers model it wraps, peft_model.get_base_model() (its LoRA "
            f"layers live there and stay active), and save a Medusa-2 LoRA with save_heads(path, lora=peft_model)")
    config = getattr(base_model, "config", None)
    if config is None or not callable(getattr(base_model, "get_output_embeddings", None)):
        raise UnsupportedModelError(f"{name} is not a transformers model; pass an AutoModelForCausalLM instance")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{name} is an encoder-decoder model; medusa_spec needs a decoder-only causal LM (AutoModelForCausalLM)")
    lm_head = base_model.get_output_embeddings()
    if lm_head is None or getattr(lm_head, "weight", None) is None or lm_head.weight.dim() != 2:
        raise UnsupportedModelError(f"{name} has no output embedding (LM head); load it with AutoModelForCausalLM")
    params = inspect.signature(base_model.forward).parameters
    cache_arg = cache_argument(base_model.forward)
    missing = [p for p in ("attention_mask", "position_ids") if p not in params] + ([] if cache_arg else ["cache"])
    if missing:
        raise UnsupportedModelError(
            f"{name}.forward takes no {', '.join(missing)}: tree verification needs explicit positions, a 4D mask "
            f"and a KV cache that can be rolled back, which recurrent or state-space models do not have")
    text_config = config.get_text_config(decoder=True)
    window = getattr(text_config, "sliding_window", None)
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is None:
        layer_types = ["sliding_attention" if window else "full_attention"]
    other = sorted(set(layer_types) - set(ATTENTION_LAYER_TYPES))
    if other:
        raise UnsupportedModelError(
            f"{name} has {other} layers: their recurrent state cannot be rolled back to the accepted tree path; "
            f"only attention layers ({', '.join(ATTENTION_LAYER_TYPES)}) are supported")
    attn = getattr(config, "_attn_implementation", None) or "eager"
    if attn not in MASKABLE_ATTENTION:
        raise UnsupportedModelError(
            f"{name} uses attn_implementation={attn!r}, which takes no custom tree mask; "
            f"load the model with attn_implementation='sdpa' (or 'eager'), or switch it back with "
            f"set_attn_implementation('sdpa')")
    return BaseSpec(
        hidden_size=lm_head.weight.shape[1],
        vocab_size=lm_head.weight.shape[0],
        layer_types=tuple(sorted(set(layer_types))),
        sliding_window=int(window) if window and "sliding_attention" in layer_types else None,
        bool_mask=attn == "sdpa",
        takes_logits_to_keep="logits_to_keep" in params,
        name_or_path=getattr(config, "_name_or_path", None) or None,
        num_layers=getattr(text_config, "num_hidden_layers", None),
        layer_width=getattr(text_config, "hidden_size", None),
        cache_arg=cache_arg,
    )


def model_device_dtype(base_model: nn.Module) -> tuple[torch.device, torch.dtype]:
    weight = base_model.get_output_embeddings().weight
    return weight.device, weight.dtype
