"""What attending per block of rows saves the data engine (medusa_spec.train.engine), at the row lengths of a
steady-state run of the recipe.

    python scripts/bench_row_blocks.py [--data DIR] [--rows 128] [--chunk-rows 8] [--conversations 3000]

1. Row lengths without a clock: the distilled conversations of `--data` (their prompts and answers, follow-up turns
   in the same row, as distill runs them) go through `--rows` rows, a finished row taking the next at once; from
   step 600 on, the columns a step's attention reads are summed for every row up to the longest (one block), blocks
   of `--chunk-rows` rows, and each row up to its own length; once with rows left where they fall, once re-sorted by
   the engine's rule (`resort_order`).
2. A clock: one decoding step of SmolLM2-135M (fp32) at a few of those steps' row lengths (random keys and values),
   one block against sorted blocks, and the cost of re-sorting the rows' cache.

Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_spec import default_model
from medusa_spec.base import inspect_base_model
from medusa_spec.columnwise import columnwise_copy
from medusa_spec.train.data import read_conversations, render
from medusa_spec.train.engine import ROW_BLOCKS_SDPA, Slots, resort_order, row_blocks
from medusa_spec.verify import layer_masks

DATA = Path(__file__).resolve().parents[1] / "training" / "data" / "smollm2-135m-instruct"
WARM_UP = 600


def turn_lengths(tokenizer, messages: list[dict]) -> list[tuple[int, int]]:
    """Per answer: (columns its prompt adds to the row, answer tokens fed back)."""
    turns, held = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = len(tokenizer(render(tokenizer, messages[:i], add_generation_prompt=True),
                               add_special_tokens=False).input_ids)
        answer = len(tokenizer(message["content"], add_special_tokens=False).input_ids) + 1  # and its eos
        turns.append((prompt - held, answer))
        held = prompt + answer
    return turns


def simulate(conversations: list[list[tuple[int, int]]], rows: int, chunk_rows: int, resort: bool,
             snapshot_steps: set[int] = frozenset(), warm_up: int = WARM_UP):
    """Columns read (summed over the steps from warm_up on) by one block, blocks and each row alone; re-sorts (with
    `resort`, the engine's rule); steps counted; row lengths at snapshot_steps, longest first."""
    queue = [list(c) for c in reversed(conversations)]
    turns: list[list] = [[] for _ in range(rows)]
    length = torch.zeros(rows, dtype=torch.long)
    left = torch.zeros(rows, dtype=torch.long)  # answer tokens a row has still to decode

    def fill(row):
        if queue:
            turns[row] = queue.pop()
            length[row], left[row] = turns[row].pop(0)
        else:
            length[row] = left[row] = 0

    for row in range(rows):
        fill(row)
    reads = dict.fromkeys(("one block", "blocks", "each row"), 0)
    resorts, snapshots, step = 0, [], 0
    while len(queue) > rows:  # stop before the queue runs dry
        order = resort_order(length, chunk_rows, rows, rows) if resort else None  # every row busy here
        if order is not None:
            length, left, turns = length[order], left[order], [turns[i] for i in order.tolist()]
            resorts += step >= warm_up
        if step >= warm_up:
            reads["one block"] += rows * (int(length.max()) + 1)
            reads["blocks"] += sum((b - a) * w for a, b, w in row_blocks(length, chunk_rows))
            reads["each row"] += int(length.sum()) + rows
        if step in snapshot_steps:
            snapshots.append(length.sort(descending=True).values.tolist())
        length += 1
        left -= 1
        for row in (left <= 0).nonzero()[:, 0].tolist():
            if turns[row]:  # a follow-up: its message joins the row
                added, left[row] = turns[row].pop(0)
                length[row] += added
            else:
                fill(row)
        step += 1
    return reads, resorts, step - warm_up, snapshots


@torch.inference_mode()
def time_step(model, lengths: list[int], chunk_rows: int, repeats: int = 5) -> dict:
    """ms of one decoding step at these row lengths (sorted, longest first): one block, then blocks."""
    runner = columnwise_copy(model, attention=ROW_BLOCKS_SDPA)
    spec, config = inspect_base_model(model), model.config
    rows, capacity = len(lengths), max(lengths) + 2
    cache = Slots(config.num_hidden_layers, rows, capacity)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (rows, config.num_key_value_heads, capacity, head_dim)
    for layer in cache.layers:
        layer.keys, layer.values, layer.is_initialized = torch.randn(shape), torch.randn(shape), True
    start, columns = torch.tensor(lengths), torch.arange(capacity)
    ids = torch.randint(config.vocab_size, (rows, 1))
    width = int(start.max()) + 1
    mask = layer_masks(spec, (columns[None, :width] <= start[:, None])[:, None, :], start[:, None],
                       columns[None, :width], torch.float32)
    result = {}
    for name, size in (("one block", rows), (f"blocks of {chunk_rows}", chunk_rows)):
        blocks, times = row_blocks(start, size), []
        for _ in range(repeats + 1):
            cache.row, cache.start, cache.width = None, start, width
            begin = time.perf_counter()
            runner(input_ids=ids, attention_mask=mask, position_ids=start[:, None], use_cache=True,
                   row_blocks=blocks, **{spec.cache_arg: cache})
            times.append(time.perf_counter() - begin)
        result[f"{name} ms"] = round(1000 * sorted(times[1:])[repeats // 2])
    shuffled = list(range(rows))
    random.Random(0).shuffle(shuffled)
    begin = time.perf_counter()
    cache.reorder(shuffled, lengths)
    result["re-sorting every row ms"] = round(1000 * (time.perf_counter() - begin))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--chunk-rows", type=int, default=8)
    parser.add_argument("--conversations", type=int, default=3000, help="a seeded sample of the data's")
    parser.add_argument("--snapshots", type=int, nargs="*", default=[1000, 2000], help="steps timed on the clock")
    args = parser.parse_args()
    path = default_model.prepare()
    tokenizer = AutoTokenizer.from_pretrained(path)
    conversations = read_conversations(args.data)
    random.Random(0).shuffle(conversations)
    lengths = [turn_lengths(tokenizer, c) for c in conversations[: args.conversations]]
    for resort in (False, True):
        reads, resorts, steps, snapshots = simulate(lengths, args.rows, args.chunk_rows, resort, set(args.snapshots))
        print(json.dumps({"rows": args.rows, "chunk_rows": args.chunk_rows, "re-sorted": resort,
                          "steps counted": steps, "re-sorts": resorts, "columns read, against one block":
                          {name: round(n / reads["one block"], 3) for name, n in reads.items()}}), flush=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for step, snapshot in zip(args.snapshots, snapshots):
        mean = round(sum(snapshot) / len(snapshot))
        print(json.dumps({"step": step, "longest row": snapshot[0], "mean row": mean,
                          **time_step(model, snapshot, args.chunk_rows)}), flush=True)


if __name__ == "__main__":
    main()
