"""Greedy speculative generation is token-identical to transformers' greedy generate."""

import functools
import inspect
import warnings

import pytest
import torch
from torch import nn
from transformers import GenerationConfig

from medusa_spec import MedusaConfig, MedusaModel, generate_with_draft, generate_with_lookup
from medusa_spec import slots as slots_module
from tiny_models import ARCHITECTURES, VOCAB, WINDOW, tiny_model

TREE = [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0], [0, 0, 0, 0]]


class OracleHeads(nn.Module):
    """Test double for MedusaHeads that knows the greedy continuation: it finds which reference
    position a hidden state belongs to (nearest recorded hidden state) and proposes the tokens
    that follow. At every `sabotage`-th position the second head ranks a wrong token first and the
    right one second, so branches other than rank 0 and partial acceptance are exercised too."""

    def __init__(self, model, sequences, num_heads=4, sabotage=3):
        super().__init__()
        with torch.no_grad():
            self.hidden = [model(s[None], output_hidden_states=True).hidden_states[-1][0] for s in sequences]
        self.sequences, self.num_heads, self.sabotage = sequences, num_heads, sabotage

    dependent = False

    def token_ids(self, draft_indices):
        return draft_indices

    def forward(self, hidden, lm_head):
        logits = torch.zeros(hidden.shape[0], self.num_heads, VOCAB)
        for b, state in enumerate(hidden):
            j = int((self.hidden[b] - state).norm(dim=-1).argmin())
            for k in range(self.num_heads):
                target = j + 2 + k  # head k predicts the token k+2 ahead of the position it reads
                token = int(self.sequences[b][target]) if target < len(self.sequences[b]) else 3
                logits[b, k, token] = 10.0
                if k == 1 and j % self.sabotage == 0:
                    logits[b, k, (token + 1) % VOCAB] = 11.0
        return logits


def left_padded(rows):
    """Token rows of different lengths -> (input_ids, attention_mask), left-padded with 0."""
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, width - len(row):] = row
        mask[b, width - len(row):] = 1
    return ids, mask


def reference_generate(model, input_ids, attention_mask=None, **kwargs):
    with torch.no_grad():
        return model.generate(input_ids, attention_mask=attention_mask, do_sample=False, **kwargs)


def prompt(length=2 * WINDOW + 1, seed=0, batch=1):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def medusa(model, heads=None, num_heads=4, seed=0, share_lm_head=True):
    mm = MedusaModel.from_base(model, MedusaConfig(num_heads=num_heads, share_lm_head=share_lm_head))
    if heads is None:  # random heads: perturb the zero-initialised blocks (and own projections, if any)
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in mm.heads.parameters():
                p.normal_(0, 0.5)
    else:
        mm.heads = heads
    return mm


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_identity_when_random_heads_are_rejected(arch):
    """The rejection case: heads with random projections guess a token the base model takes about 1 time
    in 50, so nearly every step rejects the whole tree and emits only the base model's own token."""
    model = tiny_model(arch)
    ids = prompt()
    expected = reference_generate(model, ids, max_new_tokens=30, eos_token_id=None)
    out = medusa(model, share_lm_head=False).generate(ids, max_new_tokens=30, eos_token_id=[], tree=TREE)
    assert torch.equal(out.sequences, expected)
    assert out.stats.new_tokens == [30]
    verify_steps = out.stats.row_steps[0] - 1
    assert verify_steps - out.stats.accepted_at_depth[0] >= 25, out.stats  # steps that accepted nothing


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_identity_with_heads_that_propose_long_runs(arch):
    model = tiny_model(arch)
    ids = prompt(seed=1)
    expected = reference_generate(model, ids, max_new_tokens=40, eos_token_id=None)
    mm = medusa(model, OracleHeads(model, expected))
    out = mm.generate(ids, max_new_tokens=40, eos_token_id=[], tree=TREE)
    assert torch.equal(out.sequences, expected)
    # Multi-token acceptance and cache compaction really happened.
    assert out.stats.tokens_per_step > 2.5, out.stats
    assert out.stats.accepted_at_depth[3] > 0


