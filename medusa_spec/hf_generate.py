"""Tree speculation through transformers' own `generate`, by its `custom_generate` hook.

    base_model.generate(**inputs, custom_generate=CUSTOM_GENERATE, trust_remote_code=True, medusa_heads=mm)
    base_model.generate(**inputs, custom_generate=medusa_decoding, medusa_heads=mm)     # no streamer

transformers prepares the call as for its own loop (GenerationConfig merged from the argument, the model's
generation_config and keyword arguments; special tokens; max_length) and `medusa_decoding` decodes with
MedusaModel.generate. transformers 5 hands a callable no streamer (it only puts the prompt into it), so the
shipped folder, whose generate() receives every argument, binds the streamer and calls generate again with
the callable. Nothing is set on the caller's model.
"""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path

import torch
from torch import nn
from transformers.generation import (
    EosTokenCriteria,
    GenerateDecoderOnlyOutput,
    GenerationConfig,
    GenerationMode,
    LogitsProcessorList,
    MaxLengthCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .io import LORA_DIR
from .model import MedusaModel

# The folder to pass as custom_generate= (it holds custom_generate/generate.py, which imports `generate` below).
CUSTOM_GENERATE = str(Path(__file__).with_name("hf_custom_generate"))

# What transformers builds from the options medusa_spec decodes exactly, each warper with the setting it carries; these
# are read from the lists transformers hands over, where a caller's own of the same class takes the place of the one
# the options build. Any other processor or criterion (repetition_penalty, min_new_tokens, stop_strings, a subclass,
# ...) would change the output.
SAMPLING_WARPERS = {TemperatureLogitsWarper: "temperature", TopKLogitsWarper: "top_k", TopPLogitsWarper: "top_p"}
STOPPING_CRITERIA = (MaxLengthCriteria, EosTokenCriteria)
# Model inputs transformers prepares for its own loop; medusa_spec builds its own positions and cache.
# generate's own model kwargs; the cache is "past_key_values" in transformers releases before the rename (5.17).
PREPARED_MODEL_KWARGS = ("attention_mask", "position_ids", "cache", "past_key_values", "use_cache", "logits_to_keep")
UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
NO_CUSTOM = "or call base_model.generate without custom_generate"


def generate(model: nn.Module, streamer=None, assistant_model=None, **arguments):
    """The shipped folder's entry: transformers passes it every argument of `model.generate`; it binds the
    streamer to `medusa_decoding` and lets transformers prepare the call for it."""
    if assistant_model is not None:
        raise ValueError(f"custom_generate=medusa_spec proposes with Medusa heads, not an assistant_model: drop "
                         f"assistant_model (medusa_spec.generate_with_draft verifies a draft model), {NO_CUSTOM}")
    return model.generate(custom_generate=functools.partial(medusa_decoding, streamer=streamer), **arguments)


def medusa_decoding(model: nn.Module, input_ids: torch.LongTensor, logits_processor: LogitsProcessorList,
                    stopping_criteria: StoppingCriteriaList, generation_config: GenerationConfig, streamer=None,
                    medusa_heads: MedusaModel | str | os.PathLike | None = None, tree=None, **model_kwargs):
    """transformers' decoding-loop contract (as `_sample`), run by MedusaModel.generate.

    input_ids [B, S] (left-padded, with model_kwargs["attention_mask"]); sampling, max_length and eos from the
    warpers and criteria of `logits_processor` and `stopping_criteria` (the options', or a caller's in their place),
    pad from `generation_config`. `medusa_heads`: a MedusaModel on `model`, or an adapter
    folder (read at each call); `tree`: rank paths as in MedusaModel.generate. Returns sequences [B, S + new],
    or a GenerateDecoderOnlyOutput holding them when return_dict_in_generate.
    """
    medusa = _medusa_model(model, medusa_heads)
    _check_supported(generation_config, logits_processor, stopping_criteria, model_kwargs)
    _check_positions(input_ids, model_kwargs)
    sampling = _sampling(generation_config, logits_processor)
    max_length, eos = _stopping(generation_config, stopping_criteria)
    max_new_tokens = max_length - input_ids.shape[1]
    if max_new_tokens < 1:
        raise ValueError(f"max_length={max_length} leaves no room after the prompt of {input_ids.shape[1]} tokens: "
                         f"pass max_new_tokens instead")
    # The settings transformers merged from the call's options and the model's generation_config, not the model's
    # alone: a call's repetition_penalty=1.0 lifts the model's 1.3. num_return_sequences: transformers has repeated
    # the rows already.
    settings = copy.copy(generation_config)
    settings.num_return_sequences = 1
    # No mask here means all ones: transformers prepares one for every call (inferring it where none is given) and
    # may leave out an all-ones one (GenerationMixin.generate, _mask_length); a None would have prepare_inputs infer
    # padding from pad_token_id in the prompt again.
    mask = model_kwargs.get("attention_mask")
    out = medusa.generate(input_ids, torch.ones_like(input_ids) if mask is None else mask, max_new_tokens,
                          eos_token_id=eos, tree=tree, streamer=streamer, generation_config=settings, **sampling)
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=out.sequences)
    return out.sequences


