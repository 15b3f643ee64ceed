"""Interchange with other head layouts: the original Medusa repo's (which TensorRT-LLM's and TGI's converters read),
vLLM's Medusa, speculators' EAGLE-3 (speculators_format.py), which vLLM serves, and EAGLE-3's research layout
(sglang_format.py), which SGLang serves.

Every reader returns medusa_spec's own layout (a MedusaConfig and a state dict named as MedusaHeads names its
tensors, which is vLLM's naming), so each format needs one reader and one writer, not one per pair. Head and
layer counts come from the weights, never a config: published Medusa configs understate them (the original
loader hid this by loading with strict=False).
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from . import io
from .base import inspect_base_model
from .config import CONFIG_NAME, MedusaConfig, read_json_object
from .sglang_format import PICKLED_WEIGHTS, is_sglang_config, read_sglang, write_sglang
from .speculators_format import is_speculators_config, read_speculators, write_speculators

# Named for what reads them: this library, the original Medusa repo, and the engines each layout is written for
# (speculators' is also its training library's name; "sglang" is EAGLE-3's research layout, which SGLang loads).
FORMATS = ("medusa_spec", "medusa", "vllm", "speculators", "sglang")
HF_CONFIG = "config.json"  # the original Medusa and vLLM layouts both keep their config here
MEDUSA_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
VLLM_WEIGHTS = "model.safetensors"  # vLLM reads every *.safetensors in the folder; this is the usual name

_BLOCK_KEY = re.compile(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)")
_PROJECTION_KEY = re.compile(r"lm_heads\.(\d+)\.weight")
# Original Medusa: head h is nn.Sequential(ResBlock x L, Linear), so its projection is module L of the head.
_MEDUSA_LAYER_KEY = re.compile(r"(\d+)\.(\d+)\.linear\.(weight|bias)")
_MEDUSA_PROJECTION_KEY = re.compile(r"(\d+)\.(\d+)\.weight")


def detect_format(path: str | Path) -> str:
    """"medusa_spec", "medusa" (original), "vllm", "speculators" or "sglang", judged by the files in the folder
    `path`."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no adapter folder at {path}; save one with MedusaModel.save_heads({str(path)!r})")
    if (path / CONFIG_NAME).exists() or (path / io.WEIGHTS_NAME).exists():
        return "medusa_spec"
    if any((path / name).exists() for name in MEDUSA_WEIGHTS):
        return "medusa"
    if (path / HF_CONFIG).is_file():
        config = read_json_object(path / HF_CONFIG, fix="put the checkpoint's config file beside its weights")
        if (fmt := _config_format(config)) is not None:
            return fmt  # for "medusa", its weights file is missing: read_medusa says so
    raise FileNotFoundError(
        f"{path} holds no Medusa heads: expected {CONFIG_NAME} + {io.WEIGHTS_NAME} (medusa_spec), {HF_CONFIG} + "
        f"{' or '.join(MEDUSA_WEIGHTS)} (original Medusa), {HF_CONFIG} with model_type \"medusa\" + *.safetensors "
        f"(vLLM), {HF_CONFIG} with speculators_model_type + *.safetensors (speculators' EAGLE-3), or {HF_CONFIG} "
        f"with architectures [\"LlamaForCausalLMEagle3\"] + *.safetensors or {PICKLED_WEIGHTS} (EAGLE-3's research "
        f"layout, SGLang's)")


def heads_without_model(path: str | Path) -> str | None:
    """The format of the Medusa heads in the folder `path` where no model is saved beside them, else None: for a
    check that a folder given as a model is not an adapter (vLLM's and original Medusa's config.json are the heads'
    own, so the folder looks like a model to transformers until its weights fail to load)."""
    path = Path(path)
    try:
        fmt = detect_format(path)
        base = (path / HF_CONFIG).is_file() and _config_format(json.loads((path / HF_CONFIG).read_text())) is None
    except (OSError, ValueError):  # no heads, or a config.json that is no JSON: for the model loader to report
        return None
    return None if base else fmt


