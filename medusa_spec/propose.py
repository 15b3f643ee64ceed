"""Proposers: what drafts the candidates one verify pass checks, behind one contract.

A proposer is told the prompt once (`start`), then each step gives the candidates after the root
(`propose`) and learns what the base model accepted (`update`), as transformers' assisted decoding
has `get_candidates` / `update_candidate_strategy`. Medusa heads (plain or dependent, with their
context layer's cache) and eagle heads (their draft layer's own cache) are here; the lookup chain
and the heads + chain merge are in lookup.py, the draft model in draft.py.

Plain Medusa heads do not see their parent, so one call gives every head's top-k list and
siblings at one depth share it. Dependent heads read the tokens on the path to their parent,
so the tree is drafted level by level: one batched head call over all nodes of depth d - 1
gives the candidates of depth d. Eagle heads draft level by level too, each level one pass of
their draft layer over the nodes of the level above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .columnwise import PackedWeights, columnwise_copy
from .compiled import DraftGraphs, adopt, block_size
from .context import ContextCache
from .eagle import DRAFT_LAYER_SPEC
from .kv_cache import fork_prefix, new_cache
from .output import GenerationStats
from .slots import Slots
from .tree import DynamicTree, MedusaTree, Tree, chain_tree
from .verify import attention_masks, layer_masks


@dataclass(frozen=True)
class Candidates:
    """One step's candidates: node_tokens [B, N] (node 0 = the root, already emitted) on `tree`.

    draft_probs [B, N - 1, V]: on a chain, the distribution each token was drawn from (a draft model
    sampling); acceptance then applies the classic min(1, p/q) rule, else the tree rule (every node is
    a guess, checked against the base model's own draw). accept_tokens [B, N]: the tokens acceptance
    compares where they differ from node_tokens (a negative id keeps a node out of reach).
    """

    node_tokens: torch.Tensor
    tree: Tree
    draft_probs: torch.Tensor | None = None
    accept_tokens: torch.Tensor | None = None


@dataclass(frozen=True)
class Prompt:
    """What prefill leaves for a proposer's start: input_ids / attention_mask [B, S] (left-padded, bool),
    the base model's final hidden states [B, S, H] (then those of the proposer's feature_layers), the first
    root [B], the highest position to use, and the tokens a row may still emit after the root (None: no limit)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    hidden: torch.Tensor
    root: torch.Tensor
    max_position: int | None
    tokens_left: int | None = None


@dataclass(frozen=True)
class HostStep:
    """A step's per-row figures on the host, from its one sync: accept_length, active (the row was generating
    in the step), emitted (the tokens the row took: accepted ones and the bonus, cut at eos or the budget) and
    going (the row generates on after it)."""

    accept_length: list[int]
    active: list[bool]
    emitted: list[list[int]]
    going: list[bool]


def tokens_left(prompt: Prompt) -> list[float]:
    """Each row's tokens left to emit after the prompt's root (inf: no limit). A step emits its accepted candidates
    and one token more, so a draft deeper than the most any row has left - 1 is verified and never kept."""
    return [math.inf if prompt.tokens_left is None else prompt.tokens_left] * prompt.root.shape[0]


def tokens_left_after(left: list[float], host: HostStep) -> list[float]:
    """`left` after a step: less what each row emitted; 0 for rows that no longer generate (done by eos too)."""
    return [n - len(emitted) if going else 0 for n, emitted, going in zip(left, host.emitted, host.going)]


@dataclass(frozen=True)
class StepResult:
    """What one verify pass decided, for a proposer's update.

    hidden [B, N, H]: the base model's final hidden states at every node (then those of the proposer's
    feature_layers); last_node, accept_length [B]
    (bonus not counted); kept [B, m]: each row's root and accepted nodes (then repeats), m = the longest
    row's accept_length + 1; new_tokens [B, m]: the accepted tokens then the bonus; active [B]: rows that
    were generating in the step; going [B]: rows still generating after it.
    """

    candidates: Candidates
    hidden: torch.Tensor
    last_node: torch.Tensor
    accept_length: torch.Tensor
    kept: torch.Tensor
    new_tokens: torch.Tensor
    active: torch.Tensor
    going: torch.Tensor
    host: HostStep


