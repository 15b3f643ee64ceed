"""Training pipeline (medusa_spec.train) on CPU with tiny models built here.

The base model is a tiny Llama first taught to count ("count from w5" -> "w6 w7 w8 ..."), so its
own greedy continuations are predictable several tokens ahead: heads trained on its
self-distilled answers must then reach high accuracy and multi-token steps.
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import json
import math
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from peft import PeftModel
from safetensors.torch import load_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from tokenizers.processors import TemplateProcessing
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import medusa_spec.train.server
from medusa_spec import MedusaConfig, MedusaModel, grow_tree
from medusa_spec.bench import encode
from medusa_spec.cli import main as cli_main
from medusa_spec.prompts import Prompt, parse_prompt_spec, read_prompt_files, read_prompts
from medusa_spec.train import data as data_module
from medusa_spec.train import loop
from medusa_spec.train.cli import add_train_commands
from medusa_spec.train.config import TrainConfig
from medusa_spec.train.data import (
    PLAIN_TEXT_TEMPLATE,
    Example,
    collate,
    make_rows,
    read_conversations,
    require_chat_template,
    tokenize_conversation,
    tokenize_conversations,
)
from medusa_spec.train.distill import (
    SEALED_PROMPTS,
    SELF_PROMPTS,
    DistillConfig,
    answer,
    distill,
    model_identity,
    read_self_prompts,
)
from medusa_spec.train.draft_vocab import answer_token_counts, frequent_tokens
from medusa_spec.train.evaluate import calibrate_tree, count_rank_hits
from medusa_spec.train.load import load_model_and_tokenizer
from medusa_spec.train.loop import train
from medusa_spec.train.loss import heads_loss, kl_to_teacher, linear_cross_entropy, shifted_cross_entropy
from medusa_spec.train.module import TrainModule
from medusa_spec.train.options import resolve
from medusa_spec.train.server import ServerError, distill_via_server
from medusa_spec.train.store import read_records, record_model, recorded_model_differences

WORDS = 24  # the counting vocabulary w0 .. w23, cyclic
SPECIAL = ["<pad>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
ANSWER = 16  # words per answer in the base model's lessons


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matrices: a second thread only adds contention on a shared 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_tokenizer(chat_template: str | None = TEMPLATE) -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(SPECIAL + ["count", "from"] + [f"w{i}" for i in range(WORDS)])}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>",
                                   eos_token="<|end|>", additional_special_tokens=SPECIAL[2:5])
    fast.chat_template = chat_template
    return fast


def counting(start: int, length: int = ANSWER) -> str:
    return " ".join(f"w{(start + i) % WORDS}" for i in range(1, length + 1))


def ask(start: int) -> dict:
    return {"role": "user", "content": f"count from w{start}"}


def tiny_llama(tokenizer) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny Llama taught to count (full fine-tuning, ~3 s), saved with its tokenizer."""
    tokenizer = make_tokenizer()
    model = tiny_llama(tokenizer)
    lessons = torch.tensor([tokenizer.apply_chat_template([ask(s), {"role": "assistant", "content": counting(s)}],
                                                          tokenize=True, return_dict=False) for s in range(WORDS)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        model(input_ids=lessons, labels=lessons).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    path = tmp_path_factory.mktemp("base")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def conversations(base_dir, tmp_path_factory):
    """48 self-distilled answers of the counting base model."""
    base_model, tokenizer = load_model_and_tokenizer(base_dir)
    output = tmp_path_factory.mktemp("data") / "conversations.jsonl"
    prompts = [Prompt(f"p{i}", (f"count from w{i % WORDS}",)) for i in range(48)]
    settings = distill_settings(base_dir, output, batch_size=16, max_new_tokens=ANSWER + 4)
    distill(base_model, tokenizer, prompts, settings, progress=False)
    return output


def distill_settings(base_dir, output, **settings) -> DistillConfig:
    return DistillConfig(model=str(base_dir), prompts=[], output=str(output), **settings)


def small_run(base_dir, data, output_dir, **overrides) -> TrainConfig:
    settings = dict(model=str(base_dir), data=[str(data)], output=str(output_dir), num_heads=3, max_length=64,
                    batch_size=4, lr=1e-2, warmup_steps=5, eval_examples=8, log_every=50, save_every=0)
    return TrainConfig(**{**settings, **overrides})


@pytest.fixture(scope="module")
def trained(base_dir, conversations, tmp_path_factory):
    """A Medusa-1 adapter: 100 steps on the self-distilled conversations."""
    output_dir = tmp_path_factory.mktemp("medusa1")
    summary = train(small_run(base_dir, conversations, output_dir, max_steps=100))
    return output_dir, summary


# ---------------------------------------------------------------- losses


def one_hot_logits(ids: torch.Tensor, num_heads: int, vocab: int, lookahead) -> torch.Tensor:
    """Head logits [B, T, K, V] that put all mass on ids[t + lookahead(k)] (0 where past the end)."""
    batch, length = ids.shape
    logits = torch.zeros(batch, length, num_heads, vocab)
    for k in range(num_heads):
        ahead = lookahead(k)
        logits[:, : length - ahead, k] = 100.0 * torch.nn.functional.one_hot(ids[:, ahead:], vocab)
    return logits


def identity_projections(num_heads: int, vocab: int) -> list:
    """Projections that pass head states through unchanged: the states are the logits."""
    return [(torch.eye(vocab), None)] * num_heads


def test_heads_loss_is_zero_for_the_right_shift_and_large_off_by_one():
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(40, generator=g)[:12] for _ in range(2)])  # no repeats within a row
    mask, segments = torch.ones_like(ids, dtype=torch.bool), torch.ones_like(ids)
    right, per_head = heads_loss(one_hot_logits(ids, 3, 40, lambda k: k + 2), identity_projections(3, 40), ids, mask,
                                 segments, decay=0.8)
    assert right.item() < 1e-6 and per_head.max().item() < 1e-6
    for wrong_shift in (lambda k: k + 1, lambda k: k + 3):
        wrong, per_head = heads_loss(one_hot_logits(ids, 3, 40, wrong_shift), identity_projections(3, 40), ids, mask,
                                     segments, decay=0.8)
        assert wrong.item() > 50 and per_head.min().item() > 50


def test_losses_skip_non_assistant_targets_and_other_examples_of_a_packed_row():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 8, 10, generator=g)
    ids = torch.randint(0, 10, (1, 8), generator=g)
    # Only position 6 -> token 7 is an assistant target of the same example as its predictor.
    mask = torch.tensor([[0, 0, 1, 1, 0, 0, 0, 1]], dtype=torch.bool)
    segments = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 2]])
    expected = torch.nn.functional.cross_entropy(logits[0, [1, 2, 6]], ids[0, [2, 3, 7]])
    assert torch.allclose(shifted_cross_entropy(logits, ids, mask, segments, shift=1), expected)
    # Shift 2: position 2 -> 4 crosses into the second example, so only 0 -> 2, 1 -> 3 and 5 -> 7 count.
    expected = torch.nn.functional.cross_entropy(logits[0, [0, 1, 5]], ids[0, [2, 3, 7]])
    assert torch.allclose(shifted_cross_entropy(logits, ids, mask, segments, shift=2), expected)


def test_kl_to_teacher_is_zero_only_for_the_same_distribution():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 6, 11, generator=g)
    mask, segments = torch.ones(2, 6, dtype=torch.bool), torch.ones(2, 6, dtype=torch.long)
    assert kl_to_teacher(logits, logits.clone(), mask, segments).item() < 1e-6
    assert kl_to_teacher(logits, torch.randn(2, 6, 11, generator=g), mask, segments).item() > 0.1


def test_soft_targets_reduce_to_the_token_loss_for_a_certain_teacher_and_are_met_by_its_distribution():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 12, (2, 10), generator=g)
    mask, segments = torch.ones_like(ids, dtype=torch.bool), torch.ones_like(ids)
    head_logits = torch.randn(2, 10, 3, 12, generator=g)
    # A teacher sure of the data's next token (its logits at t - 1 name token t): the token loss exactly.
    certain = 1e4 * torch.nn.functional.one_hot(torch.cat([ids[:, 1:], ids[:, :1]], dim=1), 12).float()
    identity = identity_projections(3, 12)
    soft, soft_per_head = heads_loss(head_logits, identity, ids, mask, segments, 0.8, teacher_logits=certain)
    hard, hard_per_head = heads_loss(head_logits, identity, ids, mask, segments, 0.8)
    assert torch.allclose(soft, hard) and torch.allclose(soft_per_head, hard_per_head)
    # An unsure teacher: head k's loss is smallest, its entropy, when head k at t says what the teacher
    # says at t + k + 1, and larger for the neighbouring offsets.
    teacher = torch.randn(2, 10, 12, generator=g)
    entropy = -(teacher.softmax(-1) * teacher.log_softmax(-1)).sum(-1)
    for ahead in (k + 1 for k in range(3)):
        copied = torch.zeros(2, 10, 3, 12)
        for k in range(3):
            copied[:, : 10 - ahead, k] = teacher[:, ahead:]
        _, per_head = heads_loss(copied, identity, ids, mask, segments, 0.8, teacher_logits=teacher)
        k = ahead - 1
        assert torch.allclose(per_head[k], entropy[:, k + 1: 10 - 1].mean(), atol=1e-5)
        assert all(per_head[j] > entropy.mean() + 0.1 for j in range(3) if j != k)


