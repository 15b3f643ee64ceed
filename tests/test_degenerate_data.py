"""No silent garbage: distill stops loudly once most of its answers are degenerate (empty, or fewer than three
distinct words: what a base model prompted in a format it does not know writes), keeping what it stored, and
train refuses a data folder of such answers unless told otherwise."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from medusa_spec.cli import main as cli_main
from medusa_spec.prompts import Prompt
from medusa_spec.train.data import read_conversations
from medusa_spec.train.distill import DistillConfig, distill
from medusa_spec.train.load import load_model_and_tokenizer
from medusa_spec.train.repetition import degenerate
from medusa_spec.train.server import distill_via_server
from medusa_spec.train.store import ConversationStore, read_records
from test_training import FlakyServer, base_dir, distill_settings, one_thread  # noqa: F401 (fixtures)


def test_degenerate_answers_are_empty_or_of_fewer_than_three_distinct_words():
    for answer in ("", "?", "(", "Assistant", "Assistant Assistant Assistant ...", "the the the and the", "Paris."):
        assert degenerate(answer), answer
    for answer in ("Hi, I am trying to build a PC.", "x = 1 + y", "北京是中国的首都。"):
        assert not degenerate(answer), answer


def prompts(n: int) -> list[Prompt]:
    return [Prompt(f"p{i}", (f"count from w{i}",)) for i in range(n)]


def test_distill_stops_loudly_when_most_answers_are_degenerate_and_keeps_a_resumable_store(base_dir, tmp_path,  # noqa: F811
                                                                                           capsys):
    """Two new tokens an answer: "w2 w3", two words, each answer degenerate. After a window of 20 the run stops,
    naming the likely causes; the conversations finished before are stored whole (a sealed chunk of the first 16
    and the open one), and a rerun resumes from them."""
    base_model, tokenizer = load_model_and_tokenizer(base_dir)
    output = tmp_path / "data"
    settings = dict(max_new_tokens=2, batch_size=4, chunk_size=4, degenerate_window=20)
    with pytest.raises(ValueError, match=r"distill stopped: 20 of the last 20 answers are degenerate .*'w\d+ w\d+'.* "
                                         r"BOS token.*chat template.*--plain-text.*new --output"):
        distill(base_model, tokenizer, prompts(24), distill_settings(base_dir, output, **settings), progress=False)
    stored = read_records(output)
    assert len(stored) == 19  # the 20th answer stopped the run before its conversation was stored
    assert len({r["id"] for r in stored}) == 19 and {r["id"] for r in stored} < {p.id for p in prompts(24)}
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in stored)
    assert sorted(p.name for p in output.iterdir()) == ["model.json", "open.jsonl", "part-00000.jsonl.gz"]
    assert ConversationStore(output).done == {r["id"] for r in stored}  # opens as a writer: nothing to mend

    # Told to go on (--max-degenerate 1): the rest only, each stored once; the progress line shows the shares.
    stats = distill(base_model, tokenizer, prompts(24), distill_settings(base_dir, output, max_degenerate=1.0,
                                                                         **settings))
    assert (stats["skipped_finished"], stats["written"]) == (19, 5)
    assert (stats["answers"], stats["degenerate"], stats["cut"]) == (5, 5, 5)
    assert sorted(r["id"] for r in read_records(output)) == sorted(p.id for p in prompts(24))
    # The bar counts each conversation as it ends (5 of 5), not as its chunk of 16 is stored (0 of 5 before).
    assert re.search(r"5/5 \[.*tok_per_s=\d+\.\d, degenerate=100%, cut=100%]", capsys.readouterr().err)


def test_distill_goes_on_while_degenerate_answers_are_a_minority(base_dir, tmp_path):  # noqa: F811
    """The counting model's answers (16 words) pass; a cut answer is counted, not held against the run."""
    base_model, tokenizer = load_model_and_tokenizer(base_dir)
    cfg = distill_settings(base_dir, tmp_path / "out.jsonl", max_new_tokens=8, degenerate_window=2)
    stats = distill(base_model, tokenizer, prompts(6), cfg, progress=False)
    assert (stats["written"], stats["answers"], stats["degenerate"], stats["cut"]) == (6, 6, 0, 6)


def test_distill_through_a_server_stops_so_too(tmp_path):
    server = FlakyServer([], content="w1 w2")  # every answer two words
    try:
        cfg = DistillConfig(model=None, prompts=[], output=str(tmp_path / "out"), server=server.url, server_model="m",
                            concurrency=1, degenerate_window=3)
        with pytest.raises(ValueError, match="distill stopped: 3 of the last 3 answers are degenerate"):
            distill_via_server(prompts(6), cfg, progress=False)
        assert len(read_records(tmp_path / "out")) == 3  # stored one by one, the third before it was judged
        stats = distill_via_server(prompts(6), dataclasses.replace(cfg, max_degenerate=1.0), progress=False)
        assert (stats["written"], stats["answers"], stats["degenerate"]) == (3, 3, 3)
    finally:
        server.server.shutdown()


def write(path, answers: list[str]):
    path.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"count from w{i}"},
                                                                    {"role": "assistant", "content": text}]}) + "\n"
                            for i, text in enumerate(answers)))
    return path


def test_train_refuses_mostly_degenerate_data_unless_allowed(base_dir, tmp_path, capsys):  # noqa: F811
    good = " ".join(f"w{i}" for i in range(2, 18))
    data = write(tmp_path / "data.jsonl", ["", "Assistant Assistant Assistant", "w2 w3", good, good])
    train = ["train", "--model", str(base_dir), "--data", str(data), "--num-heads", "2", "--max-length", "64",
             "--batch-size", "1", "--max-steps", "1", "--eval-examples", "1", "--save-every", "0"]
    assert cli_main(train + ["--output", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert f"{data}: 3 of its 5 answers are degenerate" in err
    assert all(words in err for words in ("BOS token", "chat template", "--plain-text", "--allow-degenerate-data"))
    assert not (tmp_path / "refused").exists() or not any((tmp_path / "refused").iterdir())

    assert cli_main(train + ["--output", str(tmp_path / "allowed"), "--allow-degenerate-data"]) == 0
    assert (tmp_path / "allowed" / "medusa_config.json").is_file()
    # Half or fewer degenerate: read for training without a word.
    write(data, ["", "w2 w3", good, good])
    assert len(read_conversations(data, refuse_degenerate=True)) == 4
