"""EAGLE-3's research layout, which SGLang's EAGLE-3 loader reads (LlamaForCausalLMEagle3), SpecForge (SGLang's
trainer) writes and the EAGLE repo's published drafts use: read as eagle3 heads, and written from them.

A folder holds config.json, a Llama config of the draft's one decoder layer with architectures
["LlamaForCausalLMEagle3"], draft_vocab_size and, optionally, eagle_config.eagle_aux_hidden_state_layer_ids, and its
weights in model.safetensors (or *.safetensors, or the EAGLE repo's pytorch_model.bin): midlayer.* (the layer),
fc.weight, norm.weight, lm_head.weight over the draft vocabulary, d2t (draft index -> offset to the verifier's token
id) and t2d (the verifier's tokens in the draft vocabulary), maybe embed_tokens.weight (SGLang replaces it by the
verifier's).

It is speculators' EAGLE-3 with its default flags, one Llama layer and three auxiliary layers, under other names
(research layout -> speculators' / medusa_spec's):

- the Llama fields (hidden_size, ..., rope_theta + rope_scaling) -> transformer_layer_config (rope_parameters);
- midlayer.* -> layers.0.*; fc, norm, lm_head, d2t (offsets, as speculators'), t2d as they are;
- eagle_config.eagle_aux_hidden_state_layer_ids [a, b, c] -> feature_layers [a + 1, b + 1, c + 1]: SGLang captures
  the input of layer id + 1 (transformers' hidden_states[id + 1]); without ids it captures the inputs of layers
  [2, N // 2, N - 3] of the verifier's N, speculators' default;
- SGLang's first layer keeps g itself as its residual and feeds back the layer's output before the final norm:
  speculators' norm_before_residual and norm_output false, as are norm_before_fc and fc_norm (it has neither). A
  research config's norm_output is SpecForge's: true (its default) scores lm_head(norm(h)), as SGLang does.

Every config field is either read, kept verbatim (source_config["sglang"], written back), or refused by name; flags
this layout cannot express (qwen3 layers, more layers, other auxiliary-layer counts, the norm flags, biases) are
refused by the writer, never dropped. The draft depth is SGLang's --speculative-num-steps, not the folder's: a draft
read here drafts speculators' default 3 levels.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from . import io
from .config import MedusaConfig, read_json_object
from .eagle3 import NORM_FLAGS
from .speculators_format import draft_state_dict, draft_tensors

HF_CONFIG = "config.json"
WEIGHTS = "model.safetensors"
PICKLED_WEIGHTS = "pytorch_model.bin"  # the EAGLE repo's published drafts
ARCHITECTURE = "LlamaForCausalLMEagle3"
FIRST_LAYER = ("midlayer.", "layers.0.")  # the research layout's name for it, speculators'
SOURCE_KEY = "sglang"  # where a MedusaConfig's source_config keeps this layout's fields
NUM_FEATURES = 3  # SGLang's fc reads 3 auxiliary states (hidden_size_in * 3)
DEFAULT_DEPTH = 3  # speculators' default speculative_tokens
# The draft layer's Llama fields, read into transformer_layer_config (the rope ones as rope_parameters).
LAYER_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "num_hidden_layers", "vocab_size", "hidden_act", "rms_norm_eps", "attention_bias",
                "attention_dropout", "mlp_bias", "initializer_range", "max_position_embeddings", "pretraining_tp",
                "use_cache", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
ROPE_FIELDS = ("rope_theta", "rope_scaling")
# Kept verbatim: they change nothing SGLang's Llama draft layer computes (SpecForge's Qwen configs carry the
# sliding-window ones, off).
KEPT = ("transformers_version", "torch_dtype", "dtype", "_name_or_path", "max_window_layers", "sliding_window",
        "use_sliding_window")
# norm_output is SpecForge's (true, its default: the LM head reads norm(h)), not speculators' (feed norm(h) back).
READ = ("architectures", "draft_vocab_size", "eagle_config", "target_hidden_size", "bias", *NORM_FLAGS)
EAGLE_CONFIG_KEYS = ("eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state")


def is_sglang_config(config: dict) -> bool:
    return ARCHITECTURE in (config.get("architectures") or [])


def read_sglang(path: str | Path, base_embeddings: nn.Module | None = None,
                base_num_layers: int | None = None) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    """Config and state dict, in medusa_spec's layout, of the research-layout EAGLE-3 draft in `path`.
    `base_embeddings` checks an embed_tokens.weight the folder carries; `base_num_layers` (the verifier's decoder
    layers) gives SGLang's default auxiliary layers where eagle_config names none."""
    path = Path(path)
    file = path / HF_CONFIG
    meta = read_json_object(file, fix="put the draft's config.json beside its weights")
    if meta.get("architectures") != [ARCHITECTURE]:
        raise ValueError(f"{file}: architectures {meta.get('architectures')!r}: the research layout's is "
                         f"[{ARCHITECTURE!r}], which SGLang's EAGLE-3 loader builds")
    unknown = sorted(set(meta) - set(LAYER_FIELDS) - set(ROPE_FIELDS) - {"rope_parameters"} - set(KEPT) - set(READ))
    if unknown:
        raise ValueError(f"{file}: field(s) {unknown} are not part of the EAGLE-3 research layout as SGLang's "
                         f"{ARCHITECTURE} reads it; they may change how the draft computes, so it is refused rather "
                         f"than read without them")
    if meta.get("norm_output", True) is not True:
        raise ValueError(f"{file}: norm_output {meta['norm_output']!r}: SpecForge then scores the draft's state "
                         f"without its final norm, which SGLang's {ARCHITECTURE} applies, so this draft would compute "
                         f"otherwise there: not read (SpecForge's norm_output is not speculators': true, its default, "
                         f"is the usual lm_head(norm(h)))")
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "bias", "use_sliding_window",
                 "tie_word_embeddings"):
        if meta.get(flag) not in (None, False):
            raise ValueError(f"{file}: {flag} is {meta[flag]!r}; SGLang's {ARCHITECTURE} " + (
                "ties the draft's LM head to the verifier's embeddings with it" if flag == "tie_word_embeddings" else
                "has no such setting (it computes as if false)") + ", so this draft would compute otherwise there: "
                "not read")
    if meta.get("model_type", "llama") != "llama":
        raise ValueError(f"{file}: model_type {meta['model_type']!r}; SGLang's {ARCHITECTURE} builds a Llama draft "
                         f"layer whatever it says, so only \"llama\" is read")
    layer = {key: copy.deepcopy(meta[key]) for key in LAYER_FIELDS if key in meta}
    layer["model_type"] = "llama"
    layer.update(_rope_parameters(meta, file))
    hidden, vocab = layer.get("hidden_size"), layer.get("vocab_size")
    if not isinstance(hidden, int) or not isinstance(vocab, int):
        raise ValueError(f"{file}: hidden_size and vocab_size must be integers, got {hidden!r} and {vocab!r}")
    if layer.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{file}: num_hidden_layers {layer['num_hidden_layers']}: SGLang's {ARCHITECTURE} runs "
                         f"layers after the first without their residual stream (its BasicDecoderLayer), unlike "
                         f"speculators' and this library's, so only one-layer drafts are read")
    for key, expected in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if layer.get(key, expected) != expected:
            raise ValueError(f"{file}: {key} {layer[key]!r}: SGLang's {ARCHITECTURE} draft layer has "
                             f"{key} {expected!r}")
    target = meta.get("target_hidden_size")
    if target is not None and target != hidden:
        raise ValueError(f"{file}: target_hidden_size {target} differs from the draft's hidden_size {hidden}; drafts "
                         f"narrower than their verifier are not supported")
    draft_vocab = meta.get("draft_vocab_size")
    if not isinstance(draft_vocab, int) or not 1 <= draft_vocab <= vocab:
        raise ValueError(f"{file}: draft_vocab_size {draft_vocab!r} must be an integer from 1 to vocab_size ({vocab}); "
                         f"without it SGLang drafts with the verifier's LM head, not the folder's")
    feature_layers = _feature_layers(meta.get("eagle_config"), base_num_layers, file)
    spec = {"transformer_layer_config": layer, **{flag: False for flag in NORM_FLAGS}}
    kept = {key: copy.deepcopy(meta[key]) for key in KEPT if key in meta}
    try:
        config = MedusaConfig(num_heads=DEFAULT_DEPTH, num_layers=1, share_lm_head=False, hidden_size=hidden,
                              vocab_size=vocab, head_type="eagle3",
                              draft_vocab_size=draft_vocab if draft_vocab < vocab else None,
                              feature_layers=feature_layers, draft_layer=spec, source_config={SOURCE_KEY: kept})
    except ValueError as err:
        raise ValueError(f"{file}: {err}") from None
    tensors, source = _read_weights(path)
    renamed = {}
    for key, value in tensors.items():
        if key.startswith(FIRST_LAYER[1]):
            raise ValueError(f"{source}: {key} is speculators' name; the research layout names the draft layer "
                             f"{FIRST_LAYER[0]}* (a folder of both layouts' files?)")
        renamed[FIRST_LAYER[1] + key.removeprefix(FIRST_LAYER[0]) if key.startswith(FIRST_LAYER[0]) else key] = value
    return config, draft_state_dict(renamed, config, source, base_embeddings, name=_research_name)


