"""Loops in distilled answers: found where they begin, stopped in distillation, left out of training."""

from collections import deque

from medusa_spec.train.engine import Request, decode_stream
from medusa_spec.train.repetition import LOOP_NGRAM, LOOP_RUN, loop_start
from tiny_models import tiny_model


def test_a_loop_starts_where_its_first_copy_begins():
    prefix, block = list(range(100, 120)), list(range(1, 11))
    assert loop_start(prefix + block * 8) == len(prefix) + len(block)  # the text through the block's first copy
    assert loop_start(prefix + block * 3) is None  # 2 copies: 13 repeated positions in a row, not LOOP_RUN
    # A phrase said again is a loop from LOOP_NGRAM + LOOP_RUN - 1 tokens on: LOOP_RUN repeated positions.
    short, long = list(range(1, LOOP_NGRAM + LOOP_RUN - 1)), list(range(1, LOOP_NGRAM + LOOP_RUN))
    assert loop_start(prefix + short + [200] + short) is None
    assert loop_start(prefix + long + [200] + long) == len(prefix) + len(long) + 1


def test_distillation_stops_a_looping_row_where_the_loop_began():
    """Greedy rows of a random tiny model loop; with stop_loops each comes back cut where its loop began, and
    the other rows (refilled into the freed slots) are as before."""
    model = tiny_model("llama")
    asks = [[5, 6, 7], [9, 3, 4, 8], [20, 21], [40, 41, 42, 43, 44]]

    def run(stop_loops):
        requests = deque(Request(i, ids) for i, ids in enumerate(asks))
        return dict(decode_stream(model, requests, set(), rows=2, max_new_tokens=150, capacity=200,
                                  stop_loops=stop_loops))

    full, stopped = run(False), run(True)
    loops = {key: loop_start(tokens) for key, tokens in full.items()}
    assert sum(start is not None for start in loops.values()) >= 2  # the case under test does occur
    assert stopped == {key: tokens[:loops[key]] for key, tokens in full.items()}
