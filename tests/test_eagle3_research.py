"""EAGLE-3's research layout (SGLang's LlamaForCausalLMEagle3, SpecForge's export, the EAGLE repo's drafts): eagle3
heads written in it draft exactly what speculators' own drafts do (tests/fixtures/eagle3), it reads back to the same
config and tensors, and what it cannot express is refused by name, on writing and on reading, the user's model
untouched."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from draft_folders import edited_copy
from medusa_spec import MedusaModel
from medusa_spec.formats import convert, detect_format
from medusa_spec.sglang_format import write_sglang
from test_dependent_heads import random_heads
from tiny_models import tiny_model

FIXTURES = Path(__file__).parent / "fixtures" / "eagle3"
EXPECTED = json.loads((FIXTURES / "expected_drafts.json").read_text())
GOLDEN = FIXTURES / "eagle-repo"  # written by the EAGLE repo's own draft model: make_research_fixture.py


@pytest.fixture(scope="module")
def verifier():
    return AutoModelForCausalLM.from_pretrained(FIXTURES / "tiny-verifier").eval()


@pytest.fixture(scope="module")
def research(verifier, tmp_path_factory) -> Path:
    """speculators' "llama" fixture, through medusa_spec's own format, written in the research layout."""
    tmp = tmp_path_factory.mktemp("research")
    MedusaModel.from_pretrained(verifier, FIXTURES / "llama").save_heads(tmp / "ours")
    convert(tmp / "ours", tmp / "sglang", to="sglang", base_model=verifier)
    return tmp / "sglang"


def state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


# --- conformance ----------------------------------------------------------------------------------------------------

def test_a_speculators_draft_in_the_research_layout_drafts_the_same_at_every_depth_and_position(verifier, research):
    assert detect_format(research) == "sglang"
    mm = MedusaModel.from_pretrained(verifier, research)
    for text, expected in zip(EXPECTED["texts"], EXPECTED["drafts"]["llama"]):
        assert mm.teacher_forced_drafts(torch.tensor(text), EXPECTED["depth"]).tolist() == expected
    reference = MedusaModel.from_pretrained(verifier, FIXTURES / "llama").config
    assert mm.config.draft_layer == reference.draft_layer and mm.config.feature_layers == reference.feature_layers
    assert mm.config.draft_vocab_size == reference.draft_vocab_size and mm.config.num_heads == 3


def test_the_folder_is_speculators_tensors_under_the_research_names(research):
    """midlayer.* for layers.0.*, the rest (d2t, t2d, lm_head's rows included) as speculators wrote it; no embeddings
    (SGLang takes the verifier's). The config: a Llama config of the one layer, speculators' auxiliary layers one
    lower (SGLang captures the input of layer id + 1)."""
    want = load_file(FIXTURES / "llama" / "model.safetensors")
    del want["embed_tokens.weight"]
    got = load_file(research / "model.safetensors")
    assert got.keys() == {key.replace("layers.0.", "midlayer.") for key in want}
    assert all(torch.equal(got[key.replace("layers.0.", "midlayer.")], value) and
               got[key.replace("layers.0.", "midlayer.")].dtype == value.dtype for key, value in want.items())
    spec = json.loads((FIXTURES / "llama" / "config.json").read_text())
    meta = json.loads((research / "config.json").read_text())
    layer = {key: value for key, value in spec["transformer_layer_config"].items() if key != "rope_parameters"}
    assert meta == {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 40,
                    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True},
                    "rope_theta": 10000.0, "rope_scaling": None, "torch_dtype": "float32"}
    assert spec["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]


def test_a_research_folder_round_trips_exactly_and_as_a_pickle(verifier, research, tmp_path):
    """Read and written again: the same config.json and tensors. The EAGLE repo's pytorch_model.bin drafts the same."""
    convert(research, tmp_path / "again", to="sglang", base_model=verifier)
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == \
        json.loads((research / "config.json").read_text())
    want, got = load_file(research / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    (tmp_path / "bin").mkdir()
    shutil.copy(research / "config.json", tmp_path / "bin")
    torch.save(want, tmp_path / "bin" / "pytorch_model.bin")
    mm = MedusaModel.from_pretrained(verifier, tmp_path / "bin")
    assert mm.teacher_forced_drafts(torch.tensor(EXPECTED["texts"][0]), 3).tolist() == EXPECTED["drafts"]["llama"][0]


def test_without_ids_the_auxiliary_layers_are_sglangs_default_for_the_base(research, tmp_path):
    """No eagle_config: SGLang captures the inputs of layers [2, N // 2, N - 3]; a base too shallow for three
    distinct ones, or no base to count, is refused."""
    folder = broken_copy(research, tmp_path, config={"eagle_config": None})
    deep = tiny_model("llama", vocab_size=96, num_hidden_layers=9)
    assert MedusaModel.from_pretrained(deep, folder).config.feature_layers == [2, 4, 6]
    with pytest.raises(ValueError, match=r"default for a base of 4 layers, the inputs of layers \[2, 2, 1\]"):
        MedusaModel.from_pretrained(tiny_model("llama", vocab_size=96, num_hidden_layers=4), folder)
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids is not set.*pass the base model"):
        convert(folder, tmp_path / "out", to="medusa_spec")
    assert not (tmp_path / "out").exists()


def test_drafts_equal_the_eagle_repos_own_at_every_depth_and_position(verifier):
    """A draft the EAGLE repo's own model (cnets.Model) saved as its published drafts are (pytorch_model.bin) and the
    tokens that model drafts (tests/fixtures/eagle3/make_research_fixture.py): read as it is, every one equal; read
    with the auxiliary states one layer lower (the ids without SGLang's + 1), not."""
    golden = json.loads((GOLDEN / "expected_drafts.json").read_text())
    mm = MedusaModel.from_pretrained(verifier, GOLDEN)
    assert mm.config.feature_layers == [1, 2, 3] and mm.config.draft_vocab_size == 40
    texts = [torch.tensor(text) for text in golden["texts"]]
    assert [mm.teacher_forced_drafts(text, golden["depth"]).tolist() for text in texts] == golden["drafts"]
    assert all(len(set(row)) >= 4 for rows in golden["drafts"] for row in rows)
    mm.heads.feature_layers = [0, 1, 2]
    assert [mm.teacher_forced_drafts(text, golden["depth"]).tolist() for text in texts] != golden["drafts"]


def test_the_eagle_repos_draft_converts_to_the_same_tensors_and_config(verifier, tmp_path):
    """Written again: its tensors but the embeddings (SGLang takes the verifier's) and its config, with rope_scaling
    stated; through speculators' format and back, the same again."""
    convert(GOLDEN, tmp_path / "sglang", to="sglang", base_model=verifier)
    want = torch.load(GOLDEN / "pytorch_model.bin", weights_only=True)
    del want["embed_tokens.weight"]
    got = load_file(tmp_path / "sglang" / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    meta = json.loads((GOLDEN / "config.json").read_text())
    assert json.loads((tmp_path / "sglang" / "config.json").read_text()) == {**meta, "rope_scaling": None}
    convert(tmp_path / "sglang", tmp_path / "speculators", to="speculators", base_model=verifier)
    convert(tmp_path / "speculators", tmp_path / "back", to="sglang", base_model=verifier)
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert back.keys() == got.keys() and all(torch.equal(back[k], got[k]) for k in got)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == \
        {key: value for key, value in meta.items() if key != "transformers_version"} | {"rope_scaling": None}


# --- refusals -------------------------------------------------------------------------------------------------------

def broken_copy(research: Path, tmp_path: Path, config=None, tensors=None) -> Path:
    return edited_copy(research, tmp_path / "draft", config, tensors)


def test_specforges_flags_at_their_defaults_and_its_sliding_window_fields_are_read(verifier, research, tmp_path):
    """SpecForge's Qwen3 configs (a Llama draft layer) carry norm_output true, fc_norm false and the sliding-window
    fields, off: the same draft; those fields are kept and written back."""
    folder = broken_copy(research, tmp_path, config={"norm_output": True, "fc_norm": False, "sliding_window": 4096,
                                                     "use_sliding_window": False, "max_window_layers": 48})
    mm = MedusaModel.from_pretrained(verifier, folder)
    assert mm.teacher_forced_drafts(torch.tensor(EXPECTED["texts"][0]), 3).tolist() == EXPECTED["drafts"]["llama"][0]
    convert(folder, tmp_path / "back", to="sglang", base_model=verifier)
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (back["max_window_layers"], back["use_sliding_window"], back["sliding_window"]) == (48, False, 4096)


@pytest.mark.parametrize(("config", "tensors", "message"), [
    ({"architectures": ["LlamaForCausalLMEagle3", "X"]}, None, r"architectures \['LlamaForCausalLMEagle3', 'X'\]"),
    ({"fc_norm": True}, None, "fc_norm is True; SGLang's LlamaForCausalLMEagle3 has no such setting"),
    ({"norm_before_residual": True}, None, "norm_before_residual is True"),
    ({"bias": True}, None, "bias is True"),
    ({"norm_output": False}, None, "norm_output False: SpecForge then scores the draft's state without its final norm"),
    ({"tie_word_embeddings": True}, None, "ties the draft's LM head to the verifier's embeddings"),
    ({"logit_scale": 2.0}, None, r"field\(s\) \['logit_scale'\] are not part of the EAGLE-3 research layout"),
    ({"model_type": "qwen3"}, None, "model_type 'qwen3'"),
    ({"num_hidden_layers": 2}, None, "num_hidden_layers 2.*only one-layer drafts"),
    ({"hidden_act": "gelu"}, None, "hidden_act 'gelu'"),
    ({"draft_vocab_size": None}, None, "draft_vocab_size None.*verifier's LM head"),
    ({"target_hidden_size": 64}, None, "target_hidden_size 64 differs"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1.0}}, None, "state the rotary embedding once"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 1]}}, None, r"\[0, 2, 1\] must be 3 increasing"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2]}}, None, r"\[0, 2\] must be 3 increasing"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}, None, r"auxiliary layers \[2, 3, 4\]"),
    ({"eagle_config": {"use_aux_hidden_state": False}}, None, "EAGLE-1/2, not EAGLE-3"),
    ({"eagle_config": {"layers": [1]}}, None, r"eagle_config may hold .* got \['layers'\]"),
    (None, {"midlayer.hidden_norm.weight": None}, "missing midlayer.hidden_norm.weight"),
    (None, {"fc.weight": torch.ones(32, 64)}, r"fc.weight has shape \(32, 64\)"),
    (None, {"layers.0.mlp.up_proj.weight": torch.ones(48, 32)}, "layers.0.mlp.up_proj.weight is speculators' name"),
    (None, {"t2d": None}, "needs both d2t and t2d; missing t2d"),
    (None, {"d2t": lambda d2t: d2t + 1000}, r"ids outside \[0, 96\)"),
    (None, {"embed_tokens.weight": torch.ones(96, 32)}, "embed_tokens.weight is not the base model's"),
])
def test_a_bad_research_folder_is_refused_naming_the_problem_and_the_model_is_untouched(verifier, research, tmp_path,
                                                                                        config, tensors, message):
    folder = broken_copy(research, tmp_path, config, tensors)
    before = state(verifier)
    modules = {name: (type(m), sorted(vars(m))) for name, m in verifier.named_modules()}
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        MedusaModel.from_pretrained(verifier, folder)
    assert before.keys() == verifier.state_dict().keys()
    assert all(torch.equal(before[k], v) for k, v in verifier.state_dict().items())
    assert {name: (type(m), sorted(vars(m))) for name, m in verifier.named_modules()} == modules