def _config_format(config: dict) -> str | None:
    """"vllm", "medusa", "speculators" or "sglang" for a config.json of that format's heads; None for any other (a
    base model's)."""
    if is_speculators_config(config):
        return "speculators"
    if is_sglang_config(config):
        return "sglang"
    if config.get("model_type") == "medusa":
        return "vllm"
    return "medusa" if "medusa_num_heads" in config else None


def read_heads(path: str | Path, base_lm_head: nn.Module | None = None, base_embeddings: nn.Module | None = None,
               base_num_layers: int | None = None) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    """Config and state dict, in medusa_spec's layout, of the heads in `path`, whichever format it holds.
    `base_lm_head`, the base model's output embeddings, is needed for a vLLM checkpoint that carries a copy of
    it (see read_vllm); `base_embeddings`, its input embeddings, for an EAGLE-3 draft that carries a copy of
    them (see read_speculators); `base_num_layers`, its decoder layers, for a research-layout draft that leaves its
    auxiliary layers to SGLang's default (see read_sglang)."""
    io.finish_interrupted_save(path)  # a save killed midway may have left part of its files to move into place
    fmt = detect_format(path)
    if fmt == "vllm":
        return read_vllm(path, base_lm_head)
    if fmt == "speculators":
        return read_speculators(path, base_embeddings)
    if fmt == "sglang":
        return read_sglang(path, base_embeddings, base_num_layers)
    return io.load_adapter(path) if fmt == "medusa_spec" else read_medusa(path, base_lm_head)


def read_medusa(path: str | Path,
                base_lm_head: nn.Module | None = None) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    """Read the original Medusa layout: config.json (medusa_num_heads, medusa_num_layers,
    base_model_name_or_path) and medusa_lm_head.safetensors or .pt with keys `{h}.{l}.linear.weight|bias` and
    `{h}.{L}.weight`, head h's own vocabulary projection. "Version 2" checkpoints have no projections: their
    heads share the base model's LM head. Projections that are all copies of `base_lm_head` (as write_medusa
    writes shared heads) are read as heads sharing it: the same logits, without a copy per head."""
    path = Path(path)
    meta = read_json_object(path / HF_CONFIG, fix="put the checkpoint's config file beside its weights")
    weights_file = next((path / name for name in MEDUSA_WEIGHTS if (path / name).is_file()), None)
    if weights_file is None:
        raise FileNotFoundError(f"{path} has a Medusa {HF_CONFIG} but no {' or '.join(MEDUSA_WEIGHTS)}; "
                                f"put the heads' weights file beside it")
    tensors = io.read_weights_file(weights_file, MEDUSA_WEIGHTS[0])
    num_layers = 1 + max((int(m[2]) for key in tensors if (m := _MEDUSA_LAYER_KEY.fullmatch(key))), default=-1)
    projections = [key for key in tensors
                   if (m := _MEDUSA_PROJECTION_KEY.fullmatch(key)) and int(m[2]) == num_layers]
    if (projections and base_lm_head is not None and (base_lm_head.bias is None or not bool(base_lm_head.bias.any()))
            and all(io.same_weight(tensors[key], base_lm_head.weight.detach()) for key in projections)):
        tensors = {key: value for key, value in tensors.items() if key not in projections}
    return _heads_from_weights(
        {_from_medusa_key(key, num_layers): value for key, value in tensors.items()}, weights_file,
        stated={"heads": meta.get("medusa_num_heads"), "layers": meta.get("medusa_num_layers")},
        base_model_name_or_path=meta.get("base_model_name_or_path"),
        name=lambda key: _to_medusa_key(key, num_layers))


