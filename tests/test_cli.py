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


def test_bad_tree_is_a_clean_error(model_dir, capsys):
    assert main(["generate", "w5", "--model", str(model_dir), "--tree", "[[0,0]]"]) == 2
    assert "no parent [0]" in capsys.readouterr().err
