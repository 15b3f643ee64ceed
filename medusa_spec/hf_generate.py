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

# What transformers builds from the options medusa_spec decodes exactly; any other processor or criterion
# (repetition_penalty, min_new_tokens, stop_strings, a caller's own, ...) would change the output.
SAMPLING_WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
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

    input_ids [B, S] (left-padded, with model_kwargs["attention_mask"]); max_new_tokens = max_length - S;
    sampling and eos/pad from `generation_config`. `medusa_heads`: a MedusaModel on `model`, or an adapter
    folder (read at each call); `tree`: rank paths as in MedusaModel.generate. Returns sequences [B, S + new],
    or a GenerateDecoderOnlyOutput holding them when return_dict_in_generate.
    """
    medusa = _medusa_model(model, medusa_heads)
    _check_supported(generation_config, logits_processor, stopping_criteria, model_kwargs)
    max_new_tokens = generation_config.max_length - input_ids.shape[1]
    if max_new_tokens < 1:
        raise ValueError(f"max_length={generation_config.max_length} leaves no room after the prompt of "
                         f"{input_ids.shape[1]} tokens: pass max_new_tokens instead")
    # The settings transformers merged from the call's options and the model's generation_config, not the model's
    # alone: a call's repetition_penalty=1.0 lifts the model's 1.3. num_return_sequences: transformers has repeated
    # the rows already.
    settings = copy.copy(generation_config)
    settings.num_return_sequences = 1
    # No mask here means all ones: transformers prepares one for every call (inferring it where none is given) and
    # may leave out an all-ones one (GenerationMixin.generate, _mask_length); a None would have prepare_inputs infer
    # padding from pad_token_id in the prompt again.
    mask = model_kwargs.get("attention_mask")
    out = medusa.generate(input_ids, torch.ones_like(input_ids) if mask is None else mask, max_new_tokens, tree=tree,
                          streamer=streamer, generation_config=settings)
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
    others = [type(p).__name__ for p in logits_processor if not isinstance(p, SAMPLING_WARPERS)]
    others += [type(c).__name__ for c in stopping_criteria if not isinstance(c, STOPPING_CRITERIA)]
    if others:
        raise ValueError(f"custom_generate=medusa_spec applies temperature, top_k, top_p, eos_token_id and "
                         f"max_new_tokens only, but these options add {', '.join(others)}: drop them, {NO_CUSTOM}")
    unknown = sorted(set(model_kwargs) - set(PREPARED_MODEL_KWARGS))
    if unknown:
        raise ValueError(f"custom_generate=medusa_spec takes input_ids and attention_mask, not {', '.join(unknown)}: "
                         f"drop them, {NO_CUSTOM}")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError("custom_generate=medusa_spec fills its own KV cache from the prompt: pass the whole text as "
                         "input_ids without past_key_values")