@pytest.mark.parametrize("arch", ["llama", "gemma3", "mistral", "gpt2", "opt"])
def test_mixed_length_batch_equals_per_row_generation(arch):
    model = tiny_model(arch)
    lengths = [2 * WINDOW + 3, 4, WINDOW + 1]
    rows = [prompt(n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    ids, mask = left_padded(rows)
    width = ids.shape[1]
    per_row = [reference_generate(model, r[None], max_new_tokens=25, eos_token_id=None)[0, len(r):] for r in rows]
    full_rows = [torch.cat([r, new]) for r, new in zip(rows, per_row)]
    mm = medusa(model, OracleHeads(model, full_rows))
    out = mm.generate(ids, attention_mask=mask, max_new_tokens=25, eos_token_id=[], tree=TREE)
    for b in range(len(rows)):
        assert torch.equal(out.sequences[b, width:], per_row[b]), f"row {b}"
    assert out.stats.tokens_per_step > 2.0


def test_padded_batch_without_attention_mask_reads_padding_as_transformers_does():
    """No attention_mask: transformers' generate treats tokens equal to pad_token_id as padding, unless that id is
    also an eos id; medusa_spec must read the same prompt."""
    model = tiny_model("llama")
    ids, _ = left_padded([prompt(8, seed=20)[0], prompt(5, seed=21)[0]])  # padded with 0, the models' pad_token_id
    expected = reference_generate(model, ids, max_new_tokens=12)
    assert torch.equal(medusa(model).generate(ids, max_new_tokens=12, tree=TREE).sequences, expected)
    # pad_token_id == eos_token_id: transformers reads every token, the pad-valued ones too.
    eos_padded = ids.masked_fill(ids == 0, 2)
    expected = reference_generate(model, eos_padded, max_new_tokens=12, eos_token_id=2, pad_token_id=2)
    out = medusa(model).generate(eos_padded, max_new_tokens=12, eos_token_id=2, pad_token_id=2, tree=TREE)
    assert torch.equal(out.sequences, expected)


def test_eos_inside_accepted_path_stops_the_row():
    model = tiny_model("llama")
    ids = prompt(seed=4, batch=1)
    free = reference_generate(model, ids, max_new_tokens=30, eos_token_id=None)
    new = free[0, ids.shape[1]:]
    eos = int(new[12])  # a token the oracle proposes in the middle of an accepted run
    first = int((new == eos).nonzero()[0])
    mm = medusa(model, OracleHeads(model, free, sabotage=1000))
    out = mm.generate(ids, max_new_tokens=30, eos_token_id=eos, pad_token_id=0, tree=TREE)
    expected = reference_generate(model, ids, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out.sequences, expected)
    assert out.sequences.shape[1] == ids.shape[1] + first + 1  # nothing after the eos
    assert out.stats.tokens_per_step > 2.0


def test_eos_stops_one_row_of_a_batch_and_pads_it():
    model = tiny_model("qwen2")
    ids = torch.cat([prompt(9, seed=5), prompt(9, seed=6)])
    free = [reference_generate(model, ids[b:b + 1], max_new_tokens=20, eos_token_id=None)[0] for b in range(2)]
    eos = int(free[0][9 + 5])
    expected = reference_generate(model, ids, max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    out = medusa(model, OracleHeads(model, free)).generate(ids, max_new_tokens=20, eos_token_id=[eos], pad_token_id=0,
                                                           tree=TREE)
    assert torch.equal(out.sequences, expected)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7])
def test_max_new_tokens_is_exact(max_new_tokens):
    model = tiny_model("llama")
    ids = prompt(seed=7)
    expected = reference_generate(model, ids, max_new_tokens=max_new_tokens, eos_token_id=None)
    mm = medusa(model, OracleHeads(model, reference_generate(model, ids, max_new_tokens=20, eos_token_id=None)))
    out = mm.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=[], tree=TREE)
    assert torch.equal(out.sequences, expected)
    assert out.stats.new_tokens == [max_new_tokens]


def test_speculation_off_is_one_token_per_step():
    model = tiny_model("llama")
    ids = prompt(seed=8)
    out = medusa(model).generate(ids, max_new_tokens=12, eos_token_id=[], tree=[])
    assert torch.equal(out.sequences, reference_generate(model, ids, max_new_tokens=12, eos_token_id=None))
    assert out.stats.steps == 12 and out.stats.tokens_per_step == 1.0


