"""DFlash block drafts exactly as speculators 0.9.0 defines them (its models/dflash), read from its folders: given the
base model's auxiliary hidden states for a context and the token after it (the anchor), one pass of the draft scores
every position of a block of `block_size` tokens at once (EAGLE drafts one depth per pass).

This module reads a draft and drafts blocks; dflash_propose.py drafts with it in the decode loop
(generate_with_dflash). MedusaModel and its heads do not use it.

What the reference does (paths under speculators/models/dflash/ unless named; speculators 0.9.0):
- Config (config.py:28-82): speculators_model_type "dflash"; transformer_layer_config, the draft's decoder layers
  (a Qwen3Config by default, any model_type's config class otherwise, config.py:89-100); draft_vocab_size (default
  32000; below transformer_layer_config.vocab_size, the verifier's, the vocabulary is reduced); block_size (default 8);
  target_hidden_size; aux_hidden_state_layer_ids (the verifier's layers, transformers' hidden_states[i] numbering:
  convert/dflash/converter.py:118-125 adds one to z-lab's ids for that); mask_token_id (a verifier token id, required
  to draft, core.py:309-317); sliding_window_non_causal (default false); sample_from_anchor (default false).
  speculators_config's greedy speculative_tokens is block_size - 1, or block_size with sample_from_anchor
  (core.py:256-259).
- Weights (core.py:92-135, model.py DraftVocabMixin._init_vocab:37-79): fc [H, n H] over the n auxiliary states
  concatenated; hidden_norm; layers.{i} (model_definitions.py:158-207, Qwen3DFlashDecoderLayer: input_layernorm,
  self_attn.{q,k,v,o}_proj with Qwen3's per-head q_norm and k_norm, post_attention_layernorm, Qwen3MLP as mlp);
  norm; lm_head [draft vocab, H]; d2t and t2d for a reduced vocabulary; embed_tokens, verifier_lm_head and
  verifier_norm (the verifier's, for training targets). Saved: not embed_tokens, verifier_*, nor lm_head of a full
  vocabulary draft (core.py:54-57, 153-163): those are the verifier's input embeddings and LM head
  (load_verifier_weights, core.py:171-176; model.py:165-188: lm_head is the verifier's rows at t2d when reduced,
  and the embeddings where the verifier has no lm_head.weight). A reduced lm_head is saved and read from the folder.
- A block (core.py:406-434): for an anchor at position a, the block's tokens are [x_a, m, ..., m] (m = mask_token_id)
  at positions a .. a + block_size - 1, embedded with the verifier's embeddings; the context is g = hidden_norm(fc(
  aux states)) at every position before a.
- Attention (model_definitions.py:97-155; attention.py:7-100): queries come from the block only; keys and values
  from [g of the context, the block's own states], each through the same k_proj / v_proj (+ k_norm), in every layer
  (the context is never updated by the layers). Rotary angles at the positions above; q takes the block's
  (model_definitions.py:42). A block sees the whole context before its anchor and all of its own positions
  (bidirectional); in layers whose layer_types entry is "sliding_attention" (with transformer_layer_config's
  sliding_window W not null) only context positions >= a - W, and within the block only earlier or equal positions
  unless sliding_window_non_causal (attention.py:43, 61-98).
- Output (core.py:468-469, 436-453, 482-484): logits = lm_head(norm(block states)) at every block slot. Training
  matches slot k with the verifier's logits at a + k - 1, i.e. slot k scores the token at a + k (slot 0, the anchor
  itself, is not trained); with sample_from_anchor at a + k, so slot k scores the token at a + k + 1.

speculators itself drafts blocks only inside training (_backbone_forward, anchors drawn at random among positions
that leave a whole block, utils.py:21-68); tests/fixtures/dflash/make_fixtures.py has it draft at every anchor. Here
one block is drafted after a whole context, as at decoding: the anchor is the token after the context. The layers are
written out (speculators defines its own, model_definitions.py) from transformers' Qwen3 parts: RMSNorm, MLP, rotary
embedding; attention is torch's scaled_dot_product_attention over one boolean mask. Refused here though speculators
builds them: layer configs of another model_type than qwen3 (speculators reads them into Qwen3 layers as well), and
aux layer id N of an N-layer base (vLLM's last-layer state, unnormed; transformers' hidden_states[N] is normed).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from . import io
from .config import read_json_object
from .speculators_format import SPECULATORS_VERSION, WEIGHTS, token_map

HF_CONFIG = "config.json"
# Fields of speculators' DFlash config that change nothing drafted: kept verbatim in DFlashConfig.source.
KEPT = ("architectures", "auto_map", "speculators_config", "speculators_version", "transformers_version", "dtype",
        "torch_dtype", "tie_word_embeddings", "has_no_defaults_at_init", "_name_or_path", "target_hidden_size")
READ = ("speculators_model_type", "transformer_layer_config", "draft_vocab_size", "block_size",
        "aux_hidden_state_layer_ids", "mask_token_id", "sample_from_anchor", "sliding_window_non_causal")
# The layer configs DFlash drafts are built from here (speculators builds Qwen3DFlashDecoderLayer from any).
LAYER_TYPES = ("qwen3",)


@dataclass
class DFlashConfig:
    """A speculators DFlash config.json as read: the draft layers' Qwen3Config and the block's settings."""

    layer: Qwen3Config
    block_size: int
    mask_token_id: int
    aux_layer_ids: list[int]
    draft_vocab_size: int
    sample_from_anchor: bool = False
    sliding_window_non_causal: bool = False
    source: dict[str, Any] = field(default_factory=dict)  # the whole config.json, as written

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    @property
    def drafted_slots(self) -> slice:
        """The block slots that draft tokens: all with sample_from_anchor, else all but the anchor's."""
        return slice(0 if self.sample_from_anchor else 1, self.block_size)


