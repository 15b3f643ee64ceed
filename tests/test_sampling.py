"""Sampling is lossless: the tokens speculative sampling emits are distributed exactly as the
base model's processed distribution (temperature, top-k, top-p), computed with transformers' own
warpers, not this library's. The same chi-square test is shown to reject a plausible wrong rule, so
it has the power to catch one."""

import functools
import itertools

import pytest
import torch
from scipy.stats import chisquare
from torch import nn
from transformers import GenerationConfig
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import medusa_spec.accept
from medusa_spec import MedusaConfig, MedusaModel, Sampling
from medusa_spec.accept import draw_targets, processed_probs
from medusa_spec.generate import generate_with_lookup
from medusa_spec.inputs import (
    TRANSFORMERS_SAMPLING_DEFAULTS,
    UNSUPPORTED_PROCESSORS,
    UNSUPPORTED_WARPERS,
    resolve_sampling,
)
from tiny_models import tiny_model

VOCAB, ROWS, NEW = 6, 6000, 3
TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0]]
SETTINGS = [Sampling(True, 1.0), Sampling(True, 0.7), Sampling(True, 1.0, top_k=3), Sampling(True, 1.0, top_p=0.7),
            Sampling(True, 1.5, top_k=4, top_p=0.9)]


@pytest.mark.parametrize("sampling", SETTINGS, ids=str)
def test_processed_probs_match_transformers_warpers(sampling):
    logits = torch.randn(4, 50) * 3
    scores = TemperatureLogitsWarper(sampling.temperature)(None, logits.clone())
    if sampling.top_k:
        scores = TopKLogitsWarper(sampling.top_k)(None, scores)
    if sampling.top_p:
        scores = TopPLogitsWarper(sampling.top_p)(None, scores)
    torch.testing.assert_close(processed_probs(logits, sampling), scores.softmax(-1))


def transformers_scores(logits, sampling):
    scores = TemperatureLogitsWarper(sampling.temperature)(None, logits.clone())
    if sampling.top_k:
        scores = TopKLogitsWarper(sampling.top_k)(None, scores)
    if sampling.top_p:
        scores = TopPLogitsWarper(sampling.top_p)(None, scores)
    return scores


def transformers_probs(logits, sampling):
    """[N, V] logits -> the distribution transformers' sampling loop draws from with these settings."""
    return transformers_scores(logits.float(), sampling).softmax(-1)


WINDOWED = [Sampling(True, 0.7, top_k=50, top_p=0.9), Sampling(True, 1.3, top_k=5, top_p=0.5),
            Sampling(True, 1.0, top_k=20)]


@pytest.mark.parametrize("ties", ["distinct", "bf16", "integers"])
@pytest.mark.parametrize("sampling", WINDOWED, ids=str)
def test_top_k_window_keeps_what_transformers_keeps(sampling, ties):
    """processed_probs sorts only top-k's window of 2 * top_k candidates, not the vocabulary. On 5,000
    tokens it keeps exactly transformers' tokens, with their probabilities, also where scores tie at
    the top-k or top-p cut: logits rounded to bf16 (as a bf16 model's are) or to integers."""
    logits = torch.randn(64, 5000, generator=torch.Generator().manual_seed(0)) * 3
    logits = {"distinct": logits, "bf16": logits.bfloat16().float(), "integers": logits.round()}[ties]
    expected = transformers_scores(logits, sampling).softmax(-1)
    got = processed_probs(logits, sampling)
    assert torch.equal(got > 0, expected > 0)
    torch.testing.assert_close(got, expected)


def test_draws_inside_the_top_k_window_follow_the_processed_distribution():
    sampling = Sampling(True, 0.8, top_k=20, top_p=0.95)
    logits = torch.randn(300, generator=torch.Generator().manual_seed(1)) * 2
    probs = transformers_probs(logits[None], sampling)[0]
    torch.manual_seed(0)
    drawn = draw_targets(logits.expand(1, 20000, 300), sampling)[0]
    kept = probs > 0
    observed = torch.bincount(drawn, minlength=300)
    assert observed[~kept].sum() == 0
    expected = probs[kept].double() / probs[kept].double().sum() * drawn.numel()
    assert chisquare(observed[kept].double().numpy(), expected.numpy()).pvalue > 1e-3


