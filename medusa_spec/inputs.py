"""A generate call's arguments checked and resolved as transformers' generate resolves them: the prompt
tensors, the sampling settings, the special tokens."""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import GenerationConfig

from .accept import Sampling
from .base import model_device_dtype


def _check_inputs(input_ids, attention_mask, max_new_tokens, streamer, vocab_size: int) -> int:
    """Raise ValueError naming what is wrong with the prompt tensors and arguments; returns max_new_tokens as an int."""
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
        raise ValueError("input_ids must be a LongTensor of shape [batch, prompt_length] "
                         "(e.g. tokenizer(..., return_tensors='pt').input_ids)")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}); give at least one prompt token per row")
    # Before the first forward pass: an id past the embedding's rows is an IndexError deep inside torch.
    # One reduction on the ids' device; the rows come to the host only to name the bad ones.
    if bool(((input_ids < 0) | (input_ids >= vocab_size)).any()):
        check_token_ids(input_ids.tolist(), vocab_size, "input_ids", "the prompts")
    max_new_tokens = _scalar(max_new_tokens)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        not_a_count = " (True/False is not a count)" if isinstance(max_new_tokens, bool) else ""
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}{not_a_count}")
    if attention_mask is not None and (not torch.is_tensor(attention_mask) or attention_mask.shape != input_ids.shape):
        shape = tuple(attention_mask.shape) if torch.is_tensor(attention_mask) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be a tensor of input_ids' shape {tuple(input_ids.shape)}, got {shape} "
                         f"(e.g. tokenizer(..., return_tensors='pt').attention_mask)")
    if streamer is not None and not all(callable(getattr(streamer, name, None)) for name in ("put", "end")):
        raise ValueError(f"streamer must have put(token_ids) and end() methods, as transformers' TextStreamer has; got "
                         f"{type(streamer).__name__}")
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError("a streamer works with one prompt (batch size 1), as in transformers")
    return max_new_tokens


def _check_padding(attention_mask: torch.Tensor, source: str, sliding_window: int | None) -> None:
    """`source`: where the mask came from, for the message; `sliding_window`: the base model's, if any."""
    if not bool((attention_mask.sum(-1) > 0).all()):
        raise ValueError(f"a row of {source} is all padding: every prompt needs at least one token")
    if not bool(attention_mask[:, -1].bool().all()):
        raise ValueError(f"prompts must be left-padded, but {source} makes the last token of a row padding: "
                         f"set tokenizer.padding_side = 'left'")
    # Padding between a row's tokens: positions skip it as in transformers, but transformers' sliding window counts
    # cache slots where this library counts positions, so a windowed model would decode otherwise.
    if sliding_window is None:
        return
    inside = (attention_mask.cumsum(-1) > 0) & ~attention_mask.bool()
    if bool(inside.any()):
        row = int(inside.any(-1).nonzero()[0])
        raise ValueError(f"row {row} of {source} masks tokens between its first and last token, which this model's "
                         f"sliding window ({sliding_window}) would count otherwise than transformers: prompts must be "
                         f"left padding, then the prompt's tokens; drop the masked tokens from the prompt, or pass an "
                         f"attention_mask that keeps them")


def check_token_ids(rows: list[list[int]], vocab_size: int, name: str, what: str) -> None:
    """Raise ValueError naming the first of `rows` (token id lists) holding an id outside [0, vocab_size)."""
    for i, row in enumerate(rows):
        bad = [t for t in row if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name}[{i}] holds token ids {bad[:5]} outside the model's vocabulary [0, {vocab_size}); "
                             f"tokenize {what} with the model's own tokenizer (one with tokens added needs "
                             f"base_model.resize_token_embeddings(len(tokenizer)))")


def _scalar(value):
    """A numpy scalar or 0-d tensor as the Python number it holds (max_new_tokens=np.int64(5), as transformers'
    generate takes it; temperature=torch.tensor(0.7)); any other value as given, for the checks to refuse."""
    if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):
        return value.item()
    return value


