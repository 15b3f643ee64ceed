"""Hardware-aware tree choice: measure what a verify pass of n nodes costs on this machine and pick
the tree with the most expected tokens per second for the heads' measured rank accuracies; and
AdaptiveTree, generate(tree=None)'s proposer, which keeps re-choosing among those trees for the
accuracy the heads show on the text at hand."""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from functools import partial

import torch

from . import cost_cache, loop
from .base import model_device_dtype
from .columnwise import PackedWeights, columnwise_copy
from .compiled import CompiledSteps, DraftGraphs, adopt, block_size
from .kv_cache import new_cache
from .output import GenerationStats
from .propose import Candidates, DraftLayerProposer, HostStep, Prompt, Proposer, RootOnly, StepResult, heads_proposer
from .slots import prefill
from .tree import DynamicTree, MedusaTree, build_tree, chain_tree, default_tree, grow_tree

CANDIDATE_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)
# The trees tree=None times (and MedusaModel.auto_tree by default): 1, 2, 4, ..., 64 nodes after 64 tokens, the
# fastest of 2 runs. For SmolLM2-135M on a 2-core CPU that took a fraction of the time CANDIDATE_SIZES' 14 sizes
# after 256 tokens, fastest of 5, took, and both chose the same tree: the prompt's length changes little in a verify
# pass of a few nodes.
AUTO_SIZES = (1, 2, 4, 8, 16, 32, 64)
AUTO_CONTEXT = 64
AUTO_REPEATS = 2
# tree=None times its steps for one row and for PROBE_ROWS rows, once, and models every other batch size from the
# two (StepCosts.at); the probe times the sizes whose PROBE_ROWS x nodes rows stay within the largest size timed for
# one row, which are the sizes a batch chooses from.
PROBE_ROWS = 4
# AdaptiveTree re-chooses every ADAPT_EVERY steps; the held-out accuracy weighs as PRIOR_ROW_STEPS rows' steps of
# evidence, so a few lucky or unlucky steps move the choice little.
ADAPT_EVERY = 8
PRIOR_ROW_STEPS = 16
# generate(tree=None, compile=True)'s dynamic trees for eagle heads: at most this many nodes, a compiled block size
# (compiled.BLOCK_SIZES), so that a step runs one of the few graphs of the sizes up to it. Each block's verify pass and
# the drafting are priced at the fastest of COMPILED_REPEATS runs: about a second, after minutes of compiling. With 2,
# six pricings in one process put an 8-node step at 1.14-1.24x a 4-node one, with 8 at 1.19-1.31x, and the one-row
# bench chose 4 nodes a step in one run and 7.4 in the next (experiments/2026-12-07-commit-in-place/NOTES.md).
COMPILED_TREE_NODES = 8
COMPILED_REPEATS = 8


def expected_tokens_per_step(choices, rank_accuracy) -> float:
    """1 (the base model's own token) + every node's chance to be reached: its path's accuracies' product."""
    return 1.0 + sum(math.prod(rank_accuracy[d][r] for d, r in enumerate(path)) for path in choices)


def _fastest_seconds(fns: dict, repeats: int, device: torch.device) -> dict:
    """{key: the fastest of `repeats` runs of fns[key]}, each timed until `device` has run it (a CUDA op returns
    once queued: without the wait, a time would cover the launches only). Other work on the machine only ever adds
    time, so the minimum is the least noisy estimate (a median let one busy moment pick a far too large tree); and
    the functions take turns, round by round, so a machine that slows down for a while slows them all (timed one
    after the other, a 16-node verify once came out cheaper than a 4-node one)."""
    times = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            loop.wait_for(device)
            start = time.perf_counter()
            fn()
            loop.wait_for(device)
            times[key].append(time.perf_counter() - start)
    return {key: min(seconds) for key, seconds in times.items()}


