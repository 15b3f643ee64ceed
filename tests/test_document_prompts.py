"""scripts/document_prompts.py: a prompt pool of tasks over the model's own answers (summaries, extraction,
rewriting, answers from given documents) and of translations into English, for distill."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from medusa_spec.prompts import read_prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import document_prompts  # noqa: E402


def answer(i: int) -> str:
    return f"Answer {i}: " + " ".join(f"w{i}x{j}" for j in range(80))  # about 500 characters, no word repeated


LOOP = "the cat sat on the mat and then " * 20  # long enough, but a loop: never a document


@pytest.fixture
def data(tmp_path):
    conversations = [[{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": answer(i)}]
                     for i in range(10)]
    conversations += [
        [{"role": "user", "content": "Looping?"}, {"role": "assistant", "content": LOOP}],
        [{"role": "user", "content": "Short?"}, {"role": "assistant", "content": "Too short to summarize."}],
        # usable as a document, but its two-line question cannot close an answer-from-documents prompt
        [{"role": "user", "content": "Two\nlines?"}, {"role": "assistant", "content": answer(10)}],
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    return path


@pytest.fixture
def oasst(tmp_path):
    records = [{"input": "### Human: Hola, ¿qué tal? ### Assistant: Bien.", "lang": "es"},
               {"input": "### Human: Hello there ### Assistant: Hi.", "lang": "en"},
               {"input": "### Human: Guten Tag", "lang": "de"},
               {"input": "### Human: Guten Tag ### Assistant: Hallo. ### Human: Wie geht's?", "lang": "de"},
               {"input": "### Human: " + "Sehr lang. " * 100, "lang": "de"},
               {"input": "### Human: Tere", "lang": "et"}]
    path = tmp_path / "oasst.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def test_tasks_are_built_over_distinct_clean_answers_and_non_english_turns(data, oasst, tmp_path, capsys):
    out = tmp_path / "docs.jsonl"
    document_prompts.main([str(data), str(out), "--tasks", "8", "--translate", str(oasst)])
    tasks = [json.loads(line) for line in out.read_text().splitlines()]
    by_kind = {}
    for t in tasks:
        by_kind.setdefault(t["category"], []).append(t["prompt"])
    assert {k: len(v) for k, v in by_kind.items()} == {"summarization": 2, "extraction": 2, "rewriting": 2,
                                                       "rag": 2, "translation": 2}
    # English, unknown languages, overlong turns and repeats are left out; the human turn alone is asked.
    assert sorted(by_kind["translation"]) == ["Translate German to English: Guten Tag",
                                              "Translate Spanish to English: Hola, ¿qué tal?"]
    used = []
    for kind in ("summarization", "extraction", "rewriting"):
        for prompt in by_kind[kind]:
            docs = [i for i in range(11) if answer(i) in prompt]
            assert len(docs) == 1 and any(prompt == t.format(doc=answer(docs[0]))
                                          for t in document_prompts.TEMPLATES[kind])
            used += docs
    for prompt in by_kind["rag"]:
        first, second, question = prompt.split("\n")
        docs = [i for i in range(11) if answer(i) in (first, second)]
        assert len(docs) == 2 and question in (f"Question {i}?" for i in docs)
        used += docs
    assert len(used) == len(set(used)) == 10  # every document once: 6 tasks on one, 2 on two
    assert not any("cat sat" in t["prompt"] or "Too short" in t["prompt"] or "Two\nlines?" in t["prompt"]
                   for t in tasks)
    # distill reads the file as a prompt pool, categories included
    prompts = read_prompts(out)
    assert [p.turns[0] for p in prompts] == [t["prompt"] for t in tasks]
    assert [p.category for p in prompts] == [t["category"] for t in tasks]
    assert json.loads(capsys.readouterr().out.strip())["prompts"] == 10


def test_an_existing_pool_is_never_rewritten_and_too_many_tasks_are_refused(data, tmp_path):
    out = tmp_path / "docs.jsonl"
    document_prompts.main([str(data), str(out), "--tasks", "4"])
    before = out.read_text()
    with pytest.raises(SystemExit, match="not rewritten"):
        document_prompts.main([str(data), str(out), "--tasks", "4"])
    assert out.read_text() == before
    with pytest.raises(SystemExit, match="ask for fewer --tasks"):
        document_prompts.main([str(data), str(tmp_path / "more.jsonl"), "--tasks", "10"])
    assert not (tmp_path / "more.jsonl").exists()
    # the same data and seed give the same file
    document_prompts.main([str(data), str(tmp_path / "again.jsonl"), "--tasks", "4"])
    assert (tmp_path / "again.jsonl").read_text() == before