def _research_name(key: str) -> str:
    return FIRST_LAYER[0] + key.removeprefix(FIRST_LAYER[1]) if key.startswith(FIRST_LAYER[1]) else key


def _rope_parameters(meta: dict, file: Path) -> dict:
    """The research config's rope fields (rope_theta, rope_scaling as SGLang reads them; or transformers 5's
    rope_parameters) -> transformer_layer_config's rope_parameters; none where it states none."""
    if "rope_parameters" in meta:
        if any(key in meta for key in ROPE_FIELDS):
            raise ValueError(f"{file}: rope_parameters beside rope_theta / rope_scaling: state the rotary embedding "
                             f"once (SGLang reads rope_theta and rope_scaling)")
        return {"rope_parameters": copy.deepcopy(meta["rope_parameters"])}
    if meta.get("rope_theta") is None and meta.get("rope_scaling") is None:
        return {}
    scaling = meta.get("rope_scaling") or {"rope_type": "default"}
    if not isinstance(scaling, dict):
        raise ValueError(f"{file}: rope_scaling must be an object or null, got {scaling!r}")
    theta = meta.get("rope_theta", 10000.0)  # SGLang's and transformers' default
    return {"rope_parameters": {**copy.deepcopy(scaling), "rope_theta": float(theta)}}