class Proposer:
    """The contract (a base class with the trivial parts): `modules` the proposer runs, column-wise copies of
    the caller's in eval mode (columnwise_copy(..., eval_mode=True); a model's position limit also caps the
    positions), `max_depth` the deepest candidate it may propose, `feature_layers` the base model's layers
    whose hidden states it reads beside the final one (verify.base_features)."""

    modules: tuple[nn.Module, ...] = ()
    max_depth: int = 0
    feature_layers: tuple[int, ...] = ()

    def start(self, prompt: Prompt) -> None:
        """Once, after prefill."""

    def propose(self, root: torch.Tensor) -> Candidates:
        """root [B]: the token the base model just chose -> the candidates hanging off it."""
        raise NotImplementedError

    def update(self, step: StepResult) -> None:
        """After each verify pass."""

    def keep_rows(self, rows: torch.Tensor) -> None:
        """After a step in which rows of the batch finished: decoding goes on with the rows `rows` [B'] (indices into
        the batch of that step) alone, so the proposer keeps their state only."""
        raise NotImplementedError(f"{type(self).__name__} cannot drop a batch's finished rows")

    def finish(self, stats: GenerationStats) -> None:
        """Add the proposer's own figures to the GenerationStats."""


class RootOnly(Proposer):
    """No speculation (`tree=[]`): the root alone, one token per step through the same loop."""

    def start(self, prompt: Prompt) -> None:
        self.tree = chain_tree(0).to(prompt.root.device)

    def propose(self, root: torch.Tensor) -> Candidates:
        return Candidates(root[:, None], self.tree)

    def keep_rows(self, rows: torch.Tensor) -> None:
        pass  # no state by row