@pytest.mark.parametrize(("name", "message"), [
    ("llama-norm-before-residual", "norm_before_residual is true; SGLang's LlamaForCausalLMEagle3 has no such"),
    ("qwen3", "transformer_layer_config.model_type is 'qwen3'"),
    ("llama-full-vocab-2-layers", "fc_norm is true"),
])
def test_what_the_layout_cannot_express_is_refused_on_writing_and_nothing_is_written(verifier, tmp_path, name,
                                                                                     message):
    with pytest.raises(ValueError, match=f"{message}.*--to speculators"):
        convert(FIXTURES / name, tmp_path / "out", to="sglang", base_model=verifier)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_other_layers_and_head_types_are_refused_on_writing(verifier, tmp_path):
    mm = MedusaModel.from_pretrained(verifier, FIXTURES / "llama")
    for layers, message in (([0, 1, 2], r"feature_layers \[0, 1, 2\].*not the embeddings"),
                            ([1, 3], r"feature_layers \[1, 3\].*3 auxiliary states"),
                            ([3, 2, 1], r"feature_layers \[3, 2, 1\].*in layer order")):
        with pytest.raises(ValueError, match=message):
            write_sglang(tmp_path / "out", dataclasses.replace(mm.config, feature_layers=layers),
                         mm.heads.state_dict())
    model = tiny_model("llama")
    random_heads(model, head_type="eagle", num_heads=2).save_heads(tmp_path / "eagle")
    with pytest.raises(ValueError, match="holds eagle3 heads, not eagle heads"):
        convert(tmp_path / "eagle", tmp_path / "out", to="sglang", base_model=model)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_convert_refuses_a_speculators_folder_and_replaces_a_research_one(verifier, research, tmp_path):
    convert(FIXTURES / "llama", tmp_path / "spec", to="speculators", base_model=verifier)
    before = {p.name: p.read_bytes() for p in (tmp_path / "spec").iterdir()}
    with pytest.raises(ValueError, match="spec already holds config.json, model.safetensors, not files of sglang"):
        convert(research, tmp_path / "spec", to="sglang")
    assert {p.name: p.read_bytes() for p in (tmp_path / "spec").iterdir()} == before
    shutil.copytree(research, tmp_path / "dst")
    torch.save({}, tmp_path / "dst" / "pytorch_model.bin")  # a stale pickle an EAGLE-repo loader would read
    convert(FIXTURES / "llama", tmp_path / "dst", to="sglang", base_model=verifier)
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == ["config.json", "model.safetensors"]


def test_the_command_line_writes_the_research_layout(tmp_path):
    from medusa_spec.cli import main

    assert main(["convert", str(FIXTURES / "llama"), str(tmp_path / "out"), "--to", "sglang", "--weights-dtype",
                 "bfloat16", "--model", str(FIXTURES / "tiny-verifier")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_file(tmp_path / "out" / "model.safetensors")["fc.weight"].dtype == torch.bfloat16