def _feature_layers(eagle_config, base_num_layers: int | None, file: Path) -> list[int]:
    """eagle_config's auxiliary layer ids -> feature_layers (transformers' hidden_states indices): SGLang captures
    the input of layer id + 1 (set_eagle3_layers_to_capture), in layer order; without ids, the inputs of layers
    [2, N // 2, N - 3]."""
    eagle_config = {} if eagle_config is None else eagle_config
    if not isinstance(eagle_config, dict) or set(eagle_config) - set(EAGLE_CONFIG_KEYS):
        got = sorted(set(eagle_config) - set(EAGLE_CONFIG_KEYS)) if isinstance(eagle_config, dict) else eagle_config
        raise ValueError(f"{file}: eagle_config may hold {list(EAGLE_CONFIG_KEYS)} only, got {got!r}")
    if eagle_config.get("use_aux_hidden_state", True) is not True:
        raise ValueError(f"{file}: eagle_config.use_aux_hidden_state {eagle_config['use_aux_hidden_state']!r}: a "
                         f"draft without the auxiliary layers' fc is EAGLE-1/2, not EAGLE-3")
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        if base_num_layers is None:
            raise ValueError(f"{file}: eagle_config.eagle_aux_hidden_state_layer_ids is not set, so SGLang captures "
                             f"the verifier's layers [2, N // 2, N - 3] for its N layers; pass the base model "
                             f"(medusa-spec convert --model DIR), or write the ids there")
        layers = [2, base_num_layers // 2, base_num_layers - 3]
        if not 2 < layers[1] < layers[2]:
            raise ValueError(f"{file}: eagle_config.eagle_aux_hidden_state_layer_ids is not set, and SGLang's "
                             f"default for a base of {base_num_layers} layers, the inputs of layers {layers}, is not "
                             f"three distinct layers (SGLang would capture fewer states than fc reads)")
        return layers
    if (not isinstance(ids, list) or len(ids) != NUM_FEATURES
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
            or sorted(set(ids)) != ids):
        raise ValueError(f"{file}: eagle_config.eagle_aux_hidden_state_layer_ids {ids!r} must be {NUM_FEATURES} "
                         f"increasing layer ids >= 0 (SGLang's fc reads {NUM_FEATURES} states, captured in layer "
                         f"order)")
    return [i + 1 for i in ids]


def _read_weights(path: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """*.safetensors (SpecForge's save_pretrained), else the EAGLE repo's pytorch_model.bin."""
    if not any(path.glob("*.safetensors")) and (path / PICKLED_WEIGHTS).is_file():
        return io.read_weights_file(path / PICKLED_WEIGHTS, WEIGHTS), path / PICKLED_WEIGHTS
    return io.read_weights_folder(path, f"a research-layout EAGLE-3 ({ARCHITECTURE})")


def write_sglang(path: str | Path, config: MedusaConfig, state_dict: dict[str, torch.Tensor]) -> None:
    """Write eagle3 heads in the research layout (config.json + model.safetensors), atomically; what it cannot
    express is refused, naming the setting. No embed_tokens.weight: SGLang takes the verifier's."""
    check_writable(config, path)
    tensors = draft_tensors(config, state_dict)
    tensors = {_research_name(key): value for key, value in tensors.items()}
    dtype = tensors["lm_head.weight"].dtype
    # The pickled name is listed so a stale one is removed: the EAGLE repo would read it.
    with io.staged_save(path, (WEIGHTS, HF_CONFIG, PICKLED_WEIGHTS)) as staged:
        save_file(tensors, str(staged / WEIGHTS), metadata={"format": "pt"})
        io.write_json(staged / HF_CONFIG, sglang_config(config, dtype))


def check_writable(config: MedusaConfig, path) -> None:
    """Refuse heads the research layout cannot hold as they compute, naming what it lacks."""
    fix = "keep them in speculators' format (--to speculators), which vLLM serves"
    if config.head_type != "eagle3":
        raise ValueError(f"{path}: the EAGLE-3 research layout holds eagle3 heads, not {config.head_type} heads; "
                         f"keep these in medusa_spec's format (--to medusa_spec)")
    spec = config.draft_layer
    for flag in NORM_FLAGS:
        if spec[flag]:
            raise ValueError(f"{path}: {flag} is true; SGLang's {ARCHITECTURE} has no such setting (it computes as "
                             f"if false; SpecForge's norm_output is another setting), so it would draft otherwise than "
                             f"these heads: {fix}")
    layer = spec["transformer_layer_config"]
    if layer["model_type"] != "llama":
        raise ValueError(f"{path}: transformer_layer_config.model_type is {layer['model_type']!r}; SGLang's "
                         f"{ARCHITECTURE} builds a Llama draft layer (a qwen3 one's q/k norms would be lost): {fix}")
    if config.num_layers != 1:
        raise ValueError(f"{path}: num_layers {config.num_layers}: SGLang's {ARCHITECTURE} runs layers after the "
                         f"first without their residual stream, so only one-layer drafts go in this layout: {fix}")
    unknown = sorted(set(layer) - set(LAYER_FIELDS) - {"rope_parameters"})
    if unknown:
        raise ValueError(f"{path}: transformer_layer_config field(s) {unknown} have no place in SGLang's Llama "
                         f"draft config: {fix}")
    for key, expected in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if layer.get(key, expected) != expected:
            raise ValueError(f"{path}: transformer_layer_config.{key} is {layer[key]!r}; SGLang's {ARCHITECTURE} "
                             f"draft layer has {expected!r}: {fix}")
    layers = config.feature_layers
    if len(layers) != NUM_FEATURES or sorted(set(layers)) != layers or min(layers) < 1:
        raise ValueError(f"{path}: feature_layers {layers}: SGLang captures {NUM_FEATURES} auxiliary states, each "
                         f"the input of a layer >= 1 (not the embeddings, hidden_states[0]), concatenated in layer "
                         f"order: {fix}")


def sglang_config(config: MedusaConfig, dtype: torch.dtype) -> dict:
    """config.json of eagle3 heads in the research layout: the draft layer's Llama fields (rope_parameters as
    rope_theta and rope_scaling, which SGLang reads), the layout's own fields, and what source_config kept of a
    research folder the heads were read from."""
    layer = copy.deepcopy(config.draft_layer["transformer_layer_config"])
    rope = layer.pop("rope_parameters", None)
    if rope is not None:
        scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
        layer["rope_theta"] = rope.get("rope_theta", 10000.0)
        layer["rope_scaling"] = None if scaling in ({}, {"rope_type": "default"}) else scaling
    meta = {**copy.deepcopy(config.source_config.get(SOURCE_KEY, {})), **layer,
            "architectures": [ARCHITECTURE], "draft_vocab_size": config.draft_vocab_size or config.vocab_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in config.feature_layers],
                             "use_aux_hidden_state": True},
            "tie_word_embeddings": False}
    for key in {"dtype", "torch_dtype"} & meta.keys() or {"torch_dtype"}:  # the weights' dtype as written
        meta[key] = str(dtype).removeprefix("torch.")
    return dict(sorted(meta.items()))