def test_an_accepted_path_already_in_place_is_kept_without_copying_the_cache(monkeypatch):
    """Where each row's accepted nodes are the block's first slots (speculation off: the root alone; a chain) the
    commit keeps them where the verify pass wrote them (an int to keep_accepted: no gather of every layer's keys and
    values); a path through a later sibling is gathered. The output is transformers' either way."""
    model = tiny_model("llama")
    ids = prompt(seed=1)
    expected = reference_generate(model, ids, max_new_tokens=40, eos_token_id=None)
    kept = []
    real = slots_module.keep_accepted

    def spy(cache, past, keep):
        kept.append(keep)
        real(cache, past, keep)

    monkeypatch.setattr(slots_module, "keep_accepted", spy)
    oracle = medusa(model, OracleHeads(model, expected))
    runs = {"off": (medusa(model), []), "chain": (oracle, [[0], [0, 0], [0, 0, 0]]), "tree": (oracle, TREE)}
    for name, (mm, tree) in runs.items():
        kept.clear()
        out = mm.generate(ids, max_new_tokens=40, eos_token_id=[], tree=tree)
        assert torch.equal(out.sequences, expected), name
        in_place = [k for k in kept if isinstance(k, int)]
        if name == "off":
            assert in_place == kept and set(in_place) == {1}
        elif name == "chain":
            assert in_place == kept and max(in_place) == 4, kept  # whole chains accepted, none copied
        else:  # paths through node 2 ([1]) or past it are gathered; the root alone or with node 1 is not
            assert in_place and len(in_place) < len(kept), kept


def test_default_trees_and_eager_attention_are_exact():
    model = tiny_model("llama", _attn_implementation="eager")
    ids = prompt(seed=9)
    expected = reference_generate(model, ids, max_new_tokens=20, eos_token_id=None)
    mm = medusa(model, OracleHeads(model, expected))
    assert torch.equal(mm.generate(ids, max_new_tokens=20, eos_token_id=[]).sequences, expected)


class RecordingStreamer:
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.clone())

    def end(self):
        self.ended = True


def test_streamer_receives_prompt_then_every_new_token_once():
    model = tiny_model("llama")
    ids = prompt(seed=11)
    expected = reference_generate(model, ids, max_new_tokens=20, eos_token_id=None)
    streamer = RecordingStreamer()
    medusa(model, OracleHeads(model, expected)).generate(ids, max_new_tokens=20, eos_token_id=[], tree=TREE,
                                                         streamer=streamer)
    assert torch.equal(streamer.chunks[0], ids)
    assert torch.equal(torch.cat(streamer.chunks[1:]), expected[0, ids.shape[1]:])
    assert len(streamer.chunks) - 1 < 20 and streamer.ended  # several tokens per put: speculation streamed