def read_vllm(path: str | Path, base_lm_head: nn.Module | None = None) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    """Read vLLM's Medusa layout: config.json (model_type "medusa") and *.safetensors with
    `blocks.{h}.layers.{l}.weight|bias` and `lm_heads.{h}.weight`, or with original_lm_head a single
    `lm_head.weight`, a copy of the base model's LM head: medusa_spec uses `base_lm_head` itself, after checking
    that the copy equals it. With a `token_map`, vLLM keeps only the map's rows of a projection or LM head
    that holds the full vocabulary, and so does this reader; vLLM ignores the map unless truncated_vocab_size is
    below vocab_size, so a map it would ignore is refused (unless it is the identity, which changes nothing)."""
    path = Path(path)
    meta = read_json_object(path / HF_CONFIG, fix="put the checkpoint's config file beside its weights")
    tensors, source = io.read_weights_folder(path, "a vLLM Medusa")
    # vLLM strips this prefix when loading, so checkpoints carry it.
    tensors = {key.removeprefix("medusa_heads."): value for key, value in tensors.items()}
    if "token_map" in tensors and meta.get("vocab_size") is None:
        raise ValueError(f"{path}: heads with a token_map need the full vocab_size in {HF_CONFIG}; add the base "
                         f"model's vocab_size there")
    token_map = tensors.get("token_map")
    if token_map is not None:
        io.check_token_map(token_map, meta["vocab_size"], source)  # before it indexes rows below
        token_map = token_map.long()
        truncated = meta.get("truncated_vocab_size") or meta["vocab_size"]
        if not isinstance(truncated, int):
            raise ValueError(f"{path / HF_CONFIG}: truncated_vocab_size must be the token map's length (an "
                             f"integer), got {truncated!r}")
        if truncated >= meta["vocab_size"]:  # vLLM then ignores the map (Medusa.load_weights)
            if not torch.equal(token_map, torch.arange(token_map.numel())):
                raise ValueError(
                    f"{source} has a token_map of {token_map.numel()} token ids but truncated_vocab_size {truncated} "
                    f"is not below vocab_size {meta['vocab_size']}, so vLLM ignores the map and reads the rows in "
                    f"token-id order: it would draft other tokens than the map says. Set truncated_vocab_size in "
                    f"{HF_CONFIG} to the map's length if the rows follow the map, or export the heads again "
                    f"(medusa-spec convert SRC DST --to vllm writes a map over the whole vocabulary as token-id order)")
            del tensors["token_map"]
            token_map = None
    if meta.get("original_lm_head"):
        for key in ("lm_head.weight", "lm_heads.0.weight"):  # vLLM also takes the shared LM head under the second
            if key in tensors:
                _check_lm_head_copy(tensors.pop(key), key, base_lm_head, token_map, source)
    elif token_map is not None:
        for key, tensor in list(tensors.items()):
            if _PROJECTION_KEY.fullmatch(key) and tensor.shape[0] == meta["vocab_size"] != token_map.numel():
                tensors[key] = tensor[token_map]
    return _heads_from_weights(tensors, source,
                               stated={"heads": meta.get("num_heads"), "layers": meta.get("num_hidden_layers")},
                               base_model_name_or_path=meta.get("base_model_name_or_path"),
                               full_vocab_size=meta.get("vocab_size"))


def _check_lm_head_copy(copy: torch.Tensor, key: str, base_lm_head: nn.Module | None, token_map: torch.Tensor | None,
                        source) -> None:
    """The vLLM checkpoint's copy of the base LM head (all rows, or the token map's) must be the base's own."""
    if base_lm_head is None:
        raise ValueError(f"{source} holds {key}, its own copy of the base model's LM head (original_lm_head), which "
                         f"must be checked against the base model's; pass the base model "
                         f"(convert(..., base_model=...), medusa-spec convert --model DIR)")
    expected = base_lm_head.weight.detach()
    if token_map is not None and copy.shape[0] != expected.shape[0]:
        expected = expected[token_map.to(expected.device)]
    if copy.shape != expected.shape:
        raise ValueError(f"{source}: {key} has shape {tuple(copy.shape)} but the base model's LM head (its token-map "
                         f"rows, with a token_map) has {tuple(expected.shape)}; these heads belong to another model")
    if not io.same_weight(copy, expected):
        raise ValueError(f"{source}: {key}, the LM head vLLM drafts with (original_lm_head), differs from this base "
                         f"model's LM head, so these heads would draft other tokens here than in vLLM; load them onto "
                         f"the base model they were trained with, or, to keep that LM head, store it as every head's "
                         f"own lm_heads.{{h}}.weight with original_lm_head false")