@torch.inference_mode()
def measure_step_costs(mm, sizes=CANDIDATE_SIZES, context: int = 256, repeats: int = 5,
                       rank_accuracy=None, batch: int = 1, packs: PackedWeights | None = None,
                       dynamic: bool = False, time_verify: bool = True,
                       graphs: DraftGraphs | None = None) -> tuple[dict[int, float], dict[int, float]]:
    """Seconds of one verify pass of n nodes after `context` cached tokens, and of one step of drafting n nodes,
    for each n in sizes, `batch` rows at once (a batch verifies batch x n rows): through the decoding loop's own
    stages, the heads' proposer taking a step's result (with a context layer, its step over the slots the step kept)
    and proposing, then loop.verify, whose slots loop.commit drops again. The trees timed are those
    choose_tree weighs, grown from `rank_accuracy` (default: equal accuracies): a dependent head's drafting cost
    is one call per tree depth, so a tree of the same size but another shape costs another time (over a full
    vocabulary, a one-level 4-node tree drafted several times faster than the two-level one the accuracies chose).
    `packs`: the base model's packed weights, as generate passes them to the loop (see columnwise.PackedWeights).
    `dynamic`: eagle heads on a DynamicTree of n nodes instead (every step drafts the whole beam, whatever n).
    `time_verify=False`: the drafting alone, and no verify seconds ({}): the base model runs no pass, neither the
    prompt's (its states are random ones of their shape) nor a verify pass (a step's states are the prompt's last).
    `graphs`: eagle heads drafting through compiled graphs (compiled.DraftGraphs), as generate(compile=True) drafts."""
    spec, layers = mm.spec, getattr(mm.heads, "feature_layers", ())
    device, dtype = model_device_dtype(mm.base_model)
    # Any tokens and states: only the costs count. A generator of its own: the process-wide one, which other threads
    # and the caller's seeded draws use, is neither drawn from nor rewound.
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (batch, context), generator=generator).to(device)
    valid = torch.ones_like(ids, dtype=torch.bool)
    if time_verify:
        base = columnwise_copy(mm.base_model, packs=packs, eval_mode=True)  # as the decoding loop runs it
        _, hidden, slots = prefill(base, spec, ids, valid, new_cache(), feature_layers=layers)
    else:  # the proposer reads the base model's embeddings and LM head as generate's does
        base, width = mm.base_model, spec.hidden_size * (1 + len(layers))  # verify.base_features' width
        hidden = torch.randn(batch, context, width, generator=generator).to(device, dtype)
    root = ids[:, -1]  # any token: only the costs count
    prompt = Prompt(ids, valid, hidden, root, None)
    no_rows = torch.zeros(batch, dtype=torch.long, device=device)
    none_going = no_rows.bool()

    def verify(candidates: Candidates) -> torch.Tensor:
        """As the decoding loop verifies, then a commit in which no row goes on: the cache stays at `context`."""
        if not time_verify:  # the drafting alone: any states of the pass's shape will do (only the costs count)
            return hidden[:, -1:].expand(-1, candidates.tree.num_nodes, -1).contiguous()
        _, verified = loop.verify(base, spec, slots, candidates, layers)
        loop.commit(slots, 0, no_rows, none_going)
        return verified

    if dynamic:
        trees = {n: dataclasses.replace(default_dynamic_tree(mm), nodes=n) for n in sizes}
    else:
        accuracy = rank_accuracy or [[0.5] * max(sizes)] * mm.config.num_heads
        trees = {tree.num_nodes: tree for tree in (build_tree(grow_tree(accuracy, n)).to(device) for n in sizes)}
    proposers, steps = {}, {}
    for n, tree in trees.items():
        proposers[n] = heads_proposer(base, mm.heads, tree, packs, graphs)
        proposers[n].start(prompt)
        candidates = proposers[n].propose(root)
        steps[n] = deepest_step(candidates, verify(candidates), root)  # also the verify pass's warm-up

    def draft(n: int) -> None:
        # Each step from the started proposer: update replaces its state (a new context cache) rather than
        # changing it, so a shallow copy starts where the prompt left it, and every step sees `context` slots.
        proposer = copy.copy(proposers[n])
        proposer.update(steps[n])
        proposer.propose(root)

    latency = _fastest_seconds({n: partial(verify, steps[n].candidates) for n in trees}, repeats, device) \
        if time_verify else {}
    draft_seconds = _fastest_seconds({n: partial(draft, n) for n in trees}, repeats, device)
    return latency, draft_seconds