def read_config(path: str | Path) -> DFlashConfig:
    """The DFlash config in folder `path`, every field read, kept or refused by name."""
    file = Path(path) / HF_CONFIG
    meta = read_json_object(file, fix="put the draft's config.json beside its weights")
    kind = meta.get("speculators_model_type")
    if kind != "dflash":
        raise ValueError(f"{file}: speculators_model_type {kind!r} is not a DFlash draft (\"dflash\")")
    unknown = sorted(set(meta) - set(KEPT) - set(READ))
    if unknown:
        raise ValueError(f"{file}: field(s) {unknown} are not part of speculators' DFlash config as this reader "
                         f"knows it (speculators {SPECULATORS_VERSION}); they may change how the draft computes, so "
                         f"it is refused rather than read without them")
    layer = meta.get("transformer_layer_config")
    if not isinstance(layer, dict) or layer.get("model_type", "qwen3") not in LAYER_TYPES:
        kind = layer.get("model_type") if isinstance(layer, dict) else layer
        raise ValueError(f"{file}: transformer_layer_config.model_type is {kind!r}; DFlash drafts are read here with "
                         f"{' or '.join(LAYER_TYPES)} layer configs")
    fields = {k: v for k, v in copy.deepcopy(layer).items() if k != "model_type"}
    rope = fields.get("rope_parameters")
    if isinstance(rope, dict) and "sliding_attention" in rope:
        fields["rope_parameters"] = rope["sliding_attention"]  # as speculators' flatten_rope_parameters chooses
    config = Qwen3Config(**fields)
    hidden, vocab = config.hidden_size, config.vocab_size
    target = meta.get("target_hidden_size")
    if target is not None and target != hidden:
        raise ValueError(f"{file}: target_hidden_size {target} differs from the draft's hidden_size {hidden}; drafts "
                         f"narrower than their verifier are not supported")
    draft_vocab = meta.get("draft_vocab_size", 32000)  # speculators' default
    if not _is_int(draft_vocab) or not 1 <= draft_vocab <= vocab:
        raise ValueError(f"{file}: draft_vocab_size {draft_vocab!r} must be an integer from 1 to the verifier's "
                         f"vocab_size ({vocab}, transformer_layer_config.vocab_size)")
    block = meta.get("block_size", 8)
    from_anchor = meta.get("sample_from_anchor", False)
    non_causal = meta.get("sliding_window_non_causal", False)
    for name, value in (("sample_from_anchor", from_anchor), ("sliding_window_non_causal", non_causal)):
        if not isinstance(value, bool):
            raise ValueError(f"{file}: {name} must be true or false, got {value!r}")
    if not _is_int(block) or block < (1 if from_anchor else 2):
        raise ValueError(f"{file}: block_size {block!r} must be an integer >= {1 if from_anchor else 2} (the anchor's "
                         f"slot drafts nothing without sample_from_anchor)")
    mask = meta.get("mask_token_id")
    if not _is_int(mask) or not 0 <= mask < vocab:
        raise ValueError(f"{file}: mask_token_id {mask!r} must be a token id of the verifier's vocabulary "
                         f"[0, {vocab}): a block's positions after the anchor are that token")
    layers = meta.get("aux_hidden_state_layer_ids")
    if not isinstance(layers, list) or not layers or not all(_is_int(i) and i >= 0 for i in layers) \
            or len(set(layers)) != len(layers):
        raise ValueError(f"{file}: aux_hidden_state_layer_ids {layers!r} must be distinct layer ids >= 0 (speculators' "
                         f"default is [2, N // 2, N - 3] for a verifier of N decoder layers)")
    return DFlashConfig(config, block, mask, list(layers), draft_vocab, from_anchor, non_causal, meta)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, heads, n, d] at angles [B, n, d]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


