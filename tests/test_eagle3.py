"""Eagle3 heads, EAGLE-3 as speculators defines it: drafts equal to those the reference itself wrote
(tests/fixtures/eagle3, made by make_fixtures.py with speculators 0.9.0), its folders read and written unchanged,
every refusal named with the user's model untouched, lossless decoding, and training that learns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from draft_folders import edited_copy, shifted
from medusa_spec import MedusaConfig, MedusaModel
from medusa_spec.eagle3 import TRAINER_NORMS
from medusa_spec.formats import convert, detect_format
from medusa_spec.train.loop import train
from test_dependent_heads import TREE, pair_accuracy, pair_data, random_heads  # noqa: F401 (fixture)
from test_generate import left_padded, prompt, reference_generate
from test_training import small_run
from tiny_models import tiny_model

FIXTURES = Path(__file__).parent / "fixtures" / "eagle3"
EXPECTED = json.loads((FIXTURES / "expected_drafts.json").read_text())
DRAFTS = sorted(EXPECTED["drafts"])


@pytest.fixture(scope="module")
def verifier():
    return AutoModelForCausalLM.from_pretrained(FIXTURES / "tiny-verifier").eval()


def state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


# --- conformance with the reference -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", DRAFTS)
def test_drafts_equal_speculators_at_every_depth_and_position(verifier, name):
    """Row k, column t: speculators' draft at depth k + 1 (its forward after shift_batch, ttt_steps=3), in the
    verifier's vocabulary, for two texts; every one equal."""
    mm = MedusaModel.from_pretrained(verifier, FIXTURES / name)
    assert mm.config.head_type == "eagle3" and mm.config.num_heads == EXPECTED["depth"]
    for text, expected in zip(EXPECTED["texts"], EXPECTED["drafts"][name]):
        drafts = mm.teacher_forced_drafts(torch.tensor(text), EXPECTED["depth"])
        assert drafts.shape == (EXPECTED["depth"], len(text) - 1)
        assert drafts.tolist() == expected
    # Fixtures that could not tell a wrong draft from a right one: each depth drafts varied tokens.
    assert all(len(set(row)) >= 4 for rows in EXPECTED["drafts"][name] for row in rows)


def test_the_fixtures_tell_the_settings_apart():
    """Each draft differs from the others on the same texts (the layer families and norm flags matter), so the
    comparison above would catch one of them computed as another."""
    rows = {name: json.dumps(EXPECTED["drafts"][name]) for name in DRAFTS}
    assert len(set(rows.values())) == len(DRAFTS)


@pytest.mark.parametrize("name", DRAFTS)
def test_a_round_trip_gives_back_the_same_tensors_and_config(verifier, name, tmp_path):
    """load, mm.save_heads(dir), convert dir DST --to speculators: config.json and every tensor as speculators wrote
    them."""
    mm = MedusaModel.from_pretrained(verifier, FIXTURES / name)
    mm.save_heads(tmp_path / "ours")
    convert(tmp_path / "ours", tmp_path / "back", to="speculators", base_model=verifier)
    assert detect_format(tmp_path / "back") == "speculators"
    original = json.loads((FIXTURES / name / "config.json").read_text())
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == original
    want, got = load_file(FIXTURES / name / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert want.keys() == got.keys()
    assert all(torch.equal(want[key], got[key]) and want[key].dtype == got[key].dtype for key in want)


# --- refusals -----------------------------------------------------------------------------------------------------

def broken_copy(tmp_path, config=None, tensors=None, name="llama") -> Path:
    return edited_copy(FIXTURES / name, tmp_path / "draft", config, tensors)


@pytest.mark.parametrize(("config", "tensors", "message"), [
    ({"speculators_model_type": "dflash"}, None, "speculators_model_type 'dflash' is not supported.*eagle3"),
    ({"speculators_model_type": "peagle"}, None, "reads speculators' \"eagle3\" drafts"),
    ({"mask_token_id": 3}, None, r"field\(s\) \['mask_token_id'\]"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}, None, r"layers \[1, 2, 4\].*4 decoder layers.*layer 4"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 2, 5]}, None, r"layers \[1, 2, 5\].*use 0 \(the embeddings\) to 3$"),
    ({"target_hidden_size": 64}, None, "target_hidden_size 64 differs"),
    ({"norm_before_fc": True, "fc_norm": True}, None, "norm_before_fc and fc_norm exclude each other"),
    ({"transformer_layer_config": {"model_type": "gemma"}}, None, "model_type is 'gemma'"),
    (None, {"fc.weight": None}, "missing fc.weight"),
    (None, {"layers.0.hidden_norm.weight": torch.ones(5)}, r"layers.0.hidden_norm.weight has shape \(5,\)"),
    (None, {"t2d": None}, "needs both d2t and t2d; missing t2d"),
    (None, {"d2t": lambda d2t: d2t + 1000}, r"ids outside \[0, 96\)"),
    (None, {"d2t": shifted}, "one id twice"),
    (None, {"t2d": lambda t2d: t2d.roll(1)}, "t2d and d2t disagree"),
    (None, {"embed_tokens.weight": lambda e: e + 1}, "embed_tokens.weight is not the base model's input embeddings"),
])
def test_a_bad_folder_is_refused_naming_the_problem_and_the_model_is_untouched(verifier, tmp_path, config, tensors,
                                                                                message):
    if config and "transformer_layer_config" in config:
        layer = json.loads((FIXTURES / "llama" / "config.json").read_text())["transformer_layer_config"]
        config = {"transformer_layer_config": {**layer, **config["transformer_layer_config"]}}
    folder = broken_copy(tmp_path, config, tensors)
    before = state(verifier)
    modules = {name: (type(m), sorted(vars(m))) for name, m in verifier.named_modules()}
    with pytest.raises(ValueError, match=message):
        MedusaModel.from_pretrained(verifier, folder)
    assert all(torch.equal(before[k], v) for k, v in verifier.state_dict().items()) and before.keys() == \
        verifier.state_dict().keys()
    assert {name: (type(m), sorted(vars(m))) for name, m in verifier.named_modules()} == modules