@pytest.mark.parametrize("soft", [False, True])
def test_chunked_linear_cross_entropy_matches_autograd_in_value_and_gradients(soft):
    g = torch.Generator().manual_seed(4)
    states = torch.randn(10, 6, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(15, 6, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(15, generator=g, dtype=torch.float64, requires_grad=True)
    if soft:
        targets = torch.randn(10, 15, generator=g, dtype=torch.float64)
    else:
        targets = torch.randint(0, 15, (10,), generator=g)
    # chunks of 4 rows: 3 chunks, the last one short
    total = linear_cross_entropy(states, weight, bias, targets, chunk_rows=4)
    (2.5 * total).backward()
    fused = [t.grad.clone() for t in (states, weight, bias)]
    for t in (states, weight, bias):
        t.grad = None
    logits = torch.nn.functional.linear(states, weight, bias)
    wanted = targets.softmax(-1) if soft else targets
    expected = torch.nn.functional.cross_entropy(logits, wanted, reduction="sum")
    (2.5 * expected).backward()
    assert torch.allclose(total, expected)
    for got, want in zip(fused, (states.grad, weight.grad, bias.grad)):
        assert torch.allclose(got, want, atol=1e-10)


def test_heads_loss_projects_only_the_positions_with_a_target():
    """A reduced vocabulary's -1 targets and non-assistant positions are left out of the mean, and the
    loss equals the plain logits-then-cross-entropy one over the rest."""
    g = torch.Generator().manual_seed(5)
    states = torch.randn(2, 9, 2, 4, generator=g)
    weight = torch.randn(7, 4, generator=g)
    targets = torch.randint(-1, 7, (2, 9), generator=g)
    ids = targets.clamp(min=0) + 100  # token ids; `targets` are their draft indices
    mask = torch.rand(2, 9, generator=g) > 0.3
    segments = torch.ones(2, 9, dtype=torch.long)
    loss, per_head = heads_loss(states, [(weight, None)] * 2, ids, mask, segments, 0.5, targets)
    logits = states @ weight.T
    for k in range(2):
        shift = k + 2
        valid = mask[:, shift:] & (targets[:, shift:] >= 0)
        expected = torch.nn.functional.cross_entropy(logits[:, :-shift, k][valid], targets[:, shift:][valid])
        assert torch.allclose(per_head[k], expected, atol=1e-6)
    assert torch.allclose(loss, per_head[0] + 0.5 * per_head[1])


def test_rank_hits_compare_with_the_base_greedy_token_at_that_offset():
    base_logits = torch.zeros(1, 6, 9)
    base_logits[0, torch.arange(6), torch.tensor([3, 5, 7, 2, 4, 6])] = 1.0  # greedy token for positions 1..6
    head_logits = torch.zeros(1, 6, 1, 9)
    head_logits[0, 0, 0, 5] = 2.0  # head 0 at t=0 guesses position 2: the base's token there is 5 -> rank 0
    head_logits[0, 0, 0, 1] = 1.0
    head_logits[0, 1, 0, 1] = 2.0  # at t=1 guesses position 3 (base: 7) with 7 second -> rank 1
    head_logits[0, 1, 0, 7] = 1.0
    ones = torch.ones(1, 6, dtype=torch.long)
    hits, positions = count_rank_hits(head_logits, base_logits, ones.bool(), ones, top_k=2)
    assert positions.tolist() == [4]
    assert hits[0].tolist() == [1, 1]


# ---------------------------------------------------------------- data


def test_packed_rows_give_each_example_the_logits_it_has_alone():
    tokenizer = make_tokenizer()
    model = tiny_llama(tokenizer).eval()
    examples = [Example(list(range(6, 6 + n)), [True] * n) for n in (5, 9, 3)]
    rows = make_rows(examples, max_length=16, pack=True)
    assert [len(row) for row in rows] == [2, 1]
    batch = collate(rows, tokenizer.pad_token_id)
    module = TrainModule(model, MedusaModel.from_base(model).heads, bool_mask=True, takes_logits_to_keep=True)
    with torch.no_grad():
        packed = module(batch["input_ids"], batch["position_ids"], batch["segment_ids"], base_logits=True).base_logits
        alone = [model(torch.tensor([e.input_ids])).logits[0] for e in examples]
    assert torch.allclose(packed[0, :5], alone[0], atol=1e-5)
    assert torch.allclose(packed[0, 5:14], alone[1], atol=1e-5)
    assert torch.allclose(packed[1, :3], alone[2], atol=1e-5)


def test_loss_mask_covers_exactly_the_assistant_turns():
    tokenizer = make_tokenizer()
    messages = [ask(3), {"role": "assistant", "content": "w4 w5"}, ask(9), {"role": "assistant", "content": "w10"}]
    example = tokenize_conversation(tokenizer, messages)
    marked = [t for t, m in zip(tokenizer.convert_ids_to_tokens(example.input_ids), example.loss_mask) if m]
    assert marked == ["w4", "w5", "<|end|>", "w10", "<|end|>"]


def test_conversations_tokenized_in_several_processes_come_back_whole_and_in_order(monkeypatch):
    tokenizer = make_tokenizer()
    conversations = [[ask(3 + i % 7), {"role": "assistant", "content": " ".join(f"w{4 + j}" for j in range(i % 5 + 1)),
                      "cut": i % 3 == 0}] for i in range(50)]
    serial = [tokenize_conversation(tokenizer, messages) for messages in conversations]
    pools = []
    real_pool = data_module.ProcessPoolExecutor
    monkeypatch.setattr(data_module, "ProcessPoolExecutor", lambda *a, **k: pools.append(a) or real_pool(*a, **k))
    monkeypatch.setattr(data_module, "PER_WORKER", 10)
    assert tokenize_conversations(tokenizer, conversations, workers=3) == serial
    assert pools == [(3,)]  # three processes, 17 + 17 + 16 conversations
    assert tokenize_conversations(tokenizer, conversations[:25], workers=3) == serial[:25]  # 2 processes of 13 and 12
    assert pools == [(3,), (2,)]
    assert tokenize_conversations(tokenizer, conversations[:15], workers=3) == serial[:15]  # too few: no processes
    assert pools == [(3,), (2,)]


def test_an_answer_distill_stopped_trains_no_end_of_turn_marker():
    """An answer marked cut (max_new_tokens reached, a loop cut off) did not end there: the end-of-turn marker the
    template puts after it is not the model's token, so it stays out of the loss; an answer that ended keeps it."""
    tokenizer = make_tokenizer()
    messages = [ask(3), {"role": "assistant", "content": "w4 w5", "cut": True}, ask(9),
                {"role": "assistant", "content": "w10"}, ask(20), {"role": "assistant", "content": "w21", "cut": True}]
    example = tokenize_conversation(tokenizer, messages)
    marked = [t for t, m in zip(tokenizer.convert_ids_to_tokens(example.input_ids), example.loss_mask) if m]
    assert marked == ["w4", "w5", "w10", "<|end|>", "w21"]
    empty = [ask(3), {"role": "assistant", "content": "", "cut": True}, ask(9), {"role": "assistant", "content": "w10"}]
    example = tokenize_conversation(tokenizer, empty)  # a loop from the first token: nothing of it trains
    assert [t for t, m in zip(tokenizer.convert_ids_to_tokens(example.input_ids), example.loss_mask) if m] == [
        "w10", "<|end|>"]


def test_distill_marks_the_answers_it_stopped(base_dir, tmp_path):
    base_model, tokenizer = load_model_and_tokenizer(base_dir)
    output = tmp_path / "out.jsonl"
    # The model counts ANSWER words and ends its turn: a budget below that stops it, one above lets it end.
    for budget, cut in ((ANSWER - 4, True), (ANSWER + 4, False)):
        distill(base_model, tokenizer, [Prompt(f"b{budget}", ("count from w1",))],
                distill_settings(base_dir, output, max_new_tokens=budget), progress=False)
        reply = read_records(output)[-1]["messages"][1]
        assert reply.get("cut", False) is cut and reply["content"] == counting(1, min(budget, ANSWER)), reply


def test_a_loop_is_cut_from_the_last_answer_and_left_out_of_the_loss_before_another_turn():
    tokenizer = make_tokenizer()
    loop = {"role": "assistant", "content": counting(0, 80)}  # the counting words are cyclic: a loop of period 24
    messages = [ask(0), loop, ask(9), loop]
    example = tokenize_conversation(tokenizer, messages)
    tokens = tokenizer.convert_ids_to_tokens(example.input_ids)
    once = counting(0, 24).split()
    assert [t for t, m in zip(tokens, example.loss_mask) if m] == once + once  # each answer up to its loop
    assert tokens[-24:] == once  # the last answer ends there; the first stays whole, as the next turn read it
    assert len(tokens) == len(tokenize_conversation(tokenizer, messages[:2], keep_loops=True).input_ids) + 6 + 24
    kept = tokenize_conversation(tokenizer, messages, keep_loops=True)
    assert sum(kept.loss_mask) == 2 * (80 + 1)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_prompt_readers_by_record_shape(tmp_path):
    human = "### Human: Hi there ### Assistant: Hello! ### Human: Tell a joke ### Assistant:"
    cases = {
        "bare.jsonl": (["What is 2+2?"], [("What is 2+2?",)]),
        "gsm.jsonl": ([{"question": "How many?", "answer": "3"}], [("How many?",)]),
        "arena.jsonl": ([{"uid": "x", "prompt": "Write zig"}], [("Write zig",)]),
        "mbpp.jsonl": ([{"text": "Write a function", "code": "def f(): pass"}], [("Write a function",)]),
        "oasst.jsonl": ([{"input": human, "lang": "en"}], [("Hi there", "Tell a joke")]),
        "mtbench.jsonl": ([{"question_id": 1, "turns": ["First?", "Second?"]}], [("First?", "Second?")]),
        "self_instruct.jsonl": ([{"instruction": "Classify.", "instances": [{"input": "a cat"}, {"input": ""}]}],
                                [("Classify.\n\na cat",), ("Classify.",)]),
    }
    for name, (records, turns) in cases.items():
        prompts = read_prompts(write_jsonl(tmp_path / name, records))
        assert [p.turns for p in prompts] == turns, name
    capped = read_prompts(write_jsonl(tmp_path / "many.jsonl", [f"q{i}" for i in range(10)]), limit=4)
    assert [p.id for p in capped] == ["many.jsonl:1", "many.jsonl:2", "many.jsonl:3", "many.jsonl:4"]


SHARED_TRAIN = Path(__file__).resolve().parents[2] / "shared" / "data" / "train"


@pytest.mark.skipif(not SHARED_TRAIN.is_dir(), reason="the shared prompt pools are not beside this checkout")
def test_every_shared_prompt_pool_reads():
    counts = {path.name: len(read_prompts(path)) for path in sorted(SHARED_TRAIN.glob("*.jsonl"))}
    assert counts["gsm8k_train.jsonl"] == 7473 and counts["mbpp.jsonl"] == 974
    assert counts["oasst1_val_prompts_qlora_oa_questions.jsonl"] == 953
    assert counts["arena_hard_v2.0_question.jsonl"] == 750 and counts["oasst_prompt_lottery_en_250.jsonl"] == 250
    assert counts["self_instruct_seed_tasks.jsonl"] >= 175  # one prompt per instance
    oasst = read_prompts(SHARED_TRAIN / "oasst1_val_prompts_qlora_oa_questions.jsonl")
    multi_turn = [p for p in oasst if len(p.turns) > 1]
    assert multi_turn and all("### " not in turn for p in multi_turn for turn in p.turns)


def test_bad_prompt_files_say_what_to_fix(tmp_path):
    with pytest.raises(ValueError, match="no prompt field.*--prompt-field"):
        read_prompts(write_jsonl(tmp_path / "a.jsonl", [{"id": 1, "body": "x"}]))
    with pytest.raises(ValueError, match=r"b.jsonl:2: .*no prompt in field 'question'"):
        read_prompts(write_jsonl(tmp_path / "b.jsonl", [{"question": "ok"}, {"answer": "no question"}]))
    with pytest.raises(ValueError, match="no prompt in field 'query'"):
        read_prompts(write_jsonl(tmp_path / "c.jsonl", [{"question": "ok"}]), prompt_field="query")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_prompts(tmp_path / "empty.jsonl")
    (tmp_path / "broken.jsonl").write_text('"fine"\n{"question": \n')
    with pytest.raises(ValueError, match="broken.jsonl:2: not valid JSON"):
        read_prompts(tmp_path / "broken.jsonl")
    with pytest.raises(FileNotFoundError):
        read_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="no assistant turn"):
        read_conversations(write_jsonl(tmp_path / "d.jsonl", [{"messages": [ask(1)]}]))


def test_a_tokenizer_without_chat_template_is_refused_unless_plain_text(tmp_path):
    tokenizer = make_tokenizer(chat_template=None)
    with pytest.raises(ValueError, match="no chat template.*--plain-text"):
        require_chat_template(tokenizer)
    tiny_llama(tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no chat template"):
        load_model_and_tokenizer(tmp_path)
    _, tokenizer = load_model_and_tokenizer(tmp_path, plain_text=True)
    example = tokenize_conversation(tokenizer, [{"role": "user", "content": "count from w1"},
                                                {"role": "assistant", "content": "w2 w3"}])
    marked = [t for t, m in zip(tokenizer.convert_ids_to_tokens(example.input_ids), example.loss_mask) if m]
    assert marked == ["w2", "w3", "<|end|>"]  # the plain format ends an answer with eos


def bos_tokenizer(special=("<pad>", "<unk>", "<s>", "</s>")) -> PreTrainedTokenizerFast:
    """A base model's tokenizer: no chat template, and a BOS token put before any text (as Llama's and Gemma's);
    `special` in the order of their ids."""
    words = [*special, "User:", "Assistant:", "count", "from"] + [f"w{i}" for i in range(WORDS)]
    vocab = {t: i for i, t in enumerate(words)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def test_the_plain_text_format_starts_with_the_bos_token_the_tokenizer_puts_before_text(tmp_path, monkeypatch):
    """A base model has only read text after its BOS token: distill asks and train reads the plain-text format after
    it, as generate's `tokenizer(text)` puts it (without it a real base model answered "Assistant Assistant ...")."""
    distill_module = importlib.import_module("medusa_spec.train.distill")  # the package exports the function too

    bos_tokenizer().save_pretrained(tmp_path / "base")
    tiny_llama(bos_tokenizer()).save_pretrained(tmp_path / "base")
    base_model, tokenizer = load_model_and_tokenizer(tmp_path / "base", plain_text=True)
    prompt = "User: count from w1\n\nAssistant:"
    generated = encode(AutoTokenizer.from_pretrained(tmp_path / "base"), prompt)[0].tolist()  # generate's prompt
    assert generated == [tokenizer.bos_token_id] + tokenizer(prompt, add_special_tokens=False)["input_ids"]

    asked = []
    real_decode_stream = distill_module.decode_stream

    def recording(model, requests, *args, **kwargs):
        asked.extend(request.input_ids for request in requests)
        return real_decode_stream(model, requests, *args, **kwargs)

    monkeypatch.setattr(distill_module, "decode_stream", recording)
    distill(base_model, tokenizer, [Prompt("p", ("count from w1",))],
            distill_settings(tmp_path / "base", tmp_path / "out.jsonl", max_new_tokens=4), progress=False)
    assert asked == [generated]

    example = tokenize_conversation(tokenizer, [{"role": "user", "content": "count from w1"},
                                                {"role": "assistant", "content": "w2 w3"}])
    assert example.input_ids == tokenizer(f"{prompt} w2 w3</s>")["input_ids"]
    marked = [t for t, m in zip(tokenizer.convert_ids_to_tokens(example.input_ids), example.loss_mask) if m]
    assert marked == ["w2", "w3", "</s>"]
    without_bos = make_tokenizer(chat_template=None)
    require_chat_template(without_bos, plain_text=True)
    assert without_bos.chat_template == PLAIN_TEXT_TEMPLATE  # nothing put first


# ---------------------------------------------------------------- distillation


def test_distill_answers_turn_by_turn_and_resumes(base_dir, tmp_path):
    base_model, tokenizer = load_model_and_tokenizer(base_dir)
    prompts = [Prompt("two", ("count from w2", "count from w20"))]
    prompts += [Prompt(f"p{i}", (f"count from w{i}",)) for i in range(5)]
    output = tmp_path / "out.jsonl"
    cfg = distill_settings(base_dir, output, batch_size=3, max_new_tokens=6)
    first = distill(base_model, tokenizer, prompts[:4], cfg, progress=False)
    assert first["written"] == 4 and first["new_tokens"] > 0
    records = {r["id"]: r["messages"] for r in map(json.loads, output.read_text().splitlines())}
    assert [m["role"] for m in records["two"]] == ["user", "assistant", "user", "assistant"]
    assert records["two"][1]["content"] == counting(2, 6)
    # The second turn was answered after the model's own first answer (here it changes the reply).
    with_history, alone = (answer(base_model, tokenizer, [messages], cfg)[0][0]
                           for messages in (records["two"][:3], records["two"][2:3]))
    assert records["two"][3]["content"] == with_history != alone
    # A kill in the middle of a line: the partial line is dropped, then only missing prompts run.
    lines = output.read_text().splitlines(keepends=True)
    output.write_text("".join(lines[:2]) + lines[2][:10])
    second = distill(base_model, tokenizer, prompts, cfg, progress=False)
    assert second["skipped_finished"] == 2 and second["written"] == 4
    ids = [json.loads(line)["id"] for line in output.read_text().splitlines()]
    assert sorted(ids) == sorted(p.id for p in prompts)
    # Over max_prompt_tokens: a first turn is skipped, a later turn ends the conversation before it.
    short = distill_settings(base_dir, tmp_path / "short.jsonl", max_new_tokens=6, max_prompt_tokens=10)
    stats = distill(base_model, tokenizer, [Prompt("long", ("count from w1 " * 5,)), prompts[0]], short, progress=False)
    assert (stats["written"], stats["skipped_too_long"]) == (1, 1)
    record = json.loads((tmp_path / "short.jsonl").read_text())
    assert record["id"] == "two" and [m["role"] for m in record["messages"]] == ["user", "assistant"]


def test_a_resumed_sampled_distillation_stores_what_an_uninterrupted_one_does(base_dir, tmp_path):
    """Sampled answers and model-written follow-up questions draw from streams of their own (seed, conversation,
    turn), so a run killed part-way, with other rows and neighbours, then resumed, stores record by record what one
    uninterrupted run stores."""
    base_model, tokenizer = load_model_and_tokenizer(base_dir)
    prompts = [Prompt("two", ("count from w2", "count from w20"))]
    prompts += [Prompt(f"p{i}", (f"count from w{i}",)) for i in range(9)]
    sampled = dict(max_new_tokens=6, do_sample=True, temperature=1.5, follow_ups=0.6, max_prompt_tokens=400)
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    distill(base_model, tokenizer, prompts, distill_settings(base_dir, whole, batch_size=3, **sampled), progress=False)
    distill(base_model, tokenizer, prompts[:5], distill_settings(base_dir, resumed, batch_size=2, **sampled),
            progress=False)
    lines = resumed.read_text().splitlines(keepends=True)
    resumed.write_text("".join(lines[:3]) + lines[3][:12])  # the kill cut the fourth record short
    stats = distill(base_model, tokenizer, prompts, distill_settings(base_dir, resumed, batch_size=4, **sampled),
                    progress=False)
    assert stats["skipped_finished"] == 3
    records = {name: {r["id"]: r["messages"] for r in read_records(path)} for name, path in
               (("whole", whole), ("resumed", resumed))}
    assert len(records["resumed"]) == len(prompts) and records["resumed"] == records["whole"]
    greedy = [answer(base_model, tokenizer, [m[:1]], distill_settings(base_dir, whole, max_new_tokens=6))[0][0]
              for m in records["whole"].values()]
    assert greedy != [m[1]["content"] for m in records["whole"].values()]  # the answers were sampled
    assert any(len(m) == 4 for k, m in records["whole"].items() if k != "two")  # and some follow-ups asked


def test_model_written_prompts_and_follow_ups_are_answered(base_dir, tmp_path):
    """--self-prompts: the model writes user prompts (Magpie, at --prompt-temperature), kept in the output folder and
    answered; --follow-ups: a model-written second turn, answered again. The answers stay greedy meanwhile."""
    base_model, tokenizer = load_model_and_tokenizer(base_dir)
    prompts = [Prompt(f"p{i}", (f"count from w{i}",)) for i in range(8)]
    cfg = distill_settings(base_dir, tmp_path / "data", batch_size=4, max_new_tokens=ANSWER + 4, self_prompts=3,
                           follow_ups=0.9, max_prompt_tokens=400)
    stats = distill(base_model, tokenizer, prompts, cfg, progress=False)
    written = [json.loads(line)["prompt"] for line in gzip.decompress(
        (tmp_path / "data" / SEALED_PROMPTS).read_bytes()).decode().splitlines()]
    assert not (tmp_path / "data" / SELF_PROMPTS).exists()  # the finished round sealed into SEALED_PROMPTS
    assert len(set(written)) == 3 and stats["written"] == 8 + 3 and stats["follow_ups"] > 0
    records = list(read_records(tmp_path / "data"))
    assert sum(len(r["messages"]) == 4 for r in records) == stats["follow_ups"]
    for record in records:  # first answers are the base's greedy ones: the counting lesson counts on
        question, reply = (m["content"] for m in record["messages"][:2])
        start = question.removeprefix("count from w")
        if start.isdigit():
            assert reply == counting(int(start), len(reply.split())), record


def test_a_self_prompt_with_a_unicode_line_separator_is_read_back(base_dir, tmp_path):
    """JSON keeps U+2028 raw: the prompts already written are read line by line at "\n" only, so a rerun resumes."""
    base_model, tokenizer = load_model_and_tokenizer(base_dir)
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / SELF_PROMPTS).write_text(json.dumps({"prompt": "count from w1\u2028now"}, ensure_ascii=False) + "\n",
                                       encoding="utf-8")
    cfg = distill_settings(base_dir, folder, batch_size=2, max_new_tokens=4, self_prompts=1, max_prompt_tokens=400)
    stats = distill(base_model, tokenizer, [], cfg, progress=False)
    assert stats["written"] == 1
    assert read_records(folder)[0]["messages"][0]["content"] == "count from w1\u2028now"


def test_a_data_folder_holds_one_models_answers(base_dir, tmp_path):
    """The first run records the model in the folder; another model (here: other weights of the same shape and
    tokenizer) may neither add answers to it nor train heads on it, and the folder is left as it was."""
    base_model, tokenizer = load_model_and_tokenizer(base_dir)
    folder = tmp_path / "data"
    prompts = [Prompt(f"p{i}", (f"count from w{i}",)) for i in range(12)]
    distill(base_model, tokenizer, prompts, distill_settings(base_dir, folder, max_new_tokens=6), progress=False)
    assert json.loads((folder / "model.json").read_text()) == model_identity(base_model, tokenizer)
    for dtype in (torch.bfloat16, torch.float16):  # loads of the same weights in other dtypes are the same model
        assert recorded_model_differences(folder, model_identity(base_model.to(dtype), tokenizer)) == []
    base_model.float()
    other_dir = tmp_path / "other"
    other = tiny_llama(tokenizer)  # untrained: other weights
    other.save_pretrained(other_dir)
    tokenizer.save_pretrained(other_dir)
    other, _ = load_model_and_tokenizer(other_dir)
    before = sorted((p.name, p.read_bytes()) for p in folder.iterdir())
    with pytest.raises(ValueError, match=r"holds answers of another model.* \(weights \["):
        distill(other, tokenizer, prompts + [Prompt("new", ("count from w3",))],
                distill_settings(other_dir, folder, max_new_tokens=6), progress=False)
    assert sorted((p.name, p.read_bytes()) for p in folder.iterdir()) == before
    with pytest.raises(ValueError, match="--data .* holds another model's answers .*weights"):
        train(small_run(other_dir, folder, tmp_path / "heads", eval_examples=2, max_steps=1))
    settings = dict(eval_examples=2, max_steps=1, batch_size=1)
    assert train(small_run(base_dir, folder, tmp_path / "heads", **settings))["steps"] == 1
    with pytest.raises(ValueError, match="or of one this run cannot compare with its own .*server_model"):
        record_model(folder, {"server_model": "m"})  # a served model and a local one: not comparable, refused


def test_distill_refuses_two_prompt_files_of_one_name_and_bad_settings(base_dir, tmp_path):
    """Prompt ids are FILE_NAME:LINE: two files of one name would store one's answers under the other's ids, and a
    resumed run would skip the second file as done. Settings out of range fail as they are read, naming the flag."""
    for folder, text in (("a", "count from w1"), ("b", "count from w2")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "pool.jsonl").write_text(json.dumps({"prompt": text}) + "\n")
    prompts = read_prompt_files([str(tmp_path / "a" / "pool.jsonl"), str(tmp_path / "b" / "pool.jsonl")])
    base_model, tokenizer = load_model_and_tokenizer(base_dir)
    output = tmp_path / "out.jsonl"
    with pytest.raises(ValueError, match="two prompts have the id 'pool.jsonl:1'.*give each file its own name"):
        distill(base_model, tokenizer, prompts, distill_settings(base_dir, output, max_new_tokens=4), progress=False)
    assert not output.exists()
    # One file given twice is the same prompts: answered once.
    stats = distill(base_model, tokenizer, prompts[:1] * 2, distill_settings(base_dir, output, max_new_tokens=4),
                    progress=False)
    assert stats["written"] == 1 and len(read_records(output)) == 1
    # A --prompts file named as the model's own prompts are kept would clash with them once they are written: refused
    # before the model writes any.
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / SELF_PROMPTS).write_text(json.dumps({"prompt": "count from w3"}) + "\n")
    folder = tmp_path / "with-self"
    with pytest.raises(ValueError, match=f"a --prompts file is named {SELF_PROMPTS}.*rename that file"):
        distill(base_model, tokenizer, read_prompt_files([str(tmp_path / "c" / SELF_PROMPTS)]),
                distill_settings(base_dir, folder, max_new_tokens=4, self_prompts=1, max_prompt_tokens=400),
                progress=False)
    assert not (folder / SELF_PROMPTS).exists()
    for setting, match in ((dict(batch_size=0), "--batch-size must be >= 1"),
                           (dict(max_new_tokens=0), "--max-new-tokens must be >= 1"),
                           (dict(follow_ups=1.5), "--follow-ups is a share"),
                           (dict(self_prompts=-1), "--self-prompts must be >= 0")):
        with pytest.raises(ValueError, match=match):
            distill_settings(base_dir, output, **setting)


def test_distill_stores_finished_conversations_when_stopped_and_leaves_the_model_in_its_mode(base_dir, tmp_path,
                                                                                            monkeypatch):
    """A Ctrl-C in the middle keeps the conversations already answered (fewer than a write batch), and the caller's
    model comes back in the mode it was in."""
    distill_module = importlib.import_module("medusa_spec.train.distill")  # the package exports the function too

    base_model, tokenizer = load_model_and_tokenizer(base_dir)
    base_model.train()
    decoded = []
    real_decode = distill_module._decode

    def stop_at_the_third(*args):
        if len(decoded) == 2:
            raise KeyboardInterrupt
        decoded.append(real_decode(*args))
        return decoded[-1]

    monkeypatch.setattr(distill_module, "_decode", stop_at_the_third)
    output = tmp_path / "out.jsonl"
    prompts = [Prompt(f"p{i}", (f"count from w{i}",)) for i in range(4)]
    with pytest.raises(KeyboardInterrupt):
        distill(base_model, tokenizer, prompts, distill_settings(base_dir, output, batch_size=1, max_new_tokens=4),
                progress=False)
    assert len(read_records(output)) == 2
    assert base_model.training and all(m.training for m in base_model.modules())


def test_self_prompts_resume_after_a_kill_cut_a_line(base_dir, tmp_path):
    """A kill in the middle of writing self_prompts.jsonl leaves half a line: the rerun drops it and goes on writing
    whole lines, instead of failing to read the file."""
    base_model, tokenizer = load_model_and_tokenizer(base_dir)
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / SELF_PROMPTS).write_text(json.dumps({"prompt": "count from w1"}) + "\n" + '{"prompt": "count fr',
                                       encoding="utf-8")
    cfg = distill_settings(base_dir, folder, batch_size=2, max_new_tokens=4, self_prompts=2, max_prompt_tokens=400)
    stats = distill(base_model, tokenizer, [], cfg, progress=False)
    lines = gzip.decompress((folder / SEALED_PROMPTS).read_bytes()).decode("utf-8").split("\n")
    assert lines[-1] == "" and len(lines) == 3 and json.loads(lines[0]) == {"prompt": "count from w1"}
    assert json.loads(lines[1])["prompt"] != "count fr" and stats["written"] == 2


