"""DFlash drafts (dflash.py) as a proposer of the decode loop, and `generate_with_dflash`.

Each step the draft drafts one block: the root as anchor at its own position, after the context of every committed
position's auxiliary states. Its slots are drafted in one pass, none seeing another's token, so each is a marginal
guess for one depth, as a plain Medusa head's is: depth d takes slot d (slot d - 1 with sample_from_anchor), and a
tree is laid out from the slots' top-k lists as Medusa heads' trees are (default: the chain of each slot's argmax,
as deep as the block drafts). The candidates are guesses the base model's own draws are checked against (the tree
rule, accept.accept), so greedy output is the base model's and sampled output is distributed as the base model's.

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
from .propose import Candidates, Prompt, Proposer, RootOnly, StepResult
from .tree import DynamicTree, MedusaTree, build_tree


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


def dflash_tree(draft: DFlashDraft, tree: list[list[int]] | None) -> MedusaTree:
    """`tree`'s rank paths as a MedusaTree for `draft` (None: the chain of every drafted slot's argmax), refused where
    it is deeper than the slots the block drafts or ranks past the draft vocabulary."""
    config = draft.config
    slots = config.block_size - config.drafted_slots.start
    if tree is None:
        return build_tree([[0] * depth for depth in range(1, slots + 1)])
    if isinstance(tree, DynamicTree):
        raise ValueError("a DynamicTree needs eagle heads, which draft each level from the one above; a DFlash block "
                         "drafts every depth at once: give rank paths, e.g. [[0], [1], [0, 0]], or None for the chain")
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
                         pad_token_id: int | None = None, tree: list[list[int]] | None = None,
                         streamer: Streamer | None = None, timer: StepTimer | None = None,
                         generation_config: GenerationConfig | None = None) -> GenerateOutput:
    """Lossless speculative generation with a speculators DFlash draft (`load_dflash(path, base_model)`);
    `sequences` [B, prompt + new] as transformers' generate.

    `tree`: rank paths over the block's slots (path [r1, r2]: slot 1's rank-r1 token, then slot 2's rank-r2 one), at
    most as deep as the draft drafts (block_size - 1; block_size with sample_from_anchor); None (default) the chain
    of every slot's argmax, as vLLM verifies a DFlash block; `[]` turns speculation off. Other arguments as in
    MedusaModel.generate.
    """
    spec = inspect_base_model(base_model)
    check_dflash_draft(base_model, draft)
    layout = dflash_tree(draft, tree)
    sampling = resolve_sampling(base_model, do_sample, temperature, top_k, top_p, generation_config)
    eos, pad = special_tokens(base_model, eos_token_id, pad_token_id, generation_config)
    proposer = RootOnly() if layout.num_nodes == 1 else DFlashProposer(draft, layout)
    return decode(base_model, spec, proposer, input_ids, attention_mask, max_new_tokens, sampling, eos, pad, streamer,
                  timer, generation_config=generation_config)