class HeadsProposer(Proposer):
    """Medusa heads (plain or dependent) on a MedusaTree. They read only the last accepted node's state:
    the base model's final hidden state there (fused with other layers' with feature_layers), or the context
    layer's output (its keys and values kept across steps, growing by each step's accepted slots)."""

    def __init__(self, base_model: nn.Module, heads: nn.Module, tree: MedusaTree):
        self.base_model, self.heads, self.layout = base_model, heads, tree
        self.modules = (heads,)
        self.max_depth = tree.max_depth
        # heads may be any module with the MedusaHeads interface; one without feature layers reads the final state.
        self.context = getattr(heads, "context", None)
        self.feature_layers = getattr(heads, "feature_layers", ())
        self.features = getattr(heads, "features", lambda hidden: hidden)

    def start(self, prompt: Prompt) -> None:
        self.layout = self.layout.to(prompt.root.device)
        if self.context is None:
            self.state = self.features(prompt.hidden[:, -1])
            return
        # The context layer takes every prompt position with its token and the token after it, the last one
        # with the root.
        embed = self.base_model.get_input_embeddings()
        input_ids = prompt.input_ids
        self.context_cache, self.state = self.context.extend(
            None, self.features(prompt.hidden), embed(input_ids),
            embed(torch.cat([input_ids[:, 1:], prompt.root[:, None]], dim=1)), prompt.attention_mask,
            torch.full_like(prompt.root, input_ids.shape[1] - 1))

    def propose(self, root: torch.Tensor) -> Candidates:
        return self.propose_on(root, self.layout)

    def propose_on(self, root: torch.Tensor, tree: MedusaTree) -> Candidates:
        """The candidates on `tree` (on the root's device) instead of the proposer's own layout, for a wrapper that
        chooses the tree each step (autotree.AdaptiveTree)."""
        return Candidates(draft_with_heads(self.heads, self.base_model, root, self.state, tree), tree)

    def update(self, step: StepResult) -> None:
        hidden = step.hidden
        if self.context is None:
            self.state = self.features(
                hidden.gather(1, step.last_node[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0])
            return
        # The kept slots: root and accepted nodes, each with the token after it (the last: the bonus).
        embed = self.base_model.get_input_embeddings()
        kept = step.kept
        offsets = torch.arange(kept.shape[1], device=kept.device)
        self.context_cache, self.state = self.context.extend(
            self.context_cache, self.features(hidden.gather(1, kept[:, :, None].expand(-1, -1, hidden.shape[-1]))),
            embed(step.candidates.node_tokens.gather(1, kept)), embed(step.new_tokens),
            offsets < (step.accept_length + 1)[:, None], step.accept_length)

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.state = self.state[rows]
        if self.context is not None:
            cache = self.context_cache
            self.context_cache = ContextCache(cache.keys[rows], cache.values[rows], cache.valid[rows])


class DraftLayerProposer(Proposer):
    """Eagle heads on a MedusaTree (see eagle.py). The draft layer's cache holds a slot per committed position j:
    the base's state there with the token after it, at position j; the last one, the previous step's last accepted
    state with the root, gives depth 1's candidates. Depth d's nodes then take slots at the root slot's position
    + d, each with its parent's output and its own token, seeing the committed slots and its ancestors' slots.
    After the verify pass the drafted slots are dropped and the step's accepted states take their place.
    With `graphs` (generate(compile=True)), the draft layer's passes after the prompt's run through its compiled
    graphs, on a static cache."""

    def __init__(self, base_model: nn.Module, heads: nn.Module, tree: MedusaTree, graphs: DraftGraphs | None = None):
        self.base_model, self.heads, self.layout, self.graphs = base_model, heads, tree, graphs
        self.modules = (heads,)
        self.max_depth = tree.max_depth
        self.feature_layers = heads.feature_layers
        self.embed = base_model.get_input_embeddings()
        self.draft_pass = heads.draft_layer if graphs is None else graphs.forward

    def start(self, prompt: Prompt) -> None:
        self.layout = self.layout.to(prompt.root.device)
        valid, input_ids = prompt.attention_mask, prompt.input_ids
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)  # padding counts no position, as in prefill
        causal = torch.ones(input_ids.shape[1], input_ids.shape[1], dtype=torch.bool, device=valid.device).tril()
        next_ids = torch.cat([input_ids[:, 1:], prompt.root[:, None]], dim=1)
        cache = new_cache()
        mask = attention_masks(DRAFT_LAYER_SPEC, valid, positions, positions, causal, prompt.hidden.dtype)
        outputs = self.heads.draft_layer(self.heads.features(prompt.hidden), self.embed(next_ids), mask, positions,
                                         cache)  # eager: a prompt's length changes with every call
        if self.graphs is not None:
            cache = adopt(cache, input_ids.shape[1])
        # The root's slot is the prompt's last position: the draft layer's next slot is the root's own position.
        self.slots = Slots(cache, valid, positions, positions[:, -1] + 1, prompt.max_position, input_ids.shape[1])
        self.root_output = outputs[:, -1]

    def propose(self, root: torch.Tensor) -> Candidates:
        return self.propose_on(root, self.layout)

    def propose_on(self, root: torch.Tensor, tree: MedusaTree) -> Candidates:
        """The candidates on `tree` (on the root's device) instead of the proposer's own layout (see HeadsProposer)."""
        heads, slots = self.heads, self.slots
        lm_head = self.base_model.get_output_embeddings()
        node_tokens = root[:, None].expand(-1, tree.num_nodes).clone()
        bounds = tree.level_bounds
        outputs = self.root_output[:, None]  # [B, n, H]: the draft layer's outputs at the slots of depth d - 1
        for d in range(1, len(bounds)):
            start, end = bounds[d - 1]
            logits = heads.draft_logits(d - 1, outputs, lm_head)                 # [B, n, V']
            top = heads.token_ids(logits.topk(tree.top_k, dim=-1).indices)      # [B, n, top_k]
            level = slice(*bounds[d])
            node_tokens[:, level] = top[:, tree.parent[level] - start, tree.rank[level]]
            if d == len(bounds) - 1:
                break  # the deepest nodes' slots would only guess below the tree
            # Depth d's slots, appended after the committed ones and those of depths 1 .. d - 1 (nodes 1 .. level.start
            # - 1, in node order): each sees the committed slots and its ancestors' (the tree mask's columns 1 ..).
            q_pos, kv_valid, kv_pos = slots.verify_inputs(tree.depth[level] - 1)
            allowed = kv_valid[:, None, :].expand(-1, q_pos.shape[1], -1).clone()
            allowed[:, :, slots.past:] = tree.tree_mask[level, 1: level.stop]
            mask = layer_masks(DRAFT_LAYER_SPEC, allowed, q_pos, kv_pos, outputs.dtype)
            outputs = self.draft_pass(outputs[:, tree.parent[level] - start], self.embed(node_tokens[:, level]), mask,
                                      q_pos, slots.cache)
        return Candidates(node_tokens, tree)

    def update(self, step: StepResult) -> None:
        # A new Slots over the committed slots, the drafted ones dropped, not the old Slots changed: --tree auto times
        # steps from a shallow copy of one started proposer (autotree), which must find its committed slots as they
        # were (its drafted ones it drops too; see fork_prefix).
        past = self.slots
        slots = Slots(fork_prefix(past.cache, past.past), past.valid[:, :past.past], past.pos[:, :past.past],
                      past.next_pos, past.max_position, past.past)
        # The step's accepted states: root and accepted nodes, each with the token after it (the last: the bonus),
        # at the root's position onwards.
        hidden, kept, new_tokens = step.hidden, step.kept, step.new_tokens
        width = kept.shape[1]
        if self.graphs is not None:
            # Padded to a few widths (each a graph to compile): the tree's depth + 1, else a lookup chain's longer
            # path's block size. The padding slots are invalid and left out of the commit below.
            width = max(width, self.max_depth + 1) if width <= self.max_depth + 1 else block_size(width)
            kept, new_tokens = (torch.cat([ids, ids[:, -1:].expand(-1, width - ids.shape[1])], dim=1)
                                for ids in (kept, new_tokens))
        offsets = torch.arange(width, device=kept.device)
        n_kept = (step.accept_length + 1) * step.going
        q_pos, kv_valid, kv_pos = slots.verify_inputs(offsets, offsets < n_kept[:, None])
        causal = torch.ones(width, width, dtype=torch.bool, device=kept.device).tril()
        mask = attention_masks(DRAFT_LAYER_SPEC, kv_valid, kv_pos, q_pos, causal, hidden.dtype)
        states = self.heads.features(hidden.gather(1, kept[:, :, None].expand(-1, -1, hidden.shape[-1])))
        outputs = self.draft_pass(states, self.embed(new_tokens), mask, q_pos, slots.cache)
        slots.commit(step.kept.shape[1], n_kept, n_kept)  # the block's first slots: the accepted path, in place
        self.slots = slots
        self.root_output = outputs.gather(1, step.accept_length[:, None, None].expand(-1, 1, outputs.shape[-1]))[:, 0]

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.slots, self.root_output = self.slots.select(rows), self.root_output[rows]


