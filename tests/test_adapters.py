"""Head adapters: save/load hardening, interchange formats, Medusa-2 LoRA. Tiny random models, synthetic checkpoints."""

import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn

import medusa_spec.io
from medusa_spec import MedusaConfig, MedusaModel
from medusa_spec.cli import main
from medusa_spec.formats import FORMATS, convert, read_heads

# The formats of Medusa heads; speculators' and sglang hold eagle3 heads only (tests/test_eagle3*.py).
MEDUSA_FORMATS = [fmt for fmt in FORMATS if fmt not in ("speculators", "sglang")]

LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
PROMPT = torch.tensor([[1, 5, 9, 2, 7], [3, 3, 8, 1, 4]])


def tiny_base(seed=0, **overrides):
    """The same random Llama for the same seed, so a 'fresh' base equals the one heads were saved from."""
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, **overrides})).eval()


def random_medusa(base, seed=1, **config):
    """Heads with random weights everywhere (new heads start at zero, which would hide a lost tensor)."""
    model = MedusaModel.from_base(base, MedusaConfig(**config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.heads.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return model


def assert_same_heads(a, b):
    state_a, state_b = a.heads.state_dict(), b.heads.state_dict()
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        assert torch.equal(state_a[key], state_b[key]), key


def greedy(model):
    out = model.generate(PROMPT, max_new_tokens=12, eos_token_id=[])
    return out.sequences, out.stats.steps, out.stats.accepted_at_depth


class ResBlock(nn.Module):
    """The original Medusa repo's block, to write checkpoints exactly as it does."""

    def __init__(self, hidden_size):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def original_medusa_heads(num_heads, num_layers, projection=True, seed=3):
    """Heads built as the original repo builds them: one ResBlock reused for all layers of a head
    ([ResBlock] * L, so the checkpoint's tensors share storage), then the head's own projection unless "version 2"."""
    torch.manual_seed(seed)
    hidden, vocab = LLAMA["hidden_size"], LLAMA["vocab_size"]
    return nn.ModuleList(
        nn.Sequential(*([ResBlock(hidden)] * num_layers),
                      *([nn.Linear(hidden, vocab, bias=False)] if projection else []))
        for _ in range(num_heads))


def write_original(path, heads, suffix, stated_heads):
    path.mkdir(parents=True, exist_ok=True)
    state_dict = heads.state_dict()
    if suffix == ".pt":
        torch.save(state_dict, path / "medusa_lm_head.pt")
    else:  # safetensors refuses the shared storage of the repeated ResBlock
        save_file({k: v.clone() for k, v in state_dict.items()}, str(path / "medusa_lm_head.safetensors"))
    num_layers = sum(isinstance(module, ResBlock) for module in heads[0])
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": stated_heads, "medusa_num_layers": num_layers,
                                                  "base_model_name_or_path": None}))
    return state_dict


# --- own format ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("share_lm_head", [True, False])
@pytest.mark.parametrize("num_layers", [1, 2])
def test_own_round_trip_is_bit_exact_and_keeps_every_field(tmp_path, share_lm_head, num_layers):
    model = random_medusa(tiny_base(), num_heads=3, num_layers=num_layers, share_lm_head=share_lm_head,
                          tree=[[0], [1], [0, 0], [0, 0, 0]], metrics={"head_accuracy": [0.6, 0.4, 0.2]})
    model.save_heads(tmp_path)
    saved = json.loads((tmp_path / "medusa_config.json").read_text())
    assert set(saved) == set(MedusaConfig().to_dict())
    assert saved["hidden_size"] == 32 and saved["vocab_size"] == 64 and saved["format_version"] == 1
    assert set(load_file(tmp_path / "medusa_heads.safetensors")) == set(model.heads.state_dict())  # heads only

    loaded = MedusaModel.from_pretrained(tiny_base(), tmp_path)
    assert loaded.config == model.config
    assert_same_heads(loaded, model)


@pytest.mark.parametrize("fmt, share_lm_head", [("medusa_spec", True), ("medusa", False), ("medusa", True),
                                                ("vllm", False), ("vllm", True)])
def test_generation_identical_after_round_trip(tmp_path, fmt, share_lm_head):
    base = tiny_base()
    model = random_medusa(base, num_heads=3, share_lm_head=share_lm_head)
    model.save_heads(tmp_path / "own")
    convert(tmp_path / "own", tmp_path / fmt, to=fmt, base_model=base)

    loaded = MedusaModel.from_pretrained(tiny_base(), tmp_path / fmt)
    assert_same_heads(loaded, model)
    sequences, steps, accepted = greedy(loaded)
    expected_sequences, expected_steps, expected_accepted = greedy(model)
    assert torch.equal(sequences, expected_sequences)
    assert (steps, accepted) == (expected_steps, expected_accepted)  # the heads proposed the same trees


