"""scripts/compare_heads.py --prompts: adapters scored on the base model's own answers to evaluation prompts, per
category and pooled, on answers kept in a file so that later runs score the very same text."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from medusa_spec import MedusaModel
from medusa_spec.base import inspect_base_model
from medusa_spec.train.data import make_rows, tokenize_conversation
from medusa_spec.train.evaluate import evaluate
from medusa_spec.train.load import load_model_and_tokenizer
from medusa_spec.train.loop import train
from medusa_spec.train.module import TrainModule
from test_training import ANSWER, ask, base_dir, conversations, small_run  # noqa: F401 (fixtures)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import compare_heads  # noqa: E402


@pytest.fixture(scope="module")
def adapter(base_dir, conversations, tmp_path_factory):  # noqa: F811
    """Heads trained briefly on the counting model's answers: right often enough that every count is tested."""
    output_dir = tmp_path_factory.mktemp("heads")
    train(small_run(base_dir, conversations, output_dir, max_steps=30, eval_examples=0))
    return output_dir


def test_heads_are_scored_per_category_on_the_base_models_own_answers(base_dir, adapter, tmp_path,  # noqa: F811
                                                                       capsys, monkeypatch):
    starts = {"early": [1, 2, 3], "late": [17, 18]}
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"category": category, "turns": [ask(s)["content"]]}) + "\n"
                               for category, group in starts.items() for s in group))
    answers = tmp_path / "answers.jsonl"
    argv = ["--model", str(base_dir), "--heads", str(adapter), "--prompts", str(prompts), "--answers", str(answers),
            "--max-new-tokens", str(ANSWER + 4), "--batch-size", "2"]
    compare_heads.main(argv)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    # The answers are the base's greedy ones, as transformers' generate gives them.
    base_model, tokenizer = load_model_and_tokenizer(base_dir)
    records = [json.loads(line) for line in answers.read_text().splitlines()]
    assert [r["category"] for r in records] == ["early"] * 3 + ["late"] * 2
    for record in records:
        ids = tokenizer.apply_chat_template(record["messages"][:1], add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        reference = base_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        max_new_tokens=ANSWER + 4, pad_token_id=tokenizer.pad_token_id)
        assert record["messages"][1]["content"] == tokenizer.decode(reference[0, ids.shape[1]:],
                                                                    skip_special_tokens=True).strip()

    # Each category is scored on its own answers; the pooled line equals scoring all of them at once.
    assert [line["text"] for line in lines] == ["early", "late", "all"]
    medusa = MedusaModel.from_pretrained(base_model, adapter)
    spec = inspect_base_model(base_model)
    module = TrainModule(base_model, medusa.heads, spec.bool_mask, spec.takes_logits_to_keep)
    examples = [tokenize_conversation(tokenizer, r["messages"], keep_loops=True) for r in records]
    longest = max(len(e.input_ids) for e in examples)
    for line, chosen in zip(lines, (examples[:3], examples[3:], examples)):
        direct = evaluate(module, make_rows(chosen, longest, pack=True), 2, tokenizer.pad_token_id, 8, Accelerator())
        assert line["positions"] == direct["positions"][0] > 0
        assert line["top1"] == direct["top1"] and line["top8"] == direct["top8"]
        assert 0 < line["top1"][0] and 1.0 <= line["expected_4_nodes"] <= line["expected_8_nodes"] <= 4.0
    assert lines[2]["positions"] == lines[0]["positions"] + lines[1]["positions"]

    # A second run reads the kept answers instead of generating, and scores the same.
    monkeypatch.setattr(compare_heads, "answer", lambda *args: pytest.fail("answered the prompts again"))
    compare_heads.main(argv)
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == lines
    # Answers kept for other prompts are refused, not scored as these.
    prompts.write_text(json.dumps({"category": "early", "turns": [ask(5)["content"]]}) + "\n")
    with pytest.raises(SystemExit, match="answers to other prompts"):
        compare_heads.main(argv)


def test_copy_positions_split_the_same_positions_and_hits_as_compare_heads(base_dir, adapter, tmp_path,  # noqa: F811
                                                                           capsys):
    import copy_positions

    # The 3 tokens known at t (ids[t-1 : t+2]) occurred before, ending at t or earlier: the token after them copies.
    ids = [1, 2, 3, 4, 1, 2, 3, 4]
    assert copy_positions.copied(ids, ids[2:]) == [False] * 5 + [True]
    assert copy_positions.copied(ids, ids[2:-1] + [9]) == [False] * 6
    assert copy_positions.copied([7] * 6, [7] * 4) == [False, False, True, True]  # the first (7, 7, 7) ends at t = 2

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"category": c, "turns": [ask(s)["content"]]}) + "\n"
                               for c, s in (("early", 1), ("early", 2), ("late", 17))))
    answers = tmp_path / "answers.jsonl"
    copy_positions.main(["--model", str(base_dir), "--heads", str(adapter), "--prompts", str(prompts),
                         "--answers", str(answers), "--max-new-tokens", str(ANSWER + 4)])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["text"] for line in lines] == ["early", "late", "all"]

    base_model, tokenizer = load_model_and_tokenizer(base_dir)
    records = [json.loads(line) for line in answers.read_text().splitlines()]
    medusa = MedusaModel.from_pretrained(base_model, adapter)
    spec = inspect_base_model(base_model)
    module = TrainModule(base_model, medusa.heads, spec.bool_mask, spec.takes_logits_to_keep).eval()
    counts = copy_positions.count(module, tokenizer, records)
    # Counting never repeats 3 words in a row within 24 words, so no answer copies; an answer that repeats a phrase
    # does where the base, counting on, agrees with the repeat.
    assert counts["early"][0] == counts["late"][0] == 0
    repeat = {"category": "repeat",
              "messages": [ask(1), {"role": "assistant", "content": " ".join(["w2 w3 w4 w5"] * 3)}]}
    assert copy_positions.count(module, tokenizer, [repeat])["repeat"][0] > 0
    examples = [tokenize_conversation(tokenizer, r["messages"], keep_loops=True) for r in records]
    longest = max(len(e.input_ids) for e in examples)
    for line, category, chosen in zip(lines, ("early", "late"), (examples[:2], examples[2:])):
        direct = evaluate(module, make_rows(chosen, longest, pack=True), 2, tokenizer.pad_token_id, 8, Accelerator())
        copies, copy_hits, others, other_hits = counts[category]
        assert line["positions"] == copies + others == direct["positions"][0] > 0
        assert round((copy_hits + other_hits) / (copies + others), 4) == direct["top1"][0]
        assert line["copy_share"] == round(copies / (copies + others), 3)
    assert lines[2]["positions"] == lines[0]["positions"] + lines[1]["positions"]
