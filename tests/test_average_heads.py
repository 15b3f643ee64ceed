"""scripts/average_heads.py: the mean of the adapters along one line of runs (each trained on from the last one's
heads), saved as an adapter that loads and decodes losslessly; and `medusa-spec tree --exclude`, which measures such
an adapter's accuracies on conversations none of its runs learned from."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
from pathlib import Path

import pytest
import torch

from medusa_spec import MedusaModel
from medusa_spec.io import load_adapter, save_adapter
from medusa_spec.train.cli import add_train_commands
from medusa_spec.train.load import load_model_and_tokenizer
from medusa_spec.train.loop import TRAINED_ON, read_trained_on, train, write_trained_on
from test_training import ANSWER, ask, base_dir, conversations, small_run  # noqa: F401 (fixtures)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from average_heads import average_adapters  # noqa: E402


@pytest.fixture(scope="module")
def line(base_dir, conversations, tmp_path_factory):  # noqa: F811
    """Two adapters of one line of runs: dependent heads with a draft vocabulary, then those trained on."""
    root = tmp_path_factory.mktemp("line")
    first, second = root / "run1", root / "run2"
    train(small_run(base_dir, conversations, first, head_type="dependent", draft_vocab=16, max_steps=4))
    train(small_run(base_dir, conversations, second, init_heads=str(first), max_steps=4, seed=1))
    return first, second


def test_the_mean_of_a_line_of_runs_is_an_adapter_that_decodes_losslessly(base_dir, line, tmp_path):  # noqa: F811
    first, second = (shutil.copytree(run, tmp_path / run.name) for run in line)  # lists of their own below
    write_trained_on(first / TRAINED_ON, {"0" * 16, "1" * 16})
    write_trained_on(second / TRAINED_ON, {"1" * 16, "2" * 16})
    output = tmp_path / "mean"
    average_adapters([first, second], output)

    (_, weights_a), (config_b, weights_b) = load_adapter(first), load_adapter(second)
    config, weights = load_adapter(output)  # the recorded sha256 matches the averaged weights
    assert set(weights) == set(weights_a)
    changed = 0
    for name, tensor in weights.items():
        if tensor.is_floating_point():
            assert torch.allclose(tensor, (weights_a[name] + weights_b[name]) / 2, atol=1e-7, rtol=0), name
            changed += not torch.equal(weights_a[name], weights_b[name])
        else:  # the draft vocabulary's token map
            assert torch.equal(tensor, weights_a[name])
    assert changed  # the second run moved the heads: the mean is a new adapter
    # The second run's settings; not its accuracies, which were measured on its own weights.
    assert config.metrics == {"mean_of": [load_adapter(first)[0].weights_sha256, config_b.weights_sha256]}
    assert dataclasses.replace(config, metrics=config_b.metrics) == config_b
    assert read_trained_on(output / TRAINED_ON) == {"0" * 16, "1" * 16, "2" * 16}

    base_model, tokenizer = load_model_and_tokenizer(base_dir)
    medusa = MedusaModel.from_pretrained(base_model, output)
    prompt = torch.tensor([tokenizer.apply_chat_template([ask(3)], add_generation_prompt=True, tokenize=True,
                                                         return_dict=False)])
    out = medusa.generate(prompt, max_new_tokens=ANSWER)
    assert torch.equal(out.sequences, base_model.generate(prompt, max_new_tokens=ANSWER, do_sample=False))

    # Where one adapter has no list, what the mean learned from is unknown: none is written, nor one left over.
    (second / TRAINED_ON).unlink()
    average_adapters([first, second], output)
    assert not (output / TRAINED_ON).exists()


def test_adapters_that_cannot_be_averaged_are_refused_by_name(base_dir, conversations, line, tmp_path):  # noqa: F811
    first, second = line
    with pytest.raises(ValueError, match="two adapters or more"):
        average_adapters([first], tmp_path / "one")
    before = (second / "medusa_heads.safetensors").read_bytes()
    with pytest.raises(ValueError, match="one of the adapters averaged"):
        average_adapters([first, second], second)
    assert (second / "medusa_heads.safetensors").read_bytes() == before
    other = tmp_path / "plain"
    train(small_run(base_dir, conversations, other, max_steps=1))  # medusa heads, no draft vocabulary
    with pytest.raises(ValueError, match=r"differ in .*head_type.*one line of runs"):
        average_adapters([first, other], tmp_path / "out")
    config, weights = load_adapter(second)
    weights["token_map"] = weights["token_map"].flip(0)
    save_adapter(tmp_path / "remapped", config, weights)
    with pytest.raises(ValueError, match="token_map .*draft vocabularies"):
        average_adapters([first, tmp_path / "remapped"], tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_tree_measures_on_the_conversations_the_exclude_files_leave(base_dir, conversations, line,  # noqa: F811
                                                                    tmp_path, capsys):
    first, _ = line
    held_out = tmp_path / "held_out.txt"  # every conversation but those the heads held out in training
    trained_on = read_trained_on(first / TRAINED_ON)
    parser = argparse.ArgumentParser()
    add_train_commands(parser.add_subparsers(dest="command"))
    common = ["tree", "--heads", str(first), "--nodes", "4", "--model", str(base_dir), "--data", str(conversations),
              "--max-length", "64"]
    args = parser.parse_args(common)
    assert args.func(args) == 0
    every = load_adapter(first)[0].metrics["eval"]["positions"][0]
    write_trained_on(held_out, trained_on)
    args = parser.parse_args(common + ["--exclude", str(held_out)])
    assert args.func(args) == 0
    captured = capsys.readouterr()
    assert captured.out.strip().splitlines()[-1].startswith('{"heads"')  # stdout stays the tree's JSON
    assert "--exclude: " in captured.err
    assert 0 < load_adapter(first)[0].metrics["eval"]["positions"][0] < every
    args = parser.parse_args(["tree", "--heads", str(first), "--exclude", str(held_out)])
    with pytest.raises(ValueError, match="--exclude .* add --data"):
        args.func(args)
