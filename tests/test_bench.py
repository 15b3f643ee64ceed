"""bench reports where a decoding step's time goes; a decode without a StepTimer takes no laps; speculation's own share
(over medusa_off), llama.cpp where it is installed, and where a report's numbers come from."""

import hashlib
import json
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import medusa_spec
from medusa_spec import MedusaConfig, MedusaModel, autotree, bench, loop
from medusa_spec.cli import main
from medusa_spec.loop import StepTimer
from test_cli import save_tiny_model
from test_default_tree import GROWING, with_accuracies
from test_no_local_paths import ROOT, local_paths
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


def test_speculation_share_is_the_rate_over_speculation_off_in_the_same_run(tmp_path):
    """medusa_off (tree=[]: the same loop and kernels, no drafting) runs on every prompt in the rotation like the rest;
    each speculating method's over_medusa_off is its rate over medusa_off's, so its speed-up over transformers is
    medusa_off's (the kernels') times it (speculation's); the table shows both."""
    mm = MedusaModel.from_base(tiny_model("llama"), MedusaConfig(num_heads=2))
    prompts = [("a", "w5 w6 w7 w5 w6"), ("b", "w9 w10 w11 w12"), ("a", "w20 w21 w20 w21")]
    methods = ("hf_greedy", "medusa_off", "medusa_greedy", "lookup", "medusa_sample")
    records = bench.bench(mm, word_tokenizer(), prompts, max_new_tokens=16, tree=TREE, methods=methods)
    for i in range(len(prompts)):  # each prompt's methods in the order they ran: rotated by one a prompt
        assert [r["method"] for r in records if r["prompt"] == i] == list(methods[i:] + methods[:i])
    report = bench.write_report(records, tmp_path, meta={})
    overall = report["summary"]["overall"]
    rate = {m: f["tokens_per_second"] for m, f in overall.items()}
    for method in ("medusa_greedy", "lookup"):
        figures = overall[method]
        assert figures["over_medusa_off"] == pytest.approx(rate[method] / rate["medusa_off"], rel=0.01)
        assert figures["speedup"] == pytest.approx(overall["medusa_off"]["speedup"] * figures["over_medusa_off"],
                                                   rel=0.01)
    # Not speculating, or sampling (speculation off was timed greedy only): no share to give.
    assert not any("over_medusa_off" in overall[m] for m in ("hf_greedy", "medusa_off", "medusa_sample"))
    table = (tmp_path / "bench.md").read_text()
    assert "| group | method | tok/s | tokens/step | speed-up | over medusa_off | = greedy |" in table
    f = overall["medusa_greedy"]
    assert f"| {f['speedup']:.2f}x | {f['over_medusa_off']:.2f}x | 100% |" in table
    assert f"| overall | medusa_off | {rate['medusa_off']:.1f} | 1.00 | {overall['medusa_off']['speedup']:.2f}x | - |" \
        in table

    # Exact on records made by hand: transformers 5 tok/s, speculation off 10, the heads 25.
    made = [{"prompt": 0, "category": "a", "method": m, "new_tokens": n, "seconds": 1.0, "steps": n,
             **({} if m == "hf_greedy" else {"equal_to_reference": True})}
            for m, n in (("hf_greedy", 5), ("medusa_off", 10), ("medusa_greedy", 25))]
    summary = bench.summarize(made)["overall"]
    assert (summary["medusa_off"]["speedup"], summary["medusa_greedy"]["speedup"]) == (2.0, 5.0)
    assert summary["medusa_greedy"]["over_medusa_off"] == 2.5
    without_off = bench.summarize([r for r in made if r["method"] != "medusa_off"])["overall"]
    assert "over_medusa_off" not in without_off["medusa_greedy"]
    assert "| 5.00x | - | 100% |" in bench.markdown({"overall": without_off})


class FakeLlama:
    """Stands in for llama-cpp-python's Llama: greedy decoding with the tiny torch model bench also times, except
    that on prompts starting with `differ_on` its first new token is another one. So the test below proves bench's
    side of the llama_cpp method (the GGUF and thread count it passes, the prompt's token ids fed as they are,
    llama.cpp's greedy settings, a reset before each prompt, the stop at max_new_tokens and at the generation
    config's eos, identical outputs counted), not llama.cpp's arithmetic on a real GGUF (the next test, where
    llama-cpp-python is installed)."""

    model = None
    differ_on = None
    made: list = []

    def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, verbose):
        self.args = dict(model_path=model_path, n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads_batch,
                         verbose=verbose)
        self.fed, self.settings, self.was_reset = [], [], False
        type(self).made.append(self)

    def reset(self):
        self.was_reset = True

    def generate(self, tokens, **settings):
        assert self.was_reset, "the prompt must be read whole: no cache kept from the previous one"
        self.was_reset = False
        self.fed.append(list(tokens))
        self.settings.append(settings)
        sequence = list(tokens)
        while True:
            with torch.no_grad():
                token = int(self.model(torch.tensor([sequence])).logits[0, -1].argmax())
            if len(sequence) == len(tokens) and tokens[0] == self.differ_on:
                token = (token + 1) % VOCAB
            sequence.append(token)
            yield token