def exact_joint(model, prompt, sampling, new=NEW):
    """P(t1 .. t_new | prompt) for every token sequence, enumerated with the base model and transformers' warpers:
    [V] * new."""
    joint = torch.ones(())
    with torch.no_grad():
        for length in range(new):  # every prefix of `length` new tokens -> the next token's distribution
            prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=length)), dtype=torch.long)
            ids = torch.cat([prompt.expand(VOCAB ** length, -1), prefixes.view(VOCAB ** length, length)], 1)
            probs = transformers_probs(model(ids).logits[:, -1], sampling)
            joint = joint[..., None] * probs.view([VOCAB] * (length + 1))
    return joint


def triple_counts(tokens):
    """[R, 3] token triples -> how often each occurs, [V ** 3] in the order of exact_joint's cells."""
    cells = tokens[:, 0] * VOCAB * VOCAB + tokens[:, 1] * VOCAB + tokens[:, 2]
    return torch.bincount(cells, minlength=VOCAB ** 3).double()


def sample_triples(model, prompt, sampling, seed=0, heads=None):
    mm = MedusaModel.from_base(model, MedusaConfig(num_heads=2))  # zero-init heads guess plausible tokens
    if heads is not None:
        mm.heads = heads
    torch.manual_seed(seed)
    out = mm.generate(prompt.expand(ROWS, -1), max_new_tokens=NEW, do_sample=True, temperature=sampling.temperature,
                      top_k=sampling.top_k, top_p=sampling.top_p, eos_token_id=[], tree=TREE)
    return triple_counts(out.sequences[:, prompt.shape[1]:]), out.stats


def chi_square_p_value(counts, probs):
    probs = probs.flatten().double()
    assert counts[probs == 0].sum() == 0, "emitted a sequence the processed distribution excludes"
    expected = probs * counts.sum() / probs.sum()
    small = expected < 5  # pool sparse cells so the chi-square approximation holds
    observed, pooled = counts[~small], expected[~small]
    if expected[small].sum() > 0:
        observed = torch.cat([observed, counts[small].sum()[None]])
        pooled = torch.cat([pooled, expected[small].sum()[None]])
    expected = pooled
    expected = expected * observed.sum() / expected.sum()  # exact totals after float rounding
    return chisquare(observed.numpy(), expected.numpy()).pvalue


def setup():
    model = tiny_model("llama", vocab_size=VOCAB)
    prompt = torch.tensor([[3, 5, 4, 1]])
    return model, prompt


@pytest.mark.parametrize("sampling", SETTINGS, ids=str)
def test_speculative_sampling_matches_base_distribution(sampling):
    model, prompt = setup()
    counts, stats = sample_triples(model, prompt, sampling)
    assert stats.accepted_at_depth[1] > ROWS // 20, "too little acceptance to test the tree path"
    assert chi_square_p_value(counts, exact_joint(model, prompt, sampling)) > 1e-3


PROMPTS = [[3, 5, 4, 1], [5, 2]]  # of two lengths: rows of the second are left-padded


@pytest.mark.parametrize("sampling", [SETTINGS[0], SETTINGS[4]], ids=str)
def test_sampling_is_exact_at_later_steps_in_a_padded_mixed_length_batch(sampling):
    """Rows of two prompts of different lengths, interleaved in one left-padded batch, six tokens each.
    Per prompt, the joint of tokens 1-3 and the marginal of tokens 4-6: those come after several verify
    steps, with cache compaction and rows at different positions and cache lengths."""
    model = tiny_model("llama", vocab_size=VOCAB)
    width = max(len(p) for p in PROMPTS)
    ids = torch.zeros(ROWS, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b in range(ROWS):
        row = PROMPTS[b % len(PROMPTS)]
        ids[b, width - len(row):], mask[b, width - len(row):] = torch.tensor(row), 1
    mm = MedusaModel.from_base(model, MedusaConfig(num_heads=2))
    torch.manual_seed(0)
    out = mm.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, temperature=sampling.temperature,
                      top_k=sampling.top_k or 0, top_p=sampling.top_p, eos_token_id=[], tree=TREE)
    assert out.stats.accepted_at_depth[1] > ROWS // 20, "too little acceptance to test the tree path"
    assert out.stats.steps > 3  # tokens 4-6 came from verify steps after the first
    for i, prompt in enumerate(PROMPTS):
        new = out.sequences[i::len(PROMPTS), width:]
        joint = exact_joint(model, torch.tensor([prompt]), sampling, new=6)
        first, later = joint.sum(dim=(3, 4, 5)), joint.sum(dim=(0, 1, 2))
        assert chi_square_p_value(triple_counts(new[:, :3]), first) > 1e-3, f"prompt {i}, tokens 1-3"
        assert chi_square_p_value(triple_counts(new[:, 3:]), later) > 1e-3, f"prompt {i}, tokens 4-6"