@torch.inference_mode()
def measure_compiled_verify(mm, compiled: CompiledSteps, sizes: tuple[int, ...], batch: int = 1,
                            context: int = AUTO_CONTEXT, repeats: int = AUTO_REPEATS) -> dict[int, float]:
    """Seconds of a compiled verify pass (compiled.CompiledSteps) of n nodes, a chain after `context` tokens, for each
    n in sizes, `batch` rows: the graphs generate(compile=True) runs, compiled here if they are not yet."""
    base, spec, layers = mm.base_model, mm.spec, compiled.feature_layers  # prepared by generate
    device = base.get_output_embeddings().weight.device
    # Any tokens: only the costs count (a generator of its own, as measure_step_costs).
    ids = torch.randint(0, spec.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0)).to(device)
    valid = torch.ones_like(ids, dtype=torch.bool)
    _, _, slots = prefill(columnwise_copy(base, eval_mode=True), spec, ids, valid, new_cache(), feature_layers=layers)
    cache = adopt(slots.cache, context + max(sizes))

    def verify(n: int) -> None:
        q_pos = slots.next_pos[:, None] + torch.arange(n, device=device)
        chain = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        compiled.forward_block(spec, ids[:, :1].expand(-1, n), q_pos, chain, cache,
                               torch.cat([slots.valid, torch.ones_like(q_pos, dtype=torch.bool)], dim=1),
                               torch.cat([slots.pos, q_pos], dim=1), layers)

    for n in sizes:
        verify(n)  # compiles the graph of this shape, where it is new
    return _fastest_seconds({n: partial(verify, n) for n in sizes}, repeats, device)


@torch.inference_mode()
def compile_draft_updates(mm, graphs: DraftGraphs, sizes: tuple[int, ...], batch: int = 1,
                          context: int = AUTO_CONTEXT) -> None:
    """Compile eagle heads' draft graphs (prepared) for the update pass after a step that accepts a path of n slots,
    root included, for each n in sizes, `batch` rows: a lookup chain's paths run deeper than the heads' tree, and an
    update pass after a path longer than the tree is padded to the path's block size (DraftLayerProposer.update; the
    proposer here drafts no tree, so every path is such a one)."""
    spec, layers = mm.spec, mm.heads.feature_layers
    device, dtype = model_device_dtype(mm.base_model)
    # Any tokens and states: only the shapes count (a generator of its own, as measure_step_costs).
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (batch, context), generator=generator).to(device)
    hidden = torch.randn(batch, context, spec.hidden_size * (1 + len(layers)), generator=generator).to(device, dtype)
    proposer = DraftLayerProposer(mm.base_model, mm.heads, chain_tree(0), graphs)
    proposer.start(Prompt(ids, torch.ones_like(ids, dtype=torch.bool), hidden, ids[:, -1], None))
    for n in (n for n in sizes if n > 1):  # a drafting tree is at least 1 deep: its update passes at least 2 wide
        chain = Candidates(ids[:, -n:], chain_tree(n - 1).to(device))
        copy.copy(proposer).update(deepest_step(chain, hidden[:, -n:], ids[:, -1]))  # the started one kept as it is


def compiled_dynamic_tree(mm, compiled: CompiledSteps, draft_seconds: dict[int, float] | None = None,
                          nodes: int = COMPILED_TREE_NODES, packs: PackedWeights | None = None) -> DynamicTree:
    """generate(tree=None, compile=True)'s tree for eagle heads (one row): a DynamicTree of at most `nodes` nodes
    (a compiled block size), each size priced at its block's compiled verify pass (a 3-node tree costs what a
    4-node one does: both run the 4-node graph) plus drafting. Every size drafts the same levels (a step's size is
    chosen once its candidates are drafted), so drafting is one figure for all: the least of `draft_seconds`, as a
    busy moment only adds time (a 1-node timing once came out 10 ms above the 2-node one, and 1 node was never
    chosen); by default timed here, through the compiled draft graphs (prepared), as the proposer runs."""
    most = min(nodes, dynamic_sizes(mm)[-1])
    blocks = tuple(sorted({block_size(n) for n in range(1, most + 1)}))
    verify = measure_compiled_verify(mm, compiled, blocks, repeats=COMPILED_REPEATS)
    if draft_seconds is None:
        _, draft_seconds = measure_step_costs(mm, sizes=(most,), context=AUTO_CONTEXT, repeats=COMPILED_REPEATS,
                                              packs=packs, dynamic=True, time_verify=False, graphs=compiled.draft)
    draft = min(draft_seconds.values())
    step_ms = tuple(1000 * (verify[block_size(n)] + draft) for n in range(1, most + 1))
    return dataclasses.replace(default_dynamic_tree(mm), nodes=most, step_ms=step_ms)