def test_a_verifier_that_does_not_fit_is_refused(tmp_path):
    """By its embeddings' shape, and without them (vLLM shares the verifier's) by the config's sizes."""
    wider = tiny_model("llama", hidden_size=48, num_hidden_layers=4)
    other_vocab = tiny_model("llama", vocab_size=120, num_hidden_layers=4)
    for base, size in ((wider, "96 tokens of width 32.*96 of width 48"), (other_vocab, "96 tokens.*120 of width 32")):
        with pytest.raises(ValueError, match=f"{size}: this draft belongs to another model"):
            MedusaModel.from_pretrained(base, FIXTURES / "llama")
    folder = broken_copy(tmp_path, tensors={"embed_tokens.weight": None})
    with pytest.raises(ValueError, match="hidden_size=32 but the base model has 48"):
        MedusaModel.from_pretrained(wider, folder)
    with pytest.raises(ValueError, match="vocab_size=96 but the base model has 120"):
        MedusaModel.from_pretrained(other_vocab, folder)


def test_other_head_types_are_not_written_as_speculators_drafts(tmp_path):
    model = tiny_model("llama")
    random_heads(model, head_type="eagle", num_heads=2).save_heads(tmp_path / "eagle")
    with pytest.raises(ValueError, match="holds eagle3 heads, not eagle heads"):
        convert(tmp_path / "eagle", tmp_path / "out", to="speculators", base_model=model)


def test_teacher_forced_drafts_needs_heads_that_draft_by_level():
    mm = random_heads(tiny_model("llama"), num_heads=2)
    with pytest.raises(ValueError, match="head_type 'eagle' or 'eagle3'"):
        mm.teacher_forced_drafts(prompt()[0])


# --- decoding -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama-norm-before-residual", "llama-full-vocab-2-layers", "llama-trainer-norms"])
def test_reference_drafts_decode_losslessly_in_every_mode(verifier, name):
    """A speculators draft, loaded as it is: one row on a dynamic tree (tree=None), a left-padded batch on a static
    tree, and with a lookup chain: transformers' greedy text each time."""
    mm = MedusaModel.from_pretrained(verifier, FIXTURES / name)
    ids = torch.tensor([EXPECTED["texts"][0]])
    expected = reference_generate(verifier, ids, max_new_tokens=24, eos_token_id=None)
    assert torch.equal(mm.generate(ids, max_new_tokens=24, eos_token_id=[]).sequences, expected)
    rows = [torch.tensor(text) for text in EXPECTED["texts"]]
    batch, mask = left_padded(rows)
    expected = reference_generate(verifier, batch, attention_mask=mask, max_new_tokens=16, eos_token_id=None)
    out = mm.generate(batch, attention_mask=mask, max_new_tokens=16, eos_token_id=[], tree=[[0], [1], [0, 0]],
                      lookup_tokens=3)
    assert torch.equal(out.sequences, expected)


