"""Batched decoding for self-distillation: many rows at once in a preallocated cache, each row
at its own length, a finished row refilled with the next request at once (continuous batching).

transformers' `generate` pads a batch to its longest prompt, grows its cache by concatenation at
every step, and keeps finished rows in the batch until the longest answer ends. Here the cache
is allocated once ([rows, kv_heads, capacity, head_dim] per layer), a row writes at its own
column, and a finished row takes the next prompt while the others go on: a conversation's next turn,
asked at once, goes to the row that held the turn before and prefills only what that row does not
already hold (its answer's last token and the new message). The model is the
caller's, unchanged: the cache is a plain transformers `Cache` whose layers write per row, and
the mask and positions are passed explicitly, so any decoder-only model that accepts a 4D mask
runs here without modeling code of its own.

A decoding step reads, per block of `chunk_rows` rows, the keys and values up to that block's longest row, not every
row up to the longest of all: with the recipe's mix of short and long conversations most rows are far shorter than
the longest, and attention is a large share of a wide step. Rows are kept about sorted by length (moved, with their
cache, when the blocks would read 25% more than sorted ones), so a block holds rows of similar length. Once no
request waits, finished rows stay free, and a step runs only the rows up to the last busy one (re-sorted, free ones
last, before a quarter of them idle): the last long answers of a run no longer carry every row's products. The model
runs as a columnwise.columnwise_copy (fp32 on CPU): its linear layers take the fastest kernel for their row count
(oneDNN for a batch), which rounds as another matmul kernel would.
"""

from __future__ import annotations

import hashlib
import inspect
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from ..accept import Sampling, kept_scores
from ..base import inspect_base_model
from ..columnwise import PackedWeights, columnwise_copy, gqa_sdpa_attention
from ..verify import layer_masks
from .repetition import LoopWatch

GREEDY = Sampling()
ROW_BLOCKS_SDPA = "medusa_spec_row_blocks_sdpa"
# Re-sort the rows when their blocks read this much more than blocks of sorted rows would.
RESORT_AT = 1.25


def row_blocks_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, row_blocks: tuple | None = None,
                         **kwargs) -> tuple[torch.Tensor, None]:
    """sdpa attention (columnwise.gqa_sdpa_attention) taken per block of rows: `row_blocks` lists (first row, end
    row, width), and a block's rows attend to their first `width` columns only, the rest being masked for them
    anyway. Without row_blocks (a prefill), or with a per-row position bias (not sliced here), one call."""
    if row_blocks is None or attention_mask is None or query.shape[2] != 1 or kwargs.get("position_bias") is not None:
        return gqa_sdpa_attention(module, query, key, value, attention_mask, **kwargs)
    return torch.cat([gqa_sdpa_attention(module, query[a:b], key[a:b, :, :w], value[a:b, :, :w],
                                         attention_mask[a:b, ..., :w], **kwargs)[0]
                      for a, b, w in row_blocks]), None


# As columnwise.GQA_SDPA: a name in transformers' table, read only by the attention layers of decode_stream's copy.
AttentionInterface.register(ROW_BLOCKS_SDPA, row_blocks_attention)


class SlotLayer(CacheLayerMixin):
    """One layer's keys and values in fixed buffers; `slots` says where the next block goes."""

    def __init__(self, slots: "Slots"):
        super().__init__()
        self.slots = slots

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        shape = (self.slots.rows, key_states.shape[1], self.slots.capacity)
        self.keys = key_states.new_zeros(*shape, key_states.shape[-1])
        self.values = value_states.new_zeros(*shape, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        row, start, width = self.slots.row, self.slots.start, self.slots.width
        if row is not None:  # one row's prompt (prefill): a contiguous block from `start`
            end = start + key_states.shape[2]
            self.keys[row, :, start:end] = key_states[0]
            self.values[row, :, start:end] = value_states[0]
            return self.keys[row: row + 1, :, :end], self.values[row: row + 1, :, :end]
        # One new token per row of the step (the first len(start) rows), each at its own column.
        n = len(start)
        rows = torch.arange(n, device=self.keys.device)
        self.keys[rows, :, start] = key_states[:, :, 0]
        self.values[rows, :, start] = value_states[:, :, 0]
        return self.keys[:n, :, :width], self.values[:n, :, :width]

    def get_seq_length(self) -> int:
        return self.slots.width

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.slots.width, 0

    def get_max_length(self) -> int:
        return self.slots.capacity


class Slots(Cache):
    """The cache of all rows. Before each forward the engine says where it writes: `row` and an int
    `start` for one row's prefill, or `row=None` and a tensor `start` [n] for a decode step of the first n rows;
    `width` is how many columns attention reads."""

    def __init__(self, n_layers: int, rows: int, capacity: int):
        self.rows, self.capacity = rows, capacity
        self.row, self.start, self.width = None, 0, 0
        super().__init__(layers=[SlotLayer(self) for _ in range(n_layers)])

    def reorder(self, order: list[int], kept: list[int]) -> None:
        """Row i takes the first kept[order[i]] columns that row order[i] held. In place, cycle by cycle, and only
        the kept columns: copying whole buffers into new ones took seconds for a full batch of rows."""
        buffers = [b for layer in self.layers if layer.is_initialized for b in (layer.keys, layer.values)]
        done = [False] * len(order)
        for first in range(len(order)):
            if done[first] or order[first] == first:
                continue
            saved = [b[first, :, :kept[first]].clone() for b in buffers]
            row = first
            while order[row] != first:
                source = order[row]
                for b in buffers:
                    b[row, :, :kept[source]] = b[source, :, :kept[source]]
                done[row], row = True, source
            for b, s in zip(buffers, saved):
                b[row, :, :kept[first]] = s
            done[row] = True


@dataclass
class Request:
    key: object                 # returned with the answer, so the caller can match it
    input_ids: list[int]
    sampling: Sampling = GREEDY  # how this row's tokens are drawn (as transformers' generate with those settings)
    max_new_tokens: int | None = None  # None: decode_stream's

    def __post_init__(self):
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"Request {self.key!r}: max_new_tokens must be at least 1, got {self.max_new_tokens} "
                             "(None takes decode_stream's max_new_tokens)")