@dataclass(frozen=True)
class DFlashContext:
    """What a block attends to besides itself, per draft layer: the context's keys and values [B, kv heads, T, d]
    (keys after k_norm and rotary), valid [B, T] bool, positions [B, T]. Exact to keep from step to step: the layers
    never update the context, so a slot's keys and values depend on its own features and position alone."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    valid: torch.Tensor
    positions: torch.Tensor


class DFlashAttention(nn.Module):
    """speculators' Qwen3DFlashAttention: the block's queries over keys and values of [context, block]."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, n, H] (context states g, or the block's normed states), cos/sin [B, n, d] -> keys, values
        [B, kv heads, n, d]; the context's and the block's go through the same projections."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))).transpose(1, 2)
        v = self.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2)
        return _rotate(k, cos, sin), v

    def forward(self, x: torch.Tensor, context_k: torch.Tensor, context_v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, S, H] (the block, normed), context_k/v [B, kv heads, T, d], cos/sin [B, S, d] (the block's),
        mask [B, 1, S, T + S] bool -> [B, S, H]."""
        batch, size = x.shape[:2]
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.heads, self.head_dim))).transpose(1, 2)
        k, v = self.keys_values(x, cos, sin)
        k, v = torch.cat([context_k, k], dim=2), torch.cat([context_v, v], dim=2)
        # enable_gqa repeats each key/value head for consecutive query heads, as transformers' repeat_kv does.
        out = F.scaled_dot_product_attention(_rotate(q, cos, sin), k, v, attn_mask=mask, scale=self.head_dim ** -0.5,
                                             enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, size, -1))


class DFlashLayer(nn.Module):
    """speculators' Qwen3DFlashDecoderLayer: a pre-norm Qwen3 layer whose attention also reads the context."""

    def __init__(self, config: Qwen3Config, index: int):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        types = getattr(config, "layer_types", None) or []
        window = getattr(config, "sliding_window", None)
        # A "sliding_attention" layer without a window attends as a full one (speculators' mask, attention.py:43).
        self.sliding_window = window if index < len(types) and types[index] == "sliding_attention" else None

    def forward(self, x: torch.Tensor, context_k: torch.Tensor, context_v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context_k, context_v, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(nn.Module):
    """speculators' DFlashDraftModel for drafting: fc, hidden_norm, the layers, norm, lm_head over the draft vocabulary
    (token_map: draft index -> verifier token id, when reduced), and embed_tokens, the verifier's input embeddings.
    Weights are named as speculators names them.

    Drafting is two calls: `context` turns the base's auxiliary states into every layer's keys and values (once per
    context slot: a decoding loop extends them by each step's accepted tokens), `forward` drafts one block over them;
    `block_logits` does both for a whole context."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        layer, hidden = config.layer, config.layer.hidden_size
        self.config = config
        self.fc = nn.Linear(len(config.aux_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=layer.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(layer, i) for i in range(layer.num_hidden_layers))
        self.norm = Qwen3RMSNorm(hidden, eps=layer.rms_norm_eps)
        reduced = config.draft_vocab_size < config.vocab_size
        # A full-vocabulary draft scores through the verifier's own LM head (verifier_weights).
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False) if reduced else None
        # The verifier's input and output embeddings, (input, output), set by load_dflash: held by reference outside
        # the module tree, so that the draft's .to(), .half() or state_dict() never touch the base model's tensors.
        self.verifier_weights: tuple[torch.Tensor, torch.Tensor] | None = None
        self.rotary_emb = Qwen3RotaryEmbedding(layer)
        self.register_buffer("token_map", torch.arange(config.draft_vocab_size) if reduced else None)

    def context(self, features: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                past: DFlashContext | None = None) -> DFlashContext:
        """features [B, T, n H] (the base's auxiliary states at T context slots), positions [B, T], valid [B, T] bool
        -> `past` (None: nothing) followed by these slots: g = hidden_norm(fc(features)) through every layer's
        k_proj / v_proj, as the layers read the context."""
        g = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        cos, sin = self.rotary_emb(g, positions)
        kv = [layer.self_attn.keys_values(g, cos, sin) for layer in self.layers]
        keys, values = tuple(k for k, _ in kv), tuple(v for _, v in kv)
        if past is not None:
            keys = tuple(torch.cat([old, new], dim=2) for old, new in zip(past.keys, keys))
            values = tuple(torch.cat([old, new], dim=2) for old, new in zip(past.values, values))
            valid, positions = torch.cat([past.valid, valid], dim=1), torch.cat([past.positions, positions], dim=1)
        return DFlashContext(keys, values, valid, positions)

    def forward(self, context: DFlashContext, anchor: torch.Tensor, anchor_position: torch.Tensor) -> torch.Tensor:
        """One block after `context`: anchor [B] (its first token), anchor_position [B] -> the block's states [B,
        block_size, H] after the final norm (`project` scores them)."""
        size = self.config.block_size
        tokens = torch.full((len(anchor), size), self.config.mask_token_id, dtype=torch.long, device=anchor.device)
        tokens[:, 0] = anchor
        positions = anchor_position[:, None] + torch.arange(size, device=anchor.device)
        return self.block_states(context, tokens, positions, lambda window: self.mask(context, positions, window))

    def block_states(self, context: DFlashContext, tokens: torch.Tensor, positions: torch.Tensor,
                     mask_for: Callable[[int | None], torch.Tensor]) -> torch.Tensor:
        """Block slots' tokens [B, S] (anchors and mask tokens; several blocks side by side in training) at positions
        [B, S] -> their states after the final norm [B, S, H]; mask_for(sliding window or None) gives a layer's
        [B, 1, S, T + S] bool mask over [context, slots]."""
        if self.verifier_weights is None:
            raise ValueError("this DFlash draft has no verifier embeddings: load it with load_dflash(path, base_model)")
        # the base's embeddings may be in another dtype
        x = F.embedding(tokens, self.verifier_weights[0]).to(self.fc.weight.dtype)
        cos, sin = self.rotary_emb(x, positions)
        masks = {}
        for layer, k, v in zip(self.layers, context.keys, context.values):
            if layer.sliding_window not in masks:
                masks[layer.sliding_window] = mask_for(layer.sliding_window)
            x = layer(x, k, v, cos, sin, masks[layer.sliding_window])
        return self.norm(x)

    def project(self, states: torch.Tensor) -> torch.Tensor:
        """Block states [..., H] -> logits [..., draft vocab]."""
        weight = self.lm_head.weight if self.lm_head is not None else self.verifier_weights[1]
        return F.linear(states.to(weight.dtype), weight)

    def mask(self, context: DFlashContext, positions: torch.Tensor, window: int | None) -> torch.Tensor:
        """positions [B, S] (the block's) -> [B, 1, S, T + S] bool: the block sees the valid context and itself; in a
        sliding layer only context positions >= the anchor's - window, and, unless sliding_window_non_causal, only
        earlier block slots."""
        size = positions.shape[1]
        sees_context = context.valid
        sees_block = torch.ones(size, size, dtype=torch.bool, device=positions.device)
        if window is not None:
            sees_context = sees_context & (context.positions >= positions[:, :1] - window)
            if not self.config.sliding_window_non_causal:
                sees_block = sees_block.tril()
        rows = sees_context[:, None, :].expand(-1, size, -1)
        return torch.cat([rows, sees_block.expand(len(positions), -1, -1)], dim=-1)[:, None]

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> the verifier's token ids."""
        return indices if self.token_map is None else self.token_map[indices]


def block_logits(draft: DFlashDraft, features: torch.Tensor, anchor: torch.Tensor,
                 context_mask: torch.Tensor | None = None) -> torch.Tensor:
    """One pass of the draft over the block after a context: features [B, T, n H] (the base's auxiliary hidden states
    of the context, `context_features`), anchor [B] (the token after the context), context_mask [B, T] (1 for real
    tokens; left padding 0) -> logits [B, block_size, draft vocab].

    Slot k scores the token k positions after the anchor (k + 1 with sample_from_anchor); config.drafted_slots are
    the slots that draft. Positions count the real tokens, as transformers' generate does for left padding."""
    batch, length = features.shape[:2]
    visible = torch.ones(batch, length, dtype=torch.bool, device=features.device) if context_mask is None \
        else context_mask.to(device=features.device, dtype=torch.bool)
    context = draft.context(features, (visible.long().cumsum(-1) - 1).clamp(min=0), visible)
    return draft.project(draft(context, anchor, visible.sum(-1)))


def propose_block(draft: DFlashDraft, features: torch.Tensor, anchor: torch.Tensor,
                  context_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy drafts of the tokens after the anchor, in the verifier's vocabulary: [B, block_size - 1] ([B,
    block_size] with sample_from_anchor); arguments as block_logits'."""
    logits = block_logits(draft, features, anchor, context_mask)[:, draft.config.drafted_slots]
    return draft.token_ids(logits.argmax(-1))


@torch.no_grad()
def context_features(base_model: nn.Module, draft: DFlashDraft, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The base's auxiliary hidden states the draft reads: transformers' hidden_states[i] for each of
    aux_hidden_state_layer_ids, concatenated in that order -> [B, T, n H]."""
    states = base_model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
    return torch.cat([states[i] for i in draft.config.aux_layer_ids], dim=-1)


def load_dflash(path: str | Path, base_model: nn.Module) -> DFlashDraft:
    """The speculators DFlash draft in folder `path`, for `base_model` (its verifier): config and every tensor checked.
    embed_tokens and, for a full-vocabulary draft, lm_head share the base's input and output embeddings (a folder's
    copies of them must equal the base's); the draft is in eval mode."""
    path = Path(path)
    config = read_config(path)
    _check_base(config, base_model, path / HF_CONFIG)
    tensors, source = io.read_weights_folder(path, "a speculators DFlash")
    tensors = dict(tensors)
    for key in ("verifier_lm_head.weight", "verifier_norm.weight"):
        tensors.pop(key, None)  # speculators' training targets: not the draft's
    embeddings, output = base_model.get_input_embeddings().weight, base_model.get_output_embeddings().weight
    reduced = config.draft_vocab_size < config.vocab_size
    shared = {"embed_tokens.weight": embeddings, **({} if reduced else {"lm_head.weight": output})}
    for key, weight in shared.items():
        copy_ = tensors.pop(key, None)
        if copy_ is not None and not io.same_weight(copy_, weight.detach()):
            raise ValueError(f"{source}: {key} is not the base model's ({'input' if 'embed' in key else 'output'} "
                             f"embeddings), which speculators puts there (load_verifier_weights); this draft belongs "
                             f"to another model")
    d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
    if reduced:
        tensors["token_map"] = token_map(d2t, t2d, config.draft_vocab_size, config.vocab_size, source)
    elif d2t is not None and bool(d2t.any()):
        raise ValueError(f"{source}: d2t maps a draft over the whole vocabulary (draft_vocab_size = vocab_size) to "
                         f"other ids; make draft_vocab_size the number of d2t's entries, or drop d2t and t2d")
    with torch.device("meta"):
        draft = DFlashDraft(config)
    expected = {k: v.shape for k, v in draft.state_dict().items() if k not in shared}
    io.check_weights(expected, tensors, source, name=lambda key: key.replace("token_map", "d2t"),
                     fix="the folder is incomplete, or its config.json is not its weights'")
    draft.load_state_dict(tensors, strict=False, assign=True)  # the meta draft takes the folder's tensors
    draft.rotary_emb = Qwen3RotaryEmbedding(config.layer)  # its angles are no weights: made anew, off the meta device
    draft.verifier_weights = (embeddings, output)
    return draft.eval()


def new_dflash(base_model: nn.Module, num_layers: int, block_size: int, aux_layer_ids: list[int], mask_token_id: int,
               token_ids: torch.Tensor | None = None, base_name: str | None = None) -> DFlashDraft:
    """A fresh DFlash draft for `base_model`, as speculators' DFlashDraftModel.from_training_args builds one: num_layers
    Qwen3 layers of the base's sizes, full attention; lm_head the base's LM head rows of the draft vocabulary
    (`token_ids`, ascending, as speculators orders t2d; None: the whole vocabulary, through the base's own head), frozen
    as speculators keeps it; the other weights as transformers initialises a Qwen3 model (normal(0, 0.02), norms at
    one). `base_name` names the verifier in the config (speculators_config.verifier.name_or_path)."""
    text = base_model.config.get_text_config(decoder=True)
    embeddings, output = base_model.get_input_embeddings().weight, base_model.get_output_embeddings().weight
    vocab, hidden = embeddings.shape
    heads = text.num_attention_heads
    rope = getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    layer = Qwen3Config(hidden_size=hidden, intermediate_size=text.intermediate_size, num_attention_heads=heads,
                        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
                        head_dim=getattr(text, "head_dim", None) or hidden // heads,
                        hidden_act=getattr(text, "hidden_act", "silu"), rms_norm_eps=text.rms_norm_eps,
                        rope_parameters=copy.deepcopy(dict(rope)), vocab_size=vocab, num_hidden_layers=num_layers,
                        max_position_embeddings=getattr(text, "max_position_embeddings", 32768),
                        layer_types=["full_attention"] * num_layers, attention_bias=False, tie_word_embeddings=False)
    draft_vocab = vocab if token_ids is None else len(token_ids)
    verifier = {"architectures": list(getattr(base_model.config, "architectures", None) or [type(base_model).__name__]),
                "name_or_path": base_name}
    source = {"architectures": ["DFlashDraftModel"], "speculators_config": {
        "algorithm": "dflash", "default_proposal_method": "greedy",
        "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": block_size - 1,
                              "verifier_accept_k": 1}],
        "verifier": verifier}}
    config = DFlashConfig(layer, block_size, mask_token_id, list(aux_layer_ids), draft_vocab, source=source)
    _check_base(config, base_model, "new_dflash")
    draft = DFlashDraft(config).to(embeddings.device)
    for module in draft.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=layer.initializer_range)
    if token_ids is not None:
        rows = torch.as_tensor(token_ids, dtype=torch.long, device=embeddings.device)
        if rows.dim() != 1 or not bool((rows[1:] > rows[:-1]).all()) or int(rows.min()) < 0 or int(rows.max()) >= vocab:
            raise ValueError(f"token_ids must be distinct token ids of the base's vocabulary [0, {vocab}), ascending")
        draft.token_map.copy_(rows)
        draft.lm_head.weight.data.copy_(output.detach()[rows])
        draft.lm_head.requires_grad_(False)
    draft.verifier_weights = (embeddings, output)
    return draft


