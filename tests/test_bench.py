"""bench reports where a decoding step's time goes; a decode without a StepTimer takes no laps."""

import time

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from medusa_spec import MedusaConfig, MedusaModel, autotree, bench, loop
from medusa_spec.loop import StepTimer
from test_default_tree import GROWING, with_accuracies
from tiny_models import VOCAB, tiny_model

GROWING_MAX = max(GROWING)

TREE = [[0], [1], [0, 0], [1, 0], [0, 1]]
TIMED = ("medusa_off", "medusa_greedy", "medusa_sample", "medusa_lookup", "lookup", "self_draft")


def word_tokenizer():
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w3"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w3", pad_token="w0", bos_token="w1",
                                        eos_token="w2")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tokenizer


def test_bench_reports_each_stage_of_a_step(tmp_path):
    mm = MedusaModel.from_base(tiny_model("llama"), MedusaConfig(num_heads=2))
    prompts = [("a", "w5 w6 w7 w5 w6"), ("b", "w9 w10 w11 w12")]
    methods = ("hf_greedy", *TIMED)
    records = bench.bench(mm, word_tokenizer(), prompts, max_new_tokens=24, tree=TREE, methods=methods,
                          drafts=bench.draft_models(mm.base_model, methods))
    for record in records:
        if record["method"] == "hf_greedy":
            assert "stage_seconds" not in record  # transformers' own loop: no stages to tell
            continue
        stages = record["stage_seconds"]
        assert set(stages) == set(StepTimer.STAGES) and all(s > 0 for s in stages.values()), record
        assert sum(stages.values()) <= record["seconds"], record  # what they cover: the next test
        assert record["timed_steps"] == record["steps"] - 1  # every step but prefill

    report = bench.write_report(records, tmp_path, meta={})
    overall = report["summary"]["overall"]
    assert "stages" not in overall["hf_greedy"]
    # Each speed-up is over transformers decoding the same way: sampled methods over hf_sample, when it ran.
    rate = {m: f["tokens_per_second"] for m, f in overall.items()}
    assert overall["medusa_greedy"]["speedup"] == pytest.approx(rate["medusa_greedy"] / rate["hf_greedy"], rel=0.01)
    assert overall["medusa_sample"]["speedup"] is None  # hf_sample did not run
    for method in TIMED:
        figures = overall[method]
        stages = figures["stages"]
        assert list(stages) == ["propose", "verify", "accept", "commit"]
        assert sum(s["ms_per_step"] for s in stages.values()) == pytest.approx(figures["step_ms"], abs=0.01)
        assert sum(s["share"] for s in stages.values()) == pytest.approx(1.0, abs=0.01)
        prefills = [r["stage_seconds"]["prefill"] for r in records if r["method"] == method]
        assert figures["prefill_ms"] == pytest.approx(1000 * sum(prefills) / len(prefills), abs=0.01)  # per prompt
    table = (tmp_path / "bench.md").read_text()
    assert "| method | step ms | tree nodes | propose | verify | accept | commit | prefill ms |" in table
    assert "| medusa_greedy | " in table and "| medusa_greedy | - |" not in table  # a fixed tree: no sizes
    assert "mean_tree_nodes" not in overall["medusa_greedy"]
    assert all(f"| {method} | " in table.split("Where a step's time goes")[1] for method in TIMED)


def layers_move_the_clock(monkeypatch) -> None:
    """time.perf_counter stands still but for the decoder layers: a second each call."""
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    layer_forward = LlamaDecoderLayer.forward

    def costly(self, *args, **kwargs):
        clock[0] += 1.0
        return layer_forward(self, *args, **kwargs)

    monkeypatch.setattr(LlamaDecoderLayer, "forward", costly)


def test_every_forward_pass_of_a_generation_is_charged_to_a_stage(monkeypatch):
    """The laps follow each other from before prefill to the last commit, so the model's work is all inside them;
    only argument checks, set-up and the output fall outside. On a clock that only the decoder layers move (one
    second a call), the stages add up to the generation's time exactly. (On the real clock that set-up is a few ms,
    which a busy machine stretches past any fixed share of a tiny model's decode.)"""
    layers_move_the_clock(monkeypatch)
    mm = MedusaModel.from_base(tiny_model("llama"), MedusaConfig(num_heads=2))
    methods = ("hf_greedy", *TIMED)
    records = bench.bench(mm, word_tokenizer(), [("a", "w5 w6 w7 w5 w6")], max_new_tokens=24, tree=TREE,
                          methods=methods, drafts=bench.draft_models(mm.base_model, methods))
    for record in records:
        if record["method"] != "hf_greedy":
            stages = record["stage_seconds"]
            assert sum(stages.values()) == record["seconds"] > 0 and stages["prefill"] >= 1, record
            assert stages["verify"] >= record["timed_steps"], record  # each step's pass through the layers


