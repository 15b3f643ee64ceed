"""Tree speculation through transformers' own generate (custom_generate): the same tokens as plain greedy and
as MedusaModel.generate, transformers' arguments, GenerationConfig, streamers and return types."""

import pytest
import torch
from transformers import GenerationConfig, TextStreamer
from transformers.generation import (
    EosTokenCriteria,
    GenerateDecoderOnlyOutput,
    LogitsProcessorList,
    MaxLengthCriteria,
    StoppingCriteriaList,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from medusa_spec.hf_generate import CUSTOM_GENERATE, medusa_decoding
from test_generate import TREE, OracleHeads, RecordingStreamer, left_padded, medusa, prompt
from tiny_models import WINDOW, tiny_model

# The two forms transformers accepts: the shipped folder (runs its generate.py, so trust_remote_code) and the callable.
ROUTES = {"folder": dict(custom_generate=CUSTOM_GENERATE, trust_remote_code=True),
          "callable": dict(custom_generate=medusa_decoding)}


def plain(model, ids, **kwargs):
    return model.generate(ids, do_sample=False, **kwargs)


class Digits:  # the tokenizer interface TextStreamer uses
    def decode(self, ids, **kwargs):
        return " ".join(str(i) for i in ids)


def module_state(model):
    return {name: dict(vars(module)) for name, module in model.named_modules()}


@pytest.mark.parametrize("route", ROUTES)
def test_greedy_equals_plain_generate_and_medusa_generate(route):
    model = tiny_model("llama")
    ids = prompt(seed=1)
    expected = plain(model, ids, max_new_tokens=30)
    mm = medusa(model, OracleHeads(model, expected))
    ours = model.generate(ids, max_new_tokens=30, medusa_heads=mm, tree=TREE, **ROUTES[route])
    direct = mm.generate(ids, max_new_tokens=30, tree=TREE)
    assert torch.equal(ours, expected)
    assert torch.equal(ours, direct.sequences)
    assert direct.stats.tokens_per_step > 2.0  # long runs accepted: compaction exercised on the same path


@pytest.mark.parametrize("route", ROUTES)
def test_padded_batch_equals_plain_generate(route):
    model = tiny_model("llama")
    rows = [prompt(n, seed=10 + i)[0] for i, n in enumerate([2 * WINDOW + 3, 4, WINDOW + 1])]
    ids, mask = left_padded(rows)
    expected = plain(model, ids, attention_mask=mask, max_new_tokens=20)
    full_rows = [torch.cat([r, expected[b, ids.shape[1]:]]) for b, r in enumerate(rows)]  # what OracleHeads reads
    mm = medusa(model, OracleHeads(model, full_rows))
    ours = model.generate(ids, attention_mask=mask, max_new_tokens=20, medusa_heads=mm, tree=TREE, **ROUTES[route])
    assert torch.equal(ours, expected)
    assert torch.equal(ours, mm.generate(ids, attention_mask=mask, max_new_tokens=20, tree=TREE).sequences)
    # Without the mask transformers infers it from the pad token (0 here) and hands it over; MedusaModel.generate
    # infers the same one.
    assert torch.equal(model.generate(ids, max_new_tokens=20, medusa_heads=mm, tree=TREE, **ROUTES[route]), expected)
    assert torch.equal(mm.generate(ids, max_new_tokens=20, tree=TREE).sequences, expected)


@pytest.mark.parametrize("route", ROUTES)
def test_sampling_arguments_reach_medusa_generate(route):
    model = tiny_model("llama", lm_head_scale=1.0)
    mm = medusa(model)
    ids = prompt(seed=2, batch=2)
    args = dict(max_new_tokens=12, do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    torch.manual_seed(5)
    ours = model.generate(ids, medusa_heads=mm, **args, **ROUTES[route])
    torch.manual_seed(5)
    direct = mm.generate(ids, **args).sequences
    assert torch.equal(ours, direct)
    torch.manual_seed(5)
    greedy = mm.generate(ids, max_new_tokens=12, do_sample=False).sequences
    assert not torch.equal(ours, greedy)  # the draws were sampled, not greedy
    torch.manual_seed(5)
    ours = model.generate(ids, medusa_heads=mm, num_return_sequences=2, **args, **ROUTES[route])
    torch.manual_seed(5)
    assert torch.equal(ours, mm.generate(ids.repeat_interleave(2, dim=0), **args).sequences)  # rows as transformers


@pytest.mark.parametrize("route", ROUTES)
def test_generation_config_argument_and_the_models_own_are_honoured(route):
    model = tiny_model("llama", lm_head_scale=1.0)
    mm = medusa(model)
    ids = prompt(seed=3)
    ours = model.generate(ids, generation_config=GenerationConfig(max_new_tokens=7, eos_token_id=None), medusa_heads=mm,
                          **ROUTES[route])
    assert ours.shape[1] == ids.shape[1] + 7
    assert torch.equal(ours, plain(model, ids, max_new_tokens=7))

    model.generation_config.max_new_tokens = 9
    model.generation_config.do_sample, model.generation_config.top_k = True, 10
    torch.manual_seed(0)
    ours = model.generate(ids, medusa_heads=mm, **ROUTES[route])
    torch.manual_seed(0)
    assert torch.equal(ours, mm.generate(ids, max_new_tokens=9).sequences)  # MedusaModel reads the same config
    assert ours.shape[1] == ids.shape[1] + 9


@pytest.mark.parametrize("route", ROUTES)
def test_a_calls_option_lifts_a_processor_the_models_generation_config_sets(route):
    """Qwen2.5-Instruct ships repetition_penalty=1.05: a call's repetition_penalty=1.0 turns it off in transformers'
    generate, and so here (the merged settings are read, not the model's own)."""
    model = tiny_model("llama")
    mm = medusa(model)
    ids = prompt(seed=6)
    model.generation_config.repetition_penalty = 1.3
    ours = model.generate(ids, max_new_tokens=8, repetition_penalty=1.0, medusa_heads=mm, **ROUTES[route])
    assert torch.equal(ours, plain(model, ids, max_new_tokens=8, repetition_penalty=1.0))
    with pytest.raises(ValueError, match="RepetitionPenaltyLogitsProcessor"):  # left on, it is still refused
        model.generate(ids, max_new_tokens=8, medusa_heads=mm, **ROUTES[route])


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("where", [0, 5])
def test_an_all_ones_mask_keeps_a_prompts_pad_token(route, where):
    """The pad id inside a prompt whose mask is all ones is a token, also where transformers leaves the all-ones mask
    out of custom_generate's arguments (5.25 passes it on this route)."""
    model = tiny_model("llama")
    mm = medusa(model)
    ids = prompt(seed=8)
    ids[0, where] = 0  # the pad id
    mask = torch.ones_like(ids)
    ours = model.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0, medusa_heads=mm, **ROUTES[route])
    assert torch.equal(ours, plain(model, ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0))


@pytest.mark.parametrize("route", ROUTES)
def test_return_dict_in_generate_gives_transformers_output(route):
    model = tiny_model("llama")
    mm = medusa(model)
    ids = prompt(seed=4)
    out = model.generate(ids, max_new_tokens=8, return_dict_in_generate=True, medusa_heads=mm, **ROUTES[route])
    assert isinstance(out, GenerateDecoderOnlyOutput)
    assert torch.equal(out.sequences, plain(model, ids, max_new_tokens=8))


def test_streamer_gets_what_transformers_streams():
    model = tiny_model("llama")
    ids = prompt(seed=5)
    theirs = RecordingStreamer()
    expected = plain(model, ids, max_new_tokens=20, streamer=theirs)
    ours = RecordingStreamer()
    model.generate(ids, max_new_tokens=20, streamer=ours, medusa_heads=medusa(model, OracleHeads(model, expected)),
                   tree=TREE, **ROUTES["folder"])
    assert torch.equal(ours.chunks[0], theirs.chunks[0])  # the prompt first, once
    assert torch.equal(torch.cat(ours.chunks[1:]), torch.cat(theirs.chunks[1:]))
    assert ours.ended and theirs.ended
    assert len(ours.chunks) < len(theirs.chunks)  # several tokens per put: speculation streamed


def test_text_streamer_prints_what_it_prints_for_plain_generate(capsys):
    model = tiny_model("llama")
    ids = prompt(seed=6)
    plain(model, ids, max_new_tokens=10, streamer=TextStreamer(Digits(), skip_prompt=True))
    expected = capsys.readouterr().out
    model.generate(ids, max_new_tokens=10, streamer=TextStreamer(Digits(), skip_prompt=True),
                   medusa_heads=medusa(model), **ROUTES["folder"])
    assert capsys.readouterr().out == expected


@pytest.mark.parametrize("route", ROUTES)
def test_heads_from_an_adapter_folder(tmp_path, route):
    model = tiny_model("llama")
    mm = medusa(model)
    mm.save_heads(tmp_path / "heads")
    ids = prompt(seed=7)
    ours = model.generate(ids, max_new_tokens=10, medusa_heads=tmp_path / "heads", **ROUTES[route])
    assert torch.equal(ours, mm.generate(ids, max_new_tokens=10).sequences)


@pytest.mark.parametrize("route", ROUTES)
def test_nothing_is_left_on_the_callers_model(route):
    model = tiny_model("llama")
    mm = medusa(model)
    ids = prompt(seed=8)
    # What transformers itself sets at its first generate and at the first forward asking for hidden states.
    plain(model, ids, max_new_tokens=3)
    model(ids, output_hidden_states=True)
    before = module_state(model)
    model.generate(ids, max_new_tokens=6, medusa_heads=mm, **ROUTES[route])
    assert module_state(model) == before
    assert "generate" not in vars(model)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("options, match", [
    (dict(), "medusa_heads=MedusaModel.from_pretrained"),
    (dict(num_beams=2), "num_beams=1"),
    (dict(repetition_penalty=1.3), "RepetitionPenaltyLogitsProcessor: drop"),
    (dict(min_new_tokens=3), "MinNewTokensLengthLogitsProcessor"),
    (dict(output_scores=True, return_dict_in_generate=True), "drop output_scores"),
    (dict(max_time=10.0), "MaxTimeCriteria"),
])
def test_unsupported_options_are_refused_naming_the_fix(route, options, match):
    model = tiny_model("llama")
    heads = {} if not options else dict(medusa_heads=medusa(model))
    with pytest.raises(ValueError, match=match):
        model.generate(prompt(seed=9), max_new_tokens=5, **heads, **options, **ROUTES[route])


@pytest.mark.parametrize("route", ROUTES)
def test_heads_of_another_model_or_of_the_wrong_type_are_refused(tmp_path, route):
    model, other = tiny_model("llama"), tiny_model("llama", seed=1)
    with pytest.raises(ValueError, match="attached to another base model"):
        model.generate(prompt(seed=9), max_new_tokens=5, medusa_heads=medusa(other), **ROUTES[route])
    with pytest.raises(TypeError, match="MedusaModel or an adapter folder"):
        model.generate(prompt(seed=9), max_new_tokens=5, medusa_heads=medusa(model).heads, **ROUTES[route])
    medusa(model).save_heads(tmp_path / "heads")
    (tmp_path / "heads" / "lora").mkdir()
    with pytest.raises(ValueError, match="load it once with"):
        model.generate(prompt(seed=9), max_new_tokens=5, medusa_heads=tmp_path / "heads", **ROUTES[route])


def test_assistant_model_is_refused_by_the_folder():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="drop assistant_model"):
        model.generate(prompt(seed=9), max_new_tokens=5, medusa_heads=medusa(model),
                       assistant_model=tiny_model("llama"), **ROUTES["folder"])



