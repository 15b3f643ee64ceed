"""Entry points that decode with Medusa heads and prompt lookup: they build the proposer and run the one loop
(loop.decode). The loop's parts live in their own modules: inputs (arguments), slots (prefill and the cache's
slots), output (sequences and stats); import their names from there.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationConfig

from .accept import Sampling
from .base import BaseSpec, inspect_base_model
from .inputs import resolve_sampling, special_tokens
from .lookup import LOOKUP_TOKENS, with_lookup
from .loop import decode
from .model import MedusaModel
from .output import GenerateOutput
from .propose import heads_proposer
from .tree import MedusaTree, build_tree

__all__ = ["generate", "generate_with_lookup"]


def generate(base_model: nn.Module, spec: BaseSpec, heads: nn.Module | None, tree: MedusaTree, input_ids: torch.Tensor,
             attention_mask: torch.Tensor | None = None, max_new_tokens: int | None = None,
             sampling: Sampling = Sampling(), eos_token_id: list[int] | None = None, pad_token_id: int | None = None,
             streamer=None, lookup_tokens: int = 0, documents=None,
             generation_config: GenerationConfig | None = None) -> GenerateOutput:
    """Decode with `heads` on `tree`. `lookup_tokens` > 0 adds a prompt-lookup chain of that length to the tree's
    root (candidates copied from the prompt, the generated text and `documents`, lists of token ids); `heads` may
    be None when `tree` is root-only; they run in eval mode and get their own mode back on return.
    `generation_config`: where max_new_tokens=None is read, in place of the base model's."""
    proposer = with_lookup(heads_proposer(base_model, heads, tree), lookup_tokens, documents, spec.vocab_size)
    return decode(base_model, spec, proposer, input_ids, attention_mask, max_new_tokens, sampling, eos_token_id or [],
                  pad_token_id, streamer, generation_config=generation_config)


def generate_with_lookup(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                         max_new_tokens: int | None = None, do_sample: bool | None = None,
                         temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                         eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
                         lookup_tokens: int = LOOKUP_TOKENS, documents=None, tree=None,
                         streamer=None, generation_config: GenerationConfig | None = None) -> GenerateOutput:
    """Prompt-lookup speculation through this library's verifier, lossless like the rest: each step also
    checks a chain of `lookup_tokens` candidates copied from where the text's last n-gram (n = 3 down to 1)
    occurred before in the prompt, the generated text or `documents` (lists of token ids).

    model: a transformers causal LM (lookup alone), or a MedusaModel (its heads' tree plus the chain, one
    verify pass for both; `tree` as in MedusaModel.generate). Other arguments as in MedusaModel.generate;
    `sequences` [B, prompt + new] as transformers' generate.
    """
    if lookup_tokens == 0:
        raise ValueError("generate_with_lookup needs lookup_tokens >= 1 (the lookup chain's length, e.g. 10)")
    if isinstance(model, MedusaModel):
        return model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                              do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                              eos_token_id=eos_token_id, pad_token_id=pad_token_id, tree=tree, streamer=streamer,
                              lookup_tokens=lookup_tokens, documents=documents, generation_config=generation_config)
    if tree is not None:
        raise ValueError("tree needs Medusa heads: pass a MedusaModel "
                         "(MedusaModel.from_pretrained(base_model, heads_dir))")
    base_model, spec = model, inspect_base_model(model)
    eos, pad = special_tokens(base_model, eos_token_id, pad_token_id, generation_config)
    return generate(base_model, spec, None, build_tree([]), input_ids, attention_mask, max_new_tokens,
                    resolve_sampling(base_model, do_sample, temperature, top_k, top_p, generation_config), eos, pad,
                    streamer, lookup_tokens, documents, generation_config)
