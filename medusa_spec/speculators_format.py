"""speculators' EAGLE-3 folder (vLLM's training library; vLLM and SGLang serve it as is): read as eagle3 heads, and
written from them.

A folder holds config.json (speculators_model_type "eagle3", transformer_layer_config, draft_vocab_size, the norm
flags, eagle_aux_hidden_state_layer_ids, speculators_config naming the verifier and the draft depth) and
*.safetensors: fc.weight, layers.{i}.*, norm.weight, lm_head.weight over the draft vocabulary, d2t (draft index ->
offset to the verifier's token id) and t2d (the verifier's tokens in the draft vocabulary) when it is reduced, and
embed_tokens.weight, a copy of the verifier's input embeddings (vLLM shares the verifier's where it is absent).

medusa_spec keeps the draft's tensors under `draft_layer.` and the vocabulary maps as its token_map (d2t + its
index); embed_tokens must equal the base model's embeddings and is not kept. Every config field is either read into
the MedusaConfig, kept verbatim in its source_config (versions, architectures, proposal settings) to be written back,
or refused by name: none is ignored.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from . import io
from .config import MedusaConfig, read_json_object
from .eagle3 import NORM_FLAGS

HF_CONFIG = "config.json"
WEIGHTS = "model.safetensors"
PREFIX = "draft_layer."
# speculators' other speculators_model_types: named when refused (dflash drafts through dflash_propose, not as heads).
OTHER_TYPES = ("dflash2", "peagle", "mtp", "xpress", "dspark")
# Fields that change nothing medusa_spec drafts: kept verbatim (source_config) and written back.
KEPT = ("architectures", "auto_map", "speculators_config", "speculators_version", "transformers_version", "dtype",
        "torch_dtype", "tie_word_embeddings", "embed_requires_grad", "has_no_defaults_at_init", "_name_or_path",
        "target_hidden_size")  # target_hidden_size once checked to be null or the draft's own width
READ = ("speculators_model_type", "transformer_layer_config", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids",
        *NORM_FLAGS)
# The version of speculators whose format this module reads and writes (its tests compare against it).
SPECULATORS_VERSION = "0.9.0"


def is_speculators_config(config: dict) -> bool:
    return "speculators_model_type" in config


def read_speculators(path: str | Path,
                     base_embeddings: nn.Module | None = None) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    """Config and state dict, in medusa_spec's layout, of the speculators EAGLE-3 draft in `path`. `base_embeddings`,
    the base model's input embeddings, is needed where the folder carries embed_tokens.weight: it must be a copy of
    them (a draft trained with its own embeddings is refused)."""
    path = Path(path)
    meta = read_json_object(path / HF_CONFIG, fix="put the draft's config.json beside its weights")
    kind = meta.get("speculators_model_type")
    if kind == "dflash":
        raise ValueError(f"{path}: speculators_model_type 'dflash' is not supported as heads (they read speculators' "
                         f"\"eagle3\" drafts): a DFlash draft drafts whole blocks; generate with it through "
                         f"medusa_spec.generate_with_dflash(base_model, load_dflash(path, base_model), input_ids)")
    if kind != "eagle3":
        raise ValueError(f"{path}: speculators_model_type {kind!r} is not supported; medusa_spec reads speculators' "
                         f"\"eagle3\" drafts (not {', '.join(OTHER_TYPES)})")
    unknown = sorted(set(meta) - set(KEPT) - set(READ))
    if unknown:
        raise ValueError(f"{path / HF_CONFIG}: field(s) {unknown} are not part of speculators' EAGLE-3 config as "
                         f"this reader knows it (speculators {SPECULATORS_VERSION}); they may change how the draft "
                         f"computes, so it is refused rather than read without them")
    layer = meta.get("transformer_layer_config")
    if not isinstance(layer, dict) or not isinstance(layer.get("hidden_size"), int):
        raise ValueError(f"{path / HF_CONFIG}: transformer_layer_config must be a decoder-layer config with its "
                         f"hidden_size, got {layer!r}")
    hidden, vocab = layer["hidden_size"], layer.get("vocab_size")
    target = meta.get("target_hidden_size")
    if target is not None and target != hidden:
        raise ValueError(f"{path / HF_CONFIG}: target_hidden_size {target} differs from the draft's hidden_size "
                         f"{hidden}; drafts narrower than their verifier are not supported")
    draft_vocab = meta.get("draft_vocab_size", vocab)
    if not isinstance(draft_vocab, int) or not isinstance(vocab, int) or not 1 <= draft_vocab <= vocab:
        raise ValueError(f"{path / HF_CONFIG}: draft_vocab_size {draft_vocab!r} must be an integer from 1 to the "
                         f"verifier's vocab_size ({vocab!r}, transformer_layer_config.vocab_size)")
    spec = {"transformer_layer_config": copy.deepcopy(layer), **{flag: meta.get(flag, False) for flag in NORM_FLAGS}}
    source = {key: copy.deepcopy(meta[key]) for key in KEPT if key in meta}
    proposal = _default_proposal(source.get("speculators_config"), path)
    verifier = (source.get("speculators_config") or {}).get("verifier") or {}
    try:
        config = MedusaConfig(num_heads=proposal.get("speculative_tokens", 3),
                              num_layers=layer.get("num_hidden_layers", 1), share_lm_head=False, hidden_size=hidden,
                              vocab_size=vocab, head_type="eagle3",
                              draft_vocab_size=draft_vocab if draft_vocab < vocab else None,
                              feature_layers=meta.get("eagle_aux_hidden_state_layer_ids") or [],
                              draft_layer=spec, base_model_name_or_path=verifier.get("name_or_path"),
                              source_config=source)
    except ValueError as err:
        raise ValueError(f"{path / HF_CONFIG}: {err}") from None
    if not config.feature_layers:
        raise ValueError(f"{path / HF_CONFIG}: eagle_aux_hidden_state_layer_ids is not set; write the verifier's "
                         f"layer ids there (speculators' default is [2, N // 2, N - 3] for N decoder layers)")
    tensors, source = io.read_weights_folder(path, "a speculators")
    return config, draft_state_dict(tensors, config, source, base_embeddings)


def _default_proposal(speculators_config: Any, path: Path) -> dict:
    """The proposal method speculators_config names as default (its speculative_tokens is the draft's depth)."""
    if speculators_config is None:
        return {}
    methods = speculators_config.get("proposal_methods") if isinstance(speculators_config, dict) else None
    if not isinstance(methods, list) or not all(isinstance(m, dict) for m in methods):
        raise ValueError(f"{path / HF_CONFIG}: speculators_config.proposal_methods must be a list of objects")
    default = speculators_config.get("default_proposal_method")
    chosen = next((m for m in methods if m.get("proposal_type") == default), methods[0] if methods else {})
    tokens = chosen.get("speculative_tokens", 3)
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"{path / HF_CONFIG}: speculative_tokens must be an integer >= 1, got {tokens!r}")
    return chosen