def test_transformers_text_streamer_works(capsys):
    from transformers import TextStreamer

    class Digits:  # the minimal tokenizer interface TextStreamer uses
        def decode(self, ids, **kwargs):
            return " ".join(str(i) for i in ids)

    model = tiny_model("llama")
    ids = prompt(seed=12)
    streamer = TextStreamer(Digits(), skip_prompt=True)
    out = medusa(model).generate(ids, max_new_tokens=6, eos_token_id=[], streamer=streamer)
    printed = capsys.readouterr().out.split()
    assert printed == [str(t) for t in out.sequences[0, ids.shape[1]:].tolist()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_runs_in_the_base_models_dtype(dtype):
    model = tiny_model("qwen3").to(dtype)
    ids = prompt(seed=13)
    expected = reference_generate(model, ids, max_new_tokens=20, eos_token_id=None)
    mm = medusa(model, OracleHeads(model, expected))
    out = mm.generate(ids, max_new_tokens=20, eos_token_id=[], tree=TREE)
    assert torch.equal(out.sequences, expected) and out.stats.tokens_per_step > 2
    real_heads = medusa(model)
    assert real_heads.heads.blocks[0].layers[0].weight.dtype == dtype
    assert torch.equal(real_heads.generate(ids, max_new_tokens=20, eos_token_id=[], tree=TREE).sequences, expected)


class ModeRecordingHeads(nn.Module):
    """Random heads' stand-in that records whether it ran in training mode."""

    dependent = False

    def __init__(self, num_heads=4):
        super().__init__()
        self.proj = nn.Linear(32, num_heads * VOCAB)
        self.num_heads, self.modes = num_heads, []

    def token_ids(self, draft_indices):
        return draft_indices

    def forward(self, hidden, lm_head):
        self.modes.append(self.training)
        return self.proj(hidden).view(hidden.shape[0], self.num_heads, VOCAB)


def test_generate_runs_heads_in_eval_mode_and_restores_their_mode():
    model = tiny_model("llama")
    heads = ModeRecordingHeads()
    mm = medusa(model, heads)
    heads.train()
    mm.generate(prompt(seed=14), max_new_tokens=5, eos_token_id=[], tree=TREE)
    assert heads.modes and not any(heads.modes)  # eval mode while generating
    assert heads.training and heads.proj.training  # and training again after, as the caller left them
    heads.eval()
    mm.generate(prompt(seed=14), max_new_tokens=5, eos_token_id=[], tree=TREE)
    assert not heads.training


def test_a_base_model_left_in_train_mode_decodes_without_dropout_and_stays_in_train_mode():
    model = tiny_model("gpt2", lm_head_scale=1.0, embd_pdrop=0.5, attn_pdrop=0.5, resid_pdrop=0.5)
    mm = medusa(model)
    expected = mm.generate(prompt(seed=15), max_new_tokens=12, eos_token_id=[], tree=TREE).sequences
    model.train()
    torch.manual_seed(0)
    with torch.no_grad():  # the dropout changes what the model decodes (so the check below can fail)
        assert not torch.equal(model.generate(prompt(seed=15), max_new_tokens=12, do_sample=False, eos_token_id=None),
                               expected)
    assert torch.equal(mm.generate(prompt(seed=15), max_new_tokens=12, eos_token_id=[], tree=TREE).sequences, expected)
    assert all(m.training for m in model.modules())  # as the caller left it


@pytest.mark.parametrize("arch", ["gpt2", "opt"])  # learned position tables of 256 positions
def test_rows_finished_early_stand_still_at_the_position_limit(arch):
    """Prompt + max_new_tokens fill the position table exactly. Row 0 stops at an eos within a few tokens;
    row 1, whose heads guess wrong, then takes about one step per token: the finished row must not
    advance a position per step past the table, nor may the last steps' deep nodes index past it."""
    model = tiny_model(arch)
    limit = model.config.max_position_embeddings
    ids = torch.cat([prompt(200, seed=20), prompt(200, seed=21)])
    max_new = limit - ids.shape[1]
    free = [reference_generate(model, ids[b:b + 1], max_new_tokens=max_new, eos_token_id=None)[0] for b in range(2)]
    eos = int(free[0][200 + 3])
    assert eos not in free[1][200:].tolist()
    expected = reference_generate(model, ids, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0)
    wrong = torch.randint(3, VOCAB, (limit,), generator=torch.Generator().manual_seed(26))
    out = medusa(model, OracleHeads(model, [free[0], wrong])).generate(
        ids, max_new_tokens=max_new, eos_token_id=[eos], pad_token_id=0, tree=TREE)
    assert torch.equal(out.sequences, expected)
    assert out.stats.row_steps[0] < 5 and out.stats.row_steps[1] > 40


def test_rows_finished_early_stand_still_with_a_draft_model():
    model, draft = tiny_model("gpt2"), tiny_model("gpt2", seed=1)
    limit = model.config.max_position_embeddings
    ids = torch.cat([prompt(200, seed=22), prompt(200, seed=23)])
    max_new = limit - ids.shape[1]
    free = reference_generate(model, ids[:1], max_new_tokens=max_new, eos_token_id=None)[0]
    eos = int(free[200 + 2])
    expected = reference_generate(model, ids, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0)
    # The base model as its own draft: every draft is kept, rows run 6 tokens a step up to the table's end.
    out = generate_with_draft(model, model, ids, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0,
                              num_draft_tokens=5)
    assert torch.equal(out.sequences, expected)
    # Another model's drafts: shorter runs, so row 0 sits finished through many of row 1's steps.
    out = generate_with_draft(model, draft, ids, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0,
                              num_draft_tokens=3)
    assert torch.equal(out.sequences, expected)
    assert out.stats.row_steps[1] > out.stats.row_steps[0] + 10, out.stats.row_steps


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_prompt_and_max_new_tokens_past_the_position_limit_are_refused(arch):
    model = tiny_model(arch)
    limit = model.config.max_position_embeddings
    ids, mask = left_padded([prompt(limit - 10, seed=24)[0], prompt(5, seed=25)[0]])
    with pytest.raises(ValueError, match=f"needs {limit + 2} positions.*max_position_embeddings={limit}; "
                                         f"lower max_new_tokens to 10"):
        medusa(model).generate(ids, attention_mask=mask, max_new_tokens=12, tree=TREE)
    with pytest.raises(ValueError, match=f"max_position_embeddings={limit}"):
        generate_with_draft(model, model, ids, attention_mask=mask, max_new_tokens=12)
    out = medusa(model).generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=[], tree=TREE)
    assert out.stats.new_tokens == [10, 10]  # exactly at the limit: runs


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_prefill_keeps_only_the_final_hidden_states(arch):
    """No forward pass over the prompt asks for every layer's hidden states (layers x prompt length
    per row); only the verify passes over a tree's few nodes do."""
    model = tiny_model(arch)
    ids = prompt(40, seed=15)
    asked = []  # query length of every forward pass that returned all layers' hidden states
    def record(module, args, kwargs, output):
        if output.hidden_states:
            asked.append(kwargs["input_ids"].shape[1])

    handle = model.register_forward_hook(record, with_kwargs=True)
    try:
        out = medusa(model).generate(ids, max_new_tokens=5, eos_token_id=[], tree=TREE)
    finally:
        handle.remove()
    assert torch.equal(out.sequences, reference_generate(model, ids, max_new_tokens=5, eos_token_id=None))
    assert asked and max(asked) <= len(TREE) + 1, asked


