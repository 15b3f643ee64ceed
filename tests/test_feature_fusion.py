"""Feature fusion (`feature_layers`): heads that read decoder layers' hidden states beside the final one.

The verify pass and prefill must hand the heads exactly the layers' states a plain forward computes, drafting
must read them, adapters must keep them, and training must learn the projection. Lossless decoding with fused
heads: test_dependent_heads.py's greedy-identity test, on every architecture."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from medusa_spec import MedusaConfig, MedusaModel, build_tree
from medusa_spec.base import inspect_base_model
from medusa_spec.formats import convert
from medusa_spec.kv_cache import new_cache
from medusa_spec.propose import HeadsProposer, Prompt, draft_with_heads
from medusa_spec.slots import prefill
from medusa_spec.train.loop import train
from medusa_spec.train.module import TrainModule
from test_dependent_heads import TREE, one_thread, random_heads  # noqa: F401 (one_thread: autouse fixture)
from test_generate import prompt
from test_training import base_dir, conversations, small_run  # noqa: F401 (fixtures)
from tiny_models import tiny_model


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2", "opt"])
def test_prefill_returns_the_final_state_then_the_layers_asked_for(arch):
    model = tiny_model(arch)
    ids = prompt(batch=2)
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        reference = model(ids, output_hidden_states=True).hidden_states
        _, hidden, _ = prefill(model, inspect_base_model(model), ids, mask, new_cache(), feature_layers=(0, 1))
        _, final_only, _ = prefill(model, inspect_base_model(model), ids, mask, new_cache())
    width = reference[-1].shape[-1]
    assert hidden.shape == (*ids.shape, 3 * width)
    for part, expected in zip(hidden.split(width, dim=-1), (reference[-1], reference[0], reference[1])):
        torch.testing.assert_close(part, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final_only, reference[-1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("head_type", ["medusa", "dependent"])
def test_the_heads_draft_from_the_fused_layers(head_type):
    model = tiny_model("llama")
    mm = random_heads(model, head_type=head_type, feature_layers=[0, 1])
    tree = build_tree(TREE)
    ids = prompt(batch=2)
    mask = torch.ones_like(ids, dtype=torch.bool)
    root = torch.tensor([5, 17])
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
        _, hidden, _ = prefill(model, mm.spec, ids, mask, new_cache(), feature_layers=(0, 1))
        proposer = HeadsProposer(model, mm.heads, tree)
        proposer.start(Prompt(ids, mask, hidden, root, None))
        drafted = proposer.propose(root).node_tokens
        fused = mm.heads.features(torch.cat([states[-1], states[0], states[1]], dim=-1)[:, -1])
        expected = draft_with_heads(mm.heads, model, root, fused, tree)
        final_only = draft_with_heads(mm.heads, model, root, states[-1][:, -1], tree)
    assert torch.equal(drafted, expected)
    assert not torch.equal(drafted, final_only)  # the layers change the guesses: the test sees them


def test_fused_heads_round_trip_and_other_formats_refuse_them(tmp_path):
    model = tiny_model("llama")
    mm = random_heads(model, feature_layers=[1])
    mm.save_heads(tmp_path / "adapter")
    loaded = MedusaModel.from_pretrained(model, tmp_path / "adapter")
    assert loaded.config.feature_layers == [1]
    torch.testing.assert_close(loaded.heads.fuse.weight, mm.heads.fuse.weight)
    ids = prompt()
    assert torch.equal(loaded.generate(ids, max_new_tokens=12, tree=TREE).sequences,
                       mm.generate(ids, max_new_tokens=12, tree=TREE).sequences)
    for target in ("vllm", "medusa"):
        with pytest.raises(ValueError, match=r"feature_layers \[1\].*--to medusa_spec"):
            convert(tmp_path / "adapter", tmp_path / target, to=target, base_model=model)


def test_bad_feature_layers_are_named():
    for bad in ([-1], [1, 1], ["1"], 3):
        with pytest.raises(ValueError, match="feature_layers must be distinct layer indices >= 0"):
            MedusaConfig(feature_layers=bad)
    assert MedusaConfig(feature_layers=[5, 2]).feature_layers == [2, 5]
    with pytest.raises(ValueError, match="it has 2 decoder layers, so use 0 .* to 1"):
        MedusaModel.from_base(tiny_model("llama"), MedusaConfig(feature_layers=[2]))


def test_training_learns_the_projection_from_cached_states(base_dir, conversations, tmp_path):  # noqa: F811
    cfg = small_run(base_dir, conversations, tmp_path, feature_layers=[0, 1], cache_hidden=True, max_steps=40)
    summary = train(cfg)
    assert summary["eval"]["top1"][0] > 0.5, summary["eval"]  # the counting model: head 0 learns to count
    cache_meta = (tmp_path / "hidden_cache" / "meta.json").read_text()
    assert '"shape": [' in cache_meta and f", {3 * 64}]" in cache_meta  # final state + 2 layers, 64 wide
    model = MedusaModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path)
    assert model.config.feature_layers == [0, 1]
    assert model.heads.fuse.weight.abs().sum() > 0  # started at zero: training moved it


@pytest.mark.parametrize("head_type", ["dependent", "eagle"])
def test_cached_states_give_the_heads_what_the_base_pass_gives(head_type):
    model = tiny_model("llama")
    mm = random_heads(model, feature_layers=[0], head_type=head_type)
    module = TrainModule(model, mm.heads, mm.spec.bool_mask, mm.spec.takes_logits_to_keep)
    ids = prompt(batch=2)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    segments = torch.ones_like(ids)
    with torch.no_grad():
        live = module(ids, positions, segments)
        cached = module(ids, positions, segments, hidden=live.hidden)
    assert live.hidden.shape[-1] == 2 * 32
    torch.testing.assert_close(cached.head_states, live.head_states)