# A DynamicTree with step costs weighs each candidate by its path probability times (tokens its tree's nodes matched +
# CALIBRATION_PRIOR) / (probabilities foretold + CALIBRATION_PRIOR), over the call so far: the prior, a few tokens at
# a scale of 1, keeps the first steps from swinging the size.
CALIBRATION_PRIOR = 8.0


class DynamicSizing:
    """A DynamicTree's size each step, for the proposers that draft one (eagle heads', DFlash's): `nodes`, or with step
    costs the size with the most expected tokens per ms, the candidates' probabilities scaled by how well they have
    foretold the tokens the trees' nodes matched so far in the call. Mixed in before the proposer's class (its start,
    update and keep_rows run first, then these'); the proposer sets `dynamic` (its DynamicTree), calls chosen_size on
    its ranked candidates and keeps the step's `tree` and `node_tokens`."""

    dynamic: DynamicTree

    def start(self, prompt: Prompt) -> None:
        super().start(prompt)
        root = prompt.root
        rows = root.shape[0]
        # float: it weighs the rows' probabilities (a row done at prefill, its first token eos, weighs one step)
        self.going = torch.ones(rows, device=root.device)
        self.rows_going = rows
        self.matched = torch.zeros((), device=root.device)  # a device tensor: read at the next step's sync
        self.foretold = 0.0
        self.sizes: list[int] = []

    def chosen_size(self, values: torch.Tensor) -> torch.return_types.sort:
        """Each row's candidates (their probabilities `values` [B, count]) best first, and the step's size (kept in
        self.sizes[-1]): one for the batch (one verify pass), chosen on the rows' ranked probabilities summed rank by
        rank. A child that ties its parent comes after it (a stable sort, and parents come first in `values`)."""
        order = torch.sort(values, dim=1, descending=True, stable=True)  # [B, count]
        ranked = (order.values * self.going[:, None]).sum(0)
        *ordered, matched = torch.cat([ranked, self.matched[None]]).tolist()  # the step's host sync
        n = self.size(ordered, matched)
        self.sizes.append(n)
        self.foretold_now = sum(ordered[: n - 1])
        return order

    def size(self, ordered: list[float], matched: float) -> int:
        """The step's tree size, root included, for the candidates' probabilities `ordered` (best first, summed over
        the rows still generating): `nodes`, or with step costs the size with the most expected tokens per ms."""
        most = min(self.dynamic.nodes, len(ordered) + 1)
        step_ms = self.dynamic.step_ms
        if step_ms is None:
            return most
        scale = (matched + CALIBRATION_PRIOR) / (self.foretold + CALIBRATION_PRIOR)
        expected = self.rows_going  # each row's own token
        best, best_rate = 1, expected / step_ms[0]
        for n in range(2, most + 1):
            expected += scale * ordered[n - 2]
            if expected / step_ms[n - 1] > best_rate:
                best, best_rate = n, expected / step_ms[n - 1]
        return best

    def update(self, step: StepResult) -> None:
        """Evidence for the scale: how deep each row's emitted tokens (the accepted ones and the bonus: the base
        model's own) run along this step's tree (its `node_tokens`), whichever candidates the pass verified (a
        lookup chain's, say)."""
        super().update(step)
        tree, node_tokens = self.tree, self.node_tokens
        if tree.num_nodes > 1:
            paths = tree.node_paths[:, :, 1:]  # [B, N, depth]: each row's tree
            # What each row emitted (its accepted tokens and the bonus, cut at eos or the budget: the host's lists),
            # padded with -1 to the tree's depth.
            width = paths.shape[2]
            emitted = torch.tensor([(tokens + [-1] * width)[:width] for tokens in step.host.emitted],
                                   device=paths.device)
            below = torch.arange(width, device=paths.device) < tree.depth[:, :, None]  # [B, N, depth]
            path_tokens = node_tokens.gather(1, paths.flatten(1)).view_as(paths)
            agree = (path_tokens == emitted[:, None, :]) | ~below  # [B, N, depth]
            reached = (agree.all(-1) * tree.depth).amax(-1)  # [B]: the deepest node on the emitted path
            self.matched = self.matched + (reached * step.active).sum()
            self.foretold += self.foretold_now
        self.going = step.going.to(self.going.dtype)
        self.rows_going = sum(step.host.going)

    def keep_rows(self, rows: torch.Tensor) -> None:
        super().keep_rows(rows)
        self.going = self.going[rows]

    def finish(self, stats: GenerationStats) -> None:
        super().finish(stats)
        stats.tree_sizes = self.sizes


