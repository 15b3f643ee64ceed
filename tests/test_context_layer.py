"""The context layer (heads read attention over the text so far): its decoding cache against the
training pass, losslessness with it (greedy identity on every architecture: test_dependent_heads),
adapters, and training that beats heads without it where the next token is decided by what came
earlier in the text."""

from __future__ import annotations

import json
import random

import pytest
import torch

from medusa_spec import MedusaConfig, MedusaModel
from medusa_spec.context import ContextLayer
from medusa_spec.formats import convert
from medusa_spec.train.loop import train
from medusa_spec.train.module import causal_within_examples
from test_dependent_heads import (  # noqa: F401 (an autouse fixture)
    TREE,
    assert_round_trips,
    assert_samples_follow_the_base,
    head0_accuracy,
    one_thread,
    random_heads,
)
from test_generate import left_padded, prompt, reference_generate
from test_sampling import SETTINGS
from test_training import WORDS, make_tokenizer, small_run, tiny_llama
from tiny_models import tiny_model


def random_context(hidden_size=16, num_heads=2, seed=0) -> ContextLayer:
    layer = ContextLayer(hidden_size, num_heads)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return layer


def test_decoding_cache_gives_the_training_pass_over_the_kept_text():
    """Row 0: no padding; row 1: two padding slots first. Each step appends a block whose slots past
    the row's `last` are rejected candidates (junk, invalid); the output at `last` must be the
    training pass's output there over the text that was kept."""
    layer = random_context()
    g = torch.Generator().manual_seed(1)
    text_hidden, text_tokens, text_next = (torch.randn(2, 12, 16, generator=g) for _ in range(3))
    expected = layer(text_hidden, text_tokens, text_next, causal_within_examples(torch.ones(2, 12, dtype=torch.long)))

    prompt_length = [5, 3]  # row 1's prompt is left-padded to 5 slots
    slots = [torch.zeros(2, 5, 16) for _ in range(3)]
    valid = torch.tensor([[True] * 5, [False, False, True, True, True]])
    for slot, text in zip(slots, (text_hidden, text_tokens, text_next)):
        slot[0], slot[1, 2:] = text[0, :5], text[1, :3]
    cache, out = layer.extend(None, *slots, valid, torch.tensor([4, 4]))
    assert torch.allclose(out, torch.stack([expected[0, 4], expected[1, 2]]), atol=1e-5)

    done = list(prompt_length)
    for kept in ([3, 1], [1, 4], [2, 2]):  # slots each row keeps per step (the longest sets the block width)
        width = max(kept)
        slots = [torch.randn(2, width, 16, generator=g) for _ in range(3)]  # junk past each row's kept slots
        for slot, text in zip(slots, (text_hidden, text_tokens, text_next)):
            for b in range(2):
                slot[b, : kept[b]] = text[b, done[b]: done[b] + kept[b]]
        block_valid = torch.arange(width)[None] < torch.tensor(kept)[:, None]
        cache, out = layer.extend(cache, *slots, block_valid, torch.tensor(kept) - 1)
        done = [d + k for d, k in zip(done, kept)]
        assert torch.allclose(out, torch.stack([expected[b, done[b] - 1] for b in range(2)]), atol=1e-5), kept
    assert cache.keys.shape[2] == cache.valid.shape[1] == 5 + 3 + 4 + 2


def test_a_new_context_layer_passes_the_hidden_state_through():
    layer = ContextLayer(16, 4)
    hidden = torch.randn(1, 6, 16)
    out = layer(hidden, torch.randn(1, 6, 16), torch.randn(1, 6, 16),
                causal_within_examples(torch.ones(1, 6, dtype=torch.long)))
    assert torch.equal(out, hidden)


@pytest.mark.parametrize("lookup_tokens", [0, 4])
def test_mixed_length_batch_with_a_context_layer_equals_per_row_generation(lookup_tokens):
    model = tiny_model("llama")
    rows = [prompt(n, seed=20 + i)[0] for i, n in enumerate([13, 4, 7])]
    ids, mask = left_padded(rows)
    per_row = [reference_generate(model, r[None], max_new_tokens=24, eos_token_id=None)[0, len(r):] for r in rows]
    mm = random_heads(model, head_type="dependent", context_heads=4, scale=0.1)
    out = mm.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=[], tree=TREE,
                      lookup_tokens=lookup_tokens)
    for b in range(len(rows)):
        assert torch.equal(out.sequences[b, ids.shape[1]:], per_row[b]), f"row {b}"