def _n_layers(model: nn.Module) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return config.num_hidden_layers


def _pick(logits: torch.Tensor, samplings: list[Sampling], uniforms: list[float]) -> torch.Tensor:
    """Next tokens [rows] from last-position logits [rows, V], row i drawn as samplings[i] says: argmax when
    greedy, else from temperature, top-k and top-p as the decoding loop draws (accept.kept_scores), by inverting the
    distribution's CDF at the row's uniform draw uniforms[i] in [0, 1) (one call for all rows that sample alike)."""
    tokens = logits.argmax(-1)
    for sampling in dict.fromkeys(s for s in samplings if s.do_sample):  # a few distinct settings, in row order
        rows = [i for i, s in enumerate(samplings) if s == sampling]
        scores, ids = kept_scores(logits[torch.tensor(rows, device=logits.device)], sampling)
        cdf = scores.softmax(dim=-1).cumsum(dim=-1)
        total = cdf[:, -1:]
        u = torch.tensor([uniforms[i] for i in rows], dtype=cdf.dtype, device=cdf.device)[:, None]
        # The first token whose CDF passes u * total: token j for u * total in [cdf[j-1], cdf[j]), a width of p_j,
        # so a filtered token (p = 0) is never drawn; kept below total, whatever the rounding of the product.
        drawn = torch.searchsorted(cdf, torch.minimum(u * total, total.nextafter(torch.zeros_like(total))),
                                   right=True)
        tokens[rows] = (drawn if ids is None else ids.gather(-1, drawn))[:, 0]
    return tokens


