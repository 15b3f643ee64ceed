"""`medusa-spec train`'s settings: one dataclass whose fields carry their --help text (those other subcommands take
too: medusa_spec.flags), checked when built."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..config import HEAD_TYPES
from ..eagle3 import NORM_FLAGS, TRAINER_NORMS
from .fields import head_defaults, head_option, option, shared, typed


@dataclass
class TrainConfig:
    """Settings of `medusa-spec train` (the flags are generated from these fields)."""

    model: str | None = shared(None)
    data: list[str] = shared(None, required=True)
    output: str = shared(None, required=True, aliases=("--output-dir",))
    mode: str = option("medusa1", "medusa1: frozen base, heads only; medusa2: LoRA on the base too",
                       choices=("medusa1", "medusa2"))
    num_heads: int | None = head_option(4, "number of heads (head k predicts the token k + 2 ahead; with "
                                        "--init-heads: more than theirs adds heads, each starting as their last); "
                                        "eagle3: the levels drafted and trained (speculators' TTT steps)")
    num_layers: int | None = head_option(1, "residual blocks per head (with --init-heads: more than theirs adds "
                                         "blocks after theirs, starting at zero); eagle3: the draft's decoder "
                                         "layers")
    share_lm_head: bool | None = head_option(True, "project through the base LM head (no per-head vocabulary "
                                             "matrix)")
    head_type: str | None = head_option("medusa", "medusa: heads read the hidden state; dependent (Hydra-style): "
                                        "also the embeddings of the tokens on the path before their guess; eagle: a "
                                        "draft layer (one decoder layer with its own cache) drafts level by level on "
                                        "its own outputs, trained unrolled as it drafts; eagle3: EAGLE-3 as vLLM's "
                                        "speculators defines it (vLLM and SGLang serve it: convert --to "
                                        "speculators), trained so too; dflash: a DFlash block drafter as speculators "
                                        "defines and trains it (one pass drafts a whole block; --block-size, "
                                        "--num-layers its layers, --feature-layers its auxiliary layers), saved as a "
                                        "speculators folder", choices=(*HEAD_TYPES, "dflash"))
    block_size: int = option(8, "dflash: a block's slots, the anchor (the step's verified token) and block_size - 1 "
                             "drafted tokens, as speculators' --block-size")
    max_anchors: int = option(512, "dflash: blocks trained per row, their anchors drawn at random among the row's "
                              "answer tokens (speculators' --max-anchors); fewer cost less memory and time")
    dflash_decay_gamma: float = option(4.0, "dflash: slot k's loss weight exp(-(k - 1) / gamma), as speculators' "
                                       "--dflash-decay-gamma")
    mask_token_id: int | None = option(None, "dflash: the token a block's slots after its anchor hold (speculators' "
                                       "--mask-token-id); default: the tokenizer's mask, unk or pad token")
    context_heads: int | None = head_option(0, "attention heads of a context layer the heads read through "
                                            "(attention over the text so far, with each position's next token; "
                                            "e.g. hidden_size / 64); 0: none")
    feature_layers: list[int] | None = head_option([], "decoder layers (1 = the first; 0 = the embeddings) whose "
                                                   "hidden states the heads read beside the final one, through a "
                                                   "learned projection (EAGLE-3's feature fusion; e.g. a low and a "
                                                   "middle layer: 8 16 of 30); with --init-heads whose heads fuse "
                                                   "none, they take it on, starting as they were; eagle3 reads these "
                                                   "alone (default: speculators' 2, N/2, N-3 of N layers)")
    draft_layer_mlp: int | None = option(None, "eagle heads: the draft layer's MLP width (a narrower one drafts "
                                         "faster on CPUs); default: the base model's")
    # speculators' own flags for an EAGLE-3 draft's norms, under its names. Left out, new eagle3 heads take its
    # trainer's defaults (eagle3.TRAINER_NORMS), not its model config's (all off): the auxiliary states fc reads
    # differ in scale by far (SmolLM2-135M: RMS 3, 7 and 20 at layers 2, 15 and 27, single channels near 450).
    norm_before_fc: bool | None = option(None, "eagle3: one RMS norm over the concatenated auxiliary states before "
                                         "fc (speculators' --norm-before-fc); left out: on for new eagle3 heads "
                                         "(off with --fc-norm), as speculators trains them; with --init-heads, "
                                         "theirs")
    fc_norm: bool | None = option(None, "eagle3: an RMS norm of each auxiliary state before fc instead (EAGLE-3.1, "
                                  "speculators' --fc-norm); left out: off for new eagle3 heads")
    norm_before_residual: bool | None = option(None, "eagle3: the first layer's residual stream starts at the normed "
                                               "state (speculators' --norm-before-residual); left out: on for new "
                                               "eagle3 heads, as speculators trains them")
    norm_output: bool | None = option(None, "eagle3: a deeper level reads the normed output of the level before "
                                      "(speculators' --norm-output); left out: on for new eagle3 heads, as "
                                      "speculators trains them")
    draft_vocab: int | None = option(None, "heads score only the N most frequent answer tokens of the training data "
                                     "(a token map saved with them); default: the full vocabulary")
    init_heads: str | None = option(None, "start from the heads of a saved adapter (this library's format, the "
                                    "original Medusa's or vLLM's) and train them on, e.g. on data they have not "
                                    "seen; their architecture and draft vocabulary are kept (head flags that set "
                                    "another are refused, but --feature-layers adds fusion to heads without, and a "
                                    "larger --num-layers adds residual blocks after theirs); their "
                                    "tree is dropped, for `medusa-spec tree` to grow one from the new accuracies; "
                                    "a DFlash draft folder (speculators') trains on as a DFlash draft, its shape "
                                    "kept")
    exclude: list[str] = shared([])
    replay: int = option(0, "with --init-heads and --exclude its trained_conversations.txt: also train on the "
                         "conversations beginning as N of those the heads learned from (a seeded sample), mixed in "
                         "with the new ones, so the heads keep what they learned (a replay); never held out")
    head_decay: float = option(0.8, "weight decay^k of head k in the heads' loss")
    heads_target: str = option("tokens", "what the heads learn at each position: tokens, the data's token "
                               "(cross-entropy); teacher, the base model's whole next-token distribution there "
                               "(soft targets from its own logits: more signal per position, and right for data "
                               "the base did not write)", choices=("tokens", "teacher"))
    max_length: int = shared(1024)
    pack: bool = option(True, "pack several conversations per row (else one per row, padded)")
    keep_loops: bool = shared(False)
    allow_degenerate_data: bool = option(False, "train on --data whose answers are mostly degenerate (empty, or fewer "
                                         "than three distinct words), which is otherwise refused")
    batch_size: int = shared(8)
    grad_accum: int = option(1, "micro-batches per optimizer step")
    epochs: float = option(1.0, "passes over the training rows (unless --max-steps)")
    max_steps: int | None = option(None, "optimizer steps; overrides --epochs")
    time_limit: float | None = option(None, "minutes the training loop may run: past them it stops after the step "
                                      "under way (every process after the same one), checkpoints (with "
                                      "--save-every), then evaluates and saves the adapter as at the end, so a run "
                                      "with a deadline (a rented GPU) leaves its heads; the learning rate follows "
                                      "the schedule of the whole run")
    lr: float = option(1e-3, "peak learning rate of the heads")
    base_lr: float = option(1e-4, "peak learning rate of the LoRA weights (medusa2)")
    weight_decay: float = option(0.0, "AdamW weight decay")
    warmup_steps: int = option(50, "linear warm-up steps before the cosine decay")
    min_lr_ratio: float = option(0.1, "final learning rate as a fraction of the peak")
    max_grad_norm: float = option(1.0, "gradient clipping (0 = off)")
    seed: int = shared(0)
    mixed_precision: str | None = option(None, "no / fp16 / bf16 (default: accelerate's config); the base is loaded "
                                         "in that dtype, trainable weights stay fp32", choices=("no", "fp16", "bf16"))
    cache_hidden: bool = option(False, "medusa1: cache the base's hidden states on disk (in --output, hidden_cache/) "
                                "so the base runs once per row, not once per epoch")
    eval_examples: int = option(64, "conversations held out to measure head accuracy")
    max_conversations: int | None = option(None, "train on this many of the other conversations (a seeded sample; the "
                                           "held-out ones stay the same): a point of a data-scaling curve")
    eval_every: int = option(0, "evaluate every N steps (0 = at the end only)")
    eval_ranks: int = shared(10)
    save_every: int = option(500, "checkpoint every N steps (0 = never)")
    keep_checkpoints: int = option(2, "checkpoints kept on disk")
    log_every: int = option(10, "log every N steps")
    resume: bool = option(False, "continue from the latest checkpoint in --output (start fresh if there is none)")
    plain_text: bool = shared(False)
    base_loss: str = option("kl", "medusa2 base loss: kl to the untouched base (self-distillation) or ce on the data",
                            choices=("kl", "ce"))
    heads_loss_weight: float = option(0.2, "medusa2: lambda in base_loss + lambda * heads_loss")
    heads_warmup_steps: int = option(0, "medusa2: train the heads alone for the first N steps")
    lora_r: int = option(16, "LoRA rank (medusa2)")
    lora_alpha: int = option(32, "LoRA alpha (medusa2)")
    lora_dropout: float = option(0.05, "LoRA dropout (medusa2)")
    lora_target_modules: str = option("all-linear", "comma-separated module names for LoRA, or all-linear (medusa2)")

    @property
    def output_dir(self) -> str:
        """`output`'s name before --output-dir became --output, kept for code that reads it."""
        return self.output

    def __post_init__(self):
        if self.head_type == "eagle3" and self.share_lm_head is None:
            self.share_lm_head = False  # the draft owns its LM head (speculators' lm_head)
        if self.init_heads is None:  # new heads: the head flags left out take their defaults
            for name, default in head_defaults(type(self)).items():
                if getattr(self, name) is None:
                    setattr(self, name, list(default) if isinstance(default, list) else default)
        if self.mode == "medusa2" and self.cache_hidden:
            raise ValueError("--cache-hidden needs a frozen base (medusa1); medusa2 changes the base's hidden states")
        for name in ("num_heads", "max_length", "batch_size", "grad_accum", "eval_ranks", "keep_checkpoints",
                     "log_every"):
            if getattr(self, name) is not None and getattr(self, name) < 1:  # None: the --init-heads heads'
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        # nan compares false with everything, so each range is written to hold for the good values only.
        ranges = {"num_layers": (0, None), "warmup_steps": (0, None), "eval_every": (0, None),
                  "save_every": (0, None), "eval_examples": (0, None), "heads_warmup_steps": (0, None),
                  "weight_decay": (0, None), "max_grad_norm": (0, None), "heads_loss_weight": (0, None),
                  "min_lr_ratio": (0, 1), "lora_dropout": (0, 0.999)}
        for name, (low, high) in ranges.items():
            value = getattr(self, name)
            if value is not None and not (value >= low and (high is None or value <= high)):
                within = f">= {low}" if high is None else f"from {low} to {high}"
                raise ValueError(f"--{name.replace('_', '-')} must be {within}, got {value}")
        for name in ("lr", "base_lr"):  # 0 is allowed: heads carried over unchanged (--init-heads)
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"--{name.replace('_', '-')} must be a number >= 0, got {getattr(self, name)}")
        lora = self._changed("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
        if lora and self.mode != "medusa2":
            raise ValueError(f"{', '.join(lora)} shape the LoRA on the base, which only --mode medusa2 trains "
                             f"(--mode {self.mode} keeps the base frozen): add --mode medusa2, or drop them")
        if self.time_limit is not None and not 0 < self.time_limit < math.inf:
            raise ValueError(f"--time-limit must be a number of minutes > 0 (or left out), got {self.time_limit}")
        for name in ("head_decay", "epochs"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"--{name.replace('_', '-')} must be a number > 0, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"--max-steps must be >= 1 (or left out to train --epochs passes), got {self.max_steps}")
        if (self.num_layers == 0 and self.head_type == "medusa" and self.share_lm_head and not self.feature_layers
                and not self.context_heads and self.init_heads is None):
            raise ValueError("--num-layers 0 leaves heads that share the LM head nothing to train: give them a block "
                             "(--num-layers 1) or their own projection (--no-share-lm-head)")
        if self.head_type is None and self.init_heads is not None and _holds_dflash(self.init_heads):
            self.head_type = "dflash"  # the folder's kind, as --init-heads gives heads their architecture
        dflash_flags = self._changed("block_size", "max_anchors", "dflash_decay_gamma", "mask_token_id")
        if dflash_flags and self.head_type != "dflash":
            raise ValueError(f"{', '.join(dflash_flags)} shape a DFlash draft's training: add --head-type dflash, or "
                             f"drop them")
        if self.head_type == "dflash":
            self._check_dflash()
        if self.norms_given() and self.head_type not in ("eagle3", None):
            raise ValueError(f"{', '.join(self.norms_given())}: speculators' norm flags shape eagle3 heads only; add "
                             f"--head-type eagle3, or drop them")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("--norm-before-fc and --fc-norm exclude each other (speculators refuses both): one norm "
                             "over all the auxiliary states, or one per state; give one of them")
        if self.head_type == "eagle3" and self.init_heads is None:
            # New heads: the flags left out as speculators' trainer sets them (with --fc-norm, no norm before fc: the
            # two exclude each other). Set here, so that a checkpoint records them and --resume compares them.
            defaults = {**TRAINER_NORMS, "norm_before_fc": TRAINER_NORMS["norm_before_fc"] and not self.fc_norm}
            for name in NORM_FLAGS:
                if getattr(self, name) is None:
                    setattr(self, name, defaults[name])
        if self.draft_layer_mlp is not None and (self.head_type not in ("eagle", None) or self.draft_layer_mlp < 1):
            raise ValueError(f"--draft-layer-mlp sets the width of eagle heads' draft layer: use it with --head-type "
                             f"eagle and a width >= 1, got {self.draft_layer_mlp} with --head-type {self.head_type}")

    def eagle3_norms(self) -> dict[str, bool | None]:
        """speculators' norm flags (None: left out, for heads other than new eagle3 ones)."""
        return {name: getattr(self, name) for name in NORM_FLAGS}

    def norms_given(self) -> list[str]:
        """The norm flags set, as typed (["--no-norm-output"])."""
        return [typed("--" + name.replace("_", "-"), value) for name, value in self.eagle3_norms().items()
                if value is not None]

    def _changed(self, *names: str) -> list[str]:
        """The flags of `names` given values other than their defaults."""
        return [f"--{name.replace('_', '-')}" for name in names
                if getattr(self, name) != type(self).__dataclass_fields__[name].default]

    def _check_dflash(self) -> None:
        """A DFlash draft trains on a frozen base, as speculators trains one: a new one, or (--init-heads) a saved
        one on."""
        refused = {"--mode medusa2": self.mode == "medusa2", "--cache-hidden": self.cache_hidden,
                   "--context-heads": bool(self.context_heads),
                   "--draft-layer-mlp": self.draft_layer_mlp is not None}
        given = [flag for flag, set_ in refused.items() if set_]
        if given:
            raise ValueError(f"{', '.join(given)}: not for --head-type dflash, which trains a DFlash draft on a frozen "
                             f"base; drop them")
        layers = 1 if self.num_layers is None else self.num_layers  # None: --init-heads' draft's
        if self.block_size < 2 or self.max_anchors < 1 or layers < 1:
            raise ValueError(f"--head-type dflash needs --block-size >= 2 (the anchor and a drafted slot), "
                             f"--max-anchors >= 1 and --num-layers >= 1; got {self.block_size}, {self.max_anchors} "
                             f"and {self.num_layers}")
        if not 0 < self.dflash_decay_gamma < math.inf:
            raise ValueError(f"--dflash-decay-gamma must be a number > 0, got {self.dflash_decay_gamma}")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ValueError(f"--mask-token-id must be a token id >= 0, got {self.mask_token_id}")


def _holds_dflash(folder: str) -> bool:
    """Whether `folder` holds a speculators DFlash draft (its config.json says so); False where it cannot be read
    (the loader reports that)."""
    try:
        return json.loads((Path(folder) / "config.json").read_text()).get("speculators_model_type") == "dflash"
    except (OSError, ValueError, AttributeError):
        return False