def test_self_prompts_are_sealed_gzipped_and_numbered_across_rounds(base_dir, tmp_path):
    """A finished round folds self_prompts.jsonl into self_prompts.jsonl.gz (tens of thousands of prompts stay small
    in git); the next round appends to a new self_prompts.jsonl and prompt n keeps the id SELF_PROMPTS:n, so the
    answers stored before are found. A kill between sealing and removing the plain file loses and repeats nothing."""
    base_model, tokenizer = load_model_and_tokenizer(base_dir)
    folder = tmp_path / "data"
    cfg = distill_settings(base_dir, folder, batch_size=2, max_new_tokens=4, self_prompts=2, max_prompt_tokens=400)
    first = distill(base_model, tokenizer, [], cfg, progress=False)
    assert first["written"] == 2 and sorted(p.name for p in folder.glob("self_prompts*")) == [SEALED_PROMPTS]
    sealed = read_self_prompts(folder)
    again = distill(base_model, tokenizer, [], replace(cfg, self_prompts=3), progress=False)
    assert again["skipped_finished"] == 2 and again["written"] == 1  # prompts 1 and 2 kept their ids
    kept = read_self_prompts(folder)
    assert kept[:2] == sealed and len(kept) == 3
    stored = {r["id"]: r["messages"][0]["content"] for r in read_records(folder)}
    assert stored == {f"{SELF_PROMPTS}:{n}": text for n, text in enumerate(kept, start=1)}
    # As if killed after the rename, before the unlink: the plain file's prompts are the sealed file's last ones.
    (folder / SELF_PROMPTS).write_text("".join(json.dumps({"prompt": t}) + "\n" for t in kept[2:]), encoding="utf-8")
    assert read_self_prompts(folder) == kept
    # The next round writes one more prompt: after the three kept, each once, and answered under its own id.
    assert distill(base_model, tokenizer, [], replace(cfg, self_prompts=4), progress=False)["written"] == 1
    grown = read_self_prompts(folder)
    assert grown[:3] == kept and len(grown) == 4 and not (folder / SELF_PROMPTS).exists()
    stored = {r["id"]: r["messages"][0]["content"] for r in read_records(folder)}
    assert stored == {f"{SELF_PROMPTS}:{n}": text for n, text in enumerate(grown, start=1)}


