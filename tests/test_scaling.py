"""The scaling curve's x axis: answer tokens the heads have seen at each logged evaluation, and the script that
turns those logs into the heads card's table and plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from medusa_spec.train import loop
from medusa_spec.train.data import read_conversations
from medusa_spec.train.load import load_model_and_tokenizer
from medusa_spec.train.loop import build_rows, split_held_out, train
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
    # A run on heads that had learned from other conversations continues their curve; its repeats stay its own.
    assert scaling.main([str(tmp_path / "run"), "--learned-before", "1000000"]) == 0
    counted = scaling.scaling_points(tmp_path / "run", nodes=4)
    continued = scaling.scaling_points(tmp_path / "run", nodes=4, learned_before=1_000_000)
    assert [p["answer_tokens"] - 1_000_000 for p in continued] == [p["answer_tokens"] for p in counted]
    assert [p["repeats"] for p in continued] == [p["repeats"] for p in counted]
    assert f"| run | 2 | {continued[0]['answer_tokens'] / 1e6:.2f}M" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        scaling.main([str(tmp_path / "run"), "--learned-before", "1", "2"])
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "train_log.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    with pytest.raises(SystemExit, match="train with --eval-every"):
        scaling.main([str(tmp_path / "empty")])


def test_max_conversations_trains_on_nested_samples_with_the_same_held_out_set(base_dir, conversations):  # noqa: F811
    _, tokenizer = load_model_and_tokenizer(base_dir)
    messages = read_conversations(conversations)  # 24: distill keeps one of each repeated prompt

    def rows(**overrides):
        cfg = small_run(base_dir, conversations, "unused", pack=False, max_length=512, keep_loops=True,
                        **overrides)  # a row per conversation; counting words is all loops
        train_rows, eval_rows = build_rows(tokenizer, messages, cfg)
        return [tuple(row[0].input_ids) for row in train_rows], [tuple(row[0].input_ids) for row in eval_rows]

    everything, held_out = rows()
    small, small_held_out = rows(max_conversations=5)
    larger, larger_held_out = rows(max_conversations=12)
    assert (len(messages), len(everything), len(small), len(larger)) == (24, 16, 5, 12)
    assert small_held_out == larger_held_out == held_out and not set(larger) & set(held_out)
    assert larger[:5] == small and set(larger) <= set(everything)
    assert rows(max_conversations=1000)[0] == everything
    with pytest.raises(ValueError, match="--max-conversations 0: give at least 1"):
        rows(max_conversations=0)


def test_no_conversation_trains_that_begins_as_a_held_out_one_does():
    def turn(role, content):
        return {"role": role, "content": content}

    chats = []
    for i in range(30):  # every even prompt asked twice, as a greedy distiller answers it: the same answer
        chats.append([turn("user", f"q{i}"), turn("assistant", f"a{i}")])
        if i % 2 == 0:
            chats.append([turn("user", f"q{i}"), turn("assistant", f"a{i}"), turn("user", "and?"),
                          turn("assistant", f"b{i}")])
        else:  # asked again, answered otherwise (sampled): no leak, it trains
            chats.append([turn("user", f"q{i}"), turn("assistant", f"other a{i}")])
    chats.append([turn("system", "terse"), turn("user", "q0"), turn("assistant", "a0")])  # another beginning
    train, held_out = split_held_out(chats, 10, seed=0)
    beginnings = [loop.first_exchange(chats[i]) for i in held_out]
    assert len(held_out) == 10 and not {loop.first_exchange(chats[i]) for i in train} & set(beginnings)
    shared = sum(loop.first_exchange(c) in beginnings for c in chats) - len(held_out)
    assert shared > 0 and len(train) == len(chats) - len(held_out) - shared  # only those left out
    assert any(chats[i][0] == chats[j][0] for i in train for j in held_out)  # a prompt answered otherwise trains
    assert loop.first_exchange(chats[-1]) == (("system", "terse"), ("user", "q0"), ("assistant", "a0"))
    assert split_held_out(chats, 10, seed=0, max_conversations=4) == (train[:4], held_out)


def test_scored_adapters_are_placed_at_the_answer_tokens_their_runs_learned_from(base_dir, conversations,  # noqa: F811
                                                                                 tmp_path, capsys):
    """--scores: the tokens counted from an adapter's trained_conversations.txt are the ones its training counted;
    a run continued on other conversations (--init-heads, --exclude) lands further along by its own sample."""
    _, tokenizer = load_model_and_tokenizer(base_dir)
    small = dict(max_steps=2, max_conversations=6, batch_size=2, eval_examples=4, max_length=16)
    first = train(small_run(base_dir, conversations, tmp_path / "first", **small))
    second = train(small_run(base_dir, conversations, tmp_path / "second", **small, init_heads=str(tmp_path / "first"),
                             exclude=[str(tmp_path / "first" / loop.TRAINED_ON)]))
    counted = scaling.learned_answer_tokens([tmp_path / "first", tmp_path / "second"], [str(conversations)],
                                            tokenizer, max_length=16)  # shorter than a conversation: cut
    # Two steps of 2 read 4 of the 6 rows: the record lists the conversations read, not the whole sample.
    assert first["answer_tokens_seen"] < first["answer_tokens_in_data"]
    assert counted == [first["answer_tokens_seen"], first["answer_tokens_seen"] + second["answer_tokens_seen"]]

    accuracy = [[0.5, 0.2], [0.3, 0.1], [0.2, 0.1]]
    lines = [{"heads": str(tmp_path / run), "text": "held-out", "top1": [0.5, 0.3, 0.2], "rank_accuracy": accuracy}
             for run in ("second", "first")]
    scores = tmp_path / "scores.jsonl"
    scores.write_text("".join(json.dumps(line) + "\n" for line in lines))
    capsys.readouterr()  # the training logs
    assert scaling.main(["--scores", str(scores), "--data", str(conversations), "--model", str(base_dir),
                         "--max-length", "16", "--nodes", "4", "--plot", str(tmp_path / "scored.png")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert [row.split("|")[1].strip() for row in table[2:]] == ["first", "second"]  # by tokens learned
    assert f"| {counted[1] / 1e6:.2f}M |" in table[3]
    assert (tmp_path / "scored.png").stat().st_size > 1000
    with pytest.raises(SystemExit):
        scaling.main(["--scores", str(scores)])  # nothing to count the tokens in
