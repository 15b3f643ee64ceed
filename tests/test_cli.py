"""The command line on a tiny model saved to disk with a word-level tokenizer (offline)."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from medusa_spec.cli import main
from tiny_models import VOCAB, tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w3"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w3", pad_token="w0", bos_token="w1",
                                        eos_token="w2")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(path)
    tiny_model("llama").save_pretrained(path)
    return path


def test_demo_reports_identical_output(capsys):
    assert main(["demo", "--max-new-tokens", "16"]) == 0
    assert "identical to transformers greedy: True" in capsys.readouterr().out


def test_generate_streams_and_compares(model_dir, capsys):
    assert main(["generate", "w5 w9 w11 w7", "--model", str(model_dir), "--max-new-tokens", "12", "--compare"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.split()) >= 1  # streamed text
    assert "tokens/step" in captured.err and "identical: True" in captured.err


def test_chat_keeps_the_conversation(model_dir, monkeypatch, capsys):
    from medusa_spec import MedusaModel

    said = iter(["w5 w9 w11", "w7 w8", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(said))
    calls, generate = [], MedusaModel.generate

    def recording_generate(self, input_ids, **kwargs):
        out = generate(self, input_ids, **kwargs)
        calls.append((input_ids[0].tolist(), out.sequences[0].tolist()))
        return out

    monkeypatch.setattr(MedusaModel, "generate", recording_generate)
    assert main(["chat", "--model", str(model_dir), "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().err.count("tokens/step") == 2
    (first_prompt, first_output), (second_prompt, _) = calls
    # The second turn's prompt holds the first turn and the model's reply to it.
    assert second_prompt[: len(first_prompt)] == first_prompt and len(second_prompt) > len(first_output)


def test_bad_tree_is_a_clean_error(model_dir, capsys):
    assert main(["generate", "w5", "--model", str(model_dir), "--tree", "[[0,0]]"]) == 2
    assert "no parent [0]" in capsys.readouterr().err


def test_bench_writes_json_markdown_and_plot(model_dir, tmp_path, capsys):
    import json

    prompts = tmp_path / "eval.jsonl"
    prompts.write_text("\n".join(json.dumps({"category": c, "turns": [t, "second turn"]}) for c, t in
                                 [("a", "w5 w6 w7"), ("a", "w9 w9"), ("b", "w11 w12 w13 w14"), ("a", "w20")]))
    out = tmp_path / "report"
    assert main(["bench", "--model", str(model_dir), "--prompts", str(prompts), "--per-category", "2",
                 "--max-new-tokens", "10", "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    summary = report["summary"]
    assert set(summary) == {"a", "b", "overall"} and summary["overall"]["hf_greedy"]["prompts"] == 3
    for method in ("hf_prompt_lookup", "medusa_off", "medusa_greedy"):
        assert summary["overall"][method]["equal_to_reference"] == 1.0, method
    assert summary["overall"]["medusa_off"]["tokens_per_step"] == 1.0
    assert summary["overall"]["hf_greedy"]["speedup"] == 1.0
    assert "| overall | medusa_greedy |" in (out / "bench.md").read_text()
    assert (out / "bench.png").stat().st_size > 1000