def dynamic_sizes(mm, sizes=AUTO_SIZES) -> list[int]:
    """The dynamic tree sizes measure_costs times for eagle heads: 1, as many as its beam drafts (at most
    max(sizes)), and the sizes between."""
    shape = default_dynamic_tree(mm)
    drafted = shape.top_k + (mm.config.num_heads - 1) * shape.beam * shape.top_k  # candidates a step ranks
    most = min(max(sizes), drafted + 1)
    return sorted({1, most} | {n for n in sizes if n < most})


def priced_dynamic_tree(mm, latency: dict[int, float], draft_seconds: dict[int, float]) -> DynamicTree:
    """generate(tree=None)'s tree for eagle heads: a DynamicTree whose step costs, for every size from 1 node to the
    largest priced, are latency + draft_seconds (measured or modelled for a batch: StepCosts.at) and linearly
    interpolated between them; each step then takes the size with the most expected tokens per ms."""
    priced = sorted(latency)
    # A size costs at least what a smaller one does: a timing above a larger size's is noise (a busy moment).
    step_ms = [1000 * min(latency[m] + draft_seconds[m] for m in priced if m >= n) for n in priced]
    most = priced[-1]
    return dataclasses.replace(default_dynamic_tree(mm), nodes=most,
                               step_ms=tuple(interpolate(priced, step_ms, n) for n in range(1, most + 1)))


def candidate_tokens(mm) -> int:
    """How many tokens the heads can guess: their draft vocabulary's, else the base's whole vocabulary."""
    return mm.config.draft_vocab_size or mm.spec.vocab_size


def default_dynamic_tree(mm) -> DynamicTree:
    """A 1-node DynamicTree of the default top_k and beam, top_k within the heads' candidate tokens (a tiny draft
    vocabulary has fewer)."""
    shape = DynamicTree(1)
    return dataclasses.replace(shape, top_k=min(shape.top_k, candidate_tokens(mm)))


def interpolate(xs: list[int], ys: list[float], x: int) -> float:
    """ys at x, linearly between the two nearest of the increasing xs (x within them)."""
    right = next(i for i, known in enumerate(xs) if known >= x)
    if xs[right] == x:
        return ys[right]
    left = right - 1
    return ys[left] + (ys[right] - ys[left]) * (x - xs[left]) / (xs[right] - xs[left])


def deepest_step(candidates: Candidates, hidden: torch.Tensor, bonus: torch.Tensor) -> StepResult:
    """A step in which every row accepted the tree's deepest path, the most slots a context layer's step takes;
    hidden [B, N, H] from the verify pass, bonus [B]."""
    depth = candidates.tree.rows().depth.expand(bonus.shape[0], -1)
    accept_length, last_node = depth.max(dim=-1)
    path, new_tokens = loop.accepted_path(candidates, last_node, accept_length, bonus)  # as acceptance builds them
    row = torch.ones_like(bonus, dtype=torch.bool)
    host = HostStep(accept_length.tolist(), row.tolist(), new_tokens.tolist(), row.tolist())
    return StepResult(candidates, hidden, last_node, accept_length, path, new_tokens, row, row, host)


def choose_tree(rank_accuracy, latency: dict[int, float],
                draft_seconds: float | dict[int, float]) -> tuple[list[list[int]], list[dict]]:
    """The tree (rank paths) maximising expected tokens / (verify + drafting seconds), and the table behind it.
    draft_seconds: drafting cost, one figure or one per tree size. A root-only tree (no speculation)
    needs no heads and is always a candidate."""
    table = []
    for n, seconds in sorted(latency.items()):
        choices = grow_tree(rank_accuracy, n)
        if len(choices) + 1 != n:
            continue  # the accuracies allow no tree this large
        expected = expected_tokens_per_step(choices, rank_accuracy)
        draft = draft_seconds.get(n, 0.0) if isinstance(draft_seconds, dict) else draft_seconds
        step = seconds + (draft if n > 1 else 0.0)
        table.append({"nodes": n, "expected_tokens_per_step": round(expected, 3),
                      "verify_ms": round(1000 * seconds, 2), "draft_ms": round(1000 * (step - seconds), 2),
                      "step_ms": round(1000 * step, 2), "expected_tokens_per_second": round(expected / step, 2),
                      "tree": choices})
    best = max(table, key=lambda row: row["expected_tokens_per_second"])
    return best["tree"], table