def _heads_from_weights(tensors: dict[str, torch.Tensor], source, stated: dict, base_model_name_or_path,
                        name=lambda key: key,
                        full_vocab_size: int | None = None) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    """Config and checked state dict of heads whose tensors, renamed to medusa_spec's layout, are `tensors`.
    Counts are read off the names; `stated` holds the counts the format's config claims, to warn about;
    `name` maps a key back to the file's own naming, for messages. With a `token_map` (vLLM's truncated
    draft vocabulary) the projections have its size and `full_vocab_size` is the base's."""
    counts = {"heads": 0, "layers": 0, "projections": 0}
    hidden_size = vocab_size = dtype = None
    for key, tensor in tensors.items():
        if m := _BLOCK_KEY.fullmatch(key):
            counts["heads"] = max(counts["heads"], int(m[1]) + 1)
            counts["layers"] = max(counts["layers"], int(m[2]) + 1)
        elif m := _PROJECTION_KEY.fullmatch(key):
            counts["heads"] = max(counts["heads"], int(m[1]) + 1)
            counts["projections"] += 1
            vocab_size = tensor.shape[0]
        else:
            continue
        hidden_size, dtype = tensor.shape[-1], tensor.dtype
    if counts["heads"] == 0:
        raise ValueError(f"{source} holds no Medusa head weights (its keys start {sorted(map(name, tensors))[:4]}); "
                         f"point at the folder of a Medusa head checkpoint")
    for what, found in counts.items():
        if stated.get(what) is not None and stated[what] is not None and stated[what] != found:
            warnings.warn(f"{source}: its {HF_CONFIG} says {stated[what]} {what} but the weights hold {found}; "
                          f"using {found}", stacklevel=2)
    draft_vocab_size = None
    if "token_map" in tensors:
        draft_vocab_size, vocab_size = tensors["token_map"].numel(), full_vocab_size
        tensors = {**tensors, "token_map": tensors["token_map"].long()}
    config = MedusaConfig(num_heads=counts["heads"], num_layers=counts["layers"],
                          share_lm_head=counts["projections"] == 0,
                          hidden_size=hidden_size, vocab_size=vocab_size, draft_vocab_size=draft_vocab_size,
                          base_model_name_or_path=base_model_name_or_path)
    expected = io.expected_shapes(config, source)
    if not any(key.endswith(".bias") for key in tensors):
        # Bias-free layers (vLLM with medusa_fc_bias false): a zero bias computes exactly the same.
        tensors = {**tensors, **{key: torch.zeros(shape, dtype=dtype) for key, shape in expected.items()
                                 if key.endswith(".bias")}}
    io.check_weights(expected, tensors, source, name=name,
                     fix="the checkpoint is incomplete or not a Medusa head checkpoint")
    return config, tensors


def _from_medusa_key(key: str, num_layers: int) -> str:
    """Original Medusa name -> medusa_spec name; a key that is not Medusa's is kept, for the check to name."""
    if m := _MEDUSA_LAYER_KEY.fullmatch(key):
        return f"blocks.{m[1]}.layers.{m[2]}.{m[3]}"
    if (m := _MEDUSA_PROJECTION_KEY.fullmatch(key)) and int(m[2]) == num_layers:
        return f"lm_heads.{m[1]}.weight"
    return key


def _to_medusa_key(key: str, num_layers: int) -> str:
    if m := _BLOCK_KEY.fullmatch(key):
        return f"{m[1]}.{m[2]}.linear.{m[3]}"
    if m := _PROJECTION_KEY.fullmatch(key):
        return f"{m[1]}.{num_layers}.weight"
    return key


