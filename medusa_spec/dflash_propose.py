"""DFlash drafts (dflash.py) as a proposer of the decode loop, and `generate_with_dflash`.

Each step the draft drafts one block: the root as anchor at its own position, after the context of every committed
position's auxiliary states. Its slots are drafted in one pass, none seeing another's token, so each is a marginal
guess for one depth, as a plain Medusa head's is: depth d takes slot d (slot d - 1 with sample_from_anchor), and a
tree is laid out from the slots' top-k lists as Medusa heads' trees are (default: the chain of each slot's argmax,
as deep as the block drafts), or as a DynamicTree chosen each step from the slots' probabilities. The candidates
are guesses the base model's own draws are checked against (the tree rule, accept.accept), so greedy output is the
base model's and sampled output is distributed as the base model's.

State from step to step: the context alone, every draft layer's keys and values of it (dflash.DFlashContext),
extended after each verify pass by the accepted positions' states; the block's own keys and values are the step's.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationConfig

from .base import inspect_base_model, model_device_dtype
from .columnwise import columnwise_copy
from .dflash import DFlashContext, DFlashDraft, _check_base
from .inputs import resolve_sampling, special_tokens
from .loop import StepTimer, Streamer, decode
from .output import GenerateOutput
from .propose import Candidates, DynamicSizing, Prompt, Proposer, RootOnly, StepResult, ranked_tree
from .tree import DynamicTree, MedusaTree, build_tree, chain_tree


class DFlashProposer(Proposer):
    """A DFlash draft on a MedusaTree whose head h is the draft's (h + 1)-th drafted block slot."""

    def __init__(self, draft: DFlashDraft, tree: MedusaTree):
        # A column-wise copy in eval mode (see columnwise), as the loop runs the base model. No `modules`: those cap
        # the positions (loop.last_position), and the draft's rotary angles are computed for any position.
        self.draft = columnwise_copy(draft, eval_mode=True)
        self.layout = tree
        self.max_depth = tree.max_depth
        self.feature_layers = tuple(draft.config.aux_layer_ids)
        first = draft.config.drafted_slots.start
        self.slots = slice(first, first + tree.max_depth)  # the block slots the tree's depths 1 .. D read

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The loop's states [..., (1 + n) H] (the final one, then the feature layers') -> the draft's [..., n H]."""
        return hidden[..., hidden.shape[-1] // (1 + len(self.feature_layers)):]

    def start(self, prompt: Prompt) -> None:
        self.layout = self.layout.to(prompt.root.device)
        valid = prompt.attention_mask.bool()
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)  # padding counts no position, as in prefill
        self.context = self.draft.context(self.features(prompt.hidden), positions, valid)
        self.next_pos = valid.sum(-1)  # the root's position

    def propose(self, root: torch.Tensor) -> Candidates:
        tree = self.layout
        logits = self.draft.project(self.draft(self.context, root, self.next_pos)[:, self.slots])  # [B, D, V']
        top = self.draft.token_ids(logits.topk(tree.top_k, dim=-1).indices)                        # [B, D, top_k]
        node_tokens = top[:, tree.head, tree.rank]  # [B, N]; node 0's entry is overwritten
        node_tokens[:, 0] = root
        return Candidates(node_tokens, tree)

    def update(self, step: StepResult) -> None:
        # The kept nodes (root and accepted ones) are the positions next_pos, next_pos + 1, ...: their states join the
        # context; a row that kept fewer than the longest gets invalid slots, a finished row only invalid ones.
        hidden, kept = step.hidden, step.kept
        offsets = torch.arange(kept.shape[1], device=kept.device)
        n_kept = (step.accept_length + 1) * step.going
        states = hidden.gather(1, kept[:, :, None].expand(-1, -1, hidden.shape[-1]))
        self.context = self.draft.context(self.features(states), self.next_pos[:, None] + offsets,
                                          offsets < n_kept[:, None], self.context)
        self.next_pos = self.next_pos + n_kept

    def keep_rows(self, rows: torch.Tensor) -> None:
        context = self.context
        self.context = DFlashContext(tuple(k[rows] for k in context.keys), tuple(v[rows] for v in context.values),
                                     context.valid[rows], context.positions[rows])
        self.next_pos = self.next_pos[rows]