# ---------------------------------------------------------------- training


def test_medusa1_lifts_head_accuracy_and_generation_takes_several_tokens_per_step(trained, base_dir):
    output_dir, summary = trained
    top1 = summary["eval"]["top1"]
    assert len(top1) == 3 and min(top1) > 0.5, top1  # chance is 1/32
    config = MedusaConfig.from_json_file(output_dir / "medusa_config.json")
    assert config.metrics["eval"]["top1"] == top1 and config.metrics["train"]["steps"] == 100

    base_model, tokenizer = load_model_and_tokenizer(base_dir)
    medusa = MedusaModel.from_pretrained(base_model, output_dir)
    prompt = torch.tensor([tokenizer.apply_chat_template([ask(7)], add_generation_prompt=True, tokenize=True,
                                                         return_dict=False)])
    out = medusa.generate(prompt, max_new_tokens=ANSWER)
    assert out.stats.tokens_per_step > 1.5, out.stats.to_dict()
    expected = base_model.generate(prompt, max_new_tokens=ANSWER, do_sample=False)
    assert torch.equal(out.sequences, expected)


def test_tree_command_stores_the_tree_grown_from_measured_accuracies(trained, base_dir, conversations):
    output_dir, summary = trained
    parser = argparse.ArgumentParser()
    add_train_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["tree", "--heads", str(output_dir), "--nodes", "6"])
    assert args.func(args) == 0
    config = MedusaConfig.from_json_file(output_dir / "medusa_config.json")
    assert config.tree == grow_tree(summary["eval"]["rank_accuracy"], 6) and len(config.tree) == 5
    assert config.metrics["tree"]["expected_tokens_per_step"] > 2
    # Measured afresh on the data: all 48 conversations, more positions than the 8 held out in training.
    args = parser.parse_args(["tree", "--heads", str(output_dir), "--nodes", "4", "--model", str(base_dir),
                              "--data", str(conversations), "--max-length", "64"])
    assert args.func(args) == 0
    config = MedusaConfig.from_json_file(output_dir / "medusa_config.json")
    assert len(config.tree) == 3 and config.metrics["eval"]["positions"][0] > summary["eval"]["positions"][0]


class Killed(Exception):
    pass


def kill_after(monkeypatch, micro_batches: int):
    """Make the training loop die at its `micro_batches`+1-th loss computation, as a kill would."""
    calls = []
    real = loop.combined_loss

    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) > micro_batches:
            raise Killed
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "combined_loss", dying)