# What transformers' generate uses for a sampling argument that neither the call nor the model's
# generation_config sets (GenerationConfig._get_default_generation_params; tests compare the two).
TRANSFORMERS_SAMPLING_DEFAULTS = (("do_sample", False), ("temperature", 1.0), ("top_k", 50), ("top_p", 1.0))
# Sampling warpers transformers' generate would also apply, with the value at which each does nothing;
# medusa_spec draws only through temperature, top-k and top-p.
UNSUPPORTED_WARPERS = (("min_p", None), ("top_h", None), ("typical_p", 1.0), ("epsilon_cutoff", 0.0),
                       ("eta_cutoff", 0.0))
# generation_config settings from which transformers' generate builds a logits processor or stopping criterion,
# greedy or sampling (GenerationMixin._get_logits_processor, _get_stopping_criteria), or which choose another
# decoding mode or more sequences per prompt (GenerationConfig.get_generation_mode: beams, contrastive search, DoLa,
# constraints), with the value at which each does nothing; medusa_spec applies none of them. (renormalize_logits is
# left out: a log-softmax changes no argmax and no distribution.)
UNSUPPORTED_PROCESSORS = (("repetition_penalty", 1.0), ("no_repeat_ngram_size", 0), ("bad_words_ids", None),
                          ("sequence_bias", None), ("min_length", 0), ("min_new_tokens", 0),
                          ("suppress_tokens", None), ("begin_suppress_tokens", None), ("forced_bos_token_id", None),
                          ("forced_eos_token_id", None), ("exponential_decay_length_penalty", None),
                          ("remove_invalid_values", False), ("guidance_scale", 1), ("watermarking_config", None),
                          ("stop_strings", None), ("max_time", None), ("encoder_repetition_penalty", 1.0),
                          ("encoder_no_repeat_ngram_size", 0), ("num_return_sequences", 1), ("num_beams", 1),
                          ("penalty_alpha", 0.0), ("dola_layers", None),
                          ("constraints", None), ("force_words_ids", None))


def settings_of(base_model: nn.Module, generation_config=None):
    """The GenerationConfig a call decodes by: the base model's own (or None), or where the caller passes one (as to
    transformers' generate, or the one transformers merged from a call's options), that one with what it leaves
    unset (None) taken from the model's, as transformers' generate merges them (_prepare_generation_config)."""
    own = getattr(base_model, "generation_config", None)
    if generation_config is None:
        return own
    if not isinstance(generation_config, GenerationConfig):
        raise TypeError(f"generation_config must be a transformers GenerationConfig, got "
                        f"{type(generation_config).__name__}; for a dict, pass GenerationConfig(**settings)")
    merged = copy.copy(generation_config)  # update() only sets attributes; the caller's config stays as it was
    if own is not None:
        merged.update(**own.to_dict(), defaults_only=True)
    return merged


def resolve_sampling(base_model: nn.Module, do_sample=None, temperature=None, top_k=None, top_p=None,
                     generation_config=None) -> Sampling:
    """The distribution `base_model.generate` would sample with the same arguments: each one given here,
    else the generation_config (settings_of), else transformers' default (top_k=50); top_k=0 / top_p=1 disable.
    A generation_config that also sets a processor medusa_spec does not apply (repetition_penalty, ...) is refused."""
    gen_config = settings_of(base_model, generation_config)
    where = "the base model's generation_config" if generation_config is None else "generation_config"
    fix = "base_model.generation_config" if generation_config is None else "generation_config"
    given = {"do_sample": do_sample, "temperature": temperature, "top_k": top_k, "top_p": top_p}
    resolved = {}
    for name, default in TRANSFORMERS_SAMPLING_DEFAULTS:
        value = given[name]
        if value is None:
            value = getattr(gen_config, name, None)
        resolved[name] = _scalar(default if value is None else value)
    if not isinstance(resolved["do_sample"], bool):  # a truthy "false" would sample
        raise ValueError(f"do_sample must be True or False, got {resolved['do_sample']!r}")
    for name, neutral in UNSUPPORTED_PROCESSORS + (UNSUPPORTED_WARPERS if resolved["do_sample"] else ()):
        value = getattr(gen_config, name, None)
        if value is not None and value != neutral:
            when = "when sampling " if name in dict(UNSUPPORTED_WARPERS) else ""
            raise ValueError(f"{where} sets {name}={value!r}, which transformers' generate applies {when}and "
                             f"medusa_spec does not (it decodes with temperature, top_k and top_p only), so the output "
                             f"would not be the model's; set {fix}.{name} = {neutral!r} to decode without it")
    return Sampling(resolved["do_sample"], resolved["temperature"], resolved["top_k"], resolved["top_p"])