def draft_state_dict(tensors: dict[str, torch.Tensor], config: MedusaConfig, source,
                     base_embeddings: nn.Module | None,
                     name: Callable[[str], str] = lambda key: key) -> dict[str, torch.Tensor]:
    """A draft's tensors under speculators' names -> medusa_spec's state dict, every one checked (names, shapes,
    vocabulary maps; embed_tokens.weight against `base_embeddings`). `name` gives a speculators name as the folder
    writes it, for messages."""
    tensors = dict(tensors)
    for key in ("verifier_lm_head.weight", "verifier_norm.weight"):
        tensors.pop(key, None)  # the verifier's own, for speculators' training targets: not the draft's
    embed = tensors.pop("embed_tokens.weight", None)
    if embed is not None:
        if base_embeddings is None:
            raise ValueError(f"{source}: embed_tokens.weight must be checked against the base model's input "
                             f"embeddings; pass the base model (medusa-spec convert --model DIR)")
        expected = base_embeddings.weight
        if embed.shape != expected.shape:
            raise ValueError(f"{source}: the draft's verifier has {embed.shape[0]} tokens of width {embed.shape[1]} "
                             f"(embed_tokens.weight) but the base model has {expected.shape[0]} of width "
                             f"{expected.shape[1]}: this draft belongs to another model")
        if not io.same_weight(embed, expected.detach()):
            raise ValueError(f"{source}: embed_tokens.weight is not the base model's input embeddings (a draft "
                             f"trained with its own, embed_requires_grad, or another verifier's): not supported")
    d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
    state = {PREFIX + key: value for key, value in tensors.items()}
    if config.draft_vocab_size is not None:
        state["token_map"] = token_map(d2t, t2d, config.draft_vocab_size, config.vocab_size, source)
    elif d2t is not None and bool(d2t.any()):
        raise ValueError(f"{source}: d2t maps a draft over the whole vocabulary (draft_vocab_size = vocab_size) to "
                         f"other ids; vLLM would use it and speculators would not: make draft_vocab_size the number "
                         f"of d2t's entries, or drop d2t and t2d")
    expected = io.expected_shapes(config, source)
    io.check_weights(expected, state, source,
                     name=lambda key: name(key.removeprefix(PREFIX).replace("token_map", "d2t")),
                     fix="the folder is incomplete, or its config.json is not its weights'")
    return state