class RepeatingHeads(nn.Module):
    """Zero-init heads (each ranks tokens as the base model did for the root) over a draft vocabulary that
    holds every token twice, as a token map with repeats does: ranks 0 and 1 are one token, so depth-1
    siblings [0] and [1] repeat a token, and so do [0, 0] and [0, 1]."""

    dependent = False

    def token_ids(self, draft_indices):
        return draft_indices // 2

    def forward(self, hidden, lm_head):
        return lm_head(hidden).repeat_interleave(2, dim=-1)[:, None].expand(-1, 2, -1)  # [B, 2 heads, 2V]


def test_sampling_is_exact_when_siblings_repeat_a_token():
    model, prompt = setup()
    sampling = SETTINGS[0]
    counts, stats = sample_triples(model, prompt, sampling, heads=RepeatingHeads())
    assert stats.accepted_at_depth[1] > ROWS // 20, "too little acceptance to test the tree path"
    assert chi_square_p_value(counts, exact_joint(model, prompt, sampling)) > 1e-3


def accept_with_retry(node_tokens, logits, tree, sampling):
    """A wrong rule: when the first draw misses the candidates, draw again (without removing
    the candidates' mass), so candidates come out more often than the base model says."""
    first, second = draw_targets(logits, sampling), draw_targets(logits, sampling)
    matches = (node_tokens == first[:, tree.parent]) | (node_tokens == second[:, tree.parent])
    matches[:, 0] = True
    reached = (tree.tree_mask[None] & ~matches[:, None, :]).sum(-1) == 0
    accept_length, last_node = (reached * (tree.depth + 1)).max(dim=-1)
    return last_node, accept_length - 1, first.gather(1, last_node[:, None])[:, 0]


def test_chi_square_rejects_a_wrong_acceptance_rule(monkeypatch):
    model, prompt = setup()
    sampling = SETTINGS[0]
    monkeypatch.setattr(medusa_spec.accept, "accept", accept_with_retry)
    counts, _ = sample_triples(model, prompt, sampling)
    assert chi_square_p_value(counts, exact_joint(model, prompt, sampling)) < 1e-6


# (generation_config settings, generate arguments): every sampling argument resolves as in transformers'
# generate: the argument, else the generation_config, else transformers' default.
RESOLUTION_CASES = [
    ({}, {"do_sample": True}),                                         # default top_k=50 cuts the 96-token vocabulary
    ({"top_k": 5, "temperature": 0.7}, {"do_sample": True}),           # from the generation_config
    ({"top_k": 5, "top_p": 0.8}, {"do_sample": True, "top_k": 0}),     # an argument wins; top_k=0 turns top-k off
    ({"do_sample": True, "temperature": 1.5}, {"top_p": 0.9}),         # do_sample itself from the generation_config
]