def fake_llama_cpp(monkeypatch, model, differ_on=None):
    module = types.ModuleType("llama_cpp")
    module.Llama = type("Llama", (FakeLlama,), {"model": model, "differ_on": differ_on, "made": []})
    module.__version__ = "0.0-fake"
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    return module.Llama


def test_llama_cpp_decodes_the_same_token_ids_greedily_and_its_identical_outputs_are_counted(tmp_path, monkeypatch):
    mm = MedusaModel.from_base(tiny_model("llama"), MedusaConfig(num_heads=2))
    tokenizer = word_tokenizer()
    prompts = [("a", "w5 w6 w7 w5 w6"), ("b", "w9 w10 w11 w12"), ("a", "w20 w21 w22")]
    encoded = [bench.encode(tokenizer, text)[0].tolist() for _, text in prompts]
    # The generation config's eos is a token the first prompt's greedy continuation reaches at its 4th new token
    # (and not before): transformers stops there, and so must llama_cpp.
    with torch.no_grad():
        plain = mm.base_model.generate(torch.tensor([encoded[0]]), max_new_tokens=12, do_sample=False,
                                       eos_token_id=None)[0, len(encoded[0]):].tolist()
    eos = next(t for i, t in enumerate(plain) if i >= 3 and t not in plain[:i])
    mm.base_model.generation_config.eos_token_id = eos
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    llama = fake_llama_cpp(monkeypatch, mm.base_model, differ_on=encoded[1][0])
    methods = ("hf_greedy", "llama_cpp", "medusa_off", "medusa_greedy")
    records = bench.bench(mm, tokenizer, prompts, max_new_tokens=12, tree=TREE, methods=methods, gguf=gguf)

    (engine,) = llama.made
    assert engine.args == dict(model_path=str(gguf), n_ctx=max(map(len, encoded)) + 12,
                               n_threads=torch.get_num_threads(), n_threads_batch=torch.get_num_threads(),
                               verbose=False)
    assert engine.fed[1:] == encoded  # after the warm-up: each prompt's token ids, as transformers reads them
    assert all(s["temp"] == 0.0 and s["repeat_penalty"] == 1.0 for s in engine.settings)
    by = {(r["prompt"], r["method"]): r for r in records}
    assert by[0, "hf_greedy"]["new_tokens"] == by[0, "llama_cpp"]["new_tokens"] == plain.index(eos) + 1
    assert by[2, "llama_cpp"]["new_tokens"] == by[2, "hf_greedy"]["new_tokens"]
    assert [by[i, "llama_cpp"]["equal_to_reference"] for i in range(3)] == [True, False, True]
    assert [[r["method"] for r in records if r["prompt"] == i].index("llama_cpp") for i in range(3)] == [1, 0, 3]

    report = bench.write_report(records, tmp_path / "out", meta={})
    figures = report["summary"]["overall"]["llama_cpp"]
    assert figures["equal_to_reference"] == pytest.approx(2 / 3, abs=0.001)
    assert figures["tokens_per_step"] == 1.0 and "over_medusa_off" not in figures
    rate = {m: f["tokens_per_second"] for m, f in report["summary"]["overall"].items()}
    assert figures["speedup"] == pytest.approx(rate["llama_cpp"] / rate["hf_greedy"], rel=0.01)
    assert "| overall | llama_cpp | " in (tmp_path / "out" / "bench.md").read_text()
    # Only one prompt of "b", and it differs: the category says so too.
    assert report["summary"]["b"]["llama_cpp"]["equal_to_reference"] == 0.0