@pytest.mark.parametrize("mode", ["medusa1", "medusa2"])
def test_resume_after_a_kill_reaches_the_weights_of_an_uninterrupted_run(mode, base_dir, conversations, tmp_path,
                                                                         monkeypatch):
    def run(output_dir, **extra):
        # grad_accum and (for medusa2) LoRA dropout: resuming must restore the micro-batch position and RNG.
        lora = {"lora_dropout": 0.1} if mode == "medusa2" else {}
        return train(small_run(base_dir, conversations, output_dir, mode=mode, max_steps=6, save_every=2,
                               grad_accum=2, eval_examples=4, **lora, **extra))

    straight_summary = run(tmp_path / "straight")
    with monkeypatch.context() as patch:
        kill_after(patch, 9)  # dies in step 5, one step after the checkpoint of step 4
        with pytest.raises(Killed):
            run(tmp_path / "killed")
    with pytest.raises(ValueError, match="--resume"):
        run(tmp_path / "killed")
    with pytest.raises(ValueError, match="settings differ.*lr"):
        run(tmp_path / "killed", resume=True, lr=2e-2)
    resumed = run(tmp_path / "killed", resume=True)
    assert resumed["start_step"] == 4
    assert resumed["answer_tokens_seen"] == straight_summary["answer_tokens_seen"]  # counted on from step 4
    straight, killed = (load_file(tmp_path / d / "medusa_heads.safetensors") for d in ("straight", "killed"))
    assert straight.keys() == killed.keys() and all(torch.equal(straight[k], killed[k]) for k in straight)
    if mode == "medusa2":
        straight, killed = (load_file(tmp_path / d / "lora" / "adapter_model.safetensors")
                            for d in ("straight", "killed"))
        assert all(torch.equal(straight[k], killed[k]) for k in straight)


def test_a_resumed_run_logs_each_step_once(base_dir, conversations, tmp_path, monkeypatch):
    """The killed run logged step 3 after its checkpoint of step 2; the resumed run logs it again, and the log kept
    both (a scaling plot drew the step twice)."""
    settings = dict(max_steps=6, save_every=2, log_every=1, eval_examples=4)
    with monkeypatch.context() as patch:
        kill_after(patch, 3)  # dies in step 4: steps 1-3 logged, the checkpoint is step 2's
        with pytest.raises(Killed):
            train(small_run(base_dir, conversations, tmp_path / "run", **settings))
    with open(tmp_path / "run" / "train_log.jsonl", "a") as f:
        f.write('{"step": 4, "lo')  # and a line the kill cut short
    train(small_run(base_dir, conversations, tmp_path / "run", resume=True, **settings))
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [1, 2, 3, 4, 5, 6] and "eval" in log[-1]


def test_resume_refuses_data_that_changed_since_the_checkpoint(base_dir, conversations, tmp_path, monkeypatch):
    """A data folder distilled further between the kill and --resume: the held-out split and the rows of each step
    shift, so the resumed run would train on other rows than its first part and evaluate on some it learned."""
    data = tmp_path / "data.jsonl"
    data.write_text(conversations.read_text())
    settings = dict(max_steps=6, save_every=2, eval_examples=4)
    with monkeypatch.context() as patch:
        kill_after(patch, 4)  # dies in step 5, after the checkpoint of step 4
        with pytest.raises(Killed):
            train(small_run(base_dir, data, tmp_path / "run", **settings))
    first = data.read_text().splitlines()[0]
    data.write_text(data.read_text() + first.replace("w", "x") + "\n")  # one conversation more
    with pytest.raises(ValueError, match="--resume: the training rows differ from those of .*step-00000004"):
        train(small_run(base_dir, data, tmp_path / "run", resume=True, **settings))
    with pytest.raises(ValueError, match="settings differ .*max_length: 64 -> 32"):  # a flag is named, not the data
        train(small_run(base_dir, data, tmp_path / "run", resume=True, **settings, max_length=32))
    data.write_text(conversations.read_text())  # the data as it was: resumes
    assert train(small_run(base_dir, data, tmp_path / "run", resume=True, **settings))["start_step"] == 4


def test_init_heads_trains_saved_heads_on_with_their_architecture_and_draft_vocabulary(base_dir, conversations,
                                                                                      tmp_path, capsys):
    first = tmp_path / "first"
    train(small_run(base_dir, conversations, first, head_type="dependent", draft_vocab=16, max_steps=10, log_every=1))
    calibrate_tree(first, 4)  # the tree stored for these accuracies
    # Data on which the 16 most frequent answer tokens are others: the continuation must keep the heads' own.
    lines = conversations.read_text().splitlines()
    fewer = tmp_path / "fewer.jsonl"
    fewer.write_text("\n".join(lines[:6] * 4) + "\n")
    base_model, tokenizer = load_model_and_tokenizer(base_dir)
    rows = make_rows([tokenize_conversation(tokenizer, m, False) for m in read_conversations(fewer)], 64, True)
    saved = load_file(first / "medusa_heads.safetensors")
    own_top = frequent_tokens(answer_token_counts(rows, base_model.config.vocab_size), 16)
    assert not torch.equal(own_top, saved["token_map"])

    # lr 0: the heads come back as saved (the architecture flags left out take the adapter's; num_heads=3 is theirs).
    still = tmp_path / "still"
    train(small_run(base_dir, fewer, still, init_heads=str(first), lr=0.0, max_steps=2, eval_examples=4))
    kept = load_file(still / "medusa_heads.safetensors")
    assert saved.keys() == kept.keys() and all(torch.equal(saved[k], kept[k]) for k in saved)
    config = MedusaConfig.from_json_file(still / "medusa_config.json")
    assert (config.head_type, config.draft_vocab_size, config.num_heads, config.tree) == ("dependent", 16, 3, None)

    # --feature-layers on heads that fuse none: they take fusion on and start as they were (same guesses, every
    # weight kept, the new projection at zero), then learn it; heads that fuse other layers are refused.
    plain = train(small_run(base_dir, fewer, tmp_path / "plain", init_heads=str(first), lr=0.0, max_steps=1,
                            eval_examples=4))
    fused = train(small_run(base_dir, fewer, tmp_path / "fused", init_heads=str(first), lr=0.0, max_steps=1,
                            eval_examples=4, feature_layers=[1]))
    assert fused["eval"]["rank_accuracy"] == plain["eval"]["rank_accuracy"]
    kept = load_file(tmp_path / "fused" / "medusa_heads.safetensors")
    assert all(torch.equal(saved[k], kept[k]) for k in saved) and set(kept) - set(saved) == {"fuse.weight", "fuse.bias"}
    assert not kept["fuse.weight"].any()
    assert MedusaConfig.from_json_file(tmp_path / "fused" / "medusa_config.json").feature_layers == [1]
    train(small_run(base_dir, fewer, tmp_path / "fusing", init_heads=str(first), max_steps=2, eval_examples=4,
                    feature_layers=[1]))
    assert load_file(tmp_path / "fusing" / "medusa_heads.safetensors")["fuse.weight"].any()
    with pytest.raises(ValueError, match="--feature-layers \\[1\\], but --feature-layers \\[2\\] was given"):
        train(small_run(base_dir, fewer, tmp_path / "refused", init_heads=str(tmp_path / "fused"),
                        eval_examples=4, feature_layers=[2]))

    # Training on from the saved heads starts at the loss they ended with, not at a fresh start's.
    train(small_run(base_dir, conversations, tmp_path / "more", init_heads=str(first), max_steps=1, log_every=1))
    losses = {run: [r["loss"] for r in map(json.loads, (tmp_path / run / "train_log.jsonl").read_text().splitlines())
                    if "loss" in r] for run in ("first", "more")}
    assert losses["more"][0] < 1.5 * losses["first"][-1] and losses["first"][0] > 5 * losses["first"][-1], losses

    # A larger --num-layers: residual blocks added after theirs, at zero, so the heads start as they were (same
    # guesses, every weight kept), then learn them; fewer blocks than the heads have are refused.
    deeper = train(small_run(base_dir, fewer, tmp_path / "deeper", init_heads=str(first), lr=0.0, max_steps=1,
                             eval_examples=4, num_layers=3))
    assert deeper["eval"]["rank_accuracy"] == plain["eval"]["rank_accuracy"]
    kept = load_file(tmp_path / "deeper" / "medusa_heads.safetensors")
    added = {f"blocks.{h}.layers.{layer}.{w}" for h in range(3) for layer in (1, 2) for w in ("weight", "bias")}
    assert all(torch.equal(saved[k], kept[k]) for k in saved) and set(kept) - set(saved) == added
    assert not any(kept[k].any() for k in added)
    assert MedusaConfig.from_json_file(tmp_path / "deeper" / "medusa_config.json").num_layers == 3
    train(small_run(base_dir, fewer, tmp_path / "deepening", init_heads=str(first), max_steps=2, eval_examples=4,
                    num_layers=2))
    assert load_file(tmp_path / "deepening" / "medusa_heads.safetensors")["blocks.0.layers.1.weight"].any()
    with pytest.raises(ValueError, match="--num-layers 3, but --num-layers 2 was given \\(fewer residual blocks"):
        train(small_run(base_dir, conversations, tmp_path / "other", init_heads=str(tmp_path / "deeper"), num_layers=2))
    # A head flag given equal to its default is still a flag given: refused where the heads have another value.
    with pytest.raises(ValueError, match="--num-layers 3, but --num-layers 1 was given"):
        train(small_run(base_dir, conversations, tmp_path / "other", init_heads=str(tmp_path / "deeper"), num_layers=1))
    with pytest.raises(ValueError, match="--head-type dependent, but --head-type medusa was given"):
        train(small_run(base_dir, conversations, tmp_path / "other", init_heads=str(first), head_type="medusa"))
    with pytest.raises(ValueError, match="have --share-lm-head, but --no-share-lm-head was given"):
        train(small_run(base_dir, conversations, tmp_path / "other", init_heads=str(first), share_lm_head=False))

    # A larger --num-heads: heads added after theirs, each a copy of their last one's block (a dependent head's path
    # input at zero, as a new head's starts); the old heads are untouched and guess as they did. Fewer are refused.
    more_heads = train(small_run(base_dir, fewer, tmp_path / "more_heads", init_heads=str(first), lr=0.0,
                                 max_steps=1, eval_examples=4, num_heads=5))
    assert "growing the heads to --num-heads 5 (theirs: 3)" in capsys.readouterr().out
    assert more_heads["eval"]["rank_accuracy"][:3] == plain["eval"]["rank_accuracy"]
    assert len(more_heads["eval"]["rank_accuracy"]) == 5
    kept = load_file(tmp_path / "more_heads" / "medusa_heads.safetensors")
    assert all(torch.equal(saved[k], kept[k]) for k in saved)
    for head in (3, 4):
        assert all(torch.equal(kept[f"blocks.{head}.layers.0.{w}"], saved[f"blocks.2.layers.0.{w}"])
                   for w in ("weight", "bias"))
        width = kept["inputs.0.weight"].shape[1]  # head k reads its k + 1 path embeddings
        assert not kept[f"inputs.{head}.weight"].any() and kept[f"inputs.{head}.weight"].shape[1] == (head + 1) * width
    assert MedusaConfig.from_json_file(tmp_path / "more_heads" / "medusa_config.json").num_heads == 5
    with pytest.raises(ValueError, match="--num-heads 5, but --num-heads 3 was given \\(fewer heads"):
        train(small_run(base_dir, conversations, tmp_path / "other", init_heads=str(tmp_path / "more_heads")))
    (first / "lora").mkdir()
    with pytest.raises(ValueError, match="Medusa-2 LoRA adapter"):
        train(small_run(base_dir, conversations, tmp_path / "lora", init_heads=str(first)))