@pytest.mark.parametrize("gen_config, kwargs", RESOLUTION_CASES, ids=str)
def test_sampling_settings_resolve_as_in_transformers(gen_config, kwargs):
    model = tiny_model("llama", vocab_size=96)
    for name, value in gen_config.items():
        setattr(model.generation_config, name, value)
    ids = torch.tensor([[3, 5, 4, 1, 7]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=1, output_scores=True, return_dict_in_generate=True, **kwargs)
        logits = model(ids).logits[:, -1]
    transformers_probs = out.scores[0].softmax(-1)  # scores: after transformers' warpers
    torch.testing.assert_close(processed_probs(logits, resolve_sampling(model, **kwargs)), transformers_probs)


def test_transformers_defaults_are_the_ones_resolved():
    defaults = GenerationConfig._get_default_generation_params()
    assert dict(TRANSFORMERS_SAMPLING_DEFAULTS) == {name: defaults[name] for name, _ in TRANSFORMERS_SAMPLING_DEFAULTS}


def test_generation_config_top_k_1_makes_sampling_greedy():
    """top_k=1 in the generation_config leaves one token to sample: transformers' sampling is greedy, and so is ours."""
    model = tiny_model("llama", vocab_size=96)
    mm = MedusaModel.from_base(model, MedusaConfig(num_heads=2))
    ids = torch.randint(3, 96, (4, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        greedy = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
    model.generation_config.top_k, model.generation_config.temperature = 1, 3.0
    torch.manual_seed(0)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, max_new_tokens=20, do_sample=True, eos_token_id=None), greedy)
    sampled = mm.generate(ids, max_new_tokens=20, do_sample=True, eos_token_id=[], tree=TREE).sequences
    assert torch.equal(sampled, greedy)


def test_sampling_from_the_generation_config_is_exact():
    """Sampling set only in the generation_config (top-k 2, temperature 0.7): the chi-square against that
    distribution."""
    model, prompt = setup()
    model.generation_config.do_sample, model.generation_config.top_k = True, 2
    model.generation_config.temperature = 0.7
    mm = MedusaModel.from_base(model, MedusaConfig(num_heads=2))
    torch.manual_seed(0)
    out = mm.generate(prompt.expand(ROWS, -1), max_new_tokens=NEW, eos_token_id=[], tree=TREE)
    new = out.sequences[:, prompt.shape[1]:]
    assert chi_square_p_value(triple_counts(new), exact_joint(model, prompt, Sampling(True, 0.7, top_k=2))) > 1e-3


@pytest.mark.parametrize("name, value", [("repetition_penalty", 1.5), ("no_repeat_ngram_size", 2),
                                         ("min_new_tokens", 3), ("suppress_tokens", [4]), ("bad_words_ids", [[4]]),
                                         ("stop_strings", ["x"]), ("encoder_repetition_penalty", 3.0),
                                         ("encoder_no_repeat_ngram_size", 1), ("num_beams", 3),
                                         ("num_return_sequences", 2)])
def test_a_processor_medusa_spec_does_not_apply_is_refused_greedy_too(name, value):
    """transformers' generate applies these from the generation_config, greedy or not (a Qwen2.5-Instruct ships
    repetition_penalty=1.05): decoding without them would not give the model's output."""
    model = tiny_model("llama", vocab_size=128)
    mm = MedusaModel.from_base(model, MedusaConfig(num_heads=2))
    prompt = torch.tensor([[3, 5, 3, 5, 3]])
    if name == "repetition_penalty":  # it does change what transformers' greedy decoding gives here
        with torch.no_grad():
            plain = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
            model.generation_config.repetition_penalty = value
            assert not torch.equal(model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None), plain)
    setattr(model.generation_config, name, value)
    for generate in (functools.partial(mm.generate, tree=TREE), functools.partial(generate_with_lookup, model)):
        with pytest.raises(ValueError, match=rf"generation_config sets {name}=.*medusa_spec does not .*"
                                             rf"base_model.generation_config.{name} = "):
            generate(prompt, max_new_tokens=2)
    setattr(model.generation_config, name, dict(UNSUPPORTED_PROCESSORS)[name])  # the fix the message names
    assert mm.generate(prompt, max_new_tokens=2, tree=TREE).sequences.shape == (1, 7)


def test_unsupported_settings_are_off_in_a_default_generation_config():
    defaults = GenerationConfig()
    # What transformers fills in for unset settings before custom_generate sees the config.
    filled = GenerationConfig._get_default_generation_params()
    for name, neutral in UNSUPPORTED_PROCESSORS + UNSUPPORTED_WARPERS:
        assert getattr(defaults, name) in (None, neutral), name
        assert filled.get(name) in (None, neutral), name


def test_a_sampling_warper_medusa_spec_does_not_apply_is_refused():
    model = tiny_model("llama", vocab_size=VOCAB)
    model.generation_config.min_p = 0.1
    mm = MedusaModel.from_base(model, MedusaConfig(num_heads=2))
    with pytest.raises(ValueError, match="min_p=0.1.*generation_config.min_p = None"):
        mm.generate(torch.tensor([[3, 5]]), max_new_tokens=2, do_sample=True, tree=TREE)
    greedy = mm.generate(torch.tensor([[3, 5]]), max_new_tokens=2, tree=TREE)  # greedy ignores it
    assert greedy.sequences.shape == (1, 4)
