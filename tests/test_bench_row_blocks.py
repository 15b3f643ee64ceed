"""scripts/bench_row_blocks.py: the row-length simulation (columns a step reads) and the step clock."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_row_blocks import simulate, time_step  # noqa: E402

from tiny_models import tiny_model  # noqa: E402

SHORT = [(1, 1)]


def test_columns_read_by_one_block_blocks_and_each_row_counted_by_hand():
    # Row 0 holds 10 prompt columns and decodes 2 tokens, row 1 holds 4: steps read 11 and 5, then 12 and 6 columns.
    # Both then take a short conversation, which leaves one in the queue: the run stops there.
    conversations = [[(10, 2)], [(4, 2)], SHORT, SHORT, SHORT]
    reads, resorts, steps, _ = simulate(conversations, rows=2, chunk_rows=1, resort=False, warm_up=0)
    assert (reads, resorts, steps) == ({"one block": 2 * 11 + 2 * 12, "blocks": 16 + 18, "each row": 16 + 18}, 0, 2)
    reads, *_ = simulate(conversations, rows=2, chunk_rows=2, resort=False, warm_up=0)
    assert reads["blocks"] == reads["one block"] == 46
    # Three rows in blocks of two: the last block has one row. Steps read 11, 5, 7 then 12, 6, 8 columns.
    conversations = [[(10, 2)], [(4, 2)], [(6, 2)]] + [SHORT] * 4
    reads, *_ = simulate(conversations, rows=3, chunk_rows=2, resort=False, warm_up=0)
    assert reads == {"one block": 3 * 11 + 3 * 12, "blocks": 2 * 11 + 7 + 2 * 12 + 8, "each row": 23 + 26}


def test_a_follow_up_turn_joins_its_row():
    # The second turn adds 3 columns (its message) to the row after the first answer's 1 token.
    conversations = [[(10, 1), (3, 1)], SHORT, SHORT, SHORT, SHORT]
    _, _, _, snapshots = simulate(conversations, rows=1, chunk_rows=1, resort=False, snapshot_steps={0, 1, 2},
                                  warm_up=0)
    assert snapshots == [[10], [14], [1]]


def test_rows_are_re_sorted_when_blocks_read_a_quarter_more_than_sorted_ones():
    # Long and short rows alternate: unsorted, each block of two reads up to a long row.
    conversations = [[(50, 20)], [(1, 20)], [(50, 20)], [(1, 20)]] + [SHORT] * 6
    plain, none, *_ = simulate(conversations, rows=4, chunk_rows=2, resort=False, warm_up=0)
    sorted_, resorts, _, snapshots = simulate(conversations, rows=4, chunk_rows=2, resort=True, snapshot_steps={0},
                                              warm_up=0)
    assert none == 0 and resorts == 1 and snapshots == [[50, 50, 1, 1]]
    assert sorted_["blocks"] < plain["blocks"] == plain["one block"] == sorted_["one block"]
    assert sorted_["each row"] == plain["each row"]


def test_the_step_clock_runs_a_model_at_given_row_lengths():
    result = time_step(tiny_model("llama"), [9, 7, 3, 1], chunk_rows=2, repeats=1)
    assert set(result) == {"one block ms", "blocks of 2 ms", "re-sorting every row ms"}
    assert all(isinstance(v, int) and v >= 0 for v in result.values())
