"""training/own-model/recipe.sh end to end on a model of a second family (Gemma 3, not Llama), set up as a base model:
a tokenizer that puts a BOS token before text and has no chat template. The script itself runs (distill --plain-text
-> train -> bench -> convert), offline, through the installed `medusa-spec`; then the heads it trained, and the
speculators folder it converted them to, decode exactly as transformers' greedy generate does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from medusa_spec import MedusaModel
from medusa_spec.bench import encode
from medusa_spec.train.loop import clock, eta_seconds
from medusa_spec.train.repetition import degenerate
from test_training import WORDS, bos_tokenizer  # WORDS: w0 .. w23, cyclic
from tiny_models import CONFIGS

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "training" / "own-model" / "recipe.sh"
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0-2: tiny_models' pad, bos and eos ids
ANSWER = 12  # words per answer the model is taught


def base_tokenizer() -> PreTrainedTokenizerFast:
    return bos_tokenizer(SPECIAL)


def counting(start: int) -> str:
    return " ".join(f"w{(start + i) % WORDS}" for i in range(1, ANSWER + 1))


def asked(start: int) -> str:
    """The plain-text format's prompt, as distill renders it after the BOS token and as generate is prompted."""
    return f"User: count from w{start}\n\nAssistant:"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """A tiny random Gemma 3 base model taught (full fine-tuning, a few seconds) to answer "count from wN" in the
    plain-text format after BOS, then to end with eos. Taught, not left random: a random model's answers are
    degenerate by nature (a word or two repeated), and the recipe's distill would rightly stop on them and train
    refuse them; a model that answers, as a real base model does in this format, needs no --allow-degenerate-data, so
    the guard stays on in the whole run (the test asserts the answers are not degenerate)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only adds contention on a shared 2-core machine
    tokenizer = base_tokenizer()
    torch.manual_seed(0)
    config = CONFIGS["gemma3"]()
    config.vocab_size = len(tokenizer)
    model = AutoModelForCausalLM.from_config(config)
    lessons = torch.tensor([tokenizer(f"{asked(s)} {counting(s)}</s>")["input_ids"] for s in range(WORDS)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(60):
        model(input_ids=lessons, labels=lessons).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.set_num_threads(threads)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    path = tmp_path_factory.mktemp("gemma3-base")
    model.eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    assert not AutoTokenizer.from_pretrained(path).chat_template  # the recipe must find the plain format itself
    return path


@pytest.fixture(scope="module")
def recipe_run(base_dir, tmp_path_factory) -> tuple[Path, str]:
    """bash recipe.sh on prompts of the user's own, sized to take seconds; returns OUT and what it printed."""
    work = tmp_path_factory.mktemp("own-model")
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"count from w{i}"}) + "\n" for i in range(WORDS)))
    bench_prompts = work / "bench_prompts.jsonl"
    bench_prompts.write_text("".join(json.dumps({"prompt": f"count from w{i}"}) + "\n" for i in (5, 17)))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # medusa-spec
           "OMP_NUM_THREADS": "1", "HEAD_TYPE": "eagle3", "NUM_HEADS": "2", "DRAFT_VOCAB": "0", "MAX_NEW_TOKENS": "16",
           "BATCH": "16", "BENCH_PROMPTS": str(bench_prompts), "BENCH_N": "2", "DEVICE": "cpu",
           "TRAIN_FLAGS": "--max-steps 40 --batch-size 4 --max-length 40 --eval-examples 4 --lr 3e-3 "
                          "--warmup-steps 2 --save-every 0 --log-every 10 --epochs 1",
           "BENCH_FLAGS": "--max-new-tokens 12"}
    env.pop("PLAIN_TEXT", None)
    run = subprocess.run(["bash", str(RECIPE), str(base_dir), str(work / "out"), str(prompts)], env=env,
                         capture_output=True, text=True, timeout=300)
    printed = run.stdout + run.stderr
    assert run.returncode == 0, printed[-4000:]
    return work / "out", printed


def test_the_recipe_distills_a_base_model_in_the_plain_format_with_real_answers(recipe_run):
    out, printed = recipe_run
    assert "format: plain text" in printed  # found from the tokenizer: no chat template
    records = [json.loads(line) for line in (out / "conversations.jsonl").read_text().splitlines()]
    assert len(records) == WORDS
    answers = {r["messages"][0]["content"]: r["messages"][1]["content"] for r in records}
    assert not any(map(degenerate, answers.values()))
    # The taught answers, so the prompts reached the model as taught: after BOS, "User: ...\n\nAssistant:" (without
    # the BOS token this model answered 15 of the 24 so).
    assert [answers[f"count from w{i}"] for i in range(WORDS)] == [counting(i) for i in range(WORDS)]


def test_the_recipe_trains_benches_and_converts_with_an_eta_throughout(recipe_run):
    out, printed = recipe_run
    trained = [line for line in printed.splitlines() if line.startswith("step=") and "loss=" in line]
    assert trained and all(" eta=" in line for line in trained)
    assert trained[-1].endswith("eta=0:00:00")  # the last step: nothing left
    assert "distill -> conversations.jsonl" in printed and "bench:" in printed  # tqdm's bars, whose ETA is their own
    overall = json.loads((out / "bench" / "bench.json").read_text())["summary"]["overall"]
    assert overall["medusa_greedy"]["equal_to_reference"] == 1
    assert "outputs identical: 100%" in printed
    config = json.loads((out / "serve" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"


@pytest.mark.parametrize("folder", ["heads", "serve"])
def test_the_recipes_heads_decode_exactly_as_greedy_generate(recipe_run, base_dir, folder):
    """The trained heads and the speculators folder convert wrote, loaded back: token-identical to transformers'
    greedy generate on held-out prompts, with heads that guess right often enough to accept several tokens a step."""
    out, _ = recipe_run
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    mm = MedusaModel.from_pretrained(base, out / folder)
    steps = tokens = 0
    for start in (3, 11, 22):
        ids = encode(tokenizer, asked(start))  # as generate and bench prompt a model without a chat template
        assert ids[0, 0] == tokenizer.bos_token_id
        expected = base.generate(ids, max_new_tokens=16, do_sample=False)
        got = mm.generate(ids, max_new_tokens=16, do_sample=False)
        assert torch.equal(got.sequences, expected)
        assert tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True) == counting(start)
        steps, tokens = steps + got.stats.steps, tokens + sum(got.stats.new_tokens)
    assert tokens / steps > 1.5  # multi-token acceptance and cache compaction were exercised


def test_train_eta_is_the_mean_step_time_times_the_steps_left_or_the_time_limit():
    assert eta_seconds(elapsed=100.0, steps_done=10, steps_left=30, time_limit=None) == 300.0
    assert eta_seconds(elapsed=100.0, steps_done=10, steps_left=30, time_limit=3) == 80.0  # 180 s - 100 s
    assert eta_seconds(elapsed=100.0, steps_done=10, steps_left=30, time_limit=60) == 300.0
    assert eta_seconds(elapsed=200.0, steps_done=10, steps_left=30, time_limit=3) == 0.0
    assert eta_seconds(elapsed=5.0, steps_done=0, steps_left=4, time_limit=None) == 20.0  # no step done: not / 0
    assert [clock(s) for s in (0, 59.6, 61, 3600 * 2 + 62)] == ["0:00:00", "0:01:00", "0:01:01", "2:01:02"]
