"""scripts/bench_batch.py: every kind of call at every batch size, both arms in turn each round and in the other order
the next, every row checked against transformers' greedy output."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from medusa_spec import MedusaModel
from medusa_spec.train.loop import train
from test_training import ask, base_dir, conversations, small_run  # noqa: F401 (fixtures)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_batch  # noqa: E402


def test_each_kind_runs_every_round_with_the_arms_in_turn(base_dir, conversations, tmp_path, capsys,  # noqa: F811
                                                           monkeypatch):
    monkeypatch.setenv("MEDUSA_SPEC_CACHE", str(tmp_path / "cache"))  # the costs it keeps on disk stay here
    heads = tmp_path / "heads"
    train(small_run(base_dir, conversations, heads, max_steps=3))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"category": f"c{s}", "turns": [ask(s)["content"]]}) + "\n" for s in (1, 5)))
    trees = []  # the tree of each call at batch 2, in order
    generate = MedusaModel.generate

    def spy(self, input_ids, *args, **kwargs):
        if input_ids.shape[0] == 2:
            trees.append("tree=None" if kwargs["tree"] is None else "tree=[]")
        return generate(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(MedusaModel, "generate", spy)
    bench_batch.main(["--model", str(base_dir), "--heads", str(heads), "--prompts", str(prompts), "--batches", "1",
                      "2", "--rounds", "2", "--max-new-tokens", "6"])
    out = capsys.readouterr().out

    assert "batch 1: " in out and "tree=None 2/2 rows identical, tree=[] 2/2 rows identical" in out
    assert "batch 2: " in out and "tree=None 4/4 rows identical, tree=[] 4/4 rows identical" in out
    batch_2 = out[out.index("batch 2: "):]
    for kind in bench_batch.KINDS:
        assert f"{kind}: tree=None" in batch_2
    # The warm models' first calls, then per round 4 kinds with both arms, the second round in the other order.
    arms = ["tree=None", "tree=[]"]
    assert trees == arms + arms * 4 + arms[::-1] * 4
