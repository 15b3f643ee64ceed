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