def token_map(d2t: torch.Tensor | None, t2d: torch.Tensor | None, draft_vocab: int, vocab: int,
              source) -> torch.Tensor:
    """d2t (offsets) and t2d (a mask over the verifier's vocabulary) -> the token map (draft index -> token id),
    after checking that the two agree."""
    if d2t is None or t2d is None:
        missing = " and ".join(name for name, t in (("d2t", d2t), ("t2d", t2d)) if t is None)
        raise ValueError(f"{source}: a reduced draft vocabulary (draft_vocab_size {draft_vocab} < {vocab}) needs "
                         f"both d2t and t2d; missing {missing}")
    if d2t.dim() != 1 or d2t.shape[0] != draft_vocab or d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise ValueError(f"{source}: d2t must hold {draft_vocab} integer offsets (draft_vocab_size), got "
                         f"{d2t.dtype} {tuple(d2t.shape)}")
    if t2d.dim() != 1 or t2d.shape[0] != vocab:
        raise ValueError(f"{source}: t2d must be a mask over the verifier's {vocab} tokens, got {tuple(t2d.shape)}")
    token_map = torch.arange(draft_vocab) + d2t.long()
    if int(token_map.min()) < 0 or int(token_map.max()) >= vocab or token_map.unique().numel() != draft_vocab:
        raise ValueError(f"{source}: d2t maps draft indices to ids outside [0, {vocab}) or to one id twice; the "
                         f"vocabulary maps are damaged or belong to another verifier")
    chosen = t2d.bool()
    if int(chosen.sum()) != draft_vocab or not bool(chosen[token_map].all()):
        raise ValueError(f"{source}: t2d and d2t disagree: t2d marks {int(chosen.sum())} tokens, d2t maps to "
                         f"{draft_vocab} of which {int(chosen[token_map].sum())} are marked; rebuild both from one "
                         f"token list")
    return token_map