def calibrated_accuracy(rank_accuracy, hits: int, seen: int) -> list[list[float]]:
    """rank_accuracy scaled to the text at hand: every accuracy times c = (how often the heads' top depth-1 guess
    was the base model's next token in `seen` row-steps, `hits` times, with the held-out rate as PRIOR_ROW_STEPS
    more) / the held-out rate, capped at 1. A path of depth d then counts c**d."""
    top1 = rank_accuracy[0][0]
    if top1 <= 0:
        return rank_accuracy
    c = (hits + PRIOR_ROW_STEPS * top1) / ((seen + PRIOR_ROW_STEPS) * top1)
    return [[min(1.0, c * accuracy) for accuracy in row] for row in rank_accuracy]


def best_tree(table: list[dict], rank_accuracy) -> dict:
    """The row of choose_tree's `table` with the most expected tokens per second for `rank_accuracy`, as
    AdaptiveTree runs it: the root alone also pays the drafting of one node (its evidence, see AdaptiveTree)."""
    guess_ms = min((row["draft_ms"] for row in table if row["nodes"] > 1), default=0.0)

    def tokens_per_ms(row: dict) -> float:
        step_ms = row["step_ms"] + (guess_ms if row["nodes"] == 1 else 0.0)
        return expected_tokens_per_step(row["tree"], rank_accuracy) / step_ms

    return max(table, key=tokens_per_ms)


