"""MedusaModel: a base causal LM plus Medusa heads; attach, save, load, generate."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import GenerationConfig

from . import autotree, eagle3, formats, io, verify
from .base import BaseSpec, inspect_base_model, model_device_dtype
from .columnwise import PackedWeights, columnwise_copy
from .compiled import CompiledSteps
from .config import MedusaConfig
from .eagle import draft_layer_shape
from .heads import MedusaHeads
from .inputs import resolve_sampling, special_tokens
from .lookup import with_lookup
from .loop import StepTimer, Streamer, decode
from .output import GenerateOutput
from .tree import DynamicTree, MedusaTree


class MedusaModel(nn.Module):
    """`base_model` (any decoder-only transformers causal LM, untouched) with `heads` on its final hidden state."""

    def __init__(self, base_model: nn.Module, config: MedusaConfig, heads: MedusaHeads):
        super().__init__()
        spec = inspect_base_model(base_model)  # refuse a model it cannot drive now, not at the first generate()
        _check_heads_match(config, heads, spec)
        self.base_model = base_model
        self.config = config
        self.heads = heads
        # The base model's fp32 CPU weights in oneDNN's layout, packed at the first generate() and kept while they
        # hold the same values (see columnwise.PackedWeights); here, not on the caller's model.
        self._packed_weights = PackedWeights()
        self._trees = autotree.TreeChoice(self._packed_weights)  # tree=None's step costs and choices
        self._compiled = CompiledSteps()  # generate(compile=True)'s graphs, compiled at their first use

    @property
    def spec(self) -> BaseSpec:
        """The base model's facts, read at each use (microseconds): its attention implementation may have been
        switched (base_model.set_attn_implementation) since the heads were attached, and eager takes another mask."""
        return inspect_base_model(self.base_model)

    @classmethod
    def from_base(cls, base_model: nn.Module, config: MedusaConfig | None = None) -> "MedusaModel":
        """Attach freshly initialised heads to `base_model`."""
        spec = inspect_base_model(base_model)
        if config is None:
            config = MedusaConfig()
        if not isinstance(config, MedusaConfig):
            raise TypeError(f"config must be a MedusaConfig, got {type(config).__name__}; for a dict, pass "
                            f"MedusaConfig(**config)")
        _check_sizes(config, spec, source="MedusaConfig")
        draft_layer, feature_layers = config.draft_layer, config.feature_layers
        text_config = base_model.config.get_text_config(decoder=True)
        if config.head_type == "eagle" and draft_layer is None:
            draft_layer = draft_layer_shape(text_config, spec.hidden_size)
        if config.head_type == "eagle3":
            draft_layer = draft_layer or eagle3.default_spec(text_config, spec.hidden_size, spec.vocab_size,
                                                             config.num_layers)
            feature_layers = feature_layers or eagle3.default_feature_layers(spec.num_layers or 1)
        config = dataclasses.replace(config, hidden_size=spec.hidden_size, vocab_size=spec.vocab_size,
                                     base_model_name_or_path=config.base_model_name_or_path or spec.name_or_path,
                                     draft_layer=draft_layer, feature_layers=feature_layers)
        _check_sizes(config, spec, source="MedusaConfig")  # the default feature layers too
        heads = MedusaHeads.from_config(config)
        heads.init_projections_from(base_model.get_output_embeddings())
        device, dtype = model_device_dtype(base_model)
        heads = heads.to(device=device, dtype=dtype)
        heads.bind_lm_head(base_model.get_output_embeddings())
        return cls(base_model, config, heads)

    @classmethod
    def from_pretrained(cls, base_model: nn.Module, path: str | Path) -> "MedusaModel":
        """Load heads onto `base_model` from `path`, saved by `save_heads` or in the original Medusa, vLLM Medusa or
        speculators EAGLE-3 format (detected from the files); sizes are checked against the base model.

        A Medusa-2 LoRA adapter saved beside the heads (lora/) is applied to `base_model` in place, through peft
        (adapter name "medusa2"), replacing one an earlier load applied; another peft adapter in `base_model` is
        refused, not removed. Everything else is checked first and a LoRA that fails to load is
        undone, so a load that fails leaves `base_model` as it was.
        """
        spec = inspect_base_model(base_model)
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be the adapter folder (a str or Path), got {type(path).__name__}")
        config, state_dict = formats.read_heads(path, base_model.get_output_embeddings(),
                                                base_model.get_input_embeddings(), spec.num_layers)
        _check_sizes(config, spec, source=str(path))
        # Compared by last path component: the same model is "org/name" on a hub and ".../name" on disk.
        if (config.base_model_name_or_path and spec.name_or_path
                and Path(config.base_model_name_or_path).name.lower() != Path(spec.name_or_path).name.lower()):
            warnings.warn(f"heads in {path} were trained for {config.base_model_name_or_path!r}, "
                          f"not {spec.name_or_path!r}: acceptance may be poor", stacklevel=2)
        if "token_map" in state_dict:
            io.check_token_map(state_dict["token_map"], spec.vocab_size, source=str(path))
        # Checked: from here the config describes heads on this base (a shared-LM-head adapter follows a resize).
        model = cls.from_base(base_model, dataclasses.replace(config, vocab_size=spec.vocab_size))
        model.heads.load_state_dict(state_dict)  # names and shapes were checked against the config when read
        io.load_lora(base_model, path)  # last: the one step that changes base_model
        model.heads.bind_lm_head(base_model.get_output_embeddings())
        return model

    def save_heads(self, path: str | Path, lora: nn.Module | None = None) -> None:
        """Write medusa_config.json + medusa_heads.safetensors (heads only) atomically.

        Medusa-2: `lora`, the peft model wrapping `base_model` whose LoRA was trained with the heads, is saved
        beside them in peft's format (lora/); saving without it removes a LoRA adapter an earlier save left.
        """
        if lora is not None and not callable(getattr(lora, "get_base_model", None)):
            raise TypeError(f"lora must be the peft model wrapping this MedusaModel's base_model "
                            f"(get_peft_model(base_model, ...)), got {type(lora).__name__}")
        if lora is not None and lora.get_base_model() is not self.base_model:
            raise ValueError("lora must be the peft model wrapping this MedusaModel's base_model "
                             "(get_peft_model(base_model, ...) before MedusaModel.from_base)")
        io.save_adapter(path, self.config, self.heads.state_dict(), lora=lora)

    def tree(self, tree: list[list[int]] | None = None, batch: int = 1) -> MedusaTree:
        """The MedusaTree generate() uses: `tree`'s rank paths, or for None those of default_choices(batch)."""
        return self._trees.medusa_tree(self, tree, batch)

    def default_choices(self, batch: int = 1) -> list[list[int]]:
        """The rank paths `tree=None` starts from, for a batch of `batch` rows. With rank accuracies in the adapter's
        metrics (metrics.eval.rank_accuracy): the best of tree_table(batch) (autotree.best_tree), which generate then
        keeps re-choosing from as the heads' accuracy on the text comes in (autotree.AdaptiveTree); without them,
        the adapter's stored tree, else default_tree(num_heads)."""
        return self._trees.choices(self, batch)

    def tree_table(self, batch: int = 1) -> list[dict]:
        """The trees `tree=None` chooses from, for a batch of `batch` rows: a row per tree size (rank paths, verify
        and drafting milliseconds, expected figures). The step costs are timed for one row at the first call, for
        autotree.PROBE_ROWS rows at the first call with a batch, and kept on this MedusaModel for the base model's
        device and dtype, and on disk for later processes on this machine (cost_cache; MEDUSA_SPEC_STEP_COSTS=0
        turns that off); any batch size is modelled from them (autotree.StepCosts.at: a batch verifies batch x
        nodes rows, so on a CPU it can afford fewer nodes) without timing anything more."""
        return self._trees.table(self, batch)

    def dynamic_tree(self, batch: int = 1) -> DynamicTree:
        """tree=None's tree for eagle heads, for a batch of `batch` rows: a DynamicTree (EAGLE-2) whose size each step
        chooses from the draft's own probabilities and this machine's step costs (autotree.priced_dynamic_tree),
        timed at the first call and kept as tree_table keeps its costs."""
        return self._trees.dynamic_tree(self, batch)

    def auto_tree(self, context: int = autotree.AUTO_CONTEXT, sizes: Sequence[int] = autotree.AUTO_SIZES,
                  repeats: int = autotree.AUTO_REPEATS, batch: int = 1) -> tuple[list[list[int]], list[dict]]:
        """The tree with the most expected tokens per second on this machine: verify-pass and drafting latency
        measured for trees of `sizes` nodes (the fastest of `repeats` runs), `batch` rows, value from the rank
        accuracies measured in training (metrics.eval.rank_accuracy). Returns (rank paths, the table of candidates).
        Measures at each call; generate(tree=None) measures once and keeps the costs. A finer grid:
        sizes=autotree.CANDIDATE_SIZES."""
        _check_heads_follow(self.base_model, self.heads)
        rank_accuracy = autotree.required_rank_accuracy(self.config)
        latency, draft_seconds = autotree.measure_step_costs(self, sizes=sizes, context=context, repeats=repeats,
                                                             rank_accuracy=rank_accuracy, batch=batch,
                                                             packs=self._packed_weights)
        return autotree.choose_tree(rank_accuracy, latency, draft_seconds)

    @torch.no_grad()
    def teacher_forced_drafts(self, input_ids: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        """What eagle or eagle3 heads draft along a text with its own tokens given: input_ids [S] or [1, S] ->
        LongTensor [depth, S - 1] of base-vocabulary ids (depth: the heads' levels by default). Row k, column t is
        the greedy draft at depth k + 1 from the base's states up to t and the tokens up to t + 1 + k, a guess of
        token t + 2 + k; columns whose path runs past the text read token 0 there, as speculators'
        Eagle3DraftModel.forward(..., ttt_steps=depth) after its shift_batch (column t pairs token t + 1 with the
        states at t) does. Offline, the share of row k matching input_ids[k + 2:] measures the draft."""
        if getattr(self.heads, "draft_layer", None) is None:
            raise ValueError(f"teacher_forced_drafts needs heads that draft level by level (head_type 'eagle' or "
                             f"'eagle3'), not {self.config.head_type} heads")
        ids = input_ids[None] if torch.is_tensor(input_ids) and input_ids.dim() == 1 else input_ids
        if not torch.is_tensor(ids) or ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 2 \
                or ids.is_floating_point():
            raise ValueError(f"input_ids must be one text of at least 2 token ids, shape [S] or [1, S], got "
                             f"{tuple(ids.shape) if torch.is_tensor(ids) else type(ids).__name__}")
        depth = self.config.num_heads if depth is None else depth
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"depth must be an integer >= 1, got {depth!r}")
        _check_heads_follow(self.base_model, self.heads)
        device, dtype = model_device_dtype(self.base_model)
        ids = ids.to(device)
        length = ids.shape[1] - 1
        # Eval-mode copies: the caller's modules keep their mode (another thread may be training them).
        base, heads = columnwise_copy(self.base_model, eval_mode=True), columnwise_copy(self.heads, eval_mode=True)
        out = base(input_ids=ids, output_hidden_states=True, use_cache=False, return_dict=True)
        states = heads.features(verify.base_features(out.hidden_states, heads.feature_layers)[:, :-1])
        # The tokens after each position, then token 0 past the text's end (speculators' padding).
        after = torch.cat([ids[:, 1:], ids.new_zeros(1, depth - 1)], dim=1)
        embeds = base.get_input_embeddings()(after).to(states.dtype)
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None]
        positions = torch.arange(length, device=device)[None]
        lm_head = base.get_output_embeddings()
        if heads.head_type == "eagle3":
            logits = heads.project(heads.draft_layer.unroll(states, embeds, causal, positions, depth), lm_head)
        else:
            outputs = heads.draft_layer.unroll(states, embeds[:, :length], causal, positions, depth)
            logits = torch.stack([heads.draft_logits(k, outputs[..., k, :], lm_head) for k in range(depth)], -2)
        return heads.token_ids(logits.argmax(-1))[0].T.contiguous()  # [depth, S - 1]

    def compile_blocks(self, sizes: Sequence[int], batch: int = 1) -> None:
        """Compile generate(compile=True)'s graphs for blocks of `sizes` nodes (each padded to compiled.block_size)
        and `batch` rows now, not at the first step that meets them: a benchmark or a server warms up with it. For
        eagle heads also their draft layer's update pass after a step that accepts a path of that many slots (a
        lookup chain's)."""
        self._compiled.prepare(self.base_model, self.spec, tuple(getattr(self.heads, "feature_layers", ())),
                               self.heads, self._packed_weights)
        autotree.measure_compiled_verify(self, self._compiled, tuple(sizes), batch)
        if getattr(self.heads, "draft_layer", None) is not None:
            autotree.compile_draft_updates(self, self._compiled.draft, tuple(sizes), batch)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int | None = None, do_sample: bool | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None, tree: list[list[int]] | DynamicTree | None = None,
                 streamer: Streamer | None = None,
                 lookup_tokens: int = 0, documents: list[list[int] | torch.Tensor] | None = None,
                 timer: StepTimer | None = None, generation_config: GenerationConfig | None = None,
                 compile: bool = False) -> GenerateOutput:
        """Lossless speculative generation; `sequences` [B, prompt + new] as transformers' generate.

        generation_config: read in place of the base model's own, as transformers' generate takes it; the settings
        below that a call leaves out come from it, and one it sets that medusa_spec does not apply
        (repetition_penalty, num_beams, ...) is refused.

        max_new_tokens: None takes the generation_config's max_new_tokens, else 128.

        do_sample, temperature, top_k, top_p: as in transformers' generate, each one not given comes from the
        generation_config, else transformers' default (greedy; top_k=50 when sampling); top_k=0
        and top_p=1.0 turn those filters off. eos_token_id / pad_token_id default to the generation_config (pass
        eos_token_id=[] to never stop early). `tree`: rank paths, or a DynamicTree for eagle heads; None (default)
        picks one. Eagle heads draft a DynamicTree (EAGLE-2) for one row, each step's size chosen from the draft's
        probabilities and step costs measured at the first call on this machine (see dynamic_tree). Other heads, and
        eagle heads for a batch, see default_choices: with the adapter's rank accuracies, the tree with the most
        expected tokens per second for step costs measured once, at the first call on this machine (a few seconds;
        then kept on this MedusaModel and on disk), and modelled for this batch size (see tree_table), re-chosen every
        few steps for how often the heads guess right on this text (down to the root alone; stats.tree_sizes shows each
        step's), or no speculation at all where the costs say no tree pays for this batch; without accuracies the
        adapter's stored tree. An explicit tree is kept as given; `[]` turns speculation off (one token per step,
        same loop). Which proposer each `tree` gives: autotree.TreeChoice.proposer.
        `lookup_tokens` > 0 also verifies a chain of up to that many candidates (its length adapts each step)
        copied from an earlier occurrence of the text's last n-gram in the prompt, the output or `documents`
        (lists of token ids), in the same pass. `timer`: a
        loop.StepTimer that adds up each decoding stage's time. The base model and the heads run in eval mode, through
        copies: no module's mode is written (another thread may be training them).
        `compile`: verify through torch.compile'd graphs of the base model (see compiled): each shape compiles once
        per process and MedusaModel (minutes on a small CPU), then a step costs less; they are kept on this
        MedusaModel, and compiled again after the base model's weights change.
        """
        _check_heads_follow(self.base_model, self.heads)
        sampling = resolve_sampling(self.base_model, do_sample, temperature, top_k, top_p, generation_config)
        eos, pad = special_tokens(self.base_model, eos_token_id, pad_token_id, generation_config)
        spec = self.spec
        batch = input_ids.shape[0] if torch.is_tensor(input_ids) and input_ids.dim() == 2 else 1  # else refused below
        compiled = None
        if compile:
            compiled = self._compiled
            compiled.prepare(self.base_model, spec, tuple(getattr(self.heads, "feature_layers", ())), self.heads,
                             self._packed_weights)
        proposer = self._trees.proposer(self, tree, batch, compiled)
        proposer = with_lookup(proposer, lookup_tokens, documents, spec.vocab_size)
        return decode(self.base_model, spec, proposer, input_ids, attention_mask, max_new_tokens, sampling, eos, pad,
                      streamer, timer, self._packed_weights, generation_config, compiled)