def test_sampled_methods_are_timed_against_transformers_sampling_the_same_way(monkeypatch):
    """hf_sample and medusa_sample pass generate the same settings (bench.SAMPLING), and medusa_sample's speed-up
    is over hf_sample's rate."""
    mm = MedusaModel.from_base(tiny_model("llama"), MedusaConfig(num_heads=2))
    asked = []
    generate = type(mm.base_model).generate
    monkeypatch.setattr(type(mm.base_model), "generate",
                        lambda self, *a, **kw: asked.append(kw) or generate(self, *a, **kw))
    records = bench.bench(mm, word_tokenizer(), [("a", "w5 w6 w7 w5 w6")], max_new_tokens=16, tree=TREE,
                          methods=("hf_greedy", "hf_sample", "medusa_sample"))
    assert asked and all(kw["do_sample"] and kw["temperature"] == 0.7 and kw["top_p"] == 0.9 for kw in asked
                         if kw["do_sample"])
    assert sum(kw["do_sample"] for kw in asked) == 2  # hf_sample: the warm-up and the prompt
    sampled = [r for r in records if r["method"] == "hf_sample"]
    assert sampled[0]["steps"] == sampled[0]["new_tokens"]
    overall = bench.summarize(records)["overall"]
    want = overall["medusa_sample"]["tokens_per_second"] / overall["hf_sample"]["tokens_per_second"]
    assert overall["medusa_sample"]["speedup"] == pytest.approx(want, rel=0.01)
    assert overall["hf_sample"]["speedup"] == 1.0


def test_decoding_without_a_timer_takes_no_laps_and_gives_the_same_tokens(monkeypatch):
    mm = MedusaModel.from_base(tiny_model("llama"), MedusaConfig(num_heads=2))
    ids = torch.tensor([[5, 6, 7, 8, 5, 6]])
    laps = []
    lap = StepTimer.lap
    monkeypatch.setattr(StepTimer, "lap", lambda self, stage: laps.append(stage) or lap(self, stage))
    synced = []
    monkeypatch.setattr(loop.torch.cuda, "synchronize", lambda *args: synced.append(args))

    plain = mm.generate(ids, max_new_tokens=20, eos_token_id=[], tree=TREE)
    assert laps == [] and synced == []
    timer = StepTimer()
    timed = mm.generate(ids, max_new_tokens=20, eos_token_id=[], tree=TREE, timer=timer)
    assert torch.equal(plain.sequences, timed.sequences)
    with torch.no_grad():
        reference = mm.base_model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(plain.sequences, reference)
    steps = timed.stats.steps - 1
    assert timer.steps == steps and laps == ["prefill"] + ["propose", "verify", "accept", "propose", "commit"] * steps
    assert synced == []  # on CPU the ops are done when they return: nothing to wait for


def test_a_timer_adds_up_over_calls(monkeypatch):
    """One timer over two calls holds, stage by stage, the sum of two timers of one call each (on a clock that only
    the decoder layers move, so the calls' times are exact)."""
    layers_move_the_clock(monkeypatch)
    mm = MedusaModel.from_base(tiny_model("llama"), MedusaConfig(num_heads=2))
    ids = torch.tensor([[5, 6, 7]])
    each, both = [StepTimer(), StepTimer()], StepTimer()
    steps = sum(mm.generate(ids, max_new_tokens=8, eos_token_id=[], tree=TREE, timer=timer).stats.steps - 1
                for timer in each)
    for _ in each:
        mm.generate(ids, max_new_tokens=8, eos_token_id=[], tree=TREE, timer=both)
    assert both.steps == steps == sum(timer.steps for timer in each)
    assert both.seconds == {stage: sum(timer.seconds[stage] for timer in each) for stage in StepTimer.STAGES}
    assert both.seconds["verify"] == 2 * steps  # a pass through the 2 layers each step


def test_an_adapting_tree_reports_the_mean_size_it_ran_weighted_by_steps(tmp_path, monkeypatch):
    """tree=None re-chooses the tree size as the heads guess: the tokens per step depend on it, so the report gives
    the mean size per step over every prompt (a long prompt's steps count more than a short one's)."""
    monkeypatch.setattr(autotree, "measure_step_costs", lambda *args, **kwargs: (GROWING, dict.fromkeys(GROWING, 0.0)))
    mm = with_accuracies()  # held-out accuracies that start a tree, then untrained heads shrink it to the root
    prompts = [("a", "w5 w6 w7 w5 w6"), ("b", "w9 w10 w11 w12")]
    records = bench.bench(mm, word_tokenizer(), prompts, max_new_tokens=48, tree=None, methods=("medusa_greedy",))
    assert all(1 < r["mean_tree_nodes"] < GROWING_MAX for r in records)
    report = bench.write_report(records, tmp_path, meta={})
    want = sum(r["mean_tree_nodes"] * r["timed_steps"] for r in records) / sum(r["timed_steps"] for r in records)
    assert report["summary"]["overall"]["medusa_greedy"]["mean_tree_nodes"] == pytest.approx(want, abs=0.005)
    # Weighted, not the plain mean of the prompts' means, wherever the two differ.
    records[0] |= {"mean_tree_nodes": 2.0, "timed_steps": 30}
    records[1] |= {"mean_tree_nodes": 4.0, "timed_steps": 10}
    assert bench.summarize(records)["overall"]["medusa_greedy"]["mean_tree_nodes"] == 2.5
    table = (tmp_path / "bench.md").read_text().split("Where a step's time goes")[1]
    assert f"| medusa_greedy | {report['summary']['overall']['medusa_greedy']['step_ms']:.2f} | {want:.2f} |" in table