def write_speculators(path: str | Path, config: MedusaConfig, state_dict: dict[str, torch.Tensor],
                      base_model: nn.Module | None = None) -> None:
    """Write eagle3 heads as a speculators EAGLE-3 folder (config.json + model.safetensors), atomically.

    The draft vocabulary is written in token-id order (d2t, t2d and lm_head's rows permuted together), as speculators
    builds it: its training reads the verifier's LM head rows in that order. With `base_model`, its input embeddings
    go in as embed_tokens.weight, as speculators writes them (vLLM shares the verifier's where they are absent), and
    its architectures name the verifier."""
    if config.head_type != "eagle3":
        raise ValueError(f"{path}: speculators' EAGLE-3 format holds eagle3 heads, not {config.head_type} heads (a "
                         f"different architecture); train eagle3 heads (medusa-spec train --head-type eagle3), or keep "
                         f"these in medusa_spec's format (--to medusa_spec)")
    tensors = draft_tensors(config, state_dict)
    if base_model is not None:
        tensors["embed_tokens.weight"] = base_model.get_input_embeddings().weight.detach().contiguous().cpu()
    with io.staged_save(path, (WEIGHTS, HF_CONFIG)) as staged:
        save_file(tensors, str(staged / WEIGHTS), metadata={"format": "pt"})
        io.write_json(staged / HF_CONFIG, speculators_config(config, tensors["lm_head.weight"].dtype, base_model))


def draft_tensors(config: MedusaConfig, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Eagle3 heads' tensors under speculators' names, on the CPU: the draft's own, and for a reduced vocabulary d2t
    (offsets) and t2d (a mask), in token-id order with lm_head's rows permuted to match, as speculators builds them
    (its training reads the verifier's LM head rows in that order)."""
    tensors = {key.removeprefix(PREFIX): value.detach().contiguous().cpu() for key, value in state_dict.items()
               if key.startswith(PREFIX)}
    token_map = state_dict.get("token_map")
    if token_map is not None:
        order = token_map.cpu().argsort()
        token_map = token_map.cpu()[order]
        tensors["lm_head.weight"] = tensors["lm_head.weight"][order].contiguous()
        tensors["d2t"] = token_map - torch.arange(token_map.numel())
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[token_map] = True
        tensors["t2d"] = t2d
    return tensors


def speculators_config(config: MedusaConfig, dtype: torch.dtype, base_model: nn.Module | None = None) -> dict:
    """config.json of eagle3 heads: what the heads' config says, over what it kept from the folder it was read from
    (source_config: only the fields a speculators config keeps, so those another format kept stay out), over
    speculators' own defaults."""
    source = {key: copy.deepcopy(value) for key, value in config.source_config.items() if key in KEPT}
    spec_config = source.pop("speculators_config", None) or {
        "algorithm": "eagle3", "default_proposal_method": "greedy",
        "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 3,
                              "verifier_accept_k": 1}],
        "verifier": {"architectures": [], "name_or_path": None}}
    default = spec_config.get("default_proposal_method")
    methods = spec_config.get("proposal_methods") or [{"proposal_type": "greedy"}]
    chosen = next((m for m in methods if m.get("proposal_type") == default), methods[0])
    chosen["speculative_tokens"] = config.num_heads
    verifier = spec_config.setdefault("verifier", {})
    verifier["name_or_path"] = config.base_model_name_or_path
    if base_model is not None:
        verifier["architectures"] = list(getattr(base_model.config, "architectures", None) or
                                         [type(base_model).__name__])
    meta = {"architectures": ["Eagle3DraftModel"], "dtype": str(dtype).removeprefix("torch."),
            "embed_requires_grad": False, "speculators_version": SPECULATORS_VERSION, "tie_word_embeddings": False,
            "target_hidden_size": None, **source}
    meta.update({"speculators_model_type": "eagle3", "speculators_config": spec_config,
                 "transformer_layer_config": copy.deepcopy(config.draft_layer["transformer_layer_config"]),
                 "draft_vocab_size": config.draft_vocab_size or config.vocab_size,
                 "eagle_aux_hidden_state_layer_ids": list(config.feature_layers),
                 **{flag: config.draft_layer[flag] for flag in NORM_FLAGS}})
    for key in {"dtype", "torch_dtype"} & meta.keys():  # the weights' dtype as written, not as read
        meta[key] = str(dtype).removeprefix("torch.")
    return dict(sorted(meta.items()))
