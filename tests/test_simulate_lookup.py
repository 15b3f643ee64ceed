"""scripts/simulate_lookup.py's datastore: the longest agreeing match, continued by majority, within one answer."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import simulate_lookup  # noqa: E402
from simulate_lookup import Datastore  # noqa: E402


def test_datastore_continues_the_longest_match_by_majority():
    answers = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 2, 3, 4, 5, 6, 7, 9], [9, 2, 3, 4, 5, 6, 7, 9], [0, 3, 4, 5, 6, 7, 8, 1]]
    store = Datastore(answers, min_match=5)
    # 5-gram [3..7] is followed by 8 twice (answers 0, 3) and 9 twice; the 6-gram [2..7] by 8 once and 9 twice.
    assert store.chain([2, 3, 4, 5, 6, 7], min_share=0.6) == [9]
    assert store.chain([5, 3, 4, 5, 6, 7], min_share=0.6) == []  # 5-gram only: 2 of 4 agree, below 60%
    assert store.chain([5, 3, 4, 5, 6, 7], min_share=0.5) in ([8], [9])
    assert store.chain([4, 5, 6, 7], min_share=0.0) == []  # shorter than min_match
    # A chain never runs across an answer's end into the next answer.
    assert store.chain([1, 2, 3, 4, 5, 6, 7], min_share=0.0) == [8]


def test_datastore_chain_runs_up_to_chain_tokens_along_the_agreeing_matches():
    answers = [[1, 2, 3, 4, 5, 10, 11, 12, 13]] * 2
    assert Datastore(answers, min_match=5).chain([1, 2, 3, 4, 5], 0.6) == [10, 11, 12][: simulate_lookup.CHAIN]