def write_medusa(path: str | Path, config: MedusaConfig, state_dict: dict[str, torch.Tensor],
                 base_lm_head: nn.Module | None = None) -> None:
    """Write the original Medusa layout (config.json + medusa_lm_head.safetensors), atomically.

    Each head is `{h}.{l}.linear.weight|bias` for its layers, then its projection `{h}.{L}.weight`, which
    TensorRT-LLM's converter and the original repo read for every head. Heads that share the base LM head get a copy
    of `base_lm_head`'s weight as every head's projection (the same logits); without it they are written as
    "version 2" (no projections), which only TGI reads (one layer per head), and a warning says so. With several
    layers per head, the original repo's own loader ties a head's layers into one module ([ResBlock] * L), so only
    TensorRT-LLM and TGI, which read each layer, run them as is.
    """
    # No "architectures" key: TGI takes a speculator config that has one for another kind of speculator.
    _refuse_unsupported(config, path, "the original Medusa format", token_map_ok=False)
    meta = {"medusa_num_heads": config.num_heads, "medusa_num_layers": config.num_layers,
            "base_model_name_or_path": config.base_model_name_or_path}
    tensors = {_to_medusa_key(key, config.num_layers): value.detach().contiguous().cpu()
               for key, value in state_dict.items()}
    if config.share_lm_head and base_lm_head is None:
        warnings.warn(f"{path}: these heads share the base model's LM head, so they are written without projections "
                      f"(\"version 2\"), which TGI reads but TensorRT-LLM's converter and the original Medusa repo do "
                      f"not; pass base_model= (medusa-spec convert --model DIR) to write a copy of its LM head as "
                      f"every head's projection", stacklevel=2)
    elif config.share_lm_head:
        weight = _base_lm_head_weight(base_lm_head, config, path, "the original Medusa format's projections ({h}."
                                      f"{config.num_layers}.weight, no bias)")
        # One copy per head: safetensors refuses tensors that share storage.
        tensors.update({f"{h}.{config.num_layers}.weight": weight.clone() for h in range(config.num_heads)})
    # The .pt name is listed so a stale one is removed: TensorRT-LLM reads medusa_lm_head.pt first.
    with io.staged_save(path, (*MEDUSA_WEIGHTS, HF_CONFIG)) as staged:
        save_file(tensors, str(staged / MEDUSA_WEIGHTS[0]), metadata={"format": "pt"})
        io.write_json(staged / HF_CONFIG, meta)


def _base_lm_head_weight(base_lm_head: nn.Module, config: MedusaConfig, path, holder: str) -> torch.Tensor:
    """The base LM head's weight [V, H] on the CPU, for a format that stores the LM head shared heads use; a bias
    (which `holder` cannot hold) and another hidden size are refused."""
    if base_lm_head.bias is not None and bool(base_lm_head.bias.any()):
        raise ValueError(f"{path}: the base model's LM head has a bias, which {holder} cannot hold, so an engine "
                         f"would draft other tokens than these heads; keep them in medusa_spec's format "
                         f"(--to medusa_spec)")
    weight = base_lm_head.weight
    if config.hidden_size is not None and weight.shape[1] != config.hidden_size:
        raise ValueError(f"{path}: the base LM head has hidden size {weight.shape[1]} but the heads have "
                         f"{config.hidden_size}; pass the base model the heads were trained for")
    return weight.detach().contiguous().cpu()