def request_draws(seed: int, request: Request, count: int) -> list[float]:
    """The uniform draws in [0, 1) a sampling request's `count` tokens are picked by, from a stream of its own: `seed`,
    its key and its prompt's length (a conversation's next turn, under the same key, is a longer prompt). What it
    samples so depends neither on its row nor on what ran beside it, so a resumed run (other requests in flight,
    another --batch-size) draws the same; drawn on the CPU, so a GPU run draws the same too."""
    digest = hashlib.sha256(f"{seed}:{request.key!r}:{len(request.input_ids)}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.rand(count, generator=generator, dtype=torch.float64).tolist()


def _block_widths(start: torch.Tensor, size: int) -> torch.Tensor:
    """The columns each block of `size` consecutive rows reads: its rows' largest `start`, plus the new column."""
    return nn.functional.pad(start + 1, (0, -len(start) % size)).view(-1, size).amax(1)


def row_blocks(start: torch.Tensor, size: int) -> tuple[tuple[int, int, int], ...]:
    """(first row, end row, columns read) per block of `size` consecutive rows writing at columns `start`."""
    rows = len(start)
    return tuple((a, min(a + size, rows), w) for a, w in zip(range(0, rows, size), _block_widths(start, size).tolist()))


def resort_order(start: torch.Tensor, size: int, running: int, busy_rows: int) -> torch.Tensor | None:
    """The rows longest first (free ones, at column 0, last), where that makes a step read RESORT_AT times less than
    now or less: its blocks' columns, or its rows (`running` now, through the last busy row; `busy_rows` sorted);
    else None."""
    ordered, order = start.sort(descending=True, stable=True)
    if running > RESORT_AT * busy_rows:
        return order
    return order if _block_widths(start, size).sum() > RESORT_AT * _block_widths(ordered, size).sum() else None


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def decode_stream(model: nn.Module, requests: deque, eos_token_ids: set[int], *, rows: int = 64,
                  max_new_tokens: int = 512, capacity: int | None = None, pad_token_id: int = 0,
                  seed: int = 0, stop_loops: bool = False, chunk_rows: int = 8) -> Iterator[tuple[object, list[int]]]:
    """Answer `requests` (a deque of Request, which the caller may extend while iterating, e.g. with
    a conversation's next turn) and yield (key, new tokens through the first eos) as each row ends.

    A row ends at an eos, after its max_new_tokens, or when its cache row is full (capacity, default the most
    any request queued at the start needs, its prompt + its max_new_tokens: pass it when later requests may need
    more); with stop_loops, also once it loops (repetition.LoopWatch), its tokens then cut where the loop began.
    Each row draws as its request's `sampling` says, from a random stream of its own (`seed`, the request's key and
    its prompt's length: request_draws). A decoding step's attention runs per block of `chunk_rows` rows
    (see the module's docstring), where the model is fp32 on CPU and its attention layers sdpa ones.
    """
    if max_new_tokens < 1:
        raise ValueError(f"decode_stream: max_new_tokens must be at least 1, got {max_new_tokens}")
    spec = inspect_base_model(model)  # read per call: the caller may switch attention implementations
    if chunk_rows < 1:
        raise ValueError(f"decode_stream: chunk_rows must be at least 1, got {chunk_rows}")
    # A copy whose attention layers take row_blocks (the caller's model stays as it is); itself where none is made.
    runner = columnwise_copy(model, attention=ROW_BLOCKS_SDPA, packs=PackedWeights())
    # Its forward passes them on only if it takes keyword arguments it does not name (transformers' models do).
    by_blocks = (any(getattr(getattr(m, "config", None), "_attn_implementation", None) == ROW_BLOCKS_SDPA
                     for m in runner.modules())
                 and any(p.kind is p.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values()))
    device = model.get_input_embeddings().weight.device
    dtype = model.get_output_embeddings().weight.dtype
    if capacity is None:
        capacity = max((len(r.input_ids) + (r.max_new_tokens or max_new_tokens) for r in requests), default=1)
    # No more cache rows than requests to fill them: a few prompts at a large --batch-size paid for idle rows' memory.
    # (A caller adds a conversation's next turn as its row ends, so the queue at the start bounds the rows in use.)
    rows = max(1, min(rows, len(requests)))
    cache = Slots(_n_layers(model), rows, capacity)
    eos = torch.tensor(sorted(eos_token_ids), device=device)
    length = torch.zeros(rows, dtype=torch.long, device=device)   # valid columns per row
    last = torch.full((rows,), pad_token_id, dtype=torch.long, device=device)  # the token to feed next
    active = [None] * rows  # per row: (key, new tokens) or None when free
    sampling = [GREEDY] * rows
    draws: list[list[float] | None] = [None] * rows  # a sampling row's request_draws, one per token
    limit = [max_new_tokens] * rows
    watch: list[LoopWatch | None] = [None] * rows
    columns = torch.arange(capacity, device=device)
    # The last prompt prefilled, the row holding it and its last logits. Model-written prompts (Magpie) all
    # start from one opening, so a request with that prompt copies the row's first columns instead of running
    # the model. Those columns stay as written while the row decodes or takes the same prompt again; a row
    # left free is overwritten at column 0, so it stops being the source.
    last_prefill: dict = {}
    held: list[list[int]] = [[] for _ in range(rows)]  # per row: the tokens its valid columns hold

    def fill(row: int) -> bool:
        """Prefill the next request that fits into `row`; False when none is left."""
        while requests:
            request = requests.popleft()
            n = len(request.input_ids)
            if n == 0 or n >= capacity:
                yield_later.append((request.key, []))  # nothing to answer in, or no room to answer
                continue
            if last_prefill.get("ids") == request.input_ids:
                source = last_prefill["row"]
                for layer in cache.layers:
                    layer.keys[row, :, :n] = layer.keys[source, :, :n]
                    layer.values[row, :, :n] = layer.values[source, :, :n]
            else:
                # Columns the row already holds for this prompt's beginning (a conversation's earlier turns) are
                # kept; at least the last token runs, for its logits. Kept columns were written one token at a
                # time, so they equal a fresh prefill's up to rounding.
                start = min(_shared_prefix(held[row], request.input_ids), n - 1)
                ids = torch.tensor([request.input_ids[start:]], device=device)
                cache.row, cache.start, cache.width = row, start, n
                q_pos, kv_pos = columns[None, start:n], columns[None, :n]
                mask = layer_masks(spec, kv_pos[:, None, :] <= q_pos[:, :, None], q_pos, kv_pos, dtype)
                keep = {"logits_to_keep": 1} if spec.takes_logits_to_keep else {}  # the last token's logits only
                out = runner(input_ids=ids, attention_mask=mask, position_ids=q_pos, use_cache=True,
                             **{spec.cache_arg: cache}, **keep)
                last_prefill.update(ids=request.input_ids, row=row, logits=out.logits[:, -1])
            held[row] = request.input_ids
            sampling[row] = request.sampling
            limit[row] = request.max_new_tokens or max_new_tokens
            draws[row] = request_draws(seed, request, limit[row]) if request.sampling.do_sample else None
            first = _pick(last_prefill["logits"], [request.sampling], [draws[row][0] if draws[row] else 0.0])
            length[row], last[row] = n, first[0]
            active[row] = (request.key, [int(first[0])])
            watch[row] = LoopWatch() if stop_loops else None
            if watch[row] is not None:
                watch[row].push(int(first[0]))
            return True
        if last_prefill.get("row") == row:
            last_prefill.clear()
        held[row] = []
        return False

    yield_later: list[tuple[object, list[int]]] = []
    with torch.inference_mode():
        for row in range(rows):
            if not fill(row):
                break
        while True:
            for item in yield_later:
                yield item
            yield_later.clear()
            # A free row takes what the caller asked since (on seeing an empty answer). Rows whose first token already
            # ends them (eos, or max_new_tokens == 1) end, and so on for the request that refills the row.
            for row in range(rows):
                if requests and active[row] is None:
                    fill(row)
                while active[row] is not None:
                    key, tokens = active[row]
                    if not (tokens[-1] in eos_token_ids or len(tokens) >= limit[row]):  # a prompt leaves a free column
                        break
                    active[row] = None
                    yield key, tokens
                    fill(row)  # only its prompt was written: held[row] is right
            if not any(a is not None for a in active):
                if yield_later:
                    continue  # yielded at the top of the loop, where the caller may still ask for more
                return
            flags = [a is not None for a in active]
            busy = torch.tensor(flags, device=device)
            # A step runs the rows up to the last busy one. A free row among them decodes a pad token at column 0
            # of its own (unused) row: harmless, and it keeps every step one dense [n, 1] forward. Once no request
            # is left, free rows pile up: the rows are re-sorted (free ones last) before they cost a quarter more.
            start = torch.where(busy, length, 0)
            # Counted on the host from `active`: no device sync for them.
            n, count = rows - flags[::-1].index(True), sum(flags)
            order = resort_order(start, chunk_rows if by_blocks else rows, n, count)  # one block: only rows count
            if order is not None:
                moved = order.tolist()
                cache.reorder(moved, start.tolist())  # a free row (start 0) holds nothing kept
                for per_row in (active, sampling, draws, limit, watch, held):
                    per_row[:] = [per_row[i] for i in moved]
                length, last, start, busy = length[order], last[order], start[order], busy[order]
                if "row" in last_prefill:
                    last_prefill["row"] = moved.index(last_prefill["row"])
                n = count  # the busy rows now come first
            start, busy = start[:n], busy[:n]
            blocks = {"row_blocks": row_blocks(start, chunk_rows)} if by_blocks else {}
            width = int(start.max()) + 1
            cache.row, cache.start, cache.width = None, start, width
            mask = layer_masks(spec, (columns[None, :width] <= start[:, None])[:, None, :], start[:, None],
                               columns[None, :width], dtype)
            out = runner(input_ids=last[:n, None], attention_mask=mask, position_ids=start[:, None],
                         use_cache=True, **{spec.cache_arg: cache}, **blocks)
            # A busy row's next token is its len(tokens)-th; a free row's pick is not used.
            uniforms = [d[len(a[1])] if d is not None and a is not None else 0.0 for d, a in zip(draws[:n], active[:n])]
            nxt = _pick(out.logits[:, -1], sampling[:n], uniforms)
            length[:n] += busy.long()
            last[:n] = torch.where(busy, nxt, last[:n])
            done = busy & (torch.isin(nxt, eos) | (length[:n] >= capacity))  # no free column to feed nxt into
            picked = nxt.tolist()  # one sync per step
            for row, a in enumerate(active[:n]):
                if a is None:
                    continue
                a[1].append(picked[row])
                looping = watch[row] is not None and watch[row].push(picked[row])
                if done[row] or len(a[1]) >= limit[row] or looping:
                    active[row] = None
                    # Its columns: the prompt and every answer token but the last (never fed back).
                    held[row] = held[row] + a[1][: len(a[1]) - 1]
                    yield (a[0], a[1][:watch[row].start]) if looping else a
                    fill(row)