@pytest.mark.parametrize("sampling", SETTINGS[1:4], ids=str)
def test_sampling_with_a_context_layer_matches_the_base(sampling):
    model = tiny_model("llama", vocab_size=6)
    ids = torch.tensor([[3, 5, 4, 1]])
    mm = MedusaModel.from_base(model, MedusaConfig(num_heads=2, head_type="dependent", context_heads=2))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a context layer that changes the drafts, small enough that some are accepted
        for param in mm.heads.context.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    assert_samples_follow_the_base(mm, ids, sampling)


def test_context_layer_round_trips_and_other_formats_refuse_it(tmp_path):
    model = tiny_model("llama")
    mm = random_heads(model, head_type="dependent", context_heads=2, scale=0.1)
    assert_round_trips(mm, tmp_path / "own", "context.qkv.weight")
    assert json.loads((tmp_path / "own" / "medusa_config.json").read_text())["context_heads"] == 2
    random_heads(model, num_heads=2, context_heads=2).save_heads(tmp_path / "plain")
    for to in ("vllm", "medusa"):
        with pytest.raises(ValueError, match=r"has no context layer \(context_heads > 0\); keep these heads"):
            convert(tmp_path / "plain", tmp_path / to, to=to, base_model=model)


def test_bad_context_heads_are_named():
    with pytest.raises(ValueError, match=r"context_heads \(5\) must divide hidden_size \(32\), e.g. 1"):
        MedusaModel.from_base(tiny_model("llama"), MedusaConfig(context_heads=5))
    with pytest.raises(ValueError, match="context_heads must be an integer >= 0, got -1"):
        MedusaConfig(context_heads=-1)


@pytest.fixture(scope="module")
def repeat_data(tmp_path_factory):
    """Answers that say a random 6-word phrase, then say it again: in the repeat, the word after the
    next one is written earlier in the answer, which only attention over the text can read."""
    tokenizer = make_tokenizer()
    base = tmp_path_factory.mktemp("repeat-base")
    tiny_llama(tokenizer).save_pretrained(base)
    tokenizer.save_pretrained(base)
    rng = random.Random(0)
    lines = []
    for i in range(160):
        phrase = " ".join(f"w{rng.randrange(WORDS)}" for _ in range(6))
        lines.append(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": "count from w1"},
                                                             {"role": "assistant", "content": f"{phrase} {phrase}"}]}))
    data = tmp_path_factory.mktemp("repeat-data") / "repeats.jsonl"
    data.write_text("\n".join(lines) + "\n")
    return base, data, tokenizer


def repeat_accuracy(adapter, base, tokenizer) -> float:
    """In the repeat, after its first word, head 0 guesses the word at t + 2."""
    rng = random.Random(1)
    phrases = [" ".join(f"w{rng.randrange(WORDS)}" for _ in range(6)) for _ in range(20)]
    # ids[start + 6 ..] is the repeat; t + 2 runs over its words after the first
    return head0_accuracy(adapter, base, tokenizer, [f"{p} {p}" for p in phrases],
                          lambda start: range(start + 5, start + 10))


def test_a_context_layer_reads_what_came_earlier_in_the_text(repeat_data, tmp_path):
    base, data, tokenizer = repeat_data
    accuracy = {}
    for context_heads in (0, 1):
        out = tmp_path / str(context_heads)
        train(small_run(base, data, out, head_type="dependent", context_heads=context_heads, num_heads=2,
                        max_steps=150, max_length=96, eval_examples=4))
        accuracy[context_heads] = repeat_accuracy(out, base, tokenizer)
    # Without the context layer the repeat's words are guesses (chance: about 1/24).
    assert accuracy[1] > 0.7 and accuracy[0] < 0.3, accuracy