@pytest.mark.parametrize("route", ["folder", "callable"])
def test_a_speculators_folder_runs_through_transformers_generate(verifier, route):
    """custom_generate (and medusa_decoding) take the folder as it is, as medusa_heads."""
    from test_hf_generate import ROUTES, plain

    ids = torch.tensor([EXPECTED["texts"][1]])
    expected = plain(verifier, ids, max_new_tokens=20)
    ours = verifier.generate(ids, max_new_tokens=20, medusa_heads=str(FIXTURES / "qwen3"), **ROUTES[route])
    assert torch.equal(ours, expected)


# --- training -----------------------------------------------------------------------------------------------------

def test_eagle3_heads_learn_what_plain_heads_cannot_and_export(pair_data, tmp_path):  # noqa: F811
    """Pairs (a, PAIR[a]) with `a` random: the word after a pick is decided by the pick, which the draft reads as its
    slot's token: level 0 as the root's, level 1 as the drafted slot's, on its own output. Then the trained heads go
    out as a speculators folder and come back drafting the same."""
    base, data, tokenizer = pair_data
    summary = train(small_run(base, data, tmp_path / "heads", head_type="eagle3", num_heads=2, draft_vocab=20,
                              max_steps=120, max_length=96, eval_examples=4, feature_layers=[0, 1]))
    config = json.loads((tmp_path / "heads" / "medusa_config.json").read_text())
    assert (config["head_type"], config["share_lm_head"], config["feature_layers"]) == ("eagle3", False, [0, 1])
    # The norms speculators' trainer gives a new draft (its train/config/schema.py), not its model config's (all off).
    assert {flag: config["draft_layer"][flag] for flag in TRAINER_NORMS} == TRAINER_NORMS
    assert len(summary["eval"]["rank_accuracy"]) == 2
    accuracy = [pair_accuracy(tmp_path / "heads", base, tokenizer, head) for head in (0, 1)]
    assert min(accuracy) > 0.7, accuracy
    from medusa_spec.train.load import load_model_and_tokenizer

    base_model, _ = load_model_and_tokenizer(base)
    convert(tmp_path / "heads", tmp_path / "speculators", to="speculators", base_model=base_model)
    meta = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert meta["speculators_model_type"] == "eagle3" and meta["draft_vocab_size"] == 20
    assert {flag: meta[flag] for flag in TRAINER_NORMS} == TRAINER_NORMS
    assert "input_norm.weight" in load_file(tmp_path / "speculators" / "model.safetensors")
    assert meta["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    ours = MedusaModel.from_pretrained(base_model, tmp_path / "heads")
    back = MedusaModel.from_pretrained(base_model, tmp_path / "speculators")
    ids = torch.tensor(tokenizer("count from w1 w3 w5 w7")["input_ids"])
    assert torch.equal(ours.teacher_forced_drafts(ids), back.teacher_forced_drafts(ids))


def test_eagle3_norm_flags_shape_new_heads_and_are_refused_where_they_mean_nothing(pair_data, tmp_path):  # noqa: F811
    """--fc-norm, --no-norm-output... as speculators' trainer takes them; on other heads, or against the norms of
    heads trained on (--init-heads), they are refused by name."""
    base, data, _ = pair_data
    run = dict(head_type="eagle3", num_heads=2, draft_vocab=20, max_steps=2, max_length=96, eval_examples=4)
    train(small_run(base, data, tmp_path / "heads", fc_norm=True, norm_output=False, **run))
    config = json.loads((tmp_path / "heads" / "medusa_config.json").read_text())
    assert {flag: config["draft_layer"][flag] for flag in TRAINER_NORMS} == {
        "norm_before_residual": True, "norm_before_fc": False, "fc_norm": True, "norm_output": False}
    with pytest.raises(ValueError, match="--norm-before-fc and --fc-norm exclude each other"):
        small_run(base, data, tmp_path / "both", norm_before_fc=True, fc_norm=True, **run)
    with pytest.raises(ValueError, match="--no-norm-output: speculators' norm flags shape eagle3 heads only"):
        small_run(base, data, tmp_path / "medusa", norm_output=False)
    with pytest.raises(ValueError, match="its heads have --fc-norm, but --no-fc-norm was given"):
        train(small_run(base, data, tmp_path / "on", init_heads=str(tmp_path / "heads"), fc_norm=False, max_steps=1))
    train(small_run(base, data, tmp_path / "medusa", num_heads=2, max_steps=1, max_length=96, eval_examples=4))
    with pytest.raises(ValueError, match="--norm-output shape eagle3 heads only, and these are medusa heads"):
        train(small_run(base, data, tmp_path / "on2", init_heads=str(tmp_path / "medusa"), norm_output=True,
                        max_steps=1))


def test_eagle3_settings_are_named():
    with pytest.raises(ValueError, match="set share_lm_head to false"):
        MedusaConfig(head_type="eagle3")
    with pytest.raises(ValueError, match="must hold exactly"):
        MedusaConfig(head_type="eagle3", share_lm_head=False, draft_layer={"num_attention_heads": 2})
    model = tiny_model("llama")
    mm = MedusaModel.from_base(model, MedusaConfig(head_type="eagle3", share_lm_head=False, num_heads=2))
    assert mm.config.feature_layers == [0, 1]  # speculators' default, within a 2-layer base
    assert mm.config.draft_layer["transformer_layer_config"]["hidden_size"] == 32
    with pytest.raises(ValueError, match="auxiliary layers"):
        MedusaModel.from_base(model, MedusaConfig(head_type="eagle3", share_lm_head=False, feature_layers=[0, 2]))


def test_teacher_forced_drafts_write_no_mode_on_the_callers_modules(verifier, monkeypatch):
    """A draft and verifier in train mode (dropout on) draft as in eval mode, and no module's `training` is written."""
    mm = MedusaModel.from_pretrained(verifier, FIXTURES / "llama")
    text = torch.tensor(EXPECTED["texts"][0])
    for module in mm.modules():
        if isinstance(module, torch.nn.Dropout) or hasattr(module, "attention_dropout"):
            monkeypatch.setattr(module, "p" if isinstance(module, torch.nn.Dropout) else "attention_dropout", 0.5)
    mm.train()
    callers, writes = {id(m) for m in mm.modules()}, []
    setattr_ = torch.nn.Module.__setattr__

    def recording(module, name, value):
        if name == "training" and id(module) in callers:
            writes.append(type(module).__name__)
        setattr_(module, name, value)

    monkeypatch.setattr(torch.nn.Module, "__setattr__", recording)
    assert mm.teacher_forced_drafts(text, 3).tolist() == EXPECTED["drafts"]["llama"][0]
    assert writes == [] and all(m.training for m in mm.modules())


def test_convert_writes_the_weights_in_the_dtype_asked(verifier, tmp_path):
    """--weights-dtype bfloat16: half the size; the folder still loads onto the fp32 verifier and decodes losslessly."""
    from medusa_spec.cli import main

    assert main(["convert", str(FIXTURES / "llama"), str(tmp_path / "bf16"), "--to", "speculators", "--weights-dtype",
                 "bfloat16", "--model", str(FIXTURES / "tiny-verifier")]) == 0
    tensors = load_file(tmp_path / "bf16" / "model.safetensors")
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.int64
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    mm = MedusaModel.from_pretrained(verifier, tmp_path / "bf16")
    ids = torch.tensor([EXPECTED["texts"][0]])
    assert torch.equal(mm.generate(ids, max_new_tokens=12, eos_token_id=[]).sequences,
                       reference_generate(verifier, ids, max_new_tokens=12, eos_token_id=None))


def test_convert_refuses_a_folder_of_other_files_and_replaces_a_speculators_one(verifier, tmp_path):
    """Into a folder holding vLLM Medusa heads: refused, nothing touched; into one holding a speculators draft: it is
    replaced by the new one, files of the user's own beside it kept."""
    model = tiny_model("llama")
    random_heads(model, head_type="medusa", num_heads=2).save_heads(tmp_path / "medusa")
    convert(tmp_path / "medusa", tmp_path / "dst", to="vllm", base_model=model)
    before = {p.name: p.read_bytes() for p in (tmp_path / "dst").iterdir()}
    with pytest.raises(ValueError, match="dst already holds config.json, model.safetensors, not files of speculators"):
        convert(FIXTURES / "llama", tmp_path / "dst", to="speculators", base_model=verifier)
    assert {p.name: p.read_bytes() for p in (tmp_path / "dst").iterdir()} == before
    convert(FIXTURES / "llama", tmp_path / "spec", to="speculators", base_model=verifier)
    (tmp_path / "spec" / "README.md").write_text("notes")
    convert(FIXTURES / "qwen3", tmp_path / "spec", to="speculators", base_model=verifier)
    assert json.loads((tmp_path / "spec" / "config.json").read_text()) == \
        json.loads((FIXTURES / "qwen3" / "config.json").read_text())
    assert (tmp_path / "spec" / "README.md").read_text() == "notes"
