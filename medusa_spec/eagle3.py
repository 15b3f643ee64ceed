"""The draft of `head_type="eagle3"`: EAGLE-3 exactly as vLLM's training library speculators defines it (its
models/eagle3), so that its checkpoints draft here unchanged and ours serve in vLLM and SGLang.

fc turns the base's auxiliary hidden states (transformers' hidden_states[i] for each i of feature_layers,
concatenated in that order) into one state g. The slot of token x_t+1 reads [input_layernorm(E(x_t+1)),
hidden_norm(g_t)] (2H wide) through the first decoder layer's q/k/v projections; its residual stream starts at g_t
(at hidden_norm(g_t) with norm_before_residual). The layers' output h stands for the base's state one position on:
lm_head(norm(h)) scores the token at t + 2 over the draft vocabulary, and h (norm(h) with norm_output) takes g's
place in the slot of a drafted token, so one layer drafts any depth. Training unrolls it the same way (speculators'
training-time test, `unroll`).

Slot j of medusa_spec's decoding loops holds the base's state at j with the token after it, at the loop's position j
(see propose.DraftLayerProposer); speculators puts that slot at the token's position, j + 1, so the layer adds one
and its rotary angles are the reference's. Layers are transformers' own Llama or Qwen3 decoder layers (what
`transformer_layer_config` names), the first with its q/k/v widened as speculators widens them; nothing of the
base's modeling code is copied.
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding

from .base import cache_argument
from .verify import model_mask


class LayerFamily(NamedTuple):
    config: type
    layer: type
    norm: type
    rotary: type
    cache_arg: str | None  # the name the decoder layer takes its cache by (see base.cache_argument)


# The decoder layers speculators builds EAGLE-3 drafts from (its model_definitions), by transformer_layer_config's
# model_type.
LAYER_FAMILIES = {
    "llama": LayerFamily(LlamaConfig, LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding,
                         cache_argument(LlamaDecoderLayer.forward)),
    "qwen3": LayerFamily(Qwen3Config, Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding,
                         cache_argument(Qwen3DecoderLayer.forward)),
}
# An eagle3 MedusaConfig's draft_layer: speculators' own fields for the draft's layers, under speculators' names.
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
SPEC_KEYS = ("transformer_layer_config", *NORM_FLAGS)
# The norm flags speculators' trainer gives a new EAGLE-3 draft (0.9.0's train/config/schema.py; its model config,
# like a config.json without them, has them all off): a norm before fc, a normed residual and normed outputs fed
# to the next level.
TRAINER_NORMS = {"norm_before_residual": True, "norm_before_fc": True, "fc_norm": False, "norm_output": True}


def default_feature_layers(num_layers: int) -> list[int]:
    """speculators' default auxiliary layers, [2, N // 2, N - 3] for a base of N decoder layers (low, middle and high
    features); a base too shallow for three distinct ones of them takes what of them lies in [0, N - 1]."""
    wanted = [2, num_layers // 2, num_layers - 3]
    if len(set(wanted)) == 3 and min(wanted) >= 0:
        return wanted
    return sorted({min(max(i, 0), num_layers - 1) for i in wanted})


def default_spec(text_config, hidden_size: int, vocab_size: int, num_layers: int = 1) -> dict[str, Any]:
    """The draft_layer of new eagle3 heads on a base model: a Llama decoder layer of the base's width, attention
    heads, MLP and RMS epsilon (as speculators takes the verifier's config for the draft's), the default norm
    flags. Its rotary base is the base's where it states one."""
    heads = getattr(text_config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1 or hidden_size % heads:
        heads = hidden_size // 64 if hidden_size % 64 == 0 else 1
    kv_heads = getattr(text_config, "num_key_value_heads", None)
    if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        kv_heads = heads
    intermediate = getattr(text_config, "intermediate_size", None)
    if not isinstance(intermediate, int) or intermediate < 1:
        intermediate = 4 * hidden_size
    layer = {"model_type": "llama", "hidden_size": hidden_size, "intermediate_size": intermediate,
             "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hidden_size // heads,
             "num_hidden_layers": num_layers, "vocab_size": vocab_size, "hidden_act": "silu",
             "rms_norm_eps": float(getattr(text_config, "rms_norm_eps", None) or 1e-6),
             "attention_bias": False, "mlp_bias": False}
    rope = getattr(text_config, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("rope_type", "default") == "default" and "rope_theta" in rope:
        layer["rope_parameters"] = {"rope_type": "default", "rope_theta": float(rope["rope_theta"])}
    return {"transformer_layer_config": layer, **{flag: False for flag in NORM_FLAGS}}


def check_spec(spec: Any, hidden_size: int | None, num_layers: int, source: str = "MedusaConfig.draft_layer") -> None:
    """Refuse an eagle3 draft_layer this module cannot build exactly as speculators would, naming the field."""
    if not isinstance(spec, dict) or set(spec) != set(SPEC_KEYS):
        got = sorted(spec) if isinstance(spec, dict) else spec
        raise ValueError(f"{source} of eagle3 heads must hold exactly {list(SPEC_KEYS)} (speculators' fields), "
                         f"got {got!r}")
    for flag in NORM_FLAGS:
        if not isinstance(spec[flag], bool):
            raise ValueError(f"{source}.{flag} must be true or false, got {spec[flag]!r}")
    if spec["norm_before_fc"] and spec["fc_norm"]:
        raise ValueError(f"{source}: norm_before_fc and fc_norm exclude each other (speculators refuses both); "
                         f"set one of them to false")
    layer = spec["transformer_layer_config"]
    if not isinstance(layer, dict) or layer.get("model_type") not in LAYER_FAMILIES:
        kind = layer.get("model_type") if isinstance(layer, dict) else layer
        raise ValueError(f"{source}.transformer_layer_config.model_type is {kind!r}: eagle3 drafts are built from "
                         f"{' or '.join(LAYER_FAMILIES)} decoder layers here (speculators' model_definitions)")
    if layer.get("num_hidden_layers", 1) != num_layers:
        raise ValueError(f"{source}.transformer_layer_config.num_hidden_layers ({layer.get('num_hidden_layers', 1)}) "
                         f"must equal num_layers ({num_layers}), the draft's decoder layers")
    if hidden_size is not None and layer.get("hidden_size") != hidden_size:
        raise ValueError(f"{source}.transformer_layer_config.hidden_size ({layer.get('hidden_size')}) is not the "
                         f"base model's hidden size ({hidden_size}): the draft reads the base's states as they are")
    config = layer_config(spec)
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        raise ValueError(f"{source}.transformer_layer_config.layer_types {config.layer_types}: sliding-window draft "
                         f"layers are not supported; use full attention")


def layer_config(spec: dict[str, Any]):
    """transformer_layer_config as transformers' config object (sdpa: it takes the boolean masks built here)."""
    fields = dict(spec["transformer_layer_config"])
    config = LAYER_FAMILIES[fields.pop("model_type")].config(**fields)
    config._attn_implementation = "sdpa"
    return config


class FirstLayer(nn.Module):
    """speculators' first EAGLE-3 layer (Eagle3FirstLayerMixin): a decoder layer whose q/k/v read [E(x), g] (2H) after
    their own norms, with its residual stream from g. Its parts are a transformers decoder layer's, under the same
    names, so its weights are named as speculators names them."""

    def __init__(self, config, family: LayerFamily, norm_before_residual: bool):
        super().__init__()
        layer = family.layer(config, layer_idx=0)
        self.self_attn, self.mlp = layer.self_attn, layer.mlp
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.hidden_norm = family.norm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm_before_residual = norm_before_residual
        self.cache_arg = cache_argument(type(self.self_attn).forward)
        width, head_dim = 2 * config.hidden_size, self.self_attn.head_dim
        for name, heads in (("q_proj", config.num_attention_heads), ("k_proj", config.num_key_value_heads),
                            ("v_proj", config.num_key_value_heads)):
            setattr(self.self_attn, name, nn.Linear(width, heads * head_dim, bias=config.attention_bias))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, position_embeddings, cache: DynamicCache) -> torch.Tensor:
        embeds, hidden = x.chunk(2, dim=-1)
        residual, hidden = hidden, self.hidden_norm(hidden)
        if self.norm_before_residual:
            residual = hidden
        x = torch.cat([self.input_layernorm(embeds), hidden], dim=-1)
        x, _ = self.self_attn(hidden_states=x, attention_mask=mask, position_embeddings=position_embeddings,
                              **{self.cache_arg: cache})
        x = residual + x
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Draft(nn.Module):
    """fc (with input_norm / fc_norm where the flags ask), the decoder layers, norm, and lm_head over the draft
    vocabulary: speculators' Eagle3DraftModel less what it borrows from the verifier (embed_tokens; the
    verifier's norm and LM head, which only its training reads)."""

    def __init__(self, spec: dict[str, Any], num_features: int, draft_vocab_size: int):
        super().__init__()
        config = layer_config(spec)
        family = LAYER_FAMILIES[spec["transformer_layer_config"]["model_type"]]
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.norm_output = spec["norm_output"]
        self.input_norm = family.norm(num_features * hidden, eps=eps) if spec["norm_before_fc"] else None
        self.fc_norm = nn.ModuleList(family.norm(hidden, eps=eps) for _ in range(num_features)) \
            if spec["fc_norm"] else None
        self.fc = nn.Linear(num_features * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([FirstLayer(config, family, spec["norm_before_residual"])] +
                                    [family.layer(config, layer_idx=i) for i in range(1, config.num_hidden_layers)])
        self.norm = family.norm(hidden, eps=eps)
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        # speculators' rotary embedding is built for a config of twice the width (its layer reads 2H); head_dim is
        # the config's own either way, but the copy keeps any rope setting that reads the width.
        wide = copy.copy(config)
        wide.hidden_size *= 2
        self.rotary_emb = family.rotary(wide)
        self.cache_arg = family.cache_arg
        # As transformers initialises a new model's weights (speculators' post_init); norms start at one.
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=config.initializer_range)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The auxiliary hidden states concatenated [..., n H] -> g [..., H]."""
        if self.input_norm is not None:
            features = self.input_norm(features)
        if self.fc_norm is not None:
            chunks = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(features)

    def forward(self, states: torch.Tensor, next_embeds: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                cache: DynamicCache) -> torch.Tensor:
        """New slots: states [B, n, H] (g, or the draft's outputs), next_embeds [B, n, H] (E of the token after each
        state), positions [B, n] (the states'), mask [B, 1, n, past + n] bool -> outputs [B, n, H], what a deeper
        slot reads as its state (head_input turns them into the LM head's input); keys and values go to `cache`."""
        positions = positions + 1  # the token's position, where speculators puts the slot
        x = torch.cat([next_embeds, states], dim=-1)
        position_embeddings = self.rotary_emb(x, positions)
        x = self.layers[0](x, mask, position_embeddings, cache)
        for layer in self.layers[1:]:
            x = layer(x, attention_mask=mask, position_ids=positions, use_cache=True, **{self.cache_arg: cache},
                      position_embeddings=position_embeddings)
        return self.norm(x) if self.norm_output else x

    def head_input(self, outputs: torch.Tensor) -> torch.Tensor:
        """forward's outputs -> what lm_head reads (with norm_output they are normed already)."""
        return outputs if self.norm_output else self.norm(outputs)

    def unroll(self, states: torch.Tensor, token_embeds: torch.Tensor, allowed: torch.Tensor,
               position_ids: torch.Tensor, steps: int) -> torch.Tensor:
        """Training and teacher-forced drafts, as speculators' Eagle3DraftModel.forward runs its ttt_steps: g [B, T, H]
        at every position, token_embeds [B, T + steps - 1, H] (token_embeds[:, t]: E of the token after t, then those
        of the tokens past the row's end, which speculators takes as token 0), allowed [B, T, T] (causal within each
        example), position_ids [B, T] -> lm_head inputs [B, T, steps, H].

        Step k's query at t reads step k - 1's output at t with the token t + k + 1, at position t's + k; it sees the
        slots step 0 made up to t (those `allowed` lets t see) and its own chain, the slots steps 1..k made at t."""
        cache = DynamicCache()
        length = states.shape[1]
        own_chain = torch.eye(length, dtype=torch.bool, device=states.device).expand_as(allowed)
        outputs = []
        for k in range(steps):
            mask = model_mask(torch.cat([allowed, *[own_chain] * k], dim=-1), bool_mask=True, dtype=states.dtype)
            states = self(states, token_embeds[:, k: k + length], mask, position_ids + k, cache)
            outputs.append(self.head_input(states))
        return torch.stack(outputs, dim=-2)