class AdaptiveTree(Proposer):
    """generate(tree=None)'s proposer: `proposer` (the heads') drafting, through its propose_on, on the tree of
    choose_tree's `table` (this machine's step costs) with the most expected tokens per second, re-chosen every
    ADAPT_EVERY steps for the accuracy the heads show on this text (calibrated_accuracy). It hands `proposer` the
    tree each step rather than setting it on `proposer`: a wrapper writes nothing into the proposer it wraps.

    Why not keep the first choice: held-out accuracies come from text like the training data and overrate the
    heads elsewhere. SmolLM2's shipped heads expected more tokens per step of their 4-node tree than they took on
    MT-bench; for a batch of 4 on a 2-core CPU that margin chose a 2-node tree that ran slower than no
    speculation (scripts/bench_batch.py). The evidence is how often the heads' top depth-1 guess is the base
    model's next token, read every step, in the still-generating row where that is rarest (a batch runs until
    its last row is done). While the root alone is in use the heads still draft that one guess (a one-node
    draft, next to a verify pass), so speculation comes back when the text turns predictable.
    `fewer_rows`: {rows: the table for that many rows}, for a batch whose finished rows have left it (loop.decode):
    fewer rows afford larger trees, so the tree is chosen again from that table at once."""

    def __init__(self, proposer: Proposer, table: list[dict], rank_accuracy,
                 fewer_rows: dict[int, list[dict]] | None = None):
        self.proposer, self.table, self.rank_accuracy = proposer, table, rank_accuracy
        self.fewer_rows = fewer_rows or {}
        self.modules, self.feature_layers = proposer.modules, proposer.feature_layers
        self.max_depth = max((len(path) for rows in (table, *self.fewer_rows.values()) for row in rows
                              for path in row["tree"]), default=1)

    def start(self, prompt: Prompt) -> None:
        self.proposer.start(prompt)
        device = prompt.root.device
        # Every tree built once; a tree without rank path [0] (its node 1) gives no evidence that step.
        # (grow_tree gives every table the same tree of n nodes)
        self.trees = {row["nodes"]: build_tree(row["tree"] or [[0]]).to(device)
                      for rows in (self.table, *self.fewer_rows.values()) for row in rows}
        self.root_alone = chain_tree(0).to(device)
        self.row = best_tree(self.table, self.rank_accuracy)
        self.hits = torch.zeros(prompt.root.shape[0], dtype=torch.long, device=device)
        self.seen = torch.zeros_like(self.hits)
        self.steps = 0
        self.sizes: list[int] = []

    def propose(self, root: torch.Tensor) -> Candidates:
        tree = self.trees[self.row["nodes"]]
        candidates = self.proposer.propose_on(root, tree)
        self.guess = candidates.node_tokens[:, 1] if tree.choices[:1] == ((0,),) else None
        self.sizes.append(self.row["nodes"])
        if self.row["nodes"] == 1:
            return Candidates(root[:, None], self.root_alone)
        return candidates

    def update(self, step: StepResult) -> None:
        self.proposer.update(step)
        if self.guess is not None:
            # new_tokens[:, 0]: the base model's token after the root, whatever the step accepted.
            self.hits += (self.guess == step.new_tokens[:, 0]) & step.active
            self.seen += step.active
        self.steps += 1
        if self.steps % ADAPT_EVERY == 0:
            self.row = best_tree(self.table, self.accuracy(step.going))

    def accuracy(self, going: torch.Tensor) -> list[list[float]]:
        """The accuracies calibrated_accuracy gives for the still-generating row (going [B]) with the lowest hit rate,
        the held-out rate weighing as there."""
        prior = PRIOR_ROW_STEPS * self.rank_accuracy[0][0]
        rate = ((self.hits + prior) / (self.seen + PRIOR_ROW_STEPS)).masked_fill(~going, float("inf"))
        hits, seen = torch.stack([self.hits, self.seen])[:, rate.argmin()].tolist()
        return calibrated_accuracy(self.rank_accuracy, hits, seen)

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.proposer.keep_rows(rows)
        self.hits, self.seen = self.hits[rows], self.seen[rows]
        if len(rows) in self.fewer_rows:
            self.table = self.fewer_rows[len(rows)]
            self.row = best_tree(self.table, self.accuracy(torch.ones_like(self.hits, dtype=torch.bool)))

    def finish(self, stats: GenerationStats) -> None:
        self.proposer.finish(stats)
        stats.tree_sizes = self.sizes


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Seconds of a step's verify pass (verify) and drafting (draft) per tree size, {rows: {nodes: seconds}},
    measured for one row and for probe_rows rows; `at` models any batch size from them."""

    verify: dict[int, dict[int, float]]
    draft: dict[int, dict[int, float]]
    probe_rows: int

    def at(self, batch: int) -> tuple[dict[int, float], dict[int, float]]:
        """(verify seconds, drafting seconds) per tree size for `batch` rows: measured for one row and for probe_rows;
        for any other batch, the one-row cost plus, for each row past the first, the cost per row the probe added
        (a pass streams the weights once whatever its rows, and each row adds its nodes' arithmetic and its own
        context; a row never makes a step cheaper, so a probe that timed below one row adds nothing). A batch
        chooses among the sizes the probe timed."""
        if batch in self.verify:
            return dict(self.verify[batch]), dict(self.draft[batch])
        if self.probe_rows not in self.verify:
            raise ValueError(f"step costs timed for {sorted(self.verify)} rows cannot price {batch}: time the probe's "
                             f"{self.probe_rows} rows too (TreeChoice.step_costs(mm, batch={batch}))")

        def model(costs: dict[int, dict[int, float]]) -> dict[int, float]:
            one, probe = costs[1], costs[self.probe_rows]
            return {n: one[n] + (batch - 1) * max(0.0, probe[n] - one[n]) / (self.probe_rows - 1) for n in probe}

        return model(self.verify), model(self.draft)

    def merged(self, other: StepCosts) -> StepCosts:
        """These costs and `other`'s rows beside them."""
        return StepCosts({**other.verify, **self.verify}, {**other.draft, **self.draft}, self.probe_rows)

    def to_dict(self) -> dict:
        """As JSON keeps it (cost_cache): rows and nodes become strings."""
        return {"verify": self.verify, "draft": self.draft, "probe_rows": self.probe_rows}

    @classmethod
    def from_dict(cls, kept: dict) -> StepCosts | None:
        """StepCosts from to_dict's JSON; None for anything else (a file of another shape is timed again)."""
        try:
            costs = cls(*({int(rows): {int(n): float(s) for n, s in sizes.items()} for rows, sizes in kept[k].items()}
                          for k in ("verify", "draft")), int(kept["probe_rows"]))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        complete = 1 in costs.verify and set(costs.verify) == set(costs.draft)
        return costs if complete and all(costs.verify[r] and set(costs.verify[r]) == set(costs.draft[r])
                                         for r in costs.verify) else None