def write_vllm(path: str | Path, config: MedusaConfig, state_dict: dict[str, torch.Tensor],
               base_lm_head: nn.Module | None = None) -> None:
    """Write vLLM's Medusa layout (config.json + model.safetensors), atomically.

    vLLM (model_executor/models/medusa.py) builds `num_heads` blocks of `num_hidden_layers` Linear layers, with
    biases only when medusa_fc_bias is true, and per-head `lm_heads.{h}.weight`; with original_lm_head it builds
    one `lm_head` (weight only) for all heads and loads it from this checkpoint, so shared-LM-head heads need
    `base_lm_head`, the base model's output embeddings, whose weight [V, H] is copied in; a bias is refused.
    """
    _refuse_unsupported(config, path, "vLLM's Medusa format", token_map_ok=True)
    tensors = {key: value.detach().contiguous().cpu() for key, value in state_dict.items()}
    full_vocab_size = config.vocab_size or (base_lm_head.weight.shape[0] if base_lm_head is not None else None)
    if "token_map" in tensors and tensors["token_map"].numel() == full_vocab_size:
        # A map over every token only orders the rows, and vLLM ignores a token_map unless truncated_vocab_size is
        # below vocab_size: write the rows in token-id order, without the map.
        token_map = tensors.pop("token_map")
        for key in [key for key in tensors if _PROJECTION_KEY.fullmatch(key)]:
            rows = torch.empty_like(tensors[key])
            rows[token_map] = tensors[key]
            tensors[key] = rows
    if config.share_lm_head:
        if base_lm_head is None:
            raise ValueError(f"{path}: vLLM's format stores the LM head these heads share (lm_head.weight); pass "
                             f"base_model= (medusa-spec convert --model DIR) to copy it from the base model")
        weight = _base_lm_head_weight(base_lm_head, config, path, "vLLM's Medusa LM head (lm_head.weight only)")
        # With a token map vLLM's LM head holds only the draft vocabulary's rows.
        tensors["lm_head.weight"] = weight if "token_map" not in tensors else weight[tensors["token_map"]].contiguous()
    projection_rows = tensors["lm_head.weight" if config.share_lm_head else "lm_heads.0.weight"].shape[0]
    vocab_size = full_vocab_size or projection_rows
    meta = {"model_type": "medusa", "architectures": ["MedusaModel"],
            "hidden_size": config.hidden_size, "vocab_size": vocab_size,
            "num_heads": config.num_heads, "num_hidden_layers": config.num_layers,
            "medusa_fc_bias": any(key.endswith(".bias") for key in tensors),
            "original_lm_head": config.share_lm_head}
    if "token_map" in tensors:
        meta["truncated_vocab_size"] = projection_rows
    with io.staged_save(path, (VLLM_WEIGHTS, HF_CONFIG)) as staged:
        save_file(tensors, str(staged / VLLM_WEIGHTS), metadata={"format": "pt"})
        io.write_json(staged / HF_CONFIG, meta)


def _refuse_unsupported(config: MedusaConfig, path, format_name: str, token_map_ok: bool) -> None:
    if config.head_type != "medusa":
        raise ValueError(f"{path}: {format_name} holds plain Medusa heads only, not {config.head_type} heads; keep "
                         f"them in medusa_spec's format (--to medusa_spec)")
    if config.context_heads:
        raise ValueError(f"{path}: {format_name} has no context layer (context_heads > 0); keep these heads in "
                         f"medusa_spec's format (--to medusa_spec)")
    if config.feature_layers:
        raise ValueError(f"{path}: {format_name} heads read the final hidden state only, not other layers' "
                         f"(feature_layers {config.feature_layers}); keep these heads in medusa_spec's format "
                         f"(--to medusa_spec)")
    if config.draft_vocab_size is not None and not token_map_ok:
        raise ValueError(f"{path}: {format_name} has no reduced draft vocabulary (token_map); export with --to vllm, "
                         f"which has one, or train heads with the full vocabulary")