def test_exclude_trains_heads_on_conversations_their_record_does_not_list(base_dir, conversations, tmp_path):
    messages = read_conversations(conversations)  # 24, each its own prompt
    keys = [loop.conversation_key(m) for m in messages]
    first = tmp_path / "first"
    train(small_run(base_dir, conversations, first, max_conversations=6, batch_size=2, epochs=1, pack=False))
    record = first / loop.TRAINED_ON
    listed = loop.read_trained_on(record)
    assert len(listed) == 6 and listed <= set(keys)  # one pass over 6 rows of one conversation each: all read

    # The conversations left: none listed, nor any that begins as a listed one (a follow-up turn added).
    follow_up = messages[keys.index(min(listed))] + [{"role": "user", "content": "again"},
                                                     {"role": "assistant", "content": "w1 w2"}]
    left = loop.without_excluded([*messages, follow_up], [str(record)])
    assert len(left) == 18 and not {loop.conversation_key(m) for m in left} & listed

    # Trained on from those heads, on the rest: 4 held out, 14 in the sample, of which 2 steps of 4 rows read 8;
    # the record lists both runs' conversations read.
    second = tmp_path / "second"
    summary = train(small_run(base_dir, conversations, second, init_heads=str(first), exclude=[str(record)],
                              eval_examples=4, max_steps=2, pack=False))
    both = loop.read_trained_on(second / loop.TRAINED_ON)
    assert summary["eval_rows"] > 0 and listed <= both and len(both) == 6 + 8

    (tmp_path / "bad.txt").write_text("# keys\nnot-a-key\n")
    (tmp_path / "other.txt").write_text("0123456789abcdef\n")  # another data folder's held-out set: would leak
    for files, error in [([tmp_path / "none.txt"], "no such file"), ([tmp_path / "bad.txt"], "bad.txt:2: 'not-a-key'"),
                         ([record, tmp_path / "other.txt"], r"other.txt: none of its 1 conversation beginnings is in "
                                                            r"--data's 24 conversations, so it would exclude nothing"),
                         ([record, second / loop.TRAINED_ON], "--eval-examples 10 leaves nothing to train on: the data "
                                                               "holds 10 conversations not excluded")]:
        with pytest.raises(ValueError, match=error):
            train(small_run(base_dir, conversations, tmp_path / "refused", exclude=[str(f) for f in files],
                            eval_examples=10))
    (tmp_path / "all.txt").write_text("".join(f"{k}\n" for k in keys))
    with pytest.raises(ValueError, match="leaves none of the 24 conversations"):
        train(small_run(base_dir, conversations, tmp_path / "refused", exclude=[str(tmp_path / "all.txt")]))


def test_replay_trains_a_seeded_sample_of_what_the_heads_learned_beside_the_new_conversations(
        base_dir, conversations, tmp_path, monkeypatch):
    messages = read_conversations(conversations)  # 24, each its own prompt
    first = tmp_path / "first"
    train(small_run(base_dir, conversations, first, max_conversations=6, batch_size=2, max_steps=2))
    record = str(first / loop.TRAINED_ON)
    learned = loop.read_trained_on(record)
    replayed = loop.replay_sample(messages, [record], str(first), 2, seed=0)
    assert len(replayed) == 2 and {loop.conversation_key(m) for m in replayed} <= learned
    assert loop.replay_sample(messages, [record], str(first), 2, seed=0) == replayed != loop.replay_sample(
        messages, [record], str(first), 2, seed=1)
    # An exclude file may list more than the heads learned (another run's held-out set): those are never replayed.
    unseen = tmp_path / "unseen.txt"
    unseen.write_text("".join(f"{loop.conversation_key(m)}\n" for m in messages))
    assert {loop.conversation_key(m) for m in loop.replay_sample(messages, [record, str(unseen)], str(first), 6,
                                                                 seed=0)} == learned

    # Trained on from those heads over the 18 others (4 held out) and the 2 replayed: the held-out rows are the ones
    # a run without replay holds out, and the training rows are that run's plus the replayed conversations.
    rows = {}
    make_rows = loop.make_rows
    monkeypatch.setattr(loop, "make_rows", lambda examples, *args: rows.setdefault(replay, []).append(
        [tuple(e.input_ids) for e in examples]) or make_rows(examples, *args))
    _, tokenizer = load_model_and_tokenizer(base_dir)
    for replay in (0, 2):
        summary = train(small_run(base_dir, conversations, tmp_path / f"replay{replay}", init_heads=str(first),
                                  exclude=[record], replay=replay, eval_examples=4, max_steps=2))
        assert summary["replayed_conversations"] == replay
    (new, held_out), (with_replay, held_out_too) = rows[0], rows[2]
    ids = [tuple(tokenize_conversation(tokenizer, m).input_ids) for m in replayed]
    assert len(held_out) == 4 and held_out_too == held_out and not set(ids) & set(held_out)
    assert with_replay == new + ids
    for overrides, error in [(dict(replay=2, exclude=[record]), "give --init-heads with the adapter"),
                             (dict(replay=2, init_heads=str(first)), "give --init-heads with the adapter"),
                             (dict(replay=7, exclude=[record], init_heads=str(first)),
                              "only 6 beginnings .* give --replay 6 or less"),
                             (dict(replay=-1), "--replay -1: give a number")]:
        with pytest.raises(ValueError, match=error):
            train(small_run(base_dir, conversations, tmp_path / "refused", **overrides))


def test_teacher_targets_learn_the_base_from_answers_it_did_not_write(base_dir, tmp_path):
    """Answers of random words: their tokens say nothing about what comes next, but the counting base,
    reading them, still says the word after the last one, and dependent heads that read the path can
    learn that from its distributions."""
    rng = torch.Generator().manual_seed(4)
    lines = []
    for i in range(48):
        words = " ".join(f"w{w}" for w in torch.randint(0, WORDS, (ANSWER,), generator=rng).tolist())
        lines.append(json.dumps({"id": f"r{i}", "messages": [ask(i % WORDS), {"role": "assistant", "content": words}]}))
    data = tmp_path / "random.jsonl"
    data.write_text("\n".join(lines) + "\n")
    base_model, tokenizer = load_model_and_tokenizer(base_dir)
    prompt = torch.tensor([tokenizer.apply_chat_template([ask(7)], add_generation_prompt=True, tokenize=True,
                                                         return_dict=False)])
    expected = base_model.generate(prompt, max_new_tokens=ANSWER, do_sample=False)
    tokens_per_step = {}
    for target in ("tokens", "teacher"):
        train(small_run(base_dir, data, tmp_path / target, head_type="dependent", heads_target=target, max_steps=100))
        medusa = MedusaModel.from_pretrained(base_model, tmp_path / target)
        out = medusa.generate(prompt, max_new_tokens=ANSWER, tree=[[0], [0, 0], [0, 0, 0]])
        assert torch.equal(out.sequences, expected)
        tokens_per_step[target] = out.stats.tokens_per_step
    # On the base's own answers: heads taught the data's random words guess about 1 in 32.
    assert tokens_per_step["teacher"] > 2 and tokens_per_step["tokens"] < 1.5, tokens_per_step


def test_cached_hidden_states_run_the_base_once_per_row_and_train_the_same(base_dir, conversations, tmp_path):
    calls = []
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: calls.append(1) if isinstance(module, LlamaForCausalLM) else None)
    try:
        summaries = {}
        for cached in (False, True):
            calls.clear()
            summaries[cached] = train(small_run(base_dir, conversations, tmp_path / str(cached), epochs=3,
                                                cache_hidden=cached, batch_size=2))
            summaries[cached]["calls"] = len(calls)
    finally:
        hook.remove()
    per_epoch = summaries[True]["train_rows"] // 2
    eval_batches = math.ceil(summaries[True]["eval_rows"] / 2)
    assert summaries[False]["calls"] == 3 * per_epoch + eval_batches
    assert summaries[True]["calls"] == per_epoch + eval_batches
    plain, cached = (load_file(tmp_path / d / "medusa_heads.safetensors") for d in ("False", "True"))
    assert all(torch.allclose(plain[k], cached[k], atol=1e-6) for k in plain)
    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / "hidden_cache").write_text("notes")  # a file where the cache would go: named, kept
    with pytest.raises(ValueError, match="hidden_cache, which is a file here; move it away"):
        train(small_run(base_dir, conversations, tmp_path / "blocked", cache_hidden=True))
    assert (tmp_path / "blocked" / "hidden_cache").read_text() == "notes"


@pytest.mark.parametrize("share_lm_head", [True, False])
def test_heads_train_under_bf16_mixed_precision_with_shared_or_own_projections(base_dir, conversations, tmp_path,
                                                                                share_lm_head):
    """The base (and a shared LM head) in bf16, the heads in fp32: the loss's chunked projection takes
    both, and own projections, the only trained vocabulary matrices, learn too."""
    output_dir = tmp_path / "run"
    # accelerate keeps its precision in a process-wide state: reset it around this run (as its own tests do).
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        train(small_run(base_dir, conversations, output_dir, max_steps=40, log_every=5, mixed_precision="bf16",
                        share_lm_head=share_lm_head))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    log = [json.loads(line) for line in (output_dir / "train_log.jsonl").read_text().splitlines()]
    head_ce = [record["head_ce"] for record in log if "head_ce" in record]
    assert all(math.isfinite(x) for row in head_ce for x in row)
    assert head_ce[-1][0] < 0.5 * head_ce[0][0]
    weights = load_file(output_dir / "medusa_heads.safetensors")
    assert ("lm_heads.0.weight" in weights) == (not share_lm_head)
    if not share_lm_head:  # each started as a copy of the base's LM head
        base_model, _ = load_model_and_tokenizer(base_dir)
        start = base_model.get_output_embeddings().weight
        assert all((weights[f"lm_heads.{k}.weight"] - start).abs().max() > 1e-3 for k in range(3))