def measure_costs(mm, packs: PackedWeights | None = None, dynamic: bool = False, rows=(1, PROBE_ROWS),
                  sizes=AUTO_SIZES, context: int = AUTO_CONTEXT, repeats: int = AUTO_REPEATS,
                  verify_costs: StepCosts | None = None) -> StepCosts:
    """StepCosts of `mm`'s heads on this machine for `rows` (one row, PROBE_ROWS rows or both: measure_step_costs):
    static trees grown from the heads' rank accuracies, or with `dynamic` eagle heads' DynamicTree (dynamic_sizes);
    PROBE_ROWS rows time the sizes whose PROBE_ROWS x nodes rows stay within max(sizes).
    `verify_costs`: StepCosts (of these rows) whose verify passes these trees' would repeat (a pass of n nodes costs
    what it costs whatever drafted them): the sizes a batch chooses from (see StepCosts.at) and their verify seconds
    are taken from it, and only the drafting is timed."""
    one_row = sorted(verify_costs.verify[1]) if verify_costs else dynamic_sizes(mm, sizes) if dynamic else list(sizes)
    probed = [n for n in one_row if n * PROBE_ROWS <= max(sizes)] or [1]
    timed = {1: probed if verify_costs else one_row, PROBE_ROWS: probed}
    verify, draft = {}, {}
    for r in rows:
        accuracy = None if dynamic else heads_rank_accuracy(mm.config)
        latency, draft[r] = measure_step_costs(mm, sizes=timed[r], context=context, repeats=repeats,
                                               rank_accuracy=accuracy, batch=r, packs=packs, dynamic=dynamic,
                                               time_verify=verify_costs is None)
        verify[r] = {n: verify_costs.verify[r][n] for n in timed[r]} if verify_costs else latency
    return StepCosts(verify, draft, PROBE_ROWS)


def heads_rank_accuracy(config) -> list[list[float]] | None:
    """The heads' held-out rank accuracies (metrics.eval.rank_accuracy), one row per head; None without them."""
    accuracy = config.metrics.get("eval", {}).get("rank_accuracy")
    return accuracy[: config.num_heads] if accuracy else None


def required_rank_accuracy(config) -> list[list[float]]:
    """heads_rank_accuracy(config), or a ValueError saying how to get them."""
    accuracy = heads_rank_accuracy(config)
    if not accuracy:
        raise ValueError("these heads carry no measured rank accuracies (metrics.eval.rank_accuracy); train them "
                         "with an eval split or run `medusa-spec tree --model ... --data ...` first")
    return accuracy