def test_a_save_of_heads_that_no_longer_fit_their_config_is_refused_and_keeps_the_old_adapter(tmp_path):
    model = random_medusa(tiny_base(), num_heads=2)
    model.save_heads(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    model.config.num_heads = 3  # heads built for 2
    with pytest.raises(ValueError, match=r"missing blocks.2.layers.0.weight.*the heads no longer match their config"):
        model.save_heads(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    model.config.num_heads = 2
    assert_same_heads(MedusaModel.from_pretrained(tiny_base(), tmp_path), model)


@pytest.mark.parametrize("metrics, match", [
    ({"eval": {"rank_accuracy": [0.6, 0.3]}}, "rank_accuracy must hold one list per head"),
    ({"eval": {"rank_accuracy": [["a"]]}}, "rank_accuracy must hold one list per head"),
    ({"eval": {"rank_accuracy": [[1.5]]}}, "rank_accuracy must hold one list per head"),
    ({"eval": [1]}, r"metrics must be an object \(and its \"eval\" one too\)"),
    ([1], r"metrics must be an object"),
])
def test_malformed_rank_accuracies_are_refused_on_load(tmp_path, metrics, match):
    """generate grows its trees from metrics.eval.rank_accuracy: a malformed one failed deep inside tree building."""
    random_medusa(tiny_base(), num_heads=2).save_heads(tmp_path)
    edit_config(tmp_path, lambda config: config.update(metrics=metrics))
    with pytest.raises(ValueError, match=rf"medusa_config.json: invalid MedusaConfig .*{match}"):
        MedusaModel.from_pretrained(tiny_base(), tmp_path)


def test_size_mismatch_is_an_error(tmp_path):
    random_medusa(tiny_base()).save_heads(tmp_path)
    with pytest.raises(ValueError, match="hidden_size=32 but the base model has 48"):
        MedusaModel.from_pretrained(tiny_base(hidden_size=48), tmp_path)
    with pytest.raises(ValueError, match="vocab_size=64 but the base model has 48"):  # shared, but another model's
        MedusaModel.from_pretrained(tiny_base(vocab_size=48), tmp_path)
    random_medusa(tiny_base(), share_lm_head=False).save_heads(tmp_path / "own")
    with pytest.raises(ValueError, match="vocab_size=64 but the base model has 80.*share_lm_head=True, follow a "
                                         "resize_token_embeddings that adds tokens"):
        MedusaModel.from_pretrained(tiny_base(vocab_size=80), tmp_path / "own")


def test_heads_sharing_the_lm_head_follow_a_resize_that_adds_tokens(tmp_path):
    """resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64) after training: heads that score through the
    base's LM head keep working (they were refused), with a warning; generate is still the base's greedy output."""
    random_medusa(tiny_base(), num_heads=2).save_heads(tmp_path)
    base = tiny_base()
    base.resize_token_embeddings(80, mean_resizing=False)
    with pytest.warns(UserWarning, match="trained on a vocabulary of 64 tokens and the base model has 80 "
                                         r"\(resize_token_embeddings\?\).*the 16 tokens added"):
        model = MedusaModel.from_pretrained(base, tmp_path)
    out = model.generate(PROMPT, max_new_tokens=12)
    assert model.config.vocab_size == 80
    expected = base.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=12, do_sample=False)
    assert torch.equal(out.sequences, expected)


def test_a_model_built_by_hand_from_parts_that_do_not_fit_is_refused():
    """MedusaModel(base, config, heads) is public: heads that are not what config describes on this base failed at
    the first generate, deep inside torch (or saved a config that does not load the weights)."""
    base = tiny_base()
    heads = random_medusa(base, num_heads=2).heads
    with pytest.raises(ValueError, match=r"heads do not match config \(num_heads=3.*blocks.2.layers.0.bias.*differ; "
                                         r"build both with MedusaModel.from_base"):
        MedusaModel(base, MedusaConfig(num_heads=3), heads)
    with pytest.raises(ValueError, match=r"heads do not match config .*hidden_size=48"):
        MedusaModel(tiny_base(hidden_size=48), MedusaConfig(num_heads=2), heads)
    with pytest.raises(ValueError, match="heads have vocab_size=64 but the base model has 48"):
        MedusaModel(tiny_base(vocab_size=48), random_medusa(base, num_heads=2).config, heads)
    with pytest.raises(TypeError, match="heads must be MedusaHeads, got ModuleList"):
        MedusaModel(base, MedusaConfig(num_heads=2), nn.ModuleList())
    with pytest.raises(TypeError, match="config must be a MedusaConfig, got dict"):
        MedusaModel(base, {"num_heads": 2}, heads)
    # Settings no weight's shape shows: the config would save them, and the heads compute by their own.
    for built, claimed, differ in [(dict(feature_layers=(0,)), dict(feature_layers=(1,)), "feature_layers"),
                                   (dict(context_heads=2), dict(context_heads=4), "context_heads"),
                                   (dict(head_type="eagle"), dict(head_type="eagle", draft_layer={
                                       "num_attention_heads": 2, "intermediate_size": 64}), "draft_layer head_dim")]:
        with pytest.raises(ValueError, match=rf": {differ} differ; build both with"):
            MedusaModel(base, MedusaConfig(num_heads=2, **claimed), random_medusa(base, num_heads=2, **built).heads)
    with pytest.raises(ValueError, match="head_type 'eagle' but no draft_layer .*MedusaModel.from_base"):
        MedusaModel(base, MedusaConfig(num_heads=2, head_type="eagle"), random_medusa(base, num_heads=2).heads)
    model = MedusaModel(base, MedusaConfig(num_heads=2), heads)  # parts that fit
    assert model.generate(PROMPT, max_new_tokens=4).sequences.shape == (2, PROMPT.shape[1] + 4)


def test_other_base_model_name_warns(tmp_path):
    base = tiny_base()
    base.config._name_or_path = "org/llama-a"
    random_medusa(base).save_heads(tmp_path)
    other = tiny_base()
    other.config._name_or_path = "org/llama-b"
    with pytest.warns(UserWarning, match="trained for 'org/llama-a', not 'org/llama-b'"):
        MedusaModel.from_pretrained(other, tmp_path)


def edit_config(path, edit):
    config = json.loads((path / "medusa_config.json").read_text())
    edit(config)
    (path / "medusa_config.json").write_text(json.dumps(config))


def test_unknown_config_keys_warn(tmp_path):
    model = random_medusa(tiny_base())
    model.save_heads(tmp_path)
    edit_config(tmp_path, lambda config: config.update(draft_temperature=0.7))
    with pytest.warns(UserWarning, match=r"ignoring unknown MedusaConfig keys \['draft_temperature'\]"):
        loaded = MedusaModel.from_pretrained(tiny_base(), tmp_path)
    assert_same_heads(loaded, model)


def test_missing_required_config_key_is_an_error(tmp_path):
    random_medusa(tiny_base()).save_heads(tmp_path)
    edit_config(tmp_path, lambda config: config.pop("hidden_size"))
    with pytest.raises(ValueError, match=r"medusa_config.json is missing required keys \['hidden_size'\]"):
        MedusaModel.from_pretrained(tiny_base(), tmp_path)


def test_invalid_config_values_are_errors(tmp_path):
    random_medusa(tiny_base()).save_heads(tmp_path)
    edit_config(tmp_path, lambda config: config.update(share_lm_head="yes"))
    with pytest.raises(ValueError,
                       match="medusa_config.json: invalid MedusaConfig .*share_lm_head must be true or false"):
        MedusaModel.from_pretrained(tiny_base(), tmp_path)
    (tmp_path / "medusa_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="medusa_config.json is not valid JSON"):
        MedusaModel.from_pretrained(tiny_base(), tmp_path)


@pytest.mark.parametrize("name", ["medusa_config.json", "medusa_heads.safetensors"])
def test_missing_file_is_an_error(tmp_path, name):
    random_medusa(tiny_base()).save_heads(tmp_path)
    (tmp_path / name).unlink()
    with pytest.raises(FileNotFoundError, match=f"{name} is missing"):
        MedusaModel.from_pretrained(tiny_base(), tmp_path)


def test_missing_or_empty_folder_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no adapter folder at"):
        MedusaModel.from_pretrained(tiny_base(), tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="holds no Medusa heads: expected medusa_config.json"):
        MedusaModel.from_pretrained(tiny_base(), tmp_path)


def test_truncated_weights_are_an_error(tmp_path):
    random_medusa(tiny_base()).save_heads(tmp_path)
    weights = tmp_path / "medusa_heads.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match="medusa_heads.safetensors is truncated or corrupt"):
        MedusaModel.from_pretrained(tiny_base(), tmp_path)


def test_wrong_tensor_shapes_are_an_error(tmp_path):
    model = random_medusa(tiny_base(), num_heads=3)
    model.save_heads(tmp_path)
    state_dict = dict(model.heads.state_dict(), **{"blocks.1.layers.0.weight": torch.zeros(32, 16)})
    save_file(state_dict, str(tmp_path / "medusa_heads.safetensors"))
    with pytest.raises(ValueError, match=r"medusa_heads.safetensors: blocks.1.layers.0.weight has shape \(32, 16\), "
                                         r"expected \(32, 32\); .*re-save the adapter"):
        MedusaModel.from_pretrained(tiny_base(), tmp_path)
    edit_config(tmp_path, lambda config: config.update(num_heads=4))  # a config from another save
    with pytest.raises(ValueError, match="missing blocks.3.layers.0.weight"):
        MedusaModel.from_pretrained(tiny_base(), tmp_path)


def test_interrupted_weights_write_leaves_old_adapter(tmp_path, monkeypatch):
    old = random_medusa(tiny_base(), seed=1, metrics={"run": "old"})
    old.save_heads(tmp_path)

    def fail_mid_write(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 100)  # a partial file, then the disk fills up
        raise OSError("No space left on device")

    monkeypatch.setattr(medusa_spec.io, "save_file", fail_mid_write)
    with pytest.raises(OSError, match="No space left"):
        random_medusa(tiny_base(), seed=2, metrics={"run": "new"}).save_heads(tmp_path)
    monkeypatch.undo()

    loaded = MedusaModel.from_pretrained(tiny_base(), tmp_path)
    assert loaded.config.metrics == {"run": "old"}
    assert_same_heads(loaded, old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["medusa_config.json", "medusa_heads.safetensors"]


@pytest.mark.parametrize("failing_move", [1, 2])  # 1: the commit (renaming the staged folder); 2: a move after it
def test_failed_moves_leave_old_or_new_adapter(tmp_path, monkeypatch, failing_move):
    old = random_medusa(tiny_base(), seed=1, metrics={"run": "old"})
    old.save_heads(tmp_path)
    new = random_medusa(tiny_base(), seed=2, num_heads=2, metrics={"run": "new"})
    real_replace, calls = os.replace, []

    def flaky_replace(src, dst):
        calls.append(dst)
        if len(calls) == failing_move:
            raise OSError("interrupted")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", flaky_replace)
    with pytest.raises(OSError, match="interrupted"):
        new.save_heads(tmp_path)
    monkeypatch.undo()

    # Before the commit the save never happened; after it the load finishes the moves.
    loaded = MedusaModel.from_pretrained(tiny_base(), tmp_path)
    assert_same_heads(loaded, old if failing_move == 1 else new)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["medusa_config.json", "medusa_heads.safetensors"]


# Functions through which a save changes the file tree; the kill test stops a save after each call.
TREE_CHANGES = ("mkdir", "replace", "rename", "unlink", "remove", "rmdir")


class FakeLora:
    """Stands in for a peft model: writes a lora/ folder whose tensor says which save wrote it."""

    def __init__(self, run):
        self.run = run

    def save_pretrained(self, folder):
        os.mkdir(folder)
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump({"run": self.run}, f)
        save_file({"run": torch.tensor([self.run])}, os.path.join(folder, "adapter_model.safetensors"))


def save_in_child(path, model, lora, kill_after):
    """Save in a forked child that SIGKILLs itself right after its `kill_after`-th change to the file tree;
    returns True if it was killed, False if the save finished first."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            steps = iter(range(1, kill_after + 1))

            def stop_after(change):
                def changed(*args, **kwargs):
                    result = change(*args, **kwargs)
                    if next(steps, None) == kill_after:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return result
                return changed

            for name in TREE_CHANGES:  # this process's own os module: the parent is untouched
                setattr(os, name, stop_after(getattr(os, name)))
            medusa_spec.io.save_adapter(path, model.config, model.heads.state_dict(), lora=lora)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) in (0, -signal.SIGKILL), "the save failed in the child"
    return os.waitstatus_to_exitcode(status) != 0


def read_adapter(path):
    """(run, heads' state dict, run of the lora/ folder or None) as a load sees the folder."""
    config, state_dict = read_heads(path)
    lora = None
    if (path / "lora").exists():
        config_run = json.loads((path / "lora" / "adapter_config.json").read_text())["run"]
        weights_run = int(load_file(path / "lora" / "adapter_model.safetensors")["run"])
        assert config_run == weights_run, "lora/ mixes two saves"
        lora = config_run
    return config.metrics["run"], state_dict, lora


USER_FILES = ["checkpoints", "train_log.jsonl"]  # what else training keeps in the adapter folder


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("old_lora, new_lora", [(False, False), (True, True), (True, False), (False, True)])
def test_save_killed_at_any_step_leaves_old_or_new_adapter(tmp_path, old_lora, new_lora):
    # Same shapes, other values: a mix of the two loads silently unless something catches it.
    versions = {run: random_medusa(tiny_base(), seed=run, num_heads=2, metrics={"run": run}) for run in (1, 2, 3)}
    loras = {1: FakeLora(1) if old_lora else None, 2: FakeLora(2) if new_lora else None}
    seen, step, killed = [], 0, True
    while killed:
        step += 1
        path = tmp_path / f"step{step}"
        medusa_spec.io.save_adapter(path, versions[1].config, versions[1].heads.state_dict(), lora=loras[1])
        (path / "checkpoints").mkdir()
        (path / "train_log.jsonl").write_text("{}\n")

        killed = save_in_child(path, versions[2], loras[2], kill_after=step)
        run, state_dict, lora = read_adapter(path)
        assert lora == (loras[run].run if loras[run] else None), f"step {step}: heads of save {run}, lora/ of {lora}"
        assert state_dict.keys() == versions[run].heads.state_dict().keys()
        assert all(torch.equal(value, versions[run].heads.state_dict()[key]) for key, value in state_dict.items()), \
            f"step {step}: the config of save {run} with other weights"
        assert not seen or run >= seen[-1], f"step {step}: back to the old adapter after the new one loaded"
        seen.append(run)

        medusa_spec.io.save_adapter(path, versions[3].config, versions[3].heads.state_dict())
        assert sorted(p.name for p in path.iterdir()) == sorted(
            ["medusa_config.json", "medusa_heads.safetensors", *USER_FILES]), f"step {step}: leftovers"
        assert read_adapter(path)[0] == 3
    assert seen[0] == 1 and seen[-1] == 2  # the kills fell on both sides of the commit


def test_weights_from_another_save_are_an_error(tmp_path):
    random_medusa(tiny_base(), seed=1).save_heads(tmp_path / "a")
    random_medusa(tiny_base(), seed=2).save_heads(tmp_path / "b")
    shutil.copy(tmp_path / "b" / "medusa_heads.safetensors", tmp_path / "a")  # same shapes, other weights
    with pytest.raises(ValueError, match=r"medusa_heads.safetensors does not match the sha256 recorded in .*a/"
                                         r"medusa_config.json: the two files come from different saves"):
        MedusaModel.from_pretrained(tiny_base(), tmp_path / "a")


def test_adapters_without_a_checksum_load(tmp_path):
    model = random_medusa(tiny_base())
    model.save_heads(tmp_path)
    assert len(json.loads((tmp_path / "medusa_config.json").read_text())["weights_sha256"]) == 64
    edit_config(tmp_path, lambda config: config.pop("weights_sha256"))  # as saved before checksums
    assert_same_heads(MedusaModel.from_pretrained(tiny_base(), tmp_path), model)


def test_shipped_heads_read_unchanged():
    shipped = Path(__file__).parent.parent / "heads" / "smollm2-135m-instruct"
    before = {p.name: p.stat().st_mtime_ns for p in shipped.iterdir()}
    config, state_dict = read_heads(shipped)
    assert (config.num_heads, config.draft_vocab_size, len(config.weights_sha256)) == (4, 4096, 64)  # checked on read
    assert "token_map" in state_dict
    assert {p.name: p.stat().st_mtime_ns for p in shipped.iterdir()} == before  # a load writes nothing


# --- original Medusa format ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
@pytest.mark.parametrize("projection", [True, False], ids=["own-projection", "version2-shared"])
def test_original_medusa_import_counts_heads_from_weights(tmp_path, suffix, projection):
    heads = original_medusa_heads(num_heads=3, num_layers=2, projection=projection)
    original = write_original(tmp_path / "medusa", heads, suffix, stated_heads=2)  # published configs understate

    base = tiny_base()
    with pytest.warns(UserWarning, match="config.json says 2 heads but the weights hold 3; using 3"):
        loaded = MedusaModel.from_pretrained(base, tmp_path / "medusa")
    assert (loaded.config.num_heads, loaded.config.num_layers, loaded.config.share_lm_head) == (3, 2, not projection)
    state = loaded.heads.state_dict()
    for h in range(3):
        for layer in range(2):
            assert torch.equal(state[f"blocks.{h}.layers.{layer}.weight"], original[f"{h}.{layer}.linear.weight"])
            assert torch.equal(state[f"blocks.{h}.layers.{layer}.bias"], original[f"{h}.{layer}.linear.bias"])
        if projection:
            assert torch.equal(state[f"lm_heads.{h}.weight"], original[f"{h}.2.weight"])
    # Converting straight from the file works too (the .pt's shared ResBlock storage is no obstacle).
    with pytest.warns(UserWarning, match="the weights hold 3"):
        convert(tmp_path / "medusa", tmp_path / "own", to="medusa_spec")
    assert_same_heads(MedusaModel.from_pretrained(tiny_base(), tmp_path / "own"), loaded)
    x = torch.randn(5, 32)
    with torch.no_grad():
        expected = torch.stack([head(x) if projection else base.lm_head(head(x)) for head in heads], dim=-2)
        torch.testing.assert_close(loaded.heads(x, base.lm_head), expected)


@pytest.mark.parametrize("projection", [True, False])
def test_original_medusa_export_round_trip_is_bit_exact(tmp_path, projection):
    original = write_original(tmp_path / "src", original_medusa_heads(3, 2, projection), ".safetensors", 3)
    convert(tmp_path / "src", tmp_path / "own", to="medusa_spec")
    if projection:
        convert(tmp_path / "own", tmp_path / "back", to="medusa")
    else:  # "version 2" as it came, since no base model is given to copy the LM head from
        with pytest.warns(UserWarning, match=r'written without projections \("version 2"\), which TGI reads but '
                                             r"TensorRT-LLM's converter and the original Medusa repo do not; pass "
                                             r"base_model="):
            convert(tmp_path / "own", tmp_path / "back", to="medusa")

    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == ["config.json", "medusa_lm_head.safetensors"]
    meta = json.loads((tmp_path / "back" / "config.json").read_text())
    assert meta == {"medusa_num_heads": 3, "medusa_num_layers": 2, "base_model_name_or_path": None}
    written = load_file(tmp_path / "back" / "medusa_lm_head.safetensors")
    assert written.keys() == original.keys()
    for key in original:
        assert torch.equal(written[key], original[key]), key


def original_medusa_logits(tensors, x, num_heads, num_layers):
    """Logits [.., heads, V] as TensorRT-LLM and the original repo compute them from the layout's tensors: a head's
    layers x <- x + SiLU(W x + b), then its projection {h}.{L}.weight."""
    out = []
    for h in range(num_heads):
        y = x
        for layer in range(num_layers):
            weight, bias = tensors[f"{h}.{layer}.linear.weight"], tensors[f"{h}.{layer}.linear.bias"]
            y = y + nn.functional.silu(y @ weight.T + bias)
        out.append(y @ tensors[f"{h}.{num_layers}.weight"].T)
    return torch.stack(out, dim=-2)


def test_original_medusa_export_gives_shared_heads_the_lm_head_as_projections(tmp_path):
    base = tiny_base()
    model = random_medusa(base, num_heads=3, num_layers=2, share_lm_head=True)
    model.save_heads(tmp_path / "own")
    convert(tmp_path / "own", tmp_path / "medusa", to="medusa", base_model=base)

    written = load_file(tmp_path / "medusa" / "medusa_lm_head.safetensors")
    for h in range(3):  # TensorRT-LLM's converter reads {h}.{L}.weight for every head
        assert torch.equal(written[f"{h}.2.weight"], base.lm_head.weight)
    x = torch.randn(5, 32)
    with torch.no_grad():
        torch.testing.assert_close(original_medusa_logits(written, x, 3, 2), model.heads(x, base.lm_head))
    loaded = MedusaModel.from_pretrained(tiny_base(), tmp_path / "medusa")  # copies of its LM head: shared again
    assert loaded.config.share_lm_head
    assert_same_heads(loaded, model)
    other = tiny_base(seed=5)  # another model's LM head: the copies are the heads' own projections
    assert not MedusaModel.from_pretrained(other, tmp_path / "medusa").config.share_lm_head


def test_original_medusa_errors(tmp_path):
    heads = original_medusa_heads(2, 1)
    write_original(tmp_path, heads, ".safetensors", 2)
    state_dict = load_file(tmp_path / "medusa_lm_head.safetensors")
    del state_dict["1.0.linear.bias"]
    save_file(state_dict, str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match=r"medusa_lm_head.safetensors: missing 1.0.linear.bias; the checkpoint is "
                                         r"incomplete"):
        MedusaModel.from_pretrained(tiny_base(), tmp_path)

    (tmp_path / "medusa_lm_head.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="has a Medusa config.json but no medusa_lm_head.safetensors or "
                                                "medusa_lm_head.pt"):
        MedusaModel.from_pretrained(tiny_base(), tmp_path)

    write_original(tmp_path, heads, ".safetensors", 2)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        MedusaModel.from_pretrained(tiny_base(), tmp_path)


class NotATensor:
    pass


def test_pickled_objects_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 1, "medusa_num_layers": 1}))
    torch.save({"0.0.linear.weight": torch.zeros(32, 32), "extra": NotATensor()}, tmp_path / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match=r"medusa_lm_head.pt holds Python objects besides tensors, which "
                                         r"torch.load\(weights_only=True\) refuses"):
        MedusaModel.from_pretrained(tiny_base(), tmp_path)

    torch.save(original_medusa_heads(1, 1).state_dict(), tmp_path / "medusa_lm_head.pt")
    data = (tmp_path / "medusa_lm_head.pt").read_bytes()
    (tmp_path / "medusa_lm_head.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="medusa_lm_head.pt is truncated or corrupt"):
        MedusaModel.from_pretrained(tiny_base(), tmp_path)


# --- vLLM format --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("share_lm_head", [False, True])
def test_vllm_export_matches_vllm_layout(tmp_path, share_lm_head):
    base = tiny_base()
    model = random_medusa(base, num_heads=3, num_layers=2, share_lm_head=share_lm_head)
    model.save_heads(tmp_path / "own")
    convert(tmp_path / "own", tmp_path / "vllm", to="vllm", base_model=base)

    meta = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert meta == {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": 32, "vocab_size": 64,
                    "num_heads": 3, "num_hidden_layers": 2, "medusa_fc_bias": True, "original_lm_head": share_lm_head}
    written = load_file(tmp_path / "vllm" / "model.safetensors")
    heads = model.heads.state_dict()
    expected_keys = set(heads) | ({"lm_head.weight"} if share_lm_head else set())
    assert set(written) == expected_keys
    for key in heads:
        assert torch.equal(written[key], heads[key]), key
    if share_lm_head:
        assert torch.equal(written["lm_head.weight"], base.lm_head.weight)

    config, state_dict = read_heads(tmp_path / "vllm", base.lm_head)
    assert (config.num_heads, config.num_layers, config.share_lm_head) == (3, 2, share_lm_head)
    assert state_dict.keys() == heads.keys() and all(torch.equal(state_dict[k], heads[k]) for k in heads)


def test_vllm_import_without_biases_and_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "medusa", "num_heads": 2, "num_hidden_layers": 1,
                                                      "medusa_fc_bias": False, "original_lm_head": True}))
    weight, base = torch.randn(32, 32), tiny_base()
    save_file({"medusa_heads.blocks.0.layers.0.weight": torch.randn(32, 32),
               "medusa_heads.blocks.1.layers.0.weight": weight,
               "lm_head.weight": base.lm_head.weight.detach().clone()}, str(tmp_path / "model.safetensors"))
    config, state_dict = read_heads(tmp_path, base.lm_head)
    assert config.share_lm_head and config.num_heads == 2
    assert torch.equal(state_dict["blocks.1.layers.0.weight"], weight)
    assert torch.equal(state_dict["blocks.1.layers.0.bias"], torch.zeros(32))  # bias-free computes the same

    save_file({"token_map": torch.arange(10)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="heads with a token_map need the full vocab_size in config.json"):
        read_heads(tmp_path)


def test_vllm_export_of_shared_heads_needs_the_base_model(tmp_path):
    random_medusa(tiny_base(), share_lm_head=True).save_heads(tmp_path / "own")
    with pytest.raises(ValueError, match=r"stores the LM head these heads share .* pass base_model="):
        convert(tmp_path / "own", tmp_path / "vllm", to="vllm")
    with pytest.raises(ValueError, match="unknown format 'tgi'; choose one of medusa_spec, medusa, vllm"):
        convert(tmp_path / "own", tmp_path / "tgi", to="tgi")
    with pytest.raises(ValueError, match="heads have hidden_size=32 but the base model .*has 48"):
        convert(tmp_path / "own", tmp_path / "vllm", to="vllm", base_model=tiny_base(hidden_size=48))


@pytest.mark.parametrize("key", ["lm_head.weight", "lm_heads.0.weight"])  # vLLM reads either as the shared head
def test_vllm_import_checks_its_lm_head_copy(tmp_path, key):
    base = tiny_base()
    model = random_medusa(base, num_heads=2, share_lm_head=True)
    model.save_heads(tmp_path / "own")
    convert(tmp_path / "own", tmp_path / "vllm", to="vllm", base_model=base)
    weights = tmp_path / "vllm" / "model.safetensors"
    tensors = load_file(weights)
    copy = tensors.pop("lm_head.weight")
    save_file({**tensors, key: copy.to(torch.bfloat16)}, str(weights))  # in another precision: the same LM head
    assert_same_heads(MedusaModel.from_pretrained(tiny_base(), tmp_path / "vllm"), model)

    copy[3, 5] += 1.0  # a fine-tuned LM head, or another model's
    save_file({**tensors, key: copy}, str(weights))
    with pytest.raises(ValueError, match=rf"model.safetensors: {re.escape(key)}, the LM head vLLM drafts with "
                                         rf"\(original_lm_head\), differs from this base model's LM head"):
        MedusaModel.from_pretrained(tiny_base(), tmp_path / "vllm")
    with pytest.raises(ValueError, match=rf"holds {re.escape(key)}, its own copy of the base model's LM head .*pass "
                                         rf"the base model"):
        convert(tmp_path / "vllm", tmp_path / "back", to="medusa_spec")
    save_file({**tensors, "lm_head.weight": copy}, str(weights))
    with pytest.raises(ValueError, match=r"lm_head.weight has shape \(64, 32\) but the base model's LM head .* has "
                                         r"\(80, 32\)"):
        read_heads(tmp_path / "vllm", tiny_base(vocab_size=80).lm_head)


@pytest.mark.parametrize("share_lm_head", [False, True])
def test_vllm_import_takes_the_token_map_rows_of_full_vocabulary_heads(tmp_path, share_lm_head):
    base = tiny_base()
    model = random_medusa(base, num_heads=2, share_lm_head=share_lm_head, draft_vocab_size=8)
    model.save_heads(tmp_path / "own")
    convert(tmp_path / "own", tmp_path / "vllm", to="vllm", base_model=base)
    weights = tmp_path / "vllm" / "model.safetensors"
    tensors = load_file(weights)
    for key in ["lm_head.weight"] if share_lm_head else ["lm_heads.0.weight", "lm_heads.1.weight"]:
        # vLLM accepts every row of the vocabulary and keeps the token map's own.
        full = base.lm_head.weight.detach().clone() if share_lm_head else torch.randn(64, 32)
        full[tensors["token_map"]] = tensors[key]
        tensors[key] = full
    save_file(tensors, str(weights))
    loaded = MedusaModel.from_pretrained(tiny_base(), tmp_path / "vllm")
    assert loaded.config.draft_vocab_size == 8
    assert_same_heads(loaded, model)


def vllm_draft_tokens(folder, x):
    """The heads' top token ids as vLLM's Medusa computes them from `folder`: blocks, then lm_heads.{h} (or the one
    lm_head with original_lm_head), with the token_map applied only where truncated_vocab_size < vocab_size."""
    meta = json.loads((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    truncated = meta.get("truncated_vocab_size") or meta["vocab_size"]
    token_map = tensors.get("token_map") if truncated < meta["vocab_size"] else None
    tokens = []
    for h in range(meta["num_heads"]):
        y = x
        for layer in range(meta["num_hidden_layers"]):
            y = y + nn.functional.silu(y @ tensors[f"blocks.{h}.layers.{layer}.weight"].T
                                       + tensors[f"blocks.{h}.layers.{layer}.bias"])
        top = (y @ tensors["lm_head.weight" if meta["original_lm_head"] else f"lm_heads.{h}.weight"].T).argmax(-1)
        tokens.append(top if token_map is None else token_map[top])
    return torch.stack(tokens, dim=-1)


@pytest.mark.parametrize("share_lm_head", [False, True])
def test_vllm_export_of_a_token_map_over_the_whole_vocabulary(tmp_path, share_lm_head):
    base = tiny_base()
    model = random_medusa(base, num_heads=2, share_lm_head=share_lm_head, draft_vocab_size=64)
    model.heads.set_token_map(torch.randperm(64, generator=torch.Generator().manual_seed(0)), base.lm_head)
    model.save_heads(tmp_path / "own")
    convert(tmp_path / "own", tmp_path / "vllm", to="vllm", base_model=base)

    meta = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert "truncated_vocab_size" not in meta and "token_map" not in load_file(tmp_path / "vllm" / "model.safetensors")
    x = torch.randn(7, 32)
    with torch.no_grad():
        expected = model.heads.token_map[model.heads(x, base.lm_head).argmax(-1)]
        assert torch.equal(vllm_draft_tokens(tmp_path / "vllm", x), expected)  # vLLM drafts what these heads draft
        loaded = MedusaModel.from_pretrained(tiny_base(), tmp_path / "vllm")
        assert loaded.config.draft_vocab_size is None
        assert torch.equal(loaded.heads(x, base.lm_head).argmax(-1), expected)


def test_vllm_import_refuses_a_token_map_vllm_would_ignore(tmp_path):
    base = tiny_base()
    model = random_medusa(base, num_heads=2, share_lm_head=False, draft_vocab_size=8)
    model.heads.set_token_map(torch.arange(20, 28), base.lm_head)
    model.save_heads(tmp_path / "own")
    convert(tmp_path / "own", tmp_path / "vllm", to="vllm", base_model=base)
    assert_same_heads(MedusaModel.from_pretrained(tiny_base(), tmp_path / "vllm"), model)

    meta = json.loads((tmp_path / "vllm" / "config.json").read_text())
    del meta["truncated_vocab_size"]  # vLLM then takes it as vocab_size, and ignores the map
    (tmp_path / "vllm" / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"model.safetensors has a token_map of 8 token ids but truncated_vocab_size "
                                         r"64 is not below vocab_size 64, so vLLM ignores the map .*Set "
                                         r"truncated_vocab_size in config.json to the map's length"):
        MedusaModel.from_pretrained(tiny_base(), tmp_path / "vllm")


def test_vllm_export_refuses_a_base_lm_head_bias(tmp_path):
    base = tiny_base()
    base.lm_head.bias = nn.Parameter(torch.randn(64))
    random_medusa(base, share_lm_head=True).save_heads(tmp_path / "shared")
    with pytest.raises(ValueError, match="the base model's LM head has a bias, which vLLM's Medusa LM head "
                                         r"\(lm_head.weight only\) cannot hold"):
        convert(tmp_path / "shared", tmp_path / "vllm", to="vllm", base_model=base)
    assert not (tmp_path / "vllm").exists()
    # Heads with their own projections do not use the base LM head: nothing is lost.
    random_medusa(base, share_lm_head=False).save_heads(tmp_path / "own")
    convert(tmp_path / "own", tmp_path / "vllm", to="vllm", base_model=base)


def test_convert_command(tmp_path):
    base = tiny_base()
    base.save_pretrained(tmp_path / "base")
    model = random_medusa(base, num_heads=2, share_lm_head=True)
    model.save_heads(tmp_path / "own")
    for fmt in MEDUSA_FORMATS:
        assert main(["convert", str(tmp_path / "own"), str(tmp_path / fmt), "--to", fmt,
                     "--model", str(tmp_path / "base")]) == 0
        assert_same_heads(MedusaModel.from_pretrained(tiny_base(), tmp_path / fmt), model)
    assert torch.equal(load_file(tmp_path / "vllm" / "model.safetensors")["lm_head.weight"], base.lm_head.weight)
    # The base model's path is recorded where the source had no name.
    assert json.loads((tmp_path / "medusa" / "config.json").read_text())["base_model_name_or_path"] == \
        str(tmp_path / "base")


# --- converting into a folder that holds files ----------------------------------------------------------------------

IN_THE_WAY = {"medusa_spec": "medusa_config.json, medusa_heads.safetensors",
              "medusa": "config.json, medusa_lm_head.safetensors",
              "vllm": "config.json, model.safetensors", "base model": "config.json, model.safetensors"}


@pytest.mark.parametrize("held, to", [(held, to) for held in IN_THE_WAY for to in MEDUSA_FORMATS if to != held
                                      and (held, to) != ("base model", "medusa_spec")])
def test_convert_refuses_a_folder_holding_another_format_or_model(tmp_path, held, to):
    base = tiny_base()
    random_medusa(base, seed=1, num_heads=2, share_lm_head=False).save_heads(tmp_path / "old")
    new = random_medusa(base, seed=2, num_heads=3, share_lm_head=False)
    new.save_heads(tmp_path / "new")
    dst = tmp_path / "dst"
    if held == "base model":  # vLLM's and Medusa's config.json, and vLLM's model.safetensors, are its names too
        base.save_pretrained(dst)
    else:
        convert(tmp_path / "old", dst, to=held)
    (dst / "README.md").write_text("notes")
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    with pytest.raises(ValueError, match=rf"dst already holds {IN_THE_WAY[held]}, not files of {to} heads: converting "
                                         rf"there would overwrite them, or leave them beside the converted heads .*"
                                         rf"convert into an empty folder, or move or delete those files"):
        convert(tmp_path / "new", dst, to=to)
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before

    for name in IN_THE_WAY[held].split(", "):  # the fix the message names
        (dst / name).unlink()
    convert(tmp_path / "new", dst, to=to)
    assert_same_heads(MedusaModel.from_pretrained(tiny_base(), dst), new)
    assert (dst / "README.md").read_text() == "notes"


def test_convert_refuses_its_source_folder_and_replaces_heads_of_its_own_format(tmp_path, capsys):
    base = tiny_base()
    old = random_medusa(base, seed=1, num_heads=2, share_lm_head=False)
    old.save_heads(tmp_path / "own")
    convert(tmp_path / "own", tmp_path / "orig", to="medusa")
    before = {p.name: p.read_bytes() for p in (tmp_path / "orig").iterdir()}
    (tmp_path / "link").symlink_to(tmp_path / "orig")
    for dst in ("orig", "link"):
        with pytest.raises(ValueError, match=rf"{dst} is .*orig, the folder the heads are read from: converting "
                                             rf"them in place would overwrite its files .*convert into another "
                                             rf"\(empty\) folder"):
            convert(tmp_path / "orig", tmp_path / dst, to="vllm")
    assert main(["convert", str(tmp_path / "orig"), str(tmp_path / "orig"), "--to", "vllm"]) == 2
    assert capsys.readouterr().err.startswith(f"medusa-spec convert: {tmp_path / 'orig'} is {tmp_path / 'orig'}, "
                                              f"the folder the heads are read from")
    assert {p.name: p.read_bytes() for p in (tmp_path / "orig").iterdir()} == before

    new = random_medusa(base, seed=2, num_heads=3, share_lm_head=False)
    new.save_heads(tmp_path / "new")
    for to in MEDUSA_FORMATS:  # into a folder of `to` heads: they are replaced
        convert(tmp_path / "own", tmp_path / to, to=to)
        convert(tmp_path / "new", tmp_path / to, to=to)
        assert_same_heads(MedusaModel.from_pretrained(tiny_base(), tmp_path / to), new)


# --- Medusa-2: LoRA beside the heads -------------------------------------------------------------------------------

def test_medusa2_lora_round_trip(tmp_path, monkeypatch):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(4)
    lora = get_peft_model(tiny_base(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    lora.eval()
    model = random_medusa(lora.get_base_model(), num_heads=3)
    model.save_heads(tmp_path, lora=lora)
    assert (tmp_path / "lora" / "adapter_config.json").is_file()
    assert (tmp_path / "lora" / "adapter_model.safetensors").is_file()

    loaded = MedusaModel.from_pretrained(tiny_base(), tmp_path)
    lora_state = {k: v for k, v in model.base_model.state_dict().items() if "lora_" in k}
    # Loaded under its own adapter name (medusa2), which a later load may replace.
    loaded_state = {k.replace(".medusa2.", ".default."): v for k, v in loaded.base_model.state_dict().items()
                    if "lora_" in k}
    assert lora_state and lora_state.keys() == loaded_state.keys()
    assert all(torch.equal(lora_state[k], loaded_state[k]) for k in lora_state)
    assert_same_heads(loaded, model)
    assert torch.equal(greedy(loaded)[0], greedy(model)[0])
    with torch.no_grad():  # the LoRA is live: the adapted base differs from the plain one
        assert not torch.equal(loaded.base_model(PROMPT).logits, tiny_base()(PROMPT).logits)

    with pytest.raises(ValueError, match="lora must be the peft model wrapping this MedusaModel's base_model"):
        random_medusa(tiny_base()).save_heads(tmp_path / "other", lora=lora)

    # A heads-only save that fails before its commit leaves the LoRA adapter with the old heads.
    def failing_replace(src, dst):
        raise OSError("interrupted")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="interrupted"):
        random_medusa(tiny_base(), seed=2).save_heads(tmp_path)
    monkeypatch.undo()
    assert (tmp_path / "lora" / "adapter_config.json").is_file()
    assert_same_heads(MedusaModel.from_pretrained(tiny_base(), tmp_path), model)

    # A completed heads-only save drops the stale LoRA adapter.
    random_medusa(tiny_base(), seed=2).save_heads(tmp_path)
    assert not (tmp_path / "lora").exists()

    (tmp_path / "lora").mkdir()
    with pytest.raises(FileNotFoundError, match="lora has no adapter_config.json"):
        MedusaModel.from_pretrained(tiny_base(), tmp_path)


def test_a_save_replaces_or_removes_only_a_lora_folder_a_save_recorded(tmp_path):
    model = random_medusa(tiny_base(), num_heads=2, metrics={"run": 0})
    mine = tmp_path / "lora"

    def save(lora=None):
        medusa_spec.io.save_adapter(tmp_path, model.config, model.heads.state_dict(), lora=lora)

    def put_my_lora():  # the user's own peft output, with notes
        mine.mkdir()
        (mine / "adapter_config.json").write_text("{}")
        (mine / "notes.txt").write_text("mine")

    refused = (r"lora: saving heads to .* would replace or delete this folder, and .*medusa_config.json does not "
               r"record that a save of heads wrote it .*move or delete .*lora, or save the heads to another folder")
    put_my_lora()  # in a folder no save wrote to
    for lora in (None, FakeLora(1)):
        with pytest.raises(ValueError, match=refused):
            save(lora)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["lora"]  # nothing written, nothing left behind
        assert (mine / "notes.txt").read_text() == "mine"
    shutil.rmtree(mine)
    model.save_heads(tmp_path)  # heads only
    put_my_lora()  # added after that save
    with pytest.raises(ValueError, match=refused):
        model.save_heads(tmp_path)
    assert (mine / "notes.txt").read_text() == "mine"

    # lora/ a save wrote is replaced by the next save's, and removed by a heads-only one.
    shutil.rmtree(mine)
    save(FakeLora(1))
    save(FakeLora(2))
    assert read_adapter(tmp_path)[2] == 2
    save()
    assert not mine.exists() and json.loads((tmp_path / "medusa_config.json").read_text())["lora"] is False
    # A LoRA adapter saved before the config recorded it is refused too: nothing tells it from the user's own.
    save(FakeLora(3))
    edit_config(tmp_path, lambda config: config.pop("lora"))
    with pytest.raises(ValueError, match=refused):
        save()
    assert read_adapter(tmp_path)[2] == 3


def medusa2_adapter(path, targets, seed, **config):
    """Save heads and a LoRA on `targets` that changes the base model's outputs (random, not zero-initialised)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    lora = get_peft_model(tiny_base(), LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
    lora.eval()
    model = random_medusa(lora.get_base_model(), seed=seed, num_heads=2, **config)
    model.save_heads(path, lora=lora)
    return model


def base_snapshot(base):
    """All a load could change in `base`: module types, attributes, weights, which train, and the outputs."""
    with torch.no_grad():
        logits = base(PROMPT).logits
    return {"modules": [(name, type(module)) for name, module in base.named_modules()],
            "attributes": sorted(vars(base)), "trains": [(n, p.requires_grad) for n, p in base.named_parameters()],
            "state": {k: v.clone() for k, v in base.state_dict().items()}, "logits": logits}


def assert_same_base(a, b):
    assert a.keys() == b.keys()
    for key in ("modules", "attributes", "trains"):
        assert a[key] == b[key], key
    assert a["state"].keys() == b["state"].keys()
    assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"]), "weights differ"
    assert torch.equal(a["logits"], b["logits"])


def break_token_map(path):
    state_dict = load_file(path / "medusa_heads.safetensors")
    state_dict["token_map"][0] = 70  # outside the vocabulary of 64
    save_file(state_dict, str(path / "medusa_heads.safetensors"))
    edit_config(path, lambda config: config.pop("weights_sha256", None))  # as an adapter saved before checksums


def break_lora_weights(path):
    weights = path / "lora" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])


def break_lora_rank(path):
    edit_lora_config(path, lambda config: config.update(r=2))  # the weights have rank 4: peft fails after injecting


def break_lora_targets(path):
    edit_lora_config(path, lambda config: config.update(target_modules=["no_such_proj"]))


def edit_lora_config(path, edit):
    config = json.loads((path / "lora" / "adapter_config.json").read_text())
    edit(config)
    (path / "lora" / "adapter_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("preloaded", [False, True], ids=["plain-base", "base-with-an-earlier-lora"])
@pytest.mark.parametrize("break_adapter, error", [
    (break_token_map, "token_map holds ids outside the base vocabulary"),
    (break_lora_weights, "adapter_model.safetensors is truncated or corrupt"),
    (break_lora_rank, "(?s)lora: peft could not apply this LoRA adapter.*size mismatch"),
    (break_lora_targets, "lora: peft could not apply .*no_such_proj"),
], ids=["token-map", "lora-weights", "lora-rank", "lora-targets"])
def test_failed_load_leaves_the_base_model_as_it_was(tmp_path, preloaded, break_adapter, error):
    medusa2_adapter(tmp_path / "good", ["q_proj", "v_proj"], seed=4)
    medusa2_adapter(tmp_path / "bad", ["k_proj", "v_proj"], seed=5, draft_vocab_size=8)
    break_adapter(tmp_path / "bad")
    base = tiny_base()
    if preloaded:
        MedusaModel.from_pretrained(base, tmp_path / "good")
    before = base_snapshot(base)
    with pytest.raises(Exception, match=error):
        MedusaModel.from_pretrained(base, tmp_path / "bad")
    assert_same_base(base_snapshot(base), before)


def test_a_lora_medusa_spec_did_not_load_is_refused_not_removed(tmp_path):
    from peft import LoraConfig, get_peft_model

    medusa2_adapter(tmp_path / "a", ["q_proj", "v_proj"], seed=4)
    base = tiny_base()
    own = get_peft_model(base, LoraConfig(r=4, target_modules=["k_proj"], init_lora_weights=False))  # the user's
    before = base_snapshot(base)
    with pytest.raises(ValueError, match=r"base_model already holds the peft adapter\(s\) default, which medusa_spec "
                                         r"did not load.*merge_and_unload\(\)"):
        MedusaModel.from_pretrained(base, tmp_path / "a")
    assert_same_base(base_snapshot(base), before)
    assert own.get_base_model() is base and any("lora_A" in name for name, _ in base.named_modules())


def test_second_load_replaces_the_lora(tmp_path, recwarn):
    medusa2_adapter(tmp_path / "a", ["q_proj", "v_proj"], seed=4)
    medusa2_adapter(tmp_path / "b", ["k_proj", "o_proj"], seed=5)
    for first, second in [("a", "a"), ("a", "b")]:
        once = MedusaModel.from_pretrained(tiny_base(), tmp_path / second)
        base = tiny_base()
        MedusaModel.from_pretrained(base, tmp_path / first)
        twice = MedusaModel.from_pretrained(base, tmp_path / second)
        assert_same_base(base_snapshot(twice.base_model), base_snapshot(once.base_model))
        assert_same_heads(twice, once)
        assert torch.equal(greedy(twice)[0], greedy(once)[0])
    assert not [w for w in recwarn if "multiple adapters" in str(w.message)]  # peft's warning about stacking