def test_a_time_limit_stops_at_a_log_step_and_still_saves_the_evaluated_adapter(base_dir, conversations, tmp_path):
    """--time-limit: past it the loop stops after the step under way (whatever --log-every is), checkpoints, and the
    run ends as a finished one does: evaluated, saved, and its summary and log say how far it got. It resumes from
    there, under another limit or none."""
    settings = dict(max_steps=6, log_every=50, eval_every=1, save_every=4)
    summary = train(small_run(base_dir, conversations, tmp_path / "run", time_limit=1e-9, **settings))
    assert summary["steps"] == 1 and summary["planned_steps"] == 6
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 1] and "loss" in log[0] and "eval" in log[1]  # evaluated once
    config = json.loads((tmp_path / "run" / "medusa_config.json").read_text())
    assert config["metrics"]["train"]["steps"] == 1 and config["metrics"]["eval"]["top1"]
    assert (tmp_path / "run" / "checkpoints" / "step-00000001").is_dir()
    resumed = train(small_run(base_dir, conversations, tmp_path / "run", resume=True, **settings))
    assert resumed["start_step"] == 1 and resumed["steps"] == 6
    with pytest.raises(ValueError, match="--time-limit must be a number of minutes > 0"):
        small_run(base_dir, conversations, tmp_path / "bad", time_limit=0.0)


def test_medusa2_trains_lora_and_heads_saves_lora_beside_the_heads_and_loads_back(base_dir, conversations, tmp_path):
    warmup_only = train(small_run(base_dir, conversations, tmp_path / "warm", mode="medusa2", max_steps=2,
                                  heads_warmup_steps=2, lora_r=4))
    lora = load_file(tmp_path / "warm" / "lora" / "adapter_model.safetensors")
    lora_b = {k: v for k, v in lora.items() if "lora_B" in k}
    assert lora_b and all(not v.any() for v in lora_b.values())  # heads-only warm-up: LoRA still at its zero init
    assert warmup_only["steps"] == 2

    summary = train(small_run(base_dir, conversations, tmp_path / "joint", mode="medusa2", max_steps=6,
                              heads_warmup_steps=2, lora_r=4, base_loss="kl"))
    output_dir = tmp_path / "joint"
    assert (output_dir / "lora" / "adapter_config.json").is_file()
    assert (output_dir / "medusa_heads.safetensors").is_file() and summary["mode"] == "medusa2"
    lora = load_file(output_dir / "lora" / "adapter_model.safetensors")
    assert any(v.any() for k, v in lora.items() if "lora_B" in k)  # the base was tuned after the warm-up

    tokenizer = make_tokenizer()
    base_model = AutoModelForCausalLM.from_pretrained(base_dir)
    medusa = MedusaModel.from_pretrained(base_model, output_dir)  # applies lora/ to the base
    heads = load_file(output_dir / "medusa_heads.safetensors")
    assert all(torch.equal(medusa.heads.state_dict()[k], heads[k]) for k in heads)
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), output_dir / "lora").eval()
    prompt = torch.tensor([tokenizer.apply_chat_template([ask(3)], add_generation_prompt=True, tokenize=True,
                                                         return_dict=False)])
    with torch.no_grad():
        assert torch.allclose(medusa.base_model(prompt).logits, tuned(input_ids=prompt).logits, atol=1e-5)
    out = medusa.generate(prompt, max_new_tokens=8)
    assert torch.equal(out.sequences, tuned.generate(input_ids=prompt, max_new_tokens=8, do_sample=False))


def test_train_refuses_a_lora_folder_in_its_output_before_training(tmp_path):
    """The adapter is saved into --output at the end, replacing or removing its lora/: one no save recorded (the
    user's own) is refused at the start, not after the training a late refusal would throw away."""
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "notes.txt").write_text("mine")
    # Neither the model nor the data exists: the refusal comes before either is read.
    cfg = TrainConfig(model=str(tmp_path / "no-model"), data=[str(tmp_path / "no-data.jsonl")], output=str(tmp_path))
    with pytest.raises(ValueError, match=r"lora: saving heads to .* would replace or delete this folder"):
        train(cfg)
    assert (tmp_path / "lora" / "notes.txt").read_text() == "mine"


RECIPES = sorted((Path(__file__).resolve().parents[1] / "training" / "recipes").glob("*.json"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.name)
def test_shipped_recipes_hold_valid_settings_and_existing_prompt_files(recipe):
    parser = argparse.ArgumentParser()
    add_train_commands(parser.add_subparsers(dest="command"))
    cfg = resolve(TrainConfig, parser.parse_args(["train", "--config", str(recipe), "--model", "m"]), "train")
    assert cfg.data and cfg.output
    if "distill" in json.loads(recipe.read_text()):
        distill_cfg = resolve(DistillConfig, parser.parse_args(["distill", "--config", str(recipe), "--model", "m"]),
                              "distill")
        assert distill_cfg.output == cfg.data[0]  # train reads what distill wrote
        if SHARED_TRAIN.is_dir():
            root = recipe.parents[2]  # recipes name prompt files relative to the repository root
            # runs/prompts/ is where training/data/prompts/unpack.sh puts the committed pools, gzipped beside it.
            pools = root / "training" / "data" / "prompts"
            assert all((root / path).is_file() or (pools / f"{path.name}.gz").is_file()
                       for path in (parse_prompt_spec(spec)[0] for spec in distill_cfg.prompts))


def test_recipe_settings_are_overridden_by_flags_and_checked(tmp_path):
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"train": {"model": "m", "data": ["d.jsonl"], "output": "o", "lr": 0.5,
                                            "num_heads": 2}}))
    parser = argparse.ArgumentParser()
    add_train_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "--config", str(recipe), "--lr", "0.25", "--no-pack"])
    cfg = resolve(TrainConfig, args, "train")
    assert (cfg.lr, cfg.num_heads, cfg.pack, cfg.batch_size) == (0.25, 2, False, TrainConfig.batch_size)
    recipe.write_text(json.dumps({"train": {"learning_rate": 1}}))
    with pytest.raises(ValueError, match="unknown 'train' settings \\['learning_rate'\\]"):
        resolve(TrainConfig, parser.parse_args(["train", "--config", str(recipe)]), "train")
    with pytest.raises(ValueError, match=r"train needs --data, --output \("):
        resolve(TrainConfig, parser.parse_args(["train"]), "train")
    with pytest.raises(ValueError, match="--cache-hidden needs a frozen base"):
        TrainConfig(model="m", data=["d"], output="o", mode="medusa2", cache_hidden=True)


@pytest.mark.parametrize("section, settings, match", [
    ("distill", {"batch_size": "big"}, "setting 'batch_size' must be an integer, got \"big\""),
    ("distill", {"prompts": "p.jsonl"}, "setting 'prompts' must be an array of strings, got \"p.jsonl\""),
    ("train", {"lr": "1e-3"}, "setting 'lr' must be a number, got \"1e-3\""),
    ("train", {"max_steps": True}, "setting 'max_steps' must be an integer or null, got true"),
])
def test_a_recipe_value_of_the_wrong_type_is_named(tmp_path, section, settings, match):
    """A string for a number compared as one deep inside (TypeError), and a string for a list of files was read
    letter by letter ("d: no such file")."""
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({section: {"data": ["d.jsonl"], "output": "o", **settings}}
                                 if section == "train" else {section: {"output": "o", **settings}}))
    parser = argparse.ArgumentParser()
    add_train_commands(parser.add_subparsers(dest="command"))
    with pytest.raises(ValueError, match=rf"recipe.json: the recipe's '{section}' {match}"):
        resolve(TrainConfig if section == "train" else DistillConfig,
                parser.parse_args([section, "--config", str(recipe)]), section)


@pytest.mark.parametrize("flag, value, match", [
    ("lr", math.nan, "--lr must be a number >= 0"), ("lr", -1.0, "--lr must be a number >= 0"),
    ("head_decay", math.nan, "--head-decay must be a number > 0"), ("epochs", 0.0, "--epochs must be a number > 0"),
    ("max_steps", 0, "--max-steps must be >= 1"), ("max_steps", -3, "--max-steps must be >= 1"),
    ("min_lr_ratio", 2.0, "--min-lr-ratio must be from 0 to 1"), ("warmup_steps", -1, "--warmup-steps must be >= 0"),
    ("max_grad_norm", -1.0, "--max-grad-norm must be >= 0"), ("save_every", -1, "--save-every must be >= 0"),
    ("heads_loss_weight", math.nan, "--heads-loss-weight must be >= 0"),
    ("num_layers", 0, "--num-layers 0 leaves heads that share the LM head nothing to train"),
    ("lora_r", 8, "--lora-r shape the LoRA on the base, which only --mode medusa2 trains"),
    ("lora_target_modules", "q_proj", "--lora-target-modules shape the LoRA on the base"),
])
def test_training_settings_out_of_range_are_refused(flag, value, match):
    """Each used to train: a nan learning rate saved all-nan heads, --max-steps -3 an untrained adapter, and
    --num-layers 0 failed inside autograd."""
    with pytest.raises(ValueError, match=match):
        TrainConfig(model="m", data=["d"], output="o", **{flag: value})


def test_distill_settings_that_would_be_ignored_or_nan_are_refused():
    with pytest.raises(ValueError, match="--prompt-temperature must be >= 0"):
        DistillConfig(model=None, prompts=[], output="o", prompt_temperature=math.nan)
    with pytest.raises(ValueError, match="--server-model names the model a --server serves: add --server URL"):
        DistillConfig(model=None, prompts=[], output="o", server_model="m")
    with pytest.raises(ValueError, match="--concurrency 4 sets the requests in flight to a --server"):
        DistillConfig(model=None, prompts=[], output="o", concurrency=4)
    assert DistillConfig(model=None, prompts=[], output="o", server="http://h:1", concurrency=4).concurrency == 4


def test_tree_refuses_a_size_below_one(capsys):
    """--nodes 0 or -3 stored "tree": [] in the adapter, silently turning speculation off."""
    parser = argparse.ArgumentParser()
    add_train_commands(parser.add_subparsers(dest="command"))
    for nodes in ("0", "-3"):
        with pytest.raises(SystemExit):
            parser.parse_args(["tree", "--heads", "h", "--nodes", nodes])
        assert f"must be an integer >= 1, got {nodes}" in capsys.readouterr().err


def test_train_refuses_to_replace_finished_heads_and_checks_ranks_first(base_dir, conversations, tmp_path):
    output = tmp_path / "run"
    with pytest.raises(ValueError, match=r"--eval-ranks 500 asks for more ranks than the heads have guesses"):
        train(small_run(base_dir, conversations, output, max_steps=2, eval_ranks=500))
    assert not (output / "medusa_config.json").exists()
    train(small_run(base_dir, conversations, output, max_steps=2))
    heads = (output / "medusa_heads.safetensors").read_bytes()
    with pytest.raises(ValueError, match="already holds trained heads .*choose a new --output"):
        train(small_run(base_dir, conversations, output, max_steps=2, seed=1))
    assert (output / "medusa_heads.safetensors").read_bytes() == heads