@pytest.mark.parametrize("route", ROUTES)
def test_a_callers_sampling_warpers_are_applied(route):
    """A caller's TopKLogitsWarper(5) is what transformers samples with (it takes the place of the options' top_k=50):
    the draws are those of top_k=5; with temperature=0.7 transformers applies it before the temperature, the same
    distribution."""
    model = tiny_model("llama", lm_head_scale=1.0)
    mm = medusa(model)
    ids = prompt(seed=2, batch=2)
    for options in (dict(), dict(temperature=0.7)):
        args = dict(max_new_tokens=12, do_sample=True, **options)
        torch.manual_seed(5)
        ours = model.generate(ids, medusa_heads=mm, logits_processor=LogitsProcessorList([TopKLogitsWarper(5)]),
                              **args, **ROUTES[route])
        torch.manual_seed(5)
        assert torch.equal(ours, mm.generate(ids, top_k=5, **args).sequences)
        torch.manual_seed(5)
        assert not torch.equal(ours, mm.generate(ids, **args).sequences)  # top_k=50 draws otherwise here


class OwnTopK(TopKLogitsWarper):  # a caller's own processor, whatever it derives from
    pass


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("processor, match", [
    (TopPLogitsWarper(0.5), r"logits_processor.*TopPLogitsWarper\(top_p=0.5\) before TopKLogitsWarper.*top_p=0.5"),
    (OwnTopK(5), "logits_processor.*OwnTopK: drop"),
    (TopKLogitsWarper(5, filter_value=-1e4), "logits_processor.*filter_value=-10000.0.*pass top_k=5"),
])
def test_a_callers_warper_that_sampling_options_cannot_express_is_refused(route, processor, match):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=match):
        model.generate(prompt(seed=9), max_new_tokens=5, do_sample=True, medusa_heads=medusa(model),
                       logits_processor=LogitsProcessorList([processor]), **ROUTES[route])