TIE_TOLERANCE = 1e-5  # logit gap within which two kernels' float rounding may order the top two tokens differently


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_agrees_with_transformers_up_to_near_ties_on_unscaled_models(arch, record_property):
    """The other tests sharpen the LM head so no argmax is within rounding of a tie. Here the logits are
    the random init's (top-two gaps down to ~1e-5): outputs must agree with transformers' generate except
    where the two computations' rounding picks the other of two near-tied tokens. Such flips are counted
    and reported (a warning, and the `near_tie_flips` property), not hidden."""
    model = tiny_model(arch, lm_head_scale=1.0)
    ids = prompt(12, seed=16, batch=8)
    expected = reference_generate(model, ids, max_new_tokens=24, eos_token_id=None)
    out = medusa(model, OracleHeads(model, expected)).generate(ids, max_new_tokens=24, eos_token_id=[], tree=TREE)
    assert out.stats.tokens_per_step > 2  # tree passes, not one token at a time
    flips = []
    for b in range(ids.shape[0]):
        differs = (out.sequences[b] != expected[b]).nonzero()
        if len(differs) == 0:
            continue
        t = int(differs[0])  # the first divergence; the texts differ from there on
        with torch.no_grad():
            logits = model(expected[b:b + 1, :t]).logits[0, -1]
        gap = float(logits[expected[b, t]] - logits[out.sequences[b, t]])
        assert gap < TIE_TOLERANCE, (f"row {b} diverges at token {t - ids.shape[1]} where transformers' choice "
                                     f"led by {gap}")
        flips.append((b, t - ids.shape[1], gap))
    record_property("near_tie_flips", len(flips))
    if flips:
        warnings.warn(f"{arch}: {len(flips)} of {ids.shape[0]} rows took the other of two near-tied tokens "
                      f"(row, token, gap): {flips}")


def named_past_key_values(model):
    """The model as transformers releases before the rename have it (5.17, which pyproject's range admits): its
    forward takes the KV cache as `past_key_values`, not `cache` (its decoder body, which prefill runs apart, keeps
    the new name here: each is asked for its own)."""
    def renamed(cls):
        class PastKeyValues(cls):
            def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                        **kwargs):
                assert "cache" not in kwargs, "a cache passed under the name this model does not take"
                inner = "cache" if "cache" in inspect.signature(super().forward).parameters else "past_key_values"
                return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                       **{inner: past_key_values}, **kwargs)
        return PastKeyValues
    model.__class__ = renamed(type(model))
    return model