class TreeChoice:
    """tree=None's choices for one MedusaModel, in one place: the step costs of its base model, measured at the
    first call for each device, dtype and kind of tree (static, or eagle heads' dynamic one) and kept (costs differ
    by orders of magnitude between devices and dtypes, and moving the model must not keep costs timed elsewhere;
    also on disk, for the next process on this machine: cost_cache), and the trees they give each batch size,
    modelled without timing anything more (StepCosts.at).
    `packs`: the MedusaModel's packed weights, which the timed steps compute from as generate's do."""

    def __init__(self, packs: PackedWeights | None = None):
        self.packs = packs
        self.costs: dict[tuple[torch.device, torch.dtype, bool], StepCosts] = {}
        self.compiled_trees: dict[tuple[torch.device, torch.dtype, int], DynamicTree] = {}

    def step_costs(self, mm, dynamic: bool = False, batch: int = 1) -> StepCosts:
        """The step costs that price `batch` rows (StepCosts.at): one row's for one row, the probe's rows too
        for a batch, each timed when first needed (a one-row call does not pay the probe's seconds). Eagle heads'
        static trees (their batches' trees) take the verify passes timed for their dynamic ones and time only their
        own drafting: a batch size met first after a one-row call then pays a fraction of a second for it, not the
        seconds of timing every verify pass again."""
        device, dtype = model_device_dtype(mm.base_model)
        key, needed = (device, dtype, dynamic), ({1} if batch == 1 else {1, PROBE_ROWS})
        costs = self.costs.get(key)
        if costs is None or not needed <= set(costs.verify):
            path = cost_cache.costs_file(mm, dynamic)
            if costs is None:  # timed by an earlier process on this machine?
                costs = StepCosts.from_dict(cost_cache.read(path) or {})
            missing = sorted(needed - set(costs.verify if costs else ()))
            if missing:  # timed now, on tokens of their own generator
                eagle = getattr(mm.heads, "draft_layer", None) is not None
                verify_costs = self.step_costs(mm, dynamic=True, batch=batch) if eagle and not dynamic else None
                timed = measure_costs(mm, self.packs, dynamic, rows=missing, verify_costs=verify_costs)
                costs = timed if costs is None else costs.merged(timed)
                cost_cache.write(path, costs.to_dict())
            self.costs[key] = costs
        return costs

    def table(self, mm, batch: int = 1) -> list[dict]:
        """choose_tree's table for `batch` rows: a row per tree size (rank paths, verify and drafting ms, expected
        figures), from the heads' rank accuracies and the step costs modelled for that batch."""
        return choose_tree(required_rank_accuracy(mm.config), *self.step_costs(mm, batch=batch).at(batch))[1]

    def dynamic_tree(self, mm, batch: int = 1) -> DynamicTree:
        """Eagle heads' DynamicTree priced for `batch` rows (priced_dynamic_tree)."""
        return priced_dynamic_tree(mm, *self.step_costs(mm, dynamic=True, batch=batch).at(batch))

    def choices(self, mm, batch: int = 1) -> list[list[int]]:
        """The rank paths tree=None starts from for `batch` rows: with rank accuracies the best of table(batch)
        (best_tree), else the adapter's stored tree, else default_tree(num_heads)."""
        accuracy = heads_rank_accuracy(mm.config)
        if not accuracy:
            return mm.config.tree or default_tree(mm.config.num_heads)
        return best_tree(self.table(mm, batch), accuracy)["tree"]

    def proposer(self, mm, tree: list[list[int]] | DynamicTree | None, batch: int,
                 compiled: CompiledSteps | None = None) -> Proposer:
        """generate's proposer for `tree`. None: eagle heads drafting one row, a priced DynamicTree (not for a
        batch: each row drafts a whole beam, and on a 2-core CPU, for 4 MT-bench rows, it ran slower than the root
        alone and the static trees below, each row on its own tree too, experiments/2026-12-06-per-row-trees);
        other heads and batches with rank accuracies, AdaptiveTree over table(batch), or no speculation at all
        (RootOnly, as tree=[]) where the step costs say no tree pays for this batch even at the held-out accuracies,
        which overrate the heads on most text; else the heads on choices(batch).
        A DynamicTree or rank paths are kept as given; [] is RootOnly. With `compiled` (generate(compile=True)),
        eagle heads draft through its draft graphs, and their tree for one row is priced by the compiled graphs
        instead (compiled_dynamic_tree, kept as the costs are); every other choice is the eager one, its blocks padded
        to the compiled sizes."""
        accuracy = heads_rank_accuracy(mm.config)
        eagle = getattr(mm.heads, "draft_layer", None) is not None
        packs = self.packs
        graphs = compiled.draft if compiled is not None and eagle else None
        if isinstance(tree, DynamicTree) or (tree is None and eagle and batch == 1):
            guesses = candidate_tokens(mm)
            if tree is not None and tree.top_k > guesses:  # else topk fails inside torch at the first step
                raise ValueError(f"DynamicTree top_k={tree.top_k} is more than the heads' {guesses} candidate tokens; "
                                 f"use top_k <= {guesses}")
            if tree is None and compiled is not None:
                key = (*model_device_dtype(mm.base_model), batch)
                if key not in self.compiled_trees:
                    self.compiled_trees[key] = compiled_dynamic_tree(mm, compiled, packs=packs)
                tree = self.compiled_trees[key]
            return heads_proposer(mm.base_model, mm.heads, self.dynamic_tree(mm, batch) if tree is None else tree,
                                  packs, graphs)
        if tree is None and accuracy:
            costs = self.step_costs(mm, batch=batch)
            chosen, table = choose_tree(accuracy, *costs.at(batch))
            if not chosen:
                return RootOnly()
            # The root alone still drafts its one guess (AdaptiveTree's evidence): the heads' proposer on [[0]].
            first = best_tree(table, accuracy)["tree"] or [[0]]
            # The tables of the batch once its finished rows have left it (loop.decode).
            fewer_rows = {rows: choose_tree(accuracy, *costs.at(rows))[1] for rows in range(1, batch)}
            return AdaptiveTree(heads_proposer(mm.base_model, mm.heads, build_tree(first), packs, graphs), table,
                                accuracy, fewer_rows)
        return heads_proposer(mm.base_model, mm.heads, self.medusa_tree(mm, tree, batch), packs, graphs)

    def medusa_tree(self, mm, tree: list[list[int]] | None, batch: int = 1) -> MedusaTree:
        """The MedusaTree of `tree`'s rank paths, or for None those of choices(batch)."""
        # top_k: a rank past the heads' guesses would fail inside topk at the first step.
        return build_tree(self.choices(mm, batch) if tree is None else tree, mm.config.num_heads,
                          top_k=candidate_tokens(mm))
