"""MedusaConfig: the head adapter's configuration, serialised to JSON beside its weights."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .eagle3 import check_spec
from .tree import validate_choices

FORMAT_VERSION = 1
CONFIG_NAME = "medusa_config.json"
# A saved config must state these: without them the weights' shapes and the base-model checks are guesses.
# (Others fall back to their defaults, as peft does.)
REQUIRED_KEYS = ("num_heads", "num_layers", "share_lm_head", "hidden_size", "vocab_size")
# "medusa": head k reads the hidden state only. "dependent" (Hydra-style): it also reads the
# embeddings of the tokens on the path to its parent. "eagle" (EAGLE-style): a draft layer with its own cache turns
# the state and the next token into the next state, drafting level by level on its own outputs (eagle.py). "eagle3":
# EAGLE-3 exactly as speculators (vLLM's training library) defines it, drafting the same way (eagle3.py).
HEAD_TYPES = ("medusa", "dependent", "eagle", "eagle3")


@dataclass
class MedusaConfig:
    """What a set of Medusa heads is and which base model it belongs to.

    Head k (0-based) predicts the token k + 2 positions after the hidden state it reads;
    the base model's own LM head predicts the token 1 position ahead.
    """

    # Eagle3 heads: the levels they draft (speculators' speculative_tokens).
    num_heads: int = 4
    # Eagle3 heads: the draft's decoder layers (its transformer_layer_config's num_hidden_layers).
    num_layers: int = 1
    # True: heads project through the base model's LM head (no extra vocab-sized matrices).
    # False: each head owns a projection initialised from the base output embedding (original Medusa); eagle3
    # heads' draft owns one LM head, so False for them.
    share_lm_head: bool = True
    hidden_size: int | None = None
    vocab_size: int | None = None
    head_type: str = "medusa"
    # Heads score only this many tokens (the token map saved with the weights); None = the full vocabulary.
    draft_vocab_size: int | None = None
    # Attention heads of the context layer the heads read through (see context.py); 0 = no context layer.
    context_heads: int = 0
    # Layers of the base (i: decoder layer i's output, 0: the embeddings) whose hidden states the heads read beside
    # the final one, added through a learned projection (EAGLE-3's low / middle / high-layer features); [] = none.
    # Eagle3 heads read these alone, in this order (speculators' eagle_aux_hidden_state_layer_ids); [] takes
    # speculators' default when they are attached.
    feature_layers: list[int] = field(default_factory=list)
    # Eagle heads' draft layer: {"num_attention_heads": n, "intermediate_size": m} (its width is hidden_size).
    # Eagle3 heads': speculators' transformer_layer_config and norm flags, under its names (eagle3.SPEC_KEYS).
    # Null for the other head types, and filled in from the base model when eagle or eagle3 heads are attached.
    draft_layer: dict[str, Any] | None = None
    base_model_name_or_path: str | None = None
    # Default tree for generate(), as Medusa "choices" (rank paths); None = a built-in default.
    tree: list[list[int]] | None = None
    # Free-form figures from training (per-head accuracies, data size, ...).
    metrics: dict[str, Any] = field(default_factory=dict)
    # sha256 of the weights file saved with this config, checked on load: a config and weights from different
    # saves are caught even when their shapes agree. Null in adapters saved before it was recorded. Not compared:
    # it names a file, not the heads.
    weights_sha256: str | None = field(default=None, compare=False)
    # Medusa-2: whether the save wrote a LoRA adapter for the base model beside the heads (lora/). A later save
    # replaces or removes lora/ only where this records it, so a lora/ folder of the user's own is never deleted.
    # False in adapters saved before it was recorded. Not compared: it names a folder, not the heads.
    lora: bool = field(default=False, compare=False)
    # What the format the heads were read from records that medusa_spec does not use (a speculators config's
    # versions, architectures, proposal settings), written back when they are converted to that format again.
    # Not compared: it describes a file, not the heads.
    source_config: dict[str, Any] = field(default_factory=dict, compare=False)
    format_version: int = FORMAT_VERSION

    def __post_init__(self):
        for name in ("num_heads", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "num_heads" else 0):
                raise ValueError(f"MedusaConfig.{name} must be an integer >= {1 if name == 'num_heads' else 0}, "
                                 f"got {value!r}")
        for name in ("share_lm_head", "lora"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MedusaConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if self.head_type not in HEAD_TYPES:
            raise ValueError(f"MedusaConfig.head_type must be one of {', '.join(HEAD_TYPES)}, got {self.head_type!r}")
        for name in ("hidden_size", "vocab_size", "draft_vocab_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"MedusaConfig.{name} must be a positive integer or null, got {value!r}")
        if (self.draft_vocab_size is not None and self.vocab_size is not None
                and self.draft_vocab_size > self.vocab_size):
            raise ValueError(f"MedusaConfig.draft_vocab_size ({self.draft_vocab_size}) exceeds vocab_size "
                             f"({self.vocab_size}); use at most the full vocabulary, or null for all of it")
        if not isinstance(self.context_heads, int) or isinstance(self.context_heads, bool) or self.context_heads < 0:
            raise ValueError(f"MedusaConfig.context_heads must be an integer >= 0, got {self.context_heads!r}")
        if self.context_heads and self.hidden_size and self.hidden_size % self.context_heads:
            raise ValueError(f"MedusaConfig.context_heads ({self.context_heads}) must divide hidden_size "
                             f"({self.hidden_size}), e.g. {max(1, self.hidden_size // 64)}")
        layers = self.feature_layers
        is_index = [isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers] \
            if isinstance(layers, (list, tuple)) else [False]
        if not all(is_index) or len(set(layers)) < len(layers):
            raise ValueError(f"MedusaConfig.feature_layers must be distinct layer indices >= 0 (e.g. [8, 16]), "
                             f"got {layers!r}")
        # Eagle3 heads concatenate them in the order given (their fc's columns); others sum them, in any order.
        self.feature_layers = list(layers) if self.head_type == "eagle3" else sorted(layers)
        self._check_draft_layer()
        self._check_metrics()
        if self.tree is not None:
            validate_choices(self.tree, self.num_heads)
            self.tree = [list(path) for path in self.tree]
        if self.weights_sha256 is not None and not (isinstance(self.weights_sha256, str)
                                                    and re.fullmatch(r"[0-9a-f]{64}", self.weights_sha256)):
            raise ValueError(f"MedusaConfig.weights_sha256 must be 64 lowercase hex digits or null, got "
                             f"{self.weights_sha256!r}")

    def _check_metrics(self) -> None:
        """metrics is free-form but for what generate reads: eval.rank_accuracy, the trees' source."""
        if not isinstance(self.metrics, dict) or not isinstance(self.metrics.get("eval", {}), dict):
            raise ValueError(f"MedusaConfig.metrics must be an object (and its \"eval\" one too), got "
                             f"{self.metrics!r}")
        ranks = self.metrics.get("eval", {}).get("rank_accuracy")
        if ranks is None:
            return
        ok = isinstance(ranks, list) and all(
            isinstance(head, list) and head and all(isinstance(a, (int, float)) and not isinstance(a, bool)
                                                    and 0 <= a <= 1 for a in head) for head in ranks)
        if not ok:
            raise ValueError(f"MedusaConfig.metrics.eval.rank_accuracy must hold one list per head of how often its "
                             f"rank-1, rank-2, ... guess is right (numbers from 0 to 1), e.g. [[0.6, 0.1], [0.4, "
                             f"0.1]], got {ranks!r}; fix it, or delete it to decode with the adapter's stored tree")

    def _check_draft_layer(self) -> None:
        if not isinstance(self.source_config, dict):
            raise ValueError(f"MedusaConfig.source_config must be an object, got {self.source_config!r}")
        if self.head_type in ("eagle", "eagle3") and self.context_heads:
            raise ValueError(f"{self.head_type} heads take no context layer (context_heads must be 0): their draft "
                             f"layer already attends over the text")
        if self.head_type == "eagle3":
            if self.share_lm_head:
                raise ValueError("eagle3 heads own their LM head (speculators' lm_head over the draft vocabulary): set "
                                 "share_lm_head to false")
            if self.num_layers < 1:
                raise ValueError(f"MedusaConfig.num_layers of eagle3 heads counts their draft's decoder layers: at "
                                 f"least 1, got {self.num_layers}")
            if self.draft_layer is not None:
                check_spec(self.draft_layer, self.hidden_size, self.num_layers)
            return
        shape = self.draft_layer
        if shape is None:
            return
        if self.head_type != "eagle":
            raise ValueError(f"MedusaConfig.draft_layer is for head_type 'eagle' and 'eagle3' only; set it to null "
                             f"for {self.head_type} heads")
        keys = ("num_attention_heads", "intermediate_size")
        positive = [isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in shape.values()] \
            if isinstance(shape, dict) else [False]
        if not isinstance(shape, dict) or sorted(shape) != sorted(keys) or not all(positive):
            raise ValueError(f"MedusaConfig.draft_layer must be {{\"num_attention_heads\": n, \"intermediate_size\": "
                             f"m}} with positive integers (or null to take them from the base model), got {shape!r}")
        if self.hidden_size and self.hidden_size % shape["num_attention_heads"]:
            raise ValueError(f"MedusaConfig.draft_layer: num_attention_heads ({shape['num_attention_heads']}) must "
                             f"divide hidden_size ({self.hidden_size})")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "MedusaConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            warnings.warn(f"{source}: ignoring unknown MedusaConfig keys {unknown} (written by a newer medusa_spec?)",
                          stacklevel=2)
        version = data.get("format_version", FORMAT_VERSION)
        if isinstance(version, int) and version > FORMAT_VERSION:
            warnings.warn(f"{source}: format_version {version} is newer than this library's {FORMAT_VERSION}; "
                          "upgrade medusa_spec", stacklevel=2)
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except (TypeError, ValueError) as err:  # e.g. a value of the wrong type in the JSON
            raise ValueError(f"{source}: invalid MedusaConfig ({err})") from None

    def to_json_file(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n", encoding="utf-8")

    @classmethod
    def from_json_file(cls, path: str | Path) -> "MedusaConfig":
        path = Path(path)
        data = read_json_object(path, fix="re-save the adapter with save_heads()")
        missing = [key for key in REQUIRED_KEYS if key not in data]
        if missing:
            raise ValueError(f"{path} is missing required keys {missing}; add them (the base model's config has "
                             f"hidden_size and vocab_size) or re-save the adapter with save_heads()")
        return cls.from_dict(data, source=str(path))


def read_json_object(path: Path, fix: str) -> dict:
    """A JSON object from `path`, or an error naming the file and `fix`."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; {fix}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); {fix}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object; {fix}")
    return data