def ranked_tree(root: torch.Tensor, order: torch.Tensor, n: int, tokens: list[torch.Tensor],
                paths: list[torch.Tensor], levels: list[int]) -> tuple[Tree, torch.Tensor]:
    """Each row's tree of its n - 1 best candidates under the root (a per-row Tree, nodes by depth, parents first) and
    its node tokens [B, n]. Candidates are numbered in the order drafted, level by level: `tokens` [B, m] and `paths`
    [B, m, depth] (each candidate's ancestors at depths 1 .. d, then itself repeated) per level, `levels` the number
    drafted up to each level's end; `order` [B, count] their indices, best first (a child never before its parent)."""
    rows, device, depth = root.shape[0], root.device, paths[0].shape[2]
    count = order.shape[1]
    chosen = order[:, : n - 1].sort(dim=1).values  # [B, n - 1] by index: by depth, parents first
    node_of = torch.zeros(rows, count, dtype=torch.long, device=device)
    node_of.scatter_(1, chosen, torch.arange(1, n, device=device).expand(rows, -1))
    chosen_depth = torch.bucketize(chosen, torch.tensor(levels, device=device), right=True) + 1
    ancestors = torch.cat(paths, dim=1).gather(1, chosen[:, :, None].expand(-1, -1, depth))  # candidate indices
    ancestors = node_of.gather(1, ancestors.flatten(1)).view_as(ancestors)
    node_paths = torch.cat([torch.zeros(rows, n, 1, dtype=torch.long, device=device),
                            torch.cat([torch.zeros(rows, 1, depth, dtype=torch.long, device=device), ancestors],
                                      dim=1)], dim=2)  # [B, n, depth + 1]
    tree_depth = torch.cat([torch.zeros(rows, 1, dtype=torch.long, device=device), chosen_depth], dim=1)
    tree_mask = (node_paths[:, :, :, None] == torch.arange(n, device=device)).any(2)
    parent = node_paths.gather(2, (tree_depth - 1).clamp(min=0)[:, :, None])[:, :, 0]
    node_tokens = torch.cat([root[:, None], torch.cat(tokens, dim=1).gather(1, chosen)], dim=1)
    return Tree(tree_depth, parent, tree_mask, node_paths), node_tokens