def save_dflash(draft: DFlashDraft, path: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write `draft` as a speculators DFlash folder (config.json + model.safetensors), atomically, as speculators saves
    one: its own weights, lm_head only for a reduced vocabulary (with d2t offsets and the t2d mask), no embed_tokens
    (the verifier's). `dtype`: the weights' (default: as they are). load_dflash reads it back exactly."""
    config = draft.config
    tensors = {key: value.detach().to("cpu", dtype if dtype is not None and value.is_floating_point() else None)
               .contiguous() for key, value in draft.state_dict().items() if key != "token_map"}
    if draft.token_map is not None:
        ids = draft.token_map.cpu()
        tensors["d2t"] = ids - torch.arange(ids.numel())
        tensors["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool)
        tensors["t2d"][ids] = True
    layer = {k: v for k, v in config.layer.to_dict().items() if k != "transformers_version"}
    weights_dtype = str(tensors["fc.weight"].dtype).removeprefix("torch.")
    meta = {key: copy.deepcopy(value) for key, value in config.source.items() if key in KEPT}
    meta.update({"speculators_model_type": "dflash", "transformer_layer_config": layer,
                 "draft_vocab_size": config.draft_vocab_size, "block_size": config.block_size,
                 "aux_hidden_state_layer_ids": list(config.aux_layer_ids), "mask_token_id": config.mask_token_id,
                 "sample_from_anchor": config.sample_from_anchor,
                 "sliding_window_non_causal": config.sliding_window_non_causal, "dtype": weights_dtype,
                 "speculators_version": meta.get("speculators_version", SPECULATORS_VERSION),
                 "tie_word_embeddings": False, "target_hidden_size": meta.get("target_hidden_size")})
    meta.pop("torch_dtype", None)
    with io.staged_save(path, (WEIGHTS, HF_CONFIG)) as staged:
        save_file(tensors, str(staged / WEIGHTS), metadata={"format": "pt"})
        io.write_json(staged / HF_CONFIG, dict(sorted(meta.items())))


def _check_base(config: DFlashConfig, base_model: nn.Module, source: Path) -> None:
    """Refuse a base model whose sizes or layers the draft was not made for."""
    text = getattr(base_model.config, "text_config", None) or base_model.config
    hidden, vocab = base_model.get_input_embeddings().weight.shape[1], base_model.get_input_embeddings().weight.shape[0]
    if (hidden, vocab) != (config.layer.hidden_size, config.vocab_size):
        raise ValueError(f"{source}: the draft reads a verifier of hidden_size={config.layer.hidden_size} and "
                         f"vocab_size={config.vocab_size} (transformer_layer_config) but the base model has "
                         f"{hidden} and {vocab}: this draft belongs to another model")
    if base_model.get_output_embeddings() is None:
        raise ValueError(f"{source}: the base model has no LM head (get_output_embeddings()); load it with "
                         f"AutoModelForCausalLM")
    layers = getattr(text, "num_hidden_layers", None)
    if isinstance(layers, int) and max(config.aux_layer_ids) >= layers:
        raise ValueError(f"{source}: aux_hidden_state_layer_ids {config.aux_layer_ids} name layer "
                         f"{max(config.aux_layer_ids)} of a base model of {layers} decoder layers; use 0 (the "
                         f"embeddings) to {layers - 1} (transformers' hidden_states[{layers}] is normed, vLLM's "
                         f"last-layer state is not)")