def _check_sizes(config: MedusaConfig, spec: BaseSpec, source: str) -> None:
    layers = config.feature_layers
    if layers and spec.num_layers is not None and max(layers) >= spec.num_layers:
        if config.head_type == "eagle3":
            last = (f"; layer {spec.num_layers}, the last layer's output before the final norm as vLLM reads it, is "
                    f"not supported (transformers gives it after the norm)" if spec.num_layers in layers else "")
            raise ValueError(f"{source}: the auxiliary layers {layers} (eagle_aux_hidden_state_layer_ids) name layers "
                             f"this base model cannot give: it has {spec.num_layers} decoder layers, so use 0 (the "
                             f"embeddings) to {spec.num_layers - 1}{last}")
        raise ValueError(f"{source}: feature_layers {layers} name layers the base model lacks: it has "
                         f"{spec.num_layers} decoder layers, so use 0 (the embeddings) to {spec.num_layers - 1} (the "
                         f"last layer's output is the final state, which the heads read anyway)")
    if layers and spec.layer_width != spec.hidden_size:
        raise ValueError(f"{source}: feature_layers needs decoder states as wide as the LM head's input, but this base "
                         f"model's layers are {spec.layer_width} wide and its LM head reads {spec.hidden_size}; "
                         f"use heads without feature_layers on it")
    for name, expected in (("hidden_size", spec.hidden_size), ("vocab_size", spec.vocab_size)):
        got = getattr(config, name)
        if got is None or got == expected:
            continue
        if name == "vocab_size" and config.share_lm_head and expected > got:
            # Such heads own no vocabulary matrix: they score through the base's LM head, whatever its size, and a
            # resize_token_embeddings that added tokens (or padded to a multiple of 64) keeps the ids they learned.
            # A smaller vocabulary is another model's. A token map's ids are checked where it is read.
            warnings.warn(f"{source}: the heads were trained on a vocabulary of {got} tokens and the base model has "
                          f"{expected} (resize_token_embeddings?); they score through its LM head, so they run, but "
                          f"never learned to draft the {expected - got} tokens added", stacklevel=3)
            continue
        fix = (" (heads that share the base's LM head, share_lm_head=True, follow a resize_token_embeddings that "
               "adds tokens)" if name == "vocab_size" else "")
        raise ValueError(f"{source}: heads have {name}={got} but the base model has {expected}; these heads belong "
                         f"to another model ({config.base_model_name_or_path or 'unknown'}){fix}")


