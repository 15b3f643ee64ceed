"""The scaling curve's x axis: answer tokens the heads have seen at each logged evaluation, and the script that
turns those logs into the heads card's table and plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from medusa_spec.train import loop
from medusa_spec.train.loop import train
from test_training import base_dir, conversations, small_run  # noqa: F401 (fixtures)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import scaling  # noqa: E402


def test_answer_tokens_seen_counts_the_targets_of_every_batch_trained_on(base_dir, conversations,  # noqa: F811
                                                                          tmp_path, monkeypatch):
    counted = []
    real = loop.collate

    def recording(rows, pad_token_id):
        batch = real(rows, pad_token_id)
        counted.append(int(batch["loss_mask"].sum()))
        return batch

    monkeypatch.setattr(loop, "collate", recording)  # the training loop's batches only (evaluation has its own)
    # 10 packed training rows: an epoch is 2 micro-batches of 4 rows, one step of grad_accum=2.
    summary = train(small_run(base_dir, conversations, tmp_path, max_steps=3, grad_accum=2, eval_every=1,
                              eval_examples=4))
    records = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    seen = {r["step"]: r["answer_tokens_seen"] for r in records if "eval" in r}
    assert seen == {1: sum(counted[:2]), 2: sum(counted[:4]), 3: sum(counted[:6])}
    assert summary["answer_tokens_seen"] == sum(counted)
    assert seen[1] <= summary["answer_tokens_in_data"] < seen[2]  # step 2 starts the second epoch

    table = scaling.markdown(scaling.scaling_points(tmp_path, nodes=4), nodes=4).splitlines()
    assert len(table) == 5 and "(repeats data)" not in table[2] and "(repeats data)" in table[3]
    expected = [float(line.rsplit("|", 2)[1]) for line in table[2:]]
    assert all(1.0 <= e <= 4.0 for e in expected)  # 4 nodes: at most 3 drafted tokens plus the bonus


def test_scaling_script_draws_the_plot_and_names_a_log_without_points(base_dir, conversations,  # noqa: F811
                                                                      tmp_path, capsys):
    train(small_run(base_dir, conversations, tmp_path / "run", max_steps=4, eval_every=2, eval_examples=4))
    assert scaling.main([str(tmp_path / "run"), "--plot", str(tmp_path / "scaling.png")]) == 0
    assert (tmp_path / "scaling.png").stat().st_size > 1000
    assert "| run | 2 |" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "train_log.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    with pytest.raises(SystemExit, match="train with --eval-every"):
        scaling.main([str(tmp_path / "empty")])