def convert(src_dir: str | Path, dst_dir: str | Path, to: str = "medusa_spec",
            base_model: str | Path | nn.Module | None = None, dtype: torch.dtype | None = None) -> None:
    """Read heads from `src_dir` (format detected) and write them to `dst_dir` in format `to`: "medusa_spec",
    "medusa" (original), "vllm", "speculators" or "sglang" (EAGLE-3 in speculators' or the research layout, eagle3
    heads only).

    `base_model`, a path or a loaded model, supplies the LM head that vLLM's format stores for shared-LM-head
    heads and the sizes a "version 2" Medusa checkpoint does not record, and is checked against the heads (and
    against the LM head copy a vLLM checkpoint carries, which needs it); a speculators folder gets its input
    embeddings, and one read is checked against them. A Medusa-2 LoRA adapter is not converted: the other formats
    hold heads only. `dtype`: the heads' floating-point weights are written in it (e.g. torch.bfloat16, half the
    size; a loader casts them to its model's dtype). `dst_dir` may be new, empty or hold `to` heads (replaced); one
    holding another format's heads or another model's files, or `src_dir` itself, is refused.
    """
    if to not in FORMATS:
        raise ValueError(f"unknown format {to!r}; choose one of {', '.join(FORMATS)}")
    if Path(src_dir).resolve() == Path(dst_dir).resolve():
        raise ValueError(f"{dst_dir} is {src_dir}, the folder the heads are read from: converting them in place "
                         f"would overwrite its files or leave two formats side by side; convert into another (empty) "
                         f"folder")
    io.finish_interrupted_save(dst_dir)  # else files a killed save still has to move in would escape the check
    in_the_way = _files_in_the_way(Path(dst_dir), to)
    if in_the_way:
        raise ValueError(f"{dst_dir} already holds {', '.join(in_the_way)}, not files of {to} heads: converting "
                         f"there would overwrite them, or leave them beside the converted heads for a load to pick "
                         f"instead; convert into an empty folder, or move or delete those files")
    if isinstance(base_model, (str, Path)):
        from transformers import AutoModelForCausalLM  # only this path needs to load a model

        base_model = AutoModelForCausalLM.from_pretrained(str(base_model), dtype="auto")
    base_lm_head = base_model.get_output_embeddings() if base_model is not None else None
    spec = inspect_base_model(base_model) if base_model is not None else None
    config, state_dict = read_heads(src_dir, base_lm_head,
                                    base_model.get_input_embeddings() if base_model is not None else None,
                                    spec.num_layers if spec is not None else None)
    if dtype is not None:
        state_dict = {key: value.to(dtype) if value.is_floating_point() else value
                      for key, value in state_dict.items()}
    if (Path(src_dir) / io.LORA_DIR).exists():
        warnings.warn(f"{Path(src_dir) / io.LORA_DIR} (a LoRA adapter for the base model) is not converted; merge it "
                      f"into the base model to serve it with an engine", stacklevel=2)
    if spec is not None:
        for key in ("hidden_size", "vocab_size"):
            if getattr(config, key) not in (None, getattr(spec, key)):
                raise ValueError(f"{src_dir}: heads have {key}={getattr(config, key)} but the base model "
                                 f"{spec.name_or_path or ''} has {getattr(spec, key)}; pass the base model the heads "
                                 f"were trained for")
        config = dataclasses.replace(config, hidden_size=spec.hidden_size, vocab_size=spec.vocab_size,
                                     base_model_name_or_path=config.base_model_name_or_path or spec.name_or_path)
    if to == "medusa_spec":
        io.save_adapter(dst_dir, config, state_dict)
    elif to == "medusa":
        write_medusa(dst_dir, config, state_dict, base_lm_head)
    elif to == "speculators":
        write_speculators(dst_dir, config, state_dict, base_model)
    elif to == "sglang":
        write_sglang(dst_dir, config, state_dict)
    else:
        write_vllm(dst_dir, config, state_dict, base_lm_head)


def _files_in_the_way(path: Path, to: str) -> list[str]:
    """Files in the folder `path` not of format `to` that writing `to` heads there would overwrite or leave beside
    them: another format's heads, or another model's config.json and weights."""
    if not path.is_dir():
        return []
    names = {file.name for file in path.iterdir()}
    try:
        config = json.loads((path / HF_CONFIG).read_text(encoding="utf-8"))
        config_format = _config_format(config) if isinstance(config, dict) else None
    except (OSError, ValueError):  # none, or unreadable: not a Medusa config.json
        config_format = None
    own = {"medusa_spec": {CONFIG_NAME, io.WEIGHTS_NAME, io.LORA_DIR}, "medusa": {HF_CONFIG, *MEDUSA_WEIGHTS},
           "vllm": {HF_CONFIG, VLLM_WEIGHTS}, "speculators": {HF_CONFIG, VLLM_WEIGHTS},
           "sglang": {HF_CONFIG, VLLM_WEIGHTS, PICKLED_WEIGHTS}}[to]
    if to != "medusa_spec" and config_format != to:
        # config.json and the weights beside it are another format's or model's
        own -= {HF_CONFIG, VLLM_WEIGHTS, PICKLED_WEIGHTS}
    found = names & {CONFIG_NAME, io.WEIGHTS_NAME, io.LORA_DIR, HF_CONFIG, *MEDUSA_WEIGHTS, VLLM_WEIGHTS,
                     PICKLED_WEIGHTS}
    if to in ("vllm", "speculators", "sglang"):
        found |= {name for name in names if name.endswith(".safetensors")}  # vLLM reads every one in the folder
    return sorted(found - own)