def _medusa_model(model: nn.Module, medusa_heads) -> MedusaModel:
    if medusa_heads is None:
        raise ValueError("custom_generate=medusa_spec needs heads: pass medusa_heads=MedusaModel.from_pretrained("
                         "base_model, heads_dir) (or medusa_heads=heads_dir) to generate()")
    if isinstance(medusa_heads, (str, os.PathLike)):
        if (Path(medusa_heads) / LORA_DIR).exists():
            raise ValueError(f"{medusa_heads} holds a Medusa-2 LoRA, which loading applies to the base model in "
                             f"place; load it once with medusa = MedusaModel.from_pretrained(base_model, "
                             f"{str(medusa_heads)!r}) and pass medusa_heads=medusa")
        return MedusaModel.from_pretrained(model, medusa_heads)
    if not isinstance(medusa_heads, MedusaModel):
        raise TypeError(f"medusa_heads must be a MedusaModel or an adapter folder, got {type(medusa_heads).__name__}; "
                        f"wrap heads with MedusaModel.from_pretrained(base_model, heads_dir)")
    if medusa_heads.base_model is not model:
        raise ValueError("medusa_heads is attached to another base model: call generate on medusa_heads.base_model, or "
                         "load the heads onto this one with MedusaModel.from_pretrained(base_model, heads_dir)")
    return medusa_heads


def _check_supported(generation_config: GenerationConfig, logits_processor, stopping_criteria, model_kwargs) -> None:
    """Refuse what medusa_spec would not decode exactly as transformers' generate, naming the option."""
    mode = generation_config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(f"custom_generate=medusa_spec decodes greedily or by sampling, one sequence per prompt; these "
                         f"options ask for {mode.value} (num_beams={generation_config.num_beams}): set num_beams=1 "
                         f"and drop the {mode.value} options, {NO_CUSTOM}")
    outputs = [name for name in UNSUPPORTED_OUTPUTS if getattr(generation_config, name, False)]
    if outputs:
        raise ValueError(f"custom_generate=medusa_spec returns sequences only: drop {', '.join(outputs)} "
                         f"(return_dict_in_generate=True alone gives a GenerateDecoderOnlyOutput), {NO_CUSTOM}")
    others = [type(p).__name__ for p in logits_processor if type(p) not in SAMPLING_WARPERS]
    others += [type(c).__name__ for c in stopping_criteria if type(c) not in STOPPING_CRITERIA]
    if others:
        raise ValueError(f"custom_generate=medusa_spec applies temperature, top_k, top_p, eos_token_id and "
                         f"max_new_tokens only (or transformers' own warpers and criteria for them in logits_processor "
                         f"and stopping_criteria), but these options add {', '.join(others)}: drop them, {NO_CUSTOM}")
    unknown = sorted(set(model_kwargs) - set(PREPARED_MODEL_KWARGS))
    if unknown:
        raise ValueError(f"custom_generate=medusa_spec takes input_ids and attention_mask, not {', '.join(unknown)}: "
                         f"drop them, {NO_CUSTOM}")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError("custom_generate=medusa_spec fills its own KV cache from the prompt: pass the whole text as "
                         "input_ids without past_key_values")