@pytest.mark.parametrize("heads", ["oracle", "eagle"])
def test_greedy_identity_on_a_model_whose_forward_takes_past_key_values(heads):
    """transformers renamed the forward's cache argument within 5.x: a model with the old name is driven through
    it (it was refused as 'takes no cache'), and a dropped cache would break identity."""
    model = tiny_model("llama")
    ids = prompt(seed=1)
    expected = reference_generate(model, ids, max_new_tokens=40, eos_token_id=None)
    old = named_past_key_values(tiny_model("llama"))
    if heads == "oracle":
        mm = medusa(old, OracleHeads(model, expected))
    else:
        mm = MedusaModel.from_base(old, MedusaConfig(num_heads=3, head_type="eagle"))
    out = mm.generate(ids, max_new_tokens=40, eos_token_id=[], tree=TREE[:5])
    assert torch.equal(out.sequences, expected)
    if heads == "oracle":
        assert out.stats.tokens_per_step > 2.0, out.stats


def test_max_new_tokens_left_out_follows_the_models_generation_config():
    """As transformers' generate reads it: the model's generation_config.max_new_tokens, else 128; a value passed
    wins. MedusaModel.generate and generate_with_draft used to stop at 128 whatever the model's config said."""
    model = tiny_model("llama")
    ids = prompt()
    model.generation_config.max_new_tokens = 9
    assert medusa(model).generate(ids, eos_token_id=[], tree=TREE).stats.new_tokens == [9]
    assert medusa(model).generate(ids, max_new_tokens=4, eos_token_id=[], tree=TREE).stats.new_tokens == [4]
    assert generate_with_draft(model, tiny_model("llama", seed=1), ids, eos_token_id=[]).stats.new_tokens == [9]
    model.generation_config.max_new_tokens = None
    assert medusa(model).generate(ids, eos_token_id=[], tree=[]).stats.new_tokens == [128]


def test_a_generation_config_passed_is_read_in_place_of_the_models():
    """As transformers' generate(generation_config=...): what it sets wins over the model's generation_config (its
    max_new_tokens, its repetition_penalty=1.0 lifting the model's), what it leaves unset comes from the model's;
    in all three entry points."""
    model = tiny_model("llama")
    ids = prompt(seed=2)
    model.generation_config.max_new_tokens = 9
    model.generation_config.repetition_penalty = 1.3  # the model's own would be refused
    settings = GenerationConfig(max_new_tokens=5, eos_token_id=None, repetition_penalty=1.0)
    expected = reference_generate(model, ids, generation_config=settings)
    assert expected.shape[1] == ids.shape[1] + 5
    draft = tiny_model("llama", seed=1)
    entries = (medusa(model).generate, functools.partial(generate_with_lookup, model),
               functools.partial(generate_with_draft, model, draft))
    for generate in entries:
        assert torch.equal(generate(ids, generation_config=settings).sequences, expected)
    unset = GenerationConfig(eos_token_id=None, repetition_penalty=1.0)  # max_new_tokens: the model's 9
    for generate in entries:
        assert generate(ids, generation_config=unset).stats.new_tokens == [9]
    with pytest.raises(ValueError, match=r"^generation_config sets repetition_penalty=1.3.*set "
                                         r"generation_config.repetition_penalty = 1.0"):  # unset: the model's
        medusa(model).generate(ids, generation_config=GenerationConfig(max_new_tokens=5))
    with pytest.raises(TypeError, match=r"generation_config must be a transformers GenerationConfig, got dict; "
                                        r"for a dict, pass GenerationConfig\(\*\*settings\)"):
        medusa(model).generate(ids, generation_config={"max_new_tokens": 5})


def test_padding_between_tokens_decodes_as_transformers_on_full_attention():
    """Positions skip masked tokens as transformers' do; only sliding windows (refused, test_inputs) count them."""
    model = tiny_model("llama")
    ids = prompt(seed=7, batch=2)
    mask = torch.ones_like(ids)
    mask[1, 3:6] = 0
    expected = reference_generate(model, ids, mask, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    out = medusa(model).generate(ids, mask, max_new_tokens=12, eos_token_id=[], pad_token_id=0, tree=TREE)
    assert torch.equal(out.sequences, expected)
