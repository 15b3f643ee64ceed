"""Step costs kept on disk (cost_cache): a new MedusaModel in another process reads them instead of timing again; a
different machine, model, dtype or heads config times its own; a bad file is timed again, an unwritable folder
only warns; MEDUSA_SPEC_STEP_COSTS=0 (the suite's setting, conftest) writes nothing."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from medusa_spec import MedusaModel, autotree, cost_cache
from test_eagle import eagle_heads
from test_generate import prompt, reference_generate
from tiny_models import tiny_model


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """The files on, in a folder of this test's own; returns the step costs' folder and the list of timings."""
    monkeypatch.setenv("MEDUSA_SPEC_STEP_COSTS", "1")
    monkeypatch.setenv("MEDUSA_SPEC_CACHE", str(tmp_path))
    timed, measure = [], autotree.measure_step_costs

    def counting(*args, **kwargs):
        timed.append(kwargs["batch"])
        return measure(*args, **kwargs)

    monkeypatch.setattr(autotree, "measure_step_costs", counting)
    return tmp_path / "step_costs", timed


def fresh(model, **config) -> MedusaModel:
    """A new MedusaModel on `model` with the same random eagle heads each time: what a new process builds."""
    return eagle_heads(model, num_heads=3, **config)


def test_a_new_medusa_model_reads_the_costs_an_earlier_one_timed(cache):
    folder, timed = cache
    model = tiny_model("llama")
    ids = prompt(seed=3)[:, :9]
    text = reference_generate(model, ids, max_new_tokens=12, eos_token_id=None)
    first = fresh(model)
    assert torch.equal(first.generate(ids, max_new_tokens=12, eos_token_id=[]).sequences, text)
    assert timed == [1] and len(list(folder.glob("*.json"))) == 1  # one row: the probe's rows wait for a batch
    second = fresh(model)
    assert torch.equal(second.generate(ids, max_new_tokens=12, eos_token_id=[]).sequences, text)
    assert timed == [1]  # read, not timed
    batch = second.dynamic_tree(3)
    assert timed == [1, autotree.PROBE_ROWS]  # the probe's rows, timed once and kept beside the one row's
    third = fresh(model)
    assert third.dynamic_tree(3) == batch and third.dynamic_tree(1) == first.dynamic_tree(1)
    assert timed == [1, autotree.PROBE_ROWS] and list(folder.glob("*.tmp")) == []


def test_other_heads_another_dtype_or_another_model_time_their_own(cache):
    folder, timed = cache
    model = tiny_model("llama")
    fresh(model).dynamic_tree(1)
    fresh(model, metrics={"eval": {"rank_accuracy": [[0.6, 0.2, 0.1, 0.05]] * 3}}).dynamic_tree(1)
    fresh(model.to(torch.bfloat16)).dynamic_tree(1)
    fresh(tiny_model("qwen2")).dynamic_tree(1)
    assert timed == [1] * 4 and len(list(folder.glob("*.json"))) == 4
    fresh(tiny_model("qwen2")).dynamic_tree(1)
    assert len(timed) == 4


def test_a_file_that_does_not_hold_costs_is_timed_again_and_replaced(cache):
    folder, timed = cache
    model = tiny_model("llama")
    expected = fresh(model).dynamic_tree(1)
    (kept,) = folder.glob("*.json")
    for bad in ("{not json", json.dumps({"verify": {"1": {}}, "draft": {}, "probe_rows": 4}), "[1, 2]"):
        kept.write_text(bad)
        timed.clear()
        tree = fresh(model).dynamic_tree(1)
        assert timed == [1] and tree.nodes == expected.nodes
        assert autotree.StepCosts.from_dict(json.loads(kept.read_text())) is not None


def test_an_unwritable_cache_only_warns(cache, monkeypatch, tmp_path):
    _, timed = cache
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("MEDUSA_SPEC_CACHE", str(blocker))  # its step_costs folder cannot be made
    model = tiny_model("llama")
    ids = prompt(seed=3)[:, :9]
    with pytest.warns(UserWarning, match="could not keep the step costs .* MEDUSA_SPEC_STEP_COSTS=0"):
        out = fresh(model).generate(ids, max_new_tokens=8, eos_token_id=[])
    assert torch.equal(out.sequences, reference_generate(model, ids, max_new_tokens=8, eos_token_id=None))
    assert timed == [1]


def test_turned_off_nothing_is_read_or_written(cache, monkeypatch):
    folder, timed = cache
    model = tiny_model("llama")
    fresh(model).dynamic_tree(1)
    monkeypatch.setenv("MEDUSA_SPEC_STEP_COSTS", "0")
    assert cost_cache.costs_file(fresh(model), dynamic=True) is None
    fresh(model).dynamic_tree(1)
    assert timed == [1, 1] and len(list(folder.glob("*.json"))) == 1


def test_step_costs_survive_json():
    costs = autotree.StepCosts(verify={1: {1: 0.01, 2: 0.012}, 4: {1: 0.02}}, draft={1: {1: 0.0, 2: 0.003},
                                                                                     4: {1: 0.001}}, probe_rows=4)
    assert autotree.StepCosts.from_dict(json.loads(json.dumps(costs.to_dict()))) == costs
    assert autotree.StepCosts.from_dict({"verify": costs.verify}) is None
    one_row = autotree.StepCosts.from_dict(json.loads(json.dumps(dataclasses.replace(
        costs, verify={1: costs.verify[1]}, draft={1: costs.draft[1]}).to_dict())))
    assert one_row.merged(costs) == costs and one_row.at(1) == costs.at(1)
    with pytest.raises(ValueError, match="cannot price 3: time the probe's 4 rows too"):
        one_row.at(3)


def test_the_folder_keeps_the_most_recently_written_files(tmp_path, monkeypatch):
    """Each code change writes a new file; past KEEP_FILES the least recently written go, never the new one."""
    monkeypatch.setattr(cost_cache, "KEEP_FILES", 3)
    folder = tmp_path / "step_costs"
    for n in range(5):
        cost_cache.write(folder / f"{n}.json", {"n": n})
        os.utime(folder / f"{n}.json", (1000 + n, 1000 + n))
    assert sorted(p.name for p in folder.glob("*.json")) == ["2.json", "3.json", "4.json"]
    cost_cache.write(folder / "2.json", {"n": 5})  # rewritten: now the newest
    cost_cache.write(folder / "new.json", {"n": 6})
    assert sorted(p.name for p in folder.glob("*.json")) == ["2.json", "4.json", "new.json"]
    assert cost_cache.read(folder / "2.json") == {"n": 5} and not list(folder.glob("*.tmp"))