def _check_positions(input_ids: torch.Tensor, model_kwargs: dict) -> None:
    """Refuse position_ids other than those transformers makes without them (each token's count of tokens before it in
    its row, padding counting none; _prepare_position_ids_for_generation): medusa_spec positions tokens so."""
    given = model_kwargs.get("position_ids")
    if given is None:
        return
    mask = model_kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask.long()
    own = mask.cumsum(-1) - 1
    if (given.dim() != 2 or given.shape[0] not in (1, input_ids.shape[0]) or given.shape[1] != input_ids.shape[1]
            or not bool(((given.to(own.device) == own) | (mask == 0)).all())):
        raise ValueError("custom_generate=medusa_spec positions each token by the attention_mask (the count of tokens "
                         "before it in its row, as transformers does without position_ids) and takes no other "
                         f"position_ids: drop position_ids, {NO_CUSTOM}")


def _sampling(generation_config: GenerationConfig, logits_processor) -> dict:
    """MedusaModel.generate's sampling arguments for what transformers' loop applies through `logits_processor`: its
    warpers, each the options' or a caller's in its place, read in list order. medusa_spec applies temperature, then
    top-k, then top-p (accept.kept_scores): temperatures multiply and top-k cuts keep the smallest, in any order
    between them (a scale keeps the order of scores), but a top-p cut must come last and filter as transformers' own
    (to -inf, keeping at least one token). Greedy: {"do_sample": False} (no warper changes the argmax)."""
    if generation_config.get_generation_mode() != GenerationMode.SAMPLE:
        return {"do_sample": False}
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    top_p = None  # the top-p warper read, which only the end of the list may follow
    for warper in logits_processor:  # others were refused (_check_supported)
        name = SAMPLING_WARPERS[type(warper)]
        value = getattr(warper, name)
        described = f"{type(warper).__name__}({name}={value})"
        if top_p is not None:
            raise ValueError(f"custom_generate=medusa_spec samples by temperature, then top_k, then top_p, but with "
                             f"the logits_processor passed to generate transformers applies {top_p} before "
                             f"{described}: pass the settings as options (top_p={sampling['top_p']}, top_k=, "
                             f"temperature=) in place of warpers, {NO_CUSTOM}")
        if name != "temperature" and (warper.filter_value != float("-inf") or
                                      (name == "top_p" and warper.min_tokens_to_keep != 1)):
            raise ValueError(f"custom_generate=medusa_spec filters as {name}={value} does (to -inf, keeping at least "
                             f"one token), but the logits_processor passed to generate holds {described} with "
                             f"filter_value={warper.filter_value}, min_tokens_to_keep={warper.min_tokens_to_keep}: "
                             f"pass {name}={value} as an option in its place, {NO_CUSTOM}")
        if name == "temperature":
            sampling[name] *= value
        elif name == "top_k":
            sampling[name] = min(sampling[name] or value, value)
        else:
            sampling[name], top_p = value, described
    return sampling


def _stopping(generation_config: GenerationConfig, stopping_criteria) -> tuple[int, list[int]]:
    """(max_length, eos ids) transformers' loop stops by: its MaxLengthCriteria and EosTokenCriteria, the options' or a
    caller's in their place (others were refused: _check_supported). No EosTokenCriteria: no eos stops a row."""
    lengths = [c.max_length for c in stopping_criteria if type(c) is MaxLengthCriteria]
    eos = [token for c in stopping_criteria if type(c) is EosTokenCriteria
           for token in c.eos_token_id.flatten().tolist()]
    return min(lengths, default=generation_config.max_length), list(dict.fromkeys(eos))