class DynamicDFlashProposer(DynamicSizing, DFlashProposer):
    """A DFlash draft on a DynamicTree: each step's tree is its best candidates by path probability, as EAGLE-2 ranks
    eagle heads' (the size from step costs and a calibration: DynamicSizing). The block's slots are drafted without
    seeing one another, so a path's probability is the product of its tokens' probabilities at their slots, and the
    children of every node at depth d are slot d's top_k tokens: a beam search over the slots' top-k lists, with no
    draft pass between levels, gives the candidates; every drafted slot is a level."""

    def __init__(self, draft: DFlashDraft, tree: DynamicTree):
        super().__init__(draft, dflash_tree(draft, None))  # every drafted slot
        self.dynamic = tree

    def start(self, prompt: Prompt) -> None:
        super().start(prompt)
        self.root_alone = chain_tree(0).to(prompt.root.device)  # a step's tree where no candidate pays

    def propose(self, root: torch.Tensor) -> Candidates:
        top_k, beam, depth = self.dynamic.top_k, self.dynamic.beam, self.max_depth
        logits = self.draft.project(self.draft(self.context, root, self.next_pos)[:, self.slots])  # [B, D, V']
        logp = logits.float().log_softmax(-1)
        # A NaN (overflowing logits) as -inf: it ranks last, where torch's sorts put it first.
        top = logp.masked_fill(logp.isnan(), float("-inf")).topk(min(top_k, logp.shape[-1]), dim=-1)
        slot_tokens = self.draft.token_ids(top.indices)  # [B, D, k]
        rows, k = root.shape[0], top.indices.shape[-1]
        beam_logp = torch.zeros(rows, 1, device=root.device)  # [B, n]: the beam's path log-probabilities
        beam_value = beam_paths = None
        tokens, values, paths, levels, count = [], [], [], [], 0
        for d in range(1, depth + 1):
            path_logp = (beam_logp[:, :, None] + top.values[:, d - 1, None, :]).flatten(1)  # [B, n * k]
            index = torch.arange(count, count + path_logp.shape[1], device=root.device)
            value = path_logp.exp()
            if beam_value is None:
                path = index[None, :, None].expand(rows, -1, depth).clone()
            else:  # never above its parent (rounding), so the best candidates always hold their parents
                value = torch.minimum(value, beam_value.repeat_interleave(k, dim=1))
                path = beam_paths.repeat_interleave(k, dim=1)
                path[:, :, d - 1:] = index[:, None]
            tokens.append(slot_tokens[:, d - 1, None, :].expand(-1, beam_logp.shape[1], -1).flatten(1))
            values.append(value)
            paths.append(path)
            count += path_logp.shape[1]
            levels.append(count)
            kept = value.topk(min(beam, value.shape[1]), dim=1).indices  # [B, beam]: each row's own
            beam_logp, beam_value = path_logp.gather(1, kept), value.gather(1, kept)
            beam_paths = path.gather(1, kept[:, :, None].expand(-1, -1, depth))
        order = self.chosen_size(torch.cat(values, dim=1))
        n = self.sizes[-1]
        if n == 1:
            self.tree, self.node_tokens = self.root_alone, root[:, None]
        else:
            self.tree, self.node_tokens = ranked_tree(root, order.indices, n, tokens, paths, levels)
        return Candidates(self.node_tokens, self.tree)


def dflash_tree(draft: DFlashDraft, tree: list[list[int]] | None) -> MedusaTree:
    """`tree`'s rank paths as a MedusaTree for `draft` (None: the chain of every drafted slot's argmax), refused where
    it is deeper than the slots the block drafts or ranks past the draft vocabulary."""
    config = draft.config
    slots = config.block_size - config.drafted_slots.start
    if tree is None:
        return build_tree([[0] * depth for depth in range(1, slots + 1)])
    if isinstance(tree, (list, tuple)):
        deepest = max((len(path) for path in tree if isinstance(path, (list, tuple))), default=0)
        if deepest > slots:
            raise ValueError(f"tree: a path {deepest} deep, but this DFlash draft drafts {slots} tokens a block "
                             f"(block_size {config.block_size}"
                             f"{'' if config.sample_from_anchor else ', less the anchor slot'}); use paths of length "
                             f"<= {slots}")
    return build_tree(tree, top_k=config.draft_vocab_size)


def check_dflash_draft(base_model: nn.Module, draft: DFlashDraft) -> None:
    """Refuse a draft that is not a DFlashDraft loaded for `base_model`, or not on its device."""
    if not isinstance(draft, DFlashDraft):
        raise TypeError(f"draft must be a DFlashDraft, got {type(draft).__name__}; load a speculators DFlash folder "
                        f"with medusa_spec.dflash.load_dflash(path, base_model)")
    _check_base(draft.config, base_model, "the DFlash draft")
    if draft.verifier_weights is None or draft.verifier_weights[0] is not base_model.get_input_embeddings().weight:
        raise ValueError("the DFlash draft was loaded for another model: it embeds its block with its verifier's input "
                         "embeddings, which are not this base model's; load it with load_dflash(path, base_model)")
    device, draft_device = model_device_dtype(base_model)[0], draft.fc.weight.device
    if draft_device != device:
        raise ValueError(f"the DFlash draft is on {draft_device} but the base model on {device}; move it with "
                         f"draft.to({str(device)!r})")


def generate_with_dflash(base_model: nn.Module, draft: DFlashDraft, input_ids: torch.Tensor,
                         attention_mask: torch.Tensor | None = None, max_new_tokens: int | None = None,
                         do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
                         top_p: float | None = None, eos_token_id: int | list[int] | None = None,
                         pad_token_id: int | None = None, tree: list[list[int]] | DynamicTree | None = None,
                         streamer: Streamer | None = None, timer: StepTimer | None = None,
                         generation_config: GenerationConfig | None = None) -> GenerateOutput:
    """Lossless speculative generation with a speculators DFlash draft (`load_dflash(path, base_model)`);
    `sequences` [B, prompt + new] as transformers' generate.

    `tree`: rank paths over the block's slots (path [r1, r2]: slot 1's rank-r1 token, then slot 2's rank-r2 one), at
    most as deep as the draft drafts (block_size - 1; block_size with sample_from_anchor); None (default) the chain
    of every slot's argmax, as vLLM verifies a DFlash block; `[]` turns speculation off; a DynamicTree: each step's
    tree of its best candidates by path probability (DynamicDFlashProposer; `stats.tree_sizes` the sizes run).
    Other arguments as in MedusaModel.generate.
    """
    spec = inspect_base_model(base_model)
    check_dflash_draft(base_model, draft)
    if isinstance(tree, DynamicTree):
        proposer = DynamicDFlashProposer(draft, tree)
    else:
        layout = dflash_tree(draft, tree)
        proposer = RootOnly() if layout.num_nodes == 1 else DFlashProposer(draft, layout)
    sampling = resolve_sampling(base_model, do_sample, temperature, top_k, top_p, generation_config)
    eos, pad = special_tokens(base_model, eos_token_id, pad_token_id, generation_config)
    return decode(base_model, spec, proposer, input_ids, attention_mask, max_new_tokens, sampling, eos, pad, streamer,
                  timer, generation_config=generation_config)