def test_llama_cpp_on_the_default_model_reads_the_token_ids_it_is_given():
    """Real llama.cpp on the default model's GGUF (SmolLM2-135M-Instruct, Q4_1): the prompt's token ids are what it
    reads (no BOS of its own in front), a prompt read after another gives the same tokens as read first (nothing kept
    from the previous prompt), and fewer new tokens are a prefix of more (greedy, no sampling)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional extra: pip install -e \".[llamacpp]\"")
    from medusa_spec import default_model

    try:
        gguf = default_model.gguf_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    llama = bench.LlamaCpp(gguf, n_ctx=64, threads=torch.get_num_threads(), eos=set())
    prompt, other = (llama.llm.tokenize(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n".encode(),
                                        add_bos=False, special=True) for text in ("Name three colours.", "Count."))
    first = llama.generate(prompt, 12)
    assert list(llama.llm.input_ids[:len(prompt)]) == prompt and len(first) == 12
    llama.generate(other, 12)
    assert llama.generate(prompt, 12) == first
    assert llama.generate(prompt, 5) == first[:5]


def test_the_report_says_what_it_was_run_on_and_names_no_path_of_this_machine(tmp_path, monkeypatch, capsys):
    """bench.json records this library's commit (from a checkout), the sha256 of the adapter's weights, the CPU model
    and the libraries' versions; the model, heads and prompt files are named as given when relative, else by name.
    Without llama-cpp-python (sys.modules holding None is how Python marks a module that cannot be imported), bench
    runs as before and says llama_cpp was skipped and why; asking for it is refused before anything runs."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    model = save_tiny_model(tmp_path / "model")
    heads = tmp_path / "heads"
    MedusaModel.from_base(tiny_model("llama"), MedusaConfig(num_heads=2)).save_heads(heads)
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"w{i} w{i + 1} w{i}"}) for i in range(5, 9)))
    out = tmp_path / "report"
    assert main(["bench", "--model", str(model), "--heads", str(heads), "--prompts", f"{prompts}:2",
                 "--max-new-tokens", "6", "--tree", json.dumps(TREE), "--output", str(out)]) == 0
    err = capsys.readouterr().err
    assert "[llama_cpp skipped: llama-cpp-python is not importable" in err

    text = (out / "bench.json").read_text()
    assert not local_paths(text) and str(tmp_path) not in text
    report = json.loads(text)
    meta = report["meta"]
    assert (meta["model"], meta["heads"], meta["prompts"], meta["gguf"]) == ("model", "heads", ["eval.jsonl:2"], None)
    assert meta["methods"] == list(bench.DEFAULT_METHODS) and "llama_cpp" not in report["summary"]["overall"]
    assert meta["skipped"]["llama_cpp"].startswith("llama-cpp-python is not importable")
    assert "llama_cpp skipped: llama-cpp-python is not importable" in (out / "bench.md").read_text()
    weights = (heads / "medusa_heads.safetensors").read_bytes()
    assert meta["adapter_sha256"] == {"medusa_heads.safetensors": hashlib.sha256(weights).hexdigest()}
    assert meta["versions"] | {"python": None} == {"medusa_spec": medusa_spec.__version__, "torch": torch.__version__,
                                                   "transformers": transformers.__version__, "python": None}
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file() and "model name" in cpuinfo.read_text():
        assert meta["cpu"] in cpuinfo.read_text() and meta["cpu"]
    checkout = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--error-unmatch", "medusa_spec/bench.py"],
                              capture_output=True)
    if checkout.returncode == 0:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
        assert meta["medusa_spec"]["commit"] == head.stdout.strip() and len(head.stdout.strip()) == 40
        assert isinstance(meta["medusa_spec"]["uncommitted_changes"], bool)

    assert main(["bench", "--model", str(model), "--methods", "hf_greedy", "llama_cpp", "--gguf", str(prompts),
                 "--output", str(tmp_path / "again")]) == 2
    assert "the llama_cpp method cannot run: llama-cpp-python is not importable" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()


def test_paths_are_shown_relative_or_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    assert bench.shown_path(tmp_path / "data" / "p.jsonl") == "data/p.jsonl"  # under the working folder
    assert bench.shown_path("../elsewhere/p.jsonl") == "../elsewhere/p.jsonl"  # relative: as given
    assert bench.shown_path(bench.MT_BENCH) == "medusa_spec/data/mt_bench_question.jsonl"  # beside the package
    assert bench.shown_path("/somewhere/else/heads") == "heads"  # else its name alone
    assert bench.shown_prompt_spec(f"{tmp_path}/data/p.jsonl:3") == "data/p.jsonl:3"


def test_a_dflash_draft_is_timed_as_the_dflash_method_beside_speculation_off(tmp_path, capsys):
    """bench --dflash DIR adds the dflash method (generate_with_dflash on that draft): greedy, so its output is checked
    against transformers', and it is given its rate over medusa_off; the report names the folder as given."""
    from medusa_spec.dflash import new_dflash, save_dflash

    model = save_tiny_model(tmp_path / "model")
    base = tiny_model("llama")
    save_dflash(new_dflash(base, num_layers=1, block_size=4, aux_layer_ids=[0, 1], mask_token_id=3), tmp_path / "df")
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"w{i} w{i + 1} w{i}"}) for i in range(5, 8)))
    out = tmp_path / "report"
    assert main(["bench", "--model", str(model), "--dflash", str(tmp_path / "df"), "--prompts", str(prompts),
                 "--methods", "hf_greedy", "medusa_off", "dflash", "--max-new-tokens", "8", "--output", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["meta"]["dflash"] == "df" and report["meta"]["methods"] == ["hf_greedy", "medusa_off", "dflash"]
    records = [r for r in report["records"] if r["method"] == "dflash"]
    assert len(records) == 3 and all(r["equal_to_reference"] for r in records)
    assert sum(r["timed_steps"] for r in records) > 0
    assert "over_medusa_off" in report["summary"]["overall"]["dflash"]
    assert main(["bench", "--model", str(model), "--methods", "dflash", "--output", str(tmp_path / "again")]) == 2
    assert "the dflash method needs --dflash DIR" in capsys.readouterr().err