class DynamicDraftLayerProposer(DynamicSizing, DraftLayerProposer):
    """Eagle heads on a DynamicTree (EAGLE-2; see tree.DynamicTree): each step drafts its candidates level by level,
    a draft-layer pass over each level's beam, and hands over the best ones as that step's tree (a Tree built with
    tensor ops, its nodes ordered by depth). In a batch each row drafts its own beam and gets its own tree (a per-row
    Tree), what it would get alone; the tree's size is one for the batch (one verify pass), and the rows draft their
    beams in the same passes.

    With step costs the size is chosen each step (size): the draft's probabilities say how many tokens the extra
    nodes would add, and a scale learned over the call (the tokens the tree's nodes matched / the probabilities it
    foretold) corrects them for how confident the draft is on this text. The choice needs the step's probabilities on
    the host: one more sync a step on a GPU."""

    def __init__(self, base_model: nn.Module, heads: nn.Module, tree: DynamicTree, graphs: DraftGraphs | None = None):
        # the layout: the root alone, for a step that drafts nothing
        super().__init__(base_model, heads, chain_tree(0), graphs)
        self.dynamic = tree
        self.max_depth = heads.num_heads

    def propose(self, root: torch.Tensor) -> Candidates:
        heads, slots, top_k, device = self.heads, self.slots, self.dynamic.top_k, root.device
        lm_head = self.base_model.get_output_embeddings()
        depth = heads.num_heads
        outputs = self.root_output[:, None]  # [B, n, H]: the draft layer's outputs at the slots of the beam
        beam_logp = torch.zeros(root.shape[0], 1, device=device)  # [B, n]: each row's path log-probability there
        beam_value = beam_paths = None
        tokens, values, paths, levels, drafted = [], [], [], [], []
        count = 0  # candidates so far: a candidate's index is its place in the order they were drafted
        for d in range(1, depth + 1):
            logp = heads.draft_logits(d - 1, outputs, lm_head).float().log_softmax(-1)
            # A NaN (overflowing draft logits) as -inf: it ranks last, where torch's sorts put it first, and the
            # minimum with the parent's value below would keep it, so a child could be chosen without its parent.
            top = logp.masked_fill(logp.isnan(), float("-inf")).topk(top_k, dim=-1)
            logp = (beam_logp[:, :, None] + top.values).flatten(1)  # [B, n * top_k]
            index = torch.arange(count, count + logp.shape[1], device=device)
            value = logp.exp()  # [B, n * top_k]
            # paths [B, n * top_k, depth]: each candidate's ancestors at depths 1 .. d, then itself repeated.
            if beam_value is None:
                path = index[None, :, None].expand(root.shape[0], -1, depth).clone()
            else:  # never above its parent (rounding), so the best candidates always hold their parents
                value = torch.minimum(value, beam_value.repeat_interleave(top_k, dim=1))
                path = beam_paths.repeat_interleave(top_k, dim=1)
                path[:, :, d - 1:] = index[:, None]
            tokens.append(heads.token_ids(top.indices).flatten(1))
            values.append(value)
            paths.append(path)
            levels.append(count + logp.shape[1])
            count += logp.shape[1]
            if d == depth or self.complete(values, value):
                break  # the deepest candidates' slots would only guess below the tree
            kept = value.topk(min(self.dynamic.beam, value.shape[1]), dim=1).indices  # [B, beam]: each row's own
            drafted.append(index[kept])
            # The beam's slots, appended after the committed ones and those drafted before: each sees the committed
            # slots, its ancestors' and its own.
            q_pos, kv_valid, kv_pos = slots.verify_inputs(torch.full_like(kept[0], d - 1))
            kept_paths = path.gather(1, kept[:, :, None].expand(-1, -1, depth))  # [B, beam, depth]
            allowed = kv_valid[:, None, :].expand(-1, kept.shape[1], -1).clone()
            allowed[:, :, slots.past:] = (kept_paths[:, :, :, None] == torch.cat(drafted, dim=1)[:, None, None]).any(2)
            mask = layer_masks(DRAFT_LAYER_SPEC, allowed, q_pos, kv_pos, outputs.dtype)
            parents = outputs.gather(1, (kept // top_k)[:, :, None].expand(-1, -1, outputs.shape[-1]))
            outputs = self.draft_pass(parents, self.embed(tokens[-1].gather(1, kept)), mask, q_pos, slots.cache)
            beam_logp, beam_value, beam_paths = logp.gather(1, kept), value.gather(1, kept), kept_paths
        # Each row's tree: its own best candidates (see chosen_size for the size).
        order = self.chosen_size(torch.cat(values, dim=1))
        n = self.sizes[-1]
        if n == 1:
            self.tree, self.node_tokens = self.layout, root[:, None]
            return Candidates(self.node_tokens, self.layout)
        self.tree, self.node_tokens = ranked_tree(root, order.indices, n, tokens, paths, levels)
        return Candidates(self.node_tokens, self.tree)

    def complete(self, values: list[torch.Tensor], value: torch.Tensor) -> bool:
        """Whether drafting can stop at this level (`value`, the last of `values`, [B, m] each) with the trees and
        size that drafting every level would give. A deeper candidate is worth at most its beam ancestor, so at most
        this level's best for its row; it cannot enter a row's tree when that is no more than the row's `nodes - 1`-th
        best candidate so far (on a tie the earlier candidate ranks first), or, with step costs, when no size that
        could hold it expects as many tokens per ms as the best size of the candidates that no deeper one can
        outrank (size_settled). Rows that finished count for nothing. Small trees whose shallow candidates outrank
        every deeper path then skip their deeper draft passes. On a CPU only: the test reads values on the host
        each level, which on a GPU is a sync that costs more than the pass it may save."""
        nodes = self.dynamic.nodes
        if value.device.type != "cpu" or nodes < 2:
            return False
        so_far, level_best, done = torch.cat(values, dim=1), value.amax(1), self.going == 0
        if so_far.shape[1] >= nodes - 1:
            least = so_far.topk(nodes - 1, dim=1).values[:, -1]
            if bool(((level_best <= least) | done).all()):
                return True
        return self.dynamic.step_ms is not None and self.size_settled(so_far, level_best, done)

    def size_settled(self, so_far: torch.Tensor, level_best: torch.Tensor, done: torch.Tensor) -> bool:
        """Whether the step's size is settled before the deeper levels are drafted: the ranks where every row's
        candidate so far is at least its row's `level_best` (what any deeper candidate is worth at most) keep their
        values whatever is drafted below, and the best size within them (size()'s rate, on those values) beats
        every larger size even at the most the deeper candidates could add (each rank at most its value so far or
        the row's level_best, the larger)."""
        step_ms, going = self.dynamic.step_ms, self.going
        most = min(self.dynamic.nodes, len(step_ms))
        ordered = so_far.sort(dim=1, descending=True).values[:, : most - 1]
        ordered = torch.cat([ordered, ordered.new_full((ordered.shape[0], most - 1 - ordered.shape[1]), -1.0)], dim=1)
        kept = (ordered >= level_best[:, None]) | done[:, None]  # [B, most - 1]: ranks no deeper candidate changes
        settled = int(kept.all(0).long().cumprod(0).sum())
        exact = (ordered * going[:, None]).sum(0)  # size()'s values for the settled ranks
        upper = (torch.maximum(ordered, level_best[:, None]) * going[:, None]).sum(0)
        ranked = torch.cat([exact[:settled], upper[settled:]]).tolist()
        scale = (float(self.matched) + CALIBRATION_PRIOR) / (self.foretold + CALIBRATION_PRIOR)
        expected, rates = self.rows_going, [self.rows_going / step_ms[0]]
        for n in range(2, most + 1):
            expected += scale * ranked[n - 2]
            rates.append(expected / step_ms[n - 1])
        return max(rates[: settled + 1]) > max(rates[settled + 1:], default=float("-inf"))



def heads_proposer(base_model: nn.Module, heads: nn.Module | None, tree: MedusaTree | DynamicTree,
                   packs: PackedWeights | None = None, graphs: DraftGraphs | None = None) -> Proposer:
    """The heads on `tree` (through a column-wise copy: see columnwise), or RootOnly for a root-only tree (no heads
    needed); a DynamicTree takes eagle heads. `packs`: the caller's packed weights (columnwise.PackedWeights), which
    the copy's layers and its draft vocabulary's projection then compute from: the projection runs several times
    faster from its pack than from its plain weight, and heads draft 3 levels a step (measured: "Eagle heads on
    5.80M tokens, cheaper drafting" in experiments/2026-12-smollm2-135m-instruct/NOTES.md). `graphs`: eagle heads'
    draft layer compiled (compiled.DraftGraphs, prepared for these heads), for generate(compile=True)."""
    dynamic = isinstance(tree, DynamicTree)
    if dynamic and getattr(heads, "draft_layer", None) is None:
        raise ValueError("a DynamicTree needs eagle heads (head_type='eagle'), which draft each level from the one "
                         "above; give these heads a tree of rank paths instead")
    if not dynamic and tree.num_nodes == 1:
        return RootOnly()
    original, heads = heads, columnwise_copy(heads, packs=packs, eval_mode=True)
    draft_lm_weight = getattr(heads, "draft_lm_weight", None)
    if packs is not None and heads is not original and draft_lm_weight is not None:
        vars(heads)["draft_lm_packed"] = packs.get(draft_lm_weight)  # on the copy only (see MedusaHeads.project)
    if dynamic:
        return DynamicDraftLayerProposer(base_model, heads, tree, graphs)
    if getattr(heads, "draft_layer", None) is not None:
        return DraftLayerProposer(base_model, heads, tree, graphs)
    return HeadsProposer(base_model, heads, tree)


def draft_with_heads(heads: nn.Module, base_model: nn.Module, root: torch.Tensor, last_hidden: torch.Tensor,
                     tree: MedusaTree) -> torch.Tensor:
    """root [B] (the token the base model just chose), last_hidden [B, H] (the heads' input state before
    root) -> node_tokens [B, N]; node 0 is the root."""
    lm_head = base_model.get_output_embeddings()
    if not heads.dependent:
        top = heads.token_ids(heads(last_hidden, lm_head).topk(tree.top_k, dim=-1).indices)  # [B, K, top_k]
        node_tokens = top[:, tree.head, tree.rank]  # [B, N]; node 0's entry is overwritten
        node_tokens[:, 0] = root
        return node_tokens
    embed = base_model.get_input_embeddings()
    node_tokens = root[:, None].expand(-1, tree.num_nodes).clone()
    bounds = tree.level_bounds
    for d in range(1, len(bounds)):
        start, end = bounds[d - 1]  # parents: every node of depth d - 1 (nodes are ordered by depth)
        path_tokens = node_tokens[:, tree.node_paths[start:end, :d]]             # [B, n, d]: root .. parent
        states = last_hidden[:, None].expand(-1, end - start, -1)
        logits = heads.head_logits(d - 1, states, embed(path_tokens), lm_head)   # [B, n, V']
        top = heads.token_ids(logits.topk(tree.top_k, dim=-1).indices)          # [B, n, top_k]
        level = slice(*bounds[d])
        node_tokens[:, level] = top[:, tree.parent[level] - start, tree.rank[level]]
    return node_tokens