def _check_heads_match(config: MedusaConfig, heads: MedusaHeads, spec: BaseSpec) -> None:
    """Refuse `heads` that are not what `config` describes for this base model (a MedusaModel built by hand from
    parts that do not belong together): generate would read the config's tree and sizes and fail deep inside torch,
    and save_heads would write a config that does not load the weights."""
    if not isinstance(config, MedusaConfig):
        raise TypeError(f"config must be a MedusaConfig, got {type(config).__name__}")
    if not isinstance(heads, MedusaHeads):
        raise TypeError(f"heads must be MedusaHeads, got {type(heads).__name__}; build a MedusaModel with "
                        f"MedusaModel.from_base(base_model, config) or MedusaModel.from_pretrained(base_model, path)")
    _check_sizes(config, spec, source="MedusaConfig")
    if config.head_type == "eagle" and config.draft_layer is None:
        raise ValueError("config has head_type 'eagle' but no draft_layer (the draft layer's shape): build the "
                         "model with MedusaModel.from_base(base_model, config), which takes the base model's")
    if config.head_type == "eagle3" and (config.draft_layer is None or not config.feature_layers):
        raise ValueError("config has head_type 'eagle3' but no draft_layer or feature_layers: build the model with "
                         "MedusaModel.from_base(base_model, config), which takes the base model's")
    with torch.device("meta"):  # the shapes config describes, without allocating them
        described = MedusaHeads.from_config(dataclasses.replace(config, hidden_size=spec.hidden_size,
                                                                vocab_size=spec.vocab_size))
    want = {name: tuple(t.shape) for name, t in described.state_dict().items()} | _settings(described)
    got = {name: tuple(t.shape) for name, t in heads.state_dict().items()} | _settings(heads)
    if want != got:
        differ = sorted(set(want) ^ set(got)) or [name for name in want if want[name] != got[name]]
        raise ValueError(f"heads do not match config (num_heads={config.num_heads}, num_layers={config.num_layers}, "
                         f"head_type={config.head_type!r}, share_lm_head={config.share_lm_head}, draft_vocab_size="
                         f"{config.draft_vocab_size}) on this base model (hidden_size={spec.hidden_size}, vocab_size="
                         f"{spec.vocab_size}): {', '.join(differ[:4])}{' ...' if len(differ) > 4 else ''} differ; "
                         f"build both with MedusaModel.from_base(base_model, config), or load saved heads with "
                         f"MedusaModel.from_pretrained(base_model, path)")


def _settings(heads: MedusaHeads) -> dict[str, object]:
    """What the heads compute by that no weight's shape shows (save_heads writes the config's, not these)."""
    attention = heads.draft_layer.layer.self_attn if getattr(heads.draft_layer, "layer", None) is not None else None
    return {"feature_layers": tuple(heads.feature_layers),
            "context_heads": heads.context.num_heads if heads.context is not None else 0,
            "draft_layer head_dim": attention.head_dim if attention is not None else None}


def _check_heads_follow(base_model: nn.Module, heads: nn.Module) -> None:
    """Refuse heads on another device or in another dtype than the base model (moved alone, as by base_model.half()
    after the heads were attached): their first matmul would fail deep inside torch. Nothing is moved here."""
    device, dtype = model_device_dtype(base_model)
    for p in heads.parameters():
        if p.device != device or p.dtype != dtype:
            raise ValueError(f"the heads are in {p.dtype} on {p.device} but the base model is in {dtype} on {device} "
                             f"(one was moved without the other): move both together with the "
                             f"MedusaModel, e.g. medusa_model.to({dtype}) or medusa_model.to('{device}')")