def test_a_recipe_or_command_line_with_the_old_output_dir_reads_as_output(tmp_path):
    """--output-dir became --output (as bench's and distill's): a recipe's "output_dir" and the old flag still set it,
    and a recipe that gives both names different folders is refused, not read one way or the other."""
    parser = argparse.ArgumentParser()
    add_train_commands(parser.add_subparsers(dest="command"))
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"train": {"data": ["d.jsonl"], "output_dir": "old"}}))
    cfg = resolve(TrainConfig, parser.parse_args(["train", "--config", str(recipe)]), "train")
    assert cfg.output == cfg.output_dir == "old"
    assert resolve(TrainConfig, parser.parse_args(["train", "--config", str(recipe), "--output-dir", "flag"]),
                   "train").output == "flag"
    recipe.write_text(json.dumps({"train": {"data": ["d.jsonl"], "output_dir": "a", "output": "a"}}))
    assert resolve(TrainConfig, parser.parse_args(["train", "--config", str(recipe)]), "train").output == "a"
    recipe.write_text(json.dumps({"train": {"data": ["d.jsonl"], "output_dir": "a", "output": "b"}}))
    with pytest.raises(ValueError, match="sets both 'output' and its old name 'output_dir'"):
        resolve(TrainConfig, parser.parse_args(["train", "--config", str(recipe)]), "train")


def test_resume_reads_a_checkpoint_written_before_output_dir_became_output(tmp_path):
    """A checkpoint's settings name the folder output_dir; the same run resumed now names it output (and from
    wherever the folder was moved): not a change of settings. Any other setting still is."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from medusa_spec.train.checkpoint import STATE, load_checkpoint

    (tmp_path / STATE).write_text(json.dumps({"step": 7, "config": {"output_dir": "runs/old", "lr": 0.001}}))
    loaded = []
    accelerator = SimpleNamespace(distributed_type=DistributedType.NO, load_state=lambda path, **_: loaded.append(path))
    assert load_checkpoint(accelerator, tmp_path, {"output": "moved/run", "lr": 0.001}) == 7 and loaded
    with pytest.raises(ValueError, match="lr: 0.001 -> 0.002"):
        load_checkpoint(accelerator, tmp_path, {"output": "runs/old", "lr": 0.002})


def test_an_eagle3_checkpoint_from_before_the_norm_flags_resumes_with_them_off(tmp_path):
    """eagle3 heads trained with speculators' norms all off until `train` took its trainer's defaults: a checkpoint
    written before has no such settings. Resumed with today's defaults the change is named; with them off, as they
    were, it resumes. Other heads, which have none, resume as before."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from medusa_spec.train.checkpoint import STATE, load_checkpoint

    loaded = []
    accelerator = SimpleNamespace(distributed_type=DistributedType.NO, load_state=lambda path, **_: loaded.append(path))
    (tmp_path / STATE).write_text(json.dumps({"step": 7, "config": {"head_type": "eagle3", "lr": 0.001}}))
    today = TrainConfig(data=["d"], output="o", head_type="eagle3", lr=0.001).eagle3_norms()
    with pytest.raises(ValueError, match="norm_before_fc: False -> True"):
        load_checkpoint(accelerator, tmp_path, {"head_type": "eagle3", "lr": 0.001, **today})
    off = TrainConfig(data=["d"], output="o", head_type="eagle3", lr=0.001, norm_before_fc=False,
                      norm_before_residual=False, norm_output=False).eagle3_norms()
    assert load_checkpoint(accelerator, tmp_path, {"head_type": "eagle3", "lr": 0.001, **off}) == 7 and loaded
    (tmp_path / STATE).write_text(json.dumps({"step": 3, "config": {"head_type": "medusa", "lr": 0.001}}))
    medusa = TrainConfig(data=["d"], output="o", lr=0.001).eagle3_norms()
    assert load_checkpoint(accelerator, tmp_path, {"head_type": "medusa", "lr": 0.001, **medusa}) == 3


# ---------------------------------------------------------------- distillation through a server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(base_dir):
    """`transformers serve` (an OpenAI-compatible server) with the counting model, on loopback."""
    pytest.importorskip("fastapi", reason="needs transformers[serving] (the dev extra installs it)")
    pytest.importorskip("uvicorn", reason="needs transformers[serving] (the dev extra installs it)")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "transformers.cli.transformers", "serve", str(base_dir),
                               "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):  # the server imports FastAPI and loads the model first
            if server.poll() is not None:
                pytest.fail(f"transformers serve exited: {server.stderr.read().decode()[-2000:]}")
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1).read()
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("transformers serve did not come up within 120 s")
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_distill_through_a_server_matches_local_distillation_and_resumes(base_dir, served, tmp_path):
    """The same conversations (turn by turn) as the local engine, greedy, through a real
    OpenAI-compatible server; a rerun skips what is stored."""
    prompts = [Prompt("two", ("count from w2", "count from w20"))]
    prompts += [Prompt(f"p{i}", (f"count from w{i}",)) for i in range(4)]
    local = tmp_path / "local.jsonl"
    base_model, tokenizer = load_model_and_tokenizer(base_dir)
    distill(base_model, tokenizer, prompts, distill_settings(base_dir, local, max_new_tokens=6), progress=False)
    remote = tmp_path / "remote"
    cfg = DistillConfig(model=None, prompts=[], output=str(remote), server=served, max_new_tokens=6, concurrency=3)
    first = distill_via_server(prompts[:3], cfg, progress=False)
    assert first["written"] == 3 and first["new_tokens"] > 0
    second = distill_via_server(prompts, cfg, progress=False)
    assert (second["skipped_finished"], second["written"]) == (3, 2)
    expected = {r["id"]: r["messages"] for r in map(json.loads, local.read_text().splitlines())}
    assert {r["id"]: r["messages"] for r in read_records(remote)} == expected


def test_a_server_refusal_for_context_length_skips_the_prompt_and_any_other_stops_the_run(tmp_path):
    """HTTP 400 is a prompt past the server's context when its message says so (vLLM, SGLang, llama.cpp's server):
    the conversation is skipped as too long, as a local one over --max-prompt-tokens. Any other 400 (a setting the
    server rejects) stops the run with the server's message, instead of skipping every prompt and storing nothing."""
    import http.server
    import threading

    class Refusing(http.server.BaseHTTPRequestHandler):
        message = ""

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"error": {"message": Refusing.message}}).encode()
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cfg = DistillConfig(model=None, prompts=[], output=str(tmp_path / "out"), server_model="m",
                            server=f"http://127.0.0.1:{server.server_address[1]}")
        Refusing.message = "This model's maximum context length is 2048 tokens. However, you requested 4000 tokens."
        stats = distill_via_server([Prompt("p", ("hi",))], cfg, progress=False)
        assert (stats["skipped_too_long"], stats["written"]) == (1, 0)
        Refusing.message = "Unrecognized request argument supplied: top_k"
        with pytest.raises(ServerError, match="HTTP 400.*top_k"):
            distill_via_server([Prompt("p", ("hi",))], cfg, progress=False)
    finally:
        server.shutdown()


class FlakyServer:
    """A chat-completions server on loopback that answers "w1 w2" after failing as `failures` says, one failure per
    request: "503" (busy), "truncated" (the body cut short midway), "reset" (the connection dropped)."""

    def __init__(self, failures, content="w1 w2"):
        import http.server
        import threading

        owner = self
        self.failures, self.requests = list(failures), 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                owner.requests += 1
                failure = owner.failures.pop(0) if owner.failures else None
                if failure == "reset":
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                body = json.dumps({"choices": [{"message": {"role": "assistant", "content": content},
                                                "finish_reason": "stop"}],
                                   "usage": {"completion_tokens": 2}}).encode()
                self.send_response(503 if failure == "503" else 200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: len(body) // 2] if failure == "truncated" else body)
                if failure == "truncated":
                    self.connection.shutdown(socket.SHUT_RDWR)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.mark.parametrize("failures", [["503", "503"], ["truncated"], ["reset"]])
def test_distill_through_a_server_retries_what_a_busy_server_drops(tmp_path, monkeypatch, failures):
    """A 503, a reply cut short or a dropped connection stopped the run (the last two with a raw
    http.client traceback): such a request is sent again, and every answer is stored once."""
    monkeypatch.setattr(medusa_spec.train.server, "BACKOFF_SECONDS", 0.01)
    server = FlakyServer(failures)
    try:
        cfg = DistillConfig(model=None, prompts=[], output=str(tmp_path / "out"), server=server.url,
                            server_model="m", concurrency=1)
        stats = distill_via_server([Prompt(f"p{i}", (f"q{i}",)) for i in range(3)], cfg, progress=False)
        assert stats["written"] == 3 and server.requests == 3 + len(failures)
        assert [r["messages"][-1]["content"] for r in read_records(tmp_path / "out")] == ["w1 w2"] * 3
        server.failures = ["503"] * medusa_spec.train.server.TRIES  # busy past every try: the run stops
        with pytest.raises(ServerError, match=rf"answered HTTP 503.*tried {medusa_spec.train.server.TRIES} times"):
            distill_via_server([Prompt("p9", ("q9",))], cfg, progress=False)
    finally:
        server.server.shutdown()


def test_a_reply_without_text_stops_the_run_and_stores_nothing(tmp_path):
    server = FlakyServer([], content=None)
    try:
        cfg = DistillConfig(model=None, prompts=[], output=str(tmp_path / "out"), server=server.url, server_model="m")
        with pytest.raises(ServerError, match=r"the reply to 'p0' holds no text \(content None\)"):
            distill_via_server([Prompt("p0", ("q0",))], cfg, progress=False)
        assert read_records(tmp_path / "out") == []
    finally:
        server.server.shutdown()


def test_distill_server_errors_name_the_fix(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(medusa_spec.train.server, "BACKOFF_SECONDS", 0.01)
    cfg = DistillConfig(model=None, prompts=[], output=str(tmp_path / "out"), server=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ServerError, match="cannot reach .* start the server"):
        distill_via_server([Prompt("p", ("hi",))], cfg, progress=False)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    code = cli_main(["distill", "--server", cfg.server, "--prompts", str(prompts), "--output", str(tmp_path / "o")])
    error = capsys.readouterr().err
    assert code == 2 and error.startswith("medusa-spec distill: cannot reach") and "Traceback" not in error
    with pytest.raises(ValueError, match="--self-prompts and --follow-ups need"):
        distill_via_server([], DistillConfig(model=None, prompts=[], output="x", server="http://h", follow_ups=0.5),
                           progress=False)


def test_heads_trained_on_the_default_model_name_it_as_the_hub_does(base_dir, conversations, tmp_path, monkeypatch):
    """Without --model, train loads the default model from a local cache folder; the adapter names the model by its
    Hub name, not that machine's path."""
    from medusa_spec import default_model

    monkeypatch.setattr(default_model, "prepare", lambda: Path(base_dir))
    train(small_run(None, conversations, tmp_path, model=None, max_steps=1, eval_examples=2))
    config = json.loads((tmp_path / "medusa_config.json").read_text())
    assert config["base_model_name_or_path"] == default_model.HUB_NAME