@pytest.mark.parametrize("route", ROUTES)
def test_a_callers_stopping_criteria_are_applied(route):
    model = tiny_model("llama")
    mm = medusa(model)
    ids = prompt(seed=10)
    length = ids.shape[1]
    full = plain(model, ids, max_new_tokens=12)
    assert full.shape[1] == length + 12
    stop = int(full[0, length + 4])  # a token greedy decoding emits: the caller's own eos
    for criteria in (MaxLengthCriteria(length + 6), EosTokenCriteria(stop)):
        expected = plain(model, ids, max_new_tokens=12, stopping_criteria=StoppingCriteriaList([criteria]))
        assert expected.shape[1] < full.shape[1]  # transformers stops where the caller's criterion says
        ours = model.generate(ids, max_new_tokens=12, stopping_criteria=StoppingCriteriaList([criteria]),
                              medusa_heads=mm, **ROUTES[route])
        assert torch.equal(ours, expected)


@pytest.mark.parametrize("route", ROUTES)
def test_position_ids_other_than_the_masks_are_refused(route):
    """medusa_spec positions the tokens as transformers does without position_ids (the mask's count of tokens so
    far): those are taken, any others refused."""
    model = tiny_model("llama")
    mm = medusa(model)
    ids = prompt(seed=11)
    own = torch.arange(ids.shape[1])[None]
    ours = model.generate(ids, position_ids=own, max_new_tokens=6, medusa_heads=mm, **ROUTES[route])
    assert torch.equal(ours, plain(model, ids, max_new_tokens=6))
    with pytest.raises(ValueError, match="position_ids.*drop position_ids"):
        model.generate(ids, position_ids=own + 3, max_new_tokens=6, medusa_heads=mm, **ROUTES[route])