def special_tokens(base_model: nn.Module, eos_token_id, pad_token_id,
                   generation_config=None) -> tuple[list[int], int | None]:
    """(eos ids, pad id), defaulting to the generation_config (settings_of); eos_token_id=[] never stops early."""
    gen_config = settings_of(base_model, generation_config)
    if eos_token_id is None:
        eos_token_id = getattr(gen_config, "eos_token_id", None)
    if pad_token_id is None:
        pad_token_id = getattr(gen_config, "pad_token_id", None)
    if torch.is_tensor(eos_token_id):  # as transformers takes it
        eos_token_id = eos_token_id.tolist()
    eos = [] if eos_token_id is None else eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    eos = [_token_id(token, "eos_token_id", "a token id (an int) or a list of them") for token in eos]
    return eos, None if pad_token_id is None else _token_id(pad_token_id, "pad_token_id", "a token id (an int)")


def _token_id(value, name: str, expected: str) -> int:
    value = _scalar(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be {expected}, not {value!r}: pass the id, e.g. tokenizer.{name}")
    return value


def padding_mask(input_ids: torch.Tensor, eos_token_id: list[int], pad_token_id: int | None) -> torch.Tensor:
    """The attention mask transformers' generate infers when none is given (_prepare_attention_mask_for_generation):
    tokens equal to pad_token_id are padding, unless there is none or it is also an eos id (then every token counts).
    transformers also asks whether the pad id occurs at all; where it does not, input_ids.ne(pad) is all ones anyway."""
    if pad_token_id is None or pad_token_id in eos_token_id:
        return torch.ones_like(input_ids)
    return input_ids.ne(pad_token_id)


# New tokens at most when neither the call nor the model's generation_config says.
DEFAULT_MAX_NEW_TOKENS = 128


def prepare_inputs(model: nn.Module, input_ids, attention_mask, max_new_tokens, streamer, eos_token_id: list[int],
                   pad_token_id: int | None, generation_config=None,
                   sliding_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Checked inputs on the model's device: (input_ids, attention_mask as bool, max_new_tokens). Without an
    attention_mask, padding is inferred from pad_token_id as transformers' generate infers it. max_new_tokens None:
    the generation_config's max_new_tokens (settings_of), as transformers' generate reads it, else
    DEFAULT_MAX_NEW_TOKENS (where transformers would fall back to generation_config.max_length, 20 unless set)."""
    if max_new_tokens is None:
        configured = getattr(settings_of(model, generation_config), "max_new_tokens", None)
        max_new_tokens = DEFAULT_MAX_NEW_TOKENS if configured is None else configured
    max_new_tokens = _check_inputs(input_ids, attention_mask, max_new_tokens, streamer,
                                   model.get_input_embeddings().num_embeddings)
    source = "attention_mask"
    if attention_mask is None:
        attention_mask = padding_mask(input_ids, eos_token_id, pad_token_id)
        source = (f"input_ids (with no attention_mask given, tokens equal to pad_token_id={pad_token_id} are padding, "
                  f"as in transformers' generate; pass the tokenizer's attention_mask)")
    _check_padding(attention_mask, source, sliding_window)
    device, _ = model_device_dtype(model)
    return input_ids.to(device=device, dtype=torch.long), attention_mask.to(device).bool(), max_new_tokens
