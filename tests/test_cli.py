"""The command line on a tiny model saved to disk with a word-level tokenizer (offline)."""

import argparse
import copy
import re

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from medusa_spec.cli import build_parser, main
from medusa_spec.inputs import resolve_sampling
from medusa_spec.tree import DynamicTree
from tiny_models import VOCAB, tiny_model


def save_tiny_model(path, **generation_config):
    """A tiny Llama and a word-level tokenizer in `path`; `generation_config` settings saved with the model."""
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w3"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w3", pad_token="w0", bos_token="w1",
                                        eos_token="w2")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(path)
    model = tiny_model("llama")
    for key, value in generation_config.items():
        setattr(model.generation_config, key, value)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_demo_reports_identical_output(capsys, monkeypatch):
    assert main(["demo", "--max-new-tokens", "16"]) == 0
    assert "identical to transformers greedy: True" in capsys.readouterr().out
    import transformers  # past the tiny model's 2,048 positions: refused before transformers decodes 3,000 tokens
    monkeypatch.setattr(transformers.GenerationMixin, "generate", lambda *a, **k: pytest.fail("transformers ran"))
    assert main(["demo", "--max-new-tokens", "3000"]) == 2
    assert "needs 3016 positions, but LlamaForCausalLM has max_position_embeddings=2048" in capsys.readouterr().err


def test_generate_streams_and_compares(model_dir, capsys):
    assert main(["generate", "w5 w9 w11 w7", "--model", str(model_dir), "--max-new-tokens", "12", "--compare"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.split()) >= 1  # streamed text
    assert "tokens/step" in captured.err and "identical: True" in captured.err


def test_chat_keeps_the_conversation(model_dir, monkeypatch, capsys):
    from medusa_spec import MedusaModel

    said = iter(["w5 w9 w11", "w7 w8", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(said))
    calls, generate = [], MedusaModel.generate

    def recording_generate(self, input_ids, **kwargs):
        out = generate(self, input_ids, **kwargs)
        calls.append((input_ids[0].tolist(), out.sequences[0].tolist()))
        return out

    monkeypatch.setattr(MedusaModel, "generate", recording_generate)
    assert main(["chat", "--model", str(model_dir), "--max-new-tokens", "6", "--lookup", "0"]) == 0  # heads alone
    assert capsys.readouterr().err.count("tokens/step") == 2
    (first_prompt, first_output), (second_prompt, _) = calls
    # The second turn's prompt holds the first turn and the model's reply to it.
    assert second_prompt[: len(first_prompt)] == first_prompt and len(second_prompt) > len(first_output)


def test_bad_tree_is_a_clean_error(model_dir, capsys):
    assert main(["generate", "w5", "--model", str(model_dir), "--tree", "[[0,0]]"]) == 2
    assert "no parent [0]" in capsys.readouterr().err


ACCURACY = [[0.6, 0.2, 0.1], [0.5, 0.3, 0.1], [0.4, 0.2, 0.2]]


@pytest.mark.parametrize("measured", [True, False])
def test_tree_node_count_grows_that_tree(model_dir, tmp_path, monkeypatch, capsys, measured):
    """--tree N: the N-node tree grown from the heads' rank accuracies (what `medusa-spec tree --nodes N` stores),
    a built-in shape of N nodes for heads that carry none; generate decodes with it."""
    import torch
    from transformers import AutoModelForCausalLM

    from medusa_spec import MedusaConfig, MedusaModel
    from medusa_spec.tree import default_tree, grow_tree

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    metrics = {"eval": {"rank_accuracy": ACCURACY}} if measured else {}
    MedusaModel.from_base(base, MedusaConfig(num_heads=3, metrics=metrics)).save_heads(tmp_path / "heads")
    trees, generate = [], MedusaModel.generate

    def recording_generate(self, input_ids, **kwargs):
        trees.append(kwargs.get("tree"))
        return generate(self, input_ids, **kwargs)

    monkeypatch.setattr(MedusaModel, "generate", recording_generate)
    torch.manual_seed(0)
    assert main(["generate", "w5 w9 w11", "--model", str(model_dir), "--heads", str(tmp_path / "heads"),
                 "--max-new-tokens", "6", "--tree", "7", "--lookup", "0"]) == 0
    expected = grow_tree(ACCURACY, 7) if measured else default_tree(3, 7)
    assert trees == [expected] and len(expected) == 6  # 7 nodes: the root and 6 paths
    assert expected != default_tree(3, 7) or not measured  # the accuracies chose another shape than the prior


@pytest.mark.parametrize("tree", ["0", "7.5", "8x", '"8"', "{}"])
def test_tree_that_is_no_tree_nor_count_is_refused(model_dir, capsys, tree):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "w5", "--model", str(model_dir), "--tree", tree])
    assert exit_info.value.code == 2
    assert "or a node count such as 16" in capsys.readouterr().err


def test_bench_refuses_lookup_methods_without_a_chain(model_dir, capsys):
    assert main(["bench", "--model", str(model_dir), "--lookup", "0"]) == 2
    assert "--lookup 0 leaves the lookup and medusa_lookup methods no chain" in capsys.readouterr().err


def test_bench_writes_json_markdown_and_plot(model_dir, tmp_path, capsys):
    import json

    prompts = tmp_path / "eval.jsonl"
    prompts.write_text("\n".join(json.dumps({"category": c, "turns": [t, "second turn"]}) for c, t in
                                 [("a", "w5 w6 w7"), ("a", "w9 w9"), ("b", "w11 w12 w13 w14"), ("a", "w20")]))
    out = tmp_path / "report"
    assert main(["bench", "--model", str(model_dir), "--prompts", str(prompts), "--per-category", "2",
                 "--max-new-tokens", "10", "--output", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    summary = report["summary"]
    assert set(summary) == {"a", "b", "overall"} and summary["overall"]["hf_greedy"]["prompts"] == 3
    for method in ("hf_prompt_lookup", "medusa_off", "medusa_greedy"):
        assert summary["overall"][method]["equal_to_reference"] == 1.0, method
    assert summary["overall"]["medusa_off"]["tokens_per_step"] == 1.0
    assert summary["overall"]["hf_greedy"]["speedup"] == 1.0
    assert "| overall | medusa_greedy |" in (out / "bench.md").read_text()
    assert (out / "bench.png").stat().st_size > 1000


def test_options_shared_by_subcommands_are_defined_once():
    """A flag that several subcommands take, training ones included, has one type, help and meaning: only its
    default value may be a command's own (the help's "(default: ...)")."""
    # argparse keeps a parser's subcommands and options only in private attributes.
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    seen = {}
    for name, parser in commands.items():
        for action in parser._actions:
            meaning = re.sub(r" \((default: .*|required)\)$", "", action.help or "", flags=re.S)
            for flag in action.option_strings:
                seen.setdefault(flag, []).append((name, type(action), action.type, meaning, action.choices,
                                                  action.nargs, action.metavar))
    for flag, definitions in seen.items():
        assert all(d[1:] == definitions[0][1:] for d in definitions), \
            f"{flag} differs between {[d[0] for d in definitions]}"
    where = {flag: {name for name, *_ in definitions} for flag, definitions in seen.items()}
    assert where["--max-new-tokens"] == {"demo", "generate", "chat", "bench", "distill"}
    for flag in ("--do-sample", "--temperature", "--top-k", "--top-p"):  # the model's sampling, nothing else
        assert where[flag] == {"generate", "chat", "distill"}, flag
    assert where["--eval-ranks"] == {"train", "tree"}  # ranks measured per head: not --top-k
    assert where["--lookup"] == where["--draft-model"] == where["--dflash"] == {"generate", "chat", "bench"}
    assert where["--system-prompt"] == {"chat", "distill"}
    assert where["--prompts"] == where["--prompt-field"] == {"bench", "distill"}
    assert where["--output"] == {"bench", "distill", "train"}  # one name for where a command writes
    assert where["--heads"] == {"generate", "chat", "bench", "tree"}
    assert where["--model"] == {"generate", "chat", "bench", "distill", "train", "tree", "convert"}
    assert where["--seed"] == {"demo", "generate", "chat", "bench", "distill", "train"}


@pytest.mark.parametrize("command, old, new, value", [
    (["bench"], "--out", "output", "report"),
    (["train"], "--output-dir", "output", "run"),
    (["tree"], "--adapter", "heads", "run"),
    (["convert", "src", "dst", "--to", "vllm"], "--base-model", "model", "base"),
])
def test_old_option_names_still_work_and_are_left_out_of_the_help(command, old, new, value, capsys):
    """bench --out, train --output-dir, tree --adapter and convert --base-model were renamed to the name the other
    commands use for the same idea; the old spelling sets the same setting and --help shows only the new one."""
    args = build_parser().parse_args([*command, old, value])
    assert getattr(args, new) == value
    with pytest.raises(SystemExit):
        build_parser().parse_args([command[0], "--help"])
    shown = capsys.readouterr().out
    assert "--" + new.replace("_", "-") in shown and not re.search(re.escape(old) + r"(?![\w-])", shown)


def test_bench_reads_several_prompt_files_each_with_an_optional_cap(model_dir, tmp_path):
    """bench --prompts takes distill's FILE[:N] list: prompts of any shape distill reads, N the first N of a file;
    a record's category, else its file's name, groups the report."""
    import json

    mt_bench = tmp_path / "mt.jsonl"
    mt_bench.write_text("\n".join(json.dumps({"category": c, "turns": [t, "second turn"]}) for c, t in
                                  [("a", "w5 w6 w7"), ("b", "w9 w9"), ("a", "w20")]))
    plain = tmp_path / "plain.jsonl"
    plain.write_text("\n".join(json.dumps({"prompt": f"w{i} w{i + 1}"}) for i in range(10, 15)))
    out = tmp_path / "report"
    assert main(["bench", "--model", str(model_dir), "--prompts", str(mt_bench), f"{plain}:2", "--max-new-tokens",
                 "4", "--methods", "hf_greedy", "medusa_greedy", "--output", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    counts = {group: figures["hf_greedy"]["prompts"] for group, figures in report["summary"].items()}
    assert counts == {"a": 2, "b": 1, "plain": 2, "overall": 5}
    assert report["meta"]["prompts"] == ["mt.jsonl", "plain.jsonl:2"]  # by name: no path of this machine


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_seed_makes_sampled_output_repeat(tmp_path, monkeypatch, capsys, command):
    """generate and chat take --seed as bench and distill do: the same seed samples the same text, another seed
    other text."""
    path = save_tiny_model(tmp_path, do_sample=True, temperature=2.0)

    def sampled(seed: str) -> str:
        said = iter(["w5 w9 w11", "w7 w8", ""])
        monkeypatch.setattr("builtins.input", lambda prompt="": next(said))
        prompt = ["w5 w9 w11"] if command == "generate" else []
        assert main([command, *prompt, "--model", str(path), "--max-new-tokens", "12", "--seed", seed]) == 0
        return capsys.readouterr().out

    first = sampled("1")
    assert first.strip()
    assert sampled("1") == first
    assert sampled("2") != first


def test_chat_speculates_as_generate_does(model_dir, monkeypatch, capsys):
    """chat takes generate's proposer options: the lookup chain by default (10 tokens), --lookup N, --lookup 0."""
    from medusa_spec import MedusaModel

    chains, generate = [], MedusaModel.generate

    def recording_generate(self, input_ids, **kwargs):
        if kwargs.get("lookup_tokens"):
            chains.append(kwargs["lookup_tokens"])
        return generate(self, input_ids, **kwargs)

    monkeypatch.setattr(MedusaModel, "generate", recording_generate)
    for options, expected in [([], [10, 10]), (["--lookup", "3"], [3, 3]), (["--lookup", "0"], [])]:
        said = iter(["w5 w9 w11 w5 w9", "w7 w8", ""])
        monkeypatch.setattr("builtins.input", lambda prompt="": next(said))
        chains.clear()
        assert main(["chat", "--model", str(model_dir), "--max-new-tokens", "6", "--tree", "off", *options]) == 0
        err = capsys.readouterr().err
        assert chains == expected, options
        assert err.count("from lookup") == len(expected) and err.count("tokens/step") == 2
        assert main(["generate", "w5 w9 w11", "--model", str(model_dir), "--max-new-tokens", "6", "--tree", "off",
                     *options]) == 0
        assert chains == expected + expected[:1], options
        capsys.readouterr()


def test_distill_samples_as_generate_does(tmp_path):
    """distill's answers resolve --do-sample, --temperature, --top-k and --top-p as generate does: a model whose
    generation_config samples samples unless --no-do-sample, and a flag given overrides it."""
    import json

    path = save_tiny_model(tmp_path / "model", do_sample=True, temperature=3.0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"w{i} w{i + 9} w{i + 20}"}) for i in range(5, 9)))

    def answers(*flags):
        out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}.jsonl"
        assert main(["distill", "--model", str(path), "--prompts", str(prompts), "--output", str(out), "--dtype",
                     "float32", "--max-new-tokens", "8", "--batch-size", "4", *flags]) == 0
        return {r["id"]: r["messages"][-1]["content"] for r in map(json.loads, out.read_text().splitlines())}

    greedy = answers("--no-do-sample")
    assert answers() != greedy  # as the model's generation_config says: it samples
    assert answers("--top-k", "1") == greedy  # sampling among the one most likely token


@pytest.mark.parametrize("proposer", [["--lookup", "0"], []], ids=["heads", "heads+lookup"])
def test_sampling_follows_the_models_generation_config_unless_a_flag_is_given(tmp_path, monkeypatch, capsys,
                                                                                   proposer):
    from medusa_spec import MedusaModel

    path = save_tiny_model(tmp_path, do_sample=True, temperature=0.5, top_k=7)
    calls, generate = [], MedusaModel.generate

    def record(mm, kwargs):
        given = {name: kwargs.get(name) for name in ("do_sample", "temperature", "top_k", "top_p")}
        sampling = resolve_sampling(mm.base_model, **given)
        calls.append((sampling.do_sample, sampling.temperature, sampling.top_k, sampling.top_p))

    def recording_generate(self, input_ids, **kwargs):
        record(self, kwargs)
        return generate(self, input_ids, **kwargs)

    monkeypatch.setattr(MedusaModel, "generate", recording_generate)
    command = ["generate", "w5 w9 w11", "--model", str(path), "--max-new-tokens", "4", "--tree", "off", *proposer]
    assert main(command) == 0
    assert calls == [(True, 0.5, 7, 1.0)]  # as transformers' generate would sample for this model
    assert main([*command, "--no-do-sample"]) == 0 and calls[-1][0] is False
    assert main([*command, "--temperature", "0.9", "--top-k", "0"]) == 0 and calls[-1] == (True, 0.9, 0, 1.0)
    capsys.readouterr()
    # --compare: transformers' generate samples as the model says too (it takes an explicit None as a setting, so
    # none may be passed), and the outputs are not claimed identical.
    plain_calls, plain_generate = [], LlamaForCausalLM.generate

    def recording_plain_generate(self, *args, **kwargs):
        effective = copy.deepcopy(self.generation_config)
        effective.update(**{name: kwargs[name] for name in ("do_sample", "temperature", "top_k", "top_p")
                            if name in kwargs})
        plain_calls.append((effective.do_sample, effective.temperature, effective.top_k))
        return plain_generate(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "generate", recording_plain_generate)
    assert main([*command, "--compare"]) == 0
    assert plain_calls[-1] == (True, 0.5, 7)
    err = capsys.readouterr().err
    assert "speed-up" in err and "identical" not in err


@pytest.mark.parametrize("cpu", [{"avx2", "fma"}, {"avx512f", "avx512_bf16"}, {"amx_bf16"}], ids=str)
def test_distill_loads_bf16_only_on_a_cpu_that_computes_it(tmp_path, monkeypatch, cpu):
    """Without --dtype, distill takes bf16 where the CPU has bf16 instructions; elsewhere torch emulates bf16, far
    slower than fp32 (an AVX2 EPYC answered at a few tokens/s in bf16), so it takes fp32."""
    import json

    import medusa_spec.train.cli
    from medusa_spec import flags

    monkeypatch.setattr(flags, "cpu_flags", lambda: cpu)
    loaded = []
    load = medusa_spec.train.cli.load_model_and_tokenizer

    def recording_load(path, dtype, plain_text):
        loaded.append(dtype)
        return load(path, dtype, plain_text)

    monkeypatch.setattr(medusa_spec.train.cli, "load_model_and_tokenizer", recording_load)
    path = save_tiny_model(tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "w5 w9"}))
    out = tmp_path / "out.jsonl"
    assert main(["distill", "--model", str(path), "--prompts", str(prompts), "--output", str(out), "--device", "cpu",
                 "--max-new-tokens", "4"]) == 0
    assert loaded == ["bfloat16" if cpu & {"avx512_bf16", "amx_bf16"} else "float32"]
    assert len(out.read_text().splitlines()) == 1


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory):
    """An adapter folder (medusa_config.json + weights, no model, no tokenizer) for the tiny model."""
    from medusa_spec import MedusaConfig, MedusaModel

    path = tmp_path_factory.mktemp("heads")
    MedusaModel.from_base(tiny_model("llama"), MedusaConfig(num_heads=2)).save_heads(path)
    return path


@pytest.fixture
def loaded(monkeypatch):
    """The paths AutoModelForCausalLM.from_pretrained is asked to load while the test runs."""
    from transformers import AutoModelForCausalLM

    paths, load = [], AutoModelForCausalLM.from_pretrained

    def recording_load(path, *args, **kwargs):
        paths.append(str(path))
        return load(path, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recording_load)
    return paths


@pytest.mark.parametrize("command, flag", [
    (["generate", "w5", "--model", "{missing}"], "--model"),
    (["generate", "w5", "--model", "{model}", "--draft-model", "{missing}"], "--draft-model"),
    (["chat", "--model", "{missing}"], "--model"),
    (["bench", "--model", "{missing}"], "--model"),
    (["bench", "--model", "{model}", "--draft-model", "{missing}", "--methods", "draft_model"], "--draft-model"),
    (["convert", "{heads}", "{out}", "--to", "vllm", "--model", "{missing}"], "--model"),
], ids=["generate", "generate-draft", "chat", "bench", "bench-draft", "convert"])
@pytest.mark.parametrize("missing", ["no-such-dir", "my-org/my-model"], ids=["path", "hub-name"])
def test_a_model_that_is_no_local_folder_is_refused_before_any_model_loads(model_dir, heads_dir, tmp_path, loaded,
                                                                           capsys, command, flag, missing):
    """Every command that loads a model checks --model and --draft-model first, as train does: transformers would
    read a missing folder as a Hub repo id (a traceback, or a download attempt for a bare name)."""
    missing = str(tmp_path / missing) if missing == "no-such-dir" else missing
    fill = dict(missing=missing, model=model_dir, heads=heads_dir, out=tmp_path / "out")
    assert main([word.format(**fill) for word in command]) == 2
    assert f"{flag} {missing}: no such folder; give a local folder holding" in capsys.readouterr().err
    assert loaded == []


@pytest.mark.parametrize("folder, lacks", [
    ("empty", "no model (config.json) and no tokenizer (tokenizer_config.json, tokenizer.json)"),
    ("weights only", "no tokenizer (tokenizer_config.json, tokenizer.json)"),
], ids=["empty", "weights-only"])
@pytest.mark.parametrize("command", ["generate", "distill"])
def test_a_folder_without_model_or_tokenizer_says_what_it_lacks(tmp_path, loaded, capsys, folder, lacks, command):
    """An empty folder or a model saved without its tokenizer, given as --model: the error names what the folder
    lacks (transformers would say to install sentencepiece)."""
    path = {"empty": tmp_path / "empty", "weights only": tmp_path / "weights"}[folder]
    path.mkdir(exist_ok=True)
    if folder == "weights only":
        tiny_model("llama").save_pretrained(path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w5 w9"}')
    arguments = {"generate": ["w5"], "distill": ["--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl")]}
    assert main([command, "--model", str(path), *arguments[command]]) == 2
    assert f"--model {path} holds {lacks}; give the folder holding the model and its tokenizer" in \
        capsys.readouterr().err
    assert loaded == []


@pytest.fixture(scope="module")
def heads_in_every_format(model_dir, heads_dir, tmp_path_factory):
    """The tiny model's heads as medusa_spec saves them and as convert writes vLLM's and original Medusa's layouts
    (whose config.json is the heads' own: to transformers the folder looks like a model)."""
    folders = {"medusa_spec": heads_dir}
    for fmt in ("vllm", "medusa"):
        folders[fmt] = tmp_path_factory.mktemp(fmt) / "heads"
        assert main(["convert", str(heads_dir), str(folders[fmt]), "--to", fmt, "--model", str(model_dir)]) == 0
    return folders


@pytest.mark.parametrize("fmt", ["medusa_spec", "vllm", "medusa"])
@pytest.mark.parametrize("command, flag", [
    (["generate", "w5", "--model", "{heads}"], "--model"),
    (["generate", "w5", "--model", "{model}", "--draft-model", "{heads}"], "--draft-model"),
    (["bench", "--model", "{model}", "--draft-model", "{heads}", "--methods", "draft_model"], "--draft-model"),
    (["distill", "--model", "{heads}", "--prompts", "{prompts}", "--output", "{out}"], "--model"),
], ids=["generate", "generate-draft", "bench-draft", "distill"])
def test_a_heads_folder_given_as_a_model_is_named_as_heads(model_dir, heads_in_every_format, tmp_path, loaded, capsys,
                                                          fmt, command, flag):
    """Heads in any format given where a model goes: the error says they are heads and where they go, before any
    model loads (a vLLM or original Medusa folder has a config.json, so it passed the model check)."""
    heads = heads_in_every_format[fmt]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w5 w9"}')
    fill = dict(heads=heads, model=model_dir, prompts=prompts, out=tmp_path / "out")
    assert main([word.format(**fill) for word in command]) == 2
    assert f"{flag} {heads} holds Medusa heads ({fmt} format), not a model: heads go with --heads" in \
        capsys.readouterr().err
    assert loaded == []


def test_a_model_folder_with_heads_saved_into_it_is_still_a_model(model_dir, tmp_path, capsys):
    """Heads saved beside a model's own config.json leave the folder a model."""
    import shutil

    from medusa_spec import MedusaConfig, MedusaModel

    folder = shutil.copytree(model_dir, tmp_path / "model")
    MedusaModel.from_base(tiny_model("llama"), MedusaConfig(num_heads=2)).save_heads(folder)
    assert main(["generate", "w5", "--model", str(folder), "--heads", str(folder), "--max-new-tokens", "2"]) == 0


def test_a_draft_model_folder_needs_a_model_but_no_tokenizer(model_dir, heads_dir, tmp_path, loaded, capsys):
    """The draft shares the base's tokenizer: a draft saved without one loads, a heads folder is refused."""
    draft = tmp_path / "draft"
    tiny_model("llama", seed=1).save_pretrained(draft)
    common = ["generate", "w5 w9", "--model", str(model_dir), "--max-new-tokens", "3"]  # one draft step (K = 1)
    assert main([*common, "--draft-model", str(heads_dir)]) == 2
    assert f"--draft-model {heads_dir} holds Medusa heads (medusa_spec format), not a model" in capsys.readouterr().err
    assert loaded == []
    assert main([*common, "--draft-model", str(draft)]) == 0
    assert "draft acceptance" in capsys.readouterr().err and loaded == [str(model_dir), str(draft)]


@pytest.mark.parametrize("device, cuda_devices, problem", [
    ("gpu", 0, "not a device torch knows; use cpu, cuda or cuda:N"),
    ("cuda", 0, "this PyTorch build/machine has no CUDA; use --device cpu"),
    ("cuda:3", 1, "this machine has 1 CUDA device(s); use cuda:0 to cuda:0"),
    ("meta", 0, "this PyTorch build/machine has no meta device to run a model on; use --device cpu or cuda"),
    ("mps", 0, "this PyTorch build/machine has no mps device to run a model on; use --device cpu or cuda"),
])
@pytest.mark.parametrize("command", ["generate", "distill"])
def test_a_device_torch_cannot_use_is_refused_before_the_model_loads(model_dir, tmp_path, monkeypatch, loaded,
                                                                     capsys, device, cuda_devices, problem, command):
    """--device is checked up front: torch would fail inside .to() (an AssertionError where there is no CUDA). The
    CUDA devices are faked, so the test says the same on any machine."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_devices > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda_devices)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w5 w9"}')
    arguments = {"generate": ["w5"], "distill": ["--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl")]}
    assert main([command, "--model", str(model_dir), "--device", device, *arguments[command]]) == 2
    assert f"--device {device}: {problem}" in capsys.readouterr().err
    assert loaded == []


@pytest.mark.parametrize("command, flag", [
    (["bench", "--model", "{model}", "--limit", "1", "--max-new-tokens", "2", "--methods", "hf_greedy",
      "--output", "{file}"], "--output"),
    (["train", "--model", "{model}", "--data", "{data}", "--output", "{file}"], "--output"),
    (["convert", "{heads}", "{file}", "--to", "medusa"], "dst"),
], ids=["bench", "train", "convert"])
def test_an_output_folder_that_is_a_file_is_refused_before_the_work(model_dir, heads_dir, tmp_path, loaded, capsys,
                                                                    command, flag):
    """bench, train and convert write a folder: an existing file there is refused up front, not by mkdir's
    FileExistsError once the work is done."""
    file = tmp_path / "results.json"
    file.write_text("{}")
    data = tmp_path / "conversations.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7"}]}')
    fill = dict(model=model_dir, heads=heads_dir, data=data, file=file)
    assert main([word.format(**fill) for word in command]) == 2
    assert f"{flag} {file} is a file; give a folder" in capsys.readouterr().err
    assert loaded == [] and file.read_text() == "{}"


@pytest.mark.parametrize("command, output", [
    (["bench", "--model", "{model}", "--limit", "1", "--max-new-tokens", "2", "--methods", "hf_greedy"], "{file}/sub"),
    (["distill", "--model", "{model}", "--prompts", "{prompts}"], "{file}/sub"),
    (["distill", "--model", "{model}", "--prompts", "{prompts}"], "{file}/sub.jsonl"),
    (["distill", "--model", "{model}", "--prompts", "{prompts}"], "{file}"),
], ids=["bench-under-a-file", "distill-under-a-file", "distill-file-under-a-file", "distill-folder-on-a-file"])
def test_an_output_under_a_file_is_refused_before_the_work(model_dir, tmp_path, capsys, command, output):
    """bench ran the whole benchmark and then lost it to NotADirectoryError; distill failed with FileExistsError or
    NotADirectoryError tracebacks."""
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w5 w9"}')
    fill = dict(model=model_dir, prompts=prompts, file=file)
    assert main([word.format(**fill) for word in command + ["--output", output]]) == 2
    assert re.search(rf"--output {re.escape(output.format(**fill))} (lies under {re.escape(str(file))}, which )?is a "
                     rf"file; give a folder", capsys.readouterr().err)
    assert file.read_text() == "mine"


@pytest.mark.parametrize("argv, message", [
    (["generate", "w5", "--seed", "99999999999999999999"], "--seed: must be an integer from"),
    (["bench", "--per-category", "0"], "--per-category: must be an integer >= 1, got 0"),
])
def test_flag_values_torch_or_the_prompts_would_refuse_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_a_prompts_folder_is_named_as_a_folder(model_dir, tmp_path, capsys):
    assert main(["distill", "--model", str(model_dir), "--prompts", str(tmp_path), "--output",
                 str(tmp_path / "out")]) == 2
    assert f"{tmp_path}: a folder, not a JSONL file" in capsys.readouterr().err


def test_documents_that_are_not_text_files_are_named(model_dir, tmp_path, capsys):
    (tmp_path / "binary.bin").write_bytes(b"\xa1\xff\x00")
    for path, problem in ((tmp_path, "a folder"), (tmp_path / "missing.txt", "no such file"),
                          (tmp_path / "binary.bin", "is not UTF-8 text")):
        assert main(["generate", "w5 w9", "--model", str(model_dir), "--max-new-tokens", "2", "--lookup", "3",
                     "--documents", str(path)]) == 2
        assert f"--documents {path}" in (err := capsys.readouterr().err) and problem in err


def test_a_recipe_that_is_not_json_names_the_file_and_the_fix(tmp_path, capsys):
    recipe = tmp_path / "recipe.json"
    recipe.write_text('{"train": {"num_heads": 3,}}')
    assert main(["train", "--config", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert f"{recipe} is not valid JSON" in err and "--config takes a recipe: a JSON object with one section" in err


@pytest.mark.parametrize("section, kind", [('[["epochs", 1]]', "array"), ('"epochs=1"', "string"), ("3", "number"),
                                           ("null", "null")])
@pytest.mark.parametrize("command", ["train", "distill"])
def test_a_recipe_section_that_is_not_an_object_names_the_file_and_the_section(tmp_path, capsys, section, kind,
                                                                               command):
    recipe = tmp_path / "recipe.json"
    recipe.write_text(f'{{"{command}": {section}}}')
    assert main([command, "--config", str(recipe)]) == 2
    assert f"{recipe}: the recipe's {command!r} section is a JSON {kind}, not an object; write it as" in \
        capsys.readouterr().err


def test_compile_flag_compiles_generate_and_bench(model_dir, tmp_path, capsys, monkeypatch):
    """--compile reaches MedusaModel.generate in generate and bench; bench compiles the lookup chain's blocks before
    its first timed prompt and records that it compiled."""
    import json

    from medusa_spec import MedusaModel

    calls, generate = [], MedusaModel.generate

    def recording_generate(self, input_ids, *args, **kwargs):
        calls.append((kwargs.get("compile"), set(self._compiled.shapes)))
        return generate(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(MedusaModel, "generate", recording_generate)
    assert main(["generate", "w5 w9 w11 w7", "--model", str(model_dir), "--max-new-tokens", "8", "--compare",
                 "--compile"]) == 0
    assert "identical: True" in capsys.readouterr().err and calls and all(c for c, _ in calls)
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text(json.dumps({"category": "a", "turns": ["w5 w6 w7 w5 w6"]}))
    calls.clear()
    out = tmp_path / "report"
    assert main(["bench", "--model", str(model_dir), "--prompts", str(prompts), "--max-new-tokens", "8", "--compile",
                 "--methods", "hf_greedy", "medusa_off", "medusa_lookup", "--output", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["meta"]["compile"] is True
    assert report["summary"]["overall"]["medusa_lookup"]["equal_to_reference"] == 1.0
    timed = calls[-2:]  # the prompt's two runs: every block the chain may add was compiled before them
    assert all(c for c, _ in timed) and {shape[1] for shape in timed[0][1]} >= {1, 16}


def test_generate_and_chat_speculate_with_a_dflash_draft(model_dir, tmp_path, monkeypatch, capsys):
    """--dflash DIR: the draft's blocks, not the heads, through generate_with_dflash, with --tree as its rank paths or N
    (a DynamicTree; left out: its chain); the greedy text is the base model's. Options of the heads or a draft model
    are refused."""
    import medusa_spec.cli as cli
    from medusa_spec.dflash import new_dflash, save_dflash

    base = tiny_model("llama")
    save_dflash(new_dflash(base, num_layers=1, block_size=4, aux_layer_ids=[0, 1], mask_token_id=3), tmp_path / "df")
    trees, real = [], cli.generate_with_dflash
    monkeypatch.setattr(cli, "generate_with_dflash", lambda *a, **k: trees.append(k["tree"]) or real(*a, **k))
    common = ["--model", str(model_dir), "--max-new-tokens", "8", "--dflash", str(tmp_path / "df")]
    assert main(["generate", "w5 w9 w11 w7", *common, "--compare"]) == 0
    assert "identical: True" in capsys.readouterr().err and trees == [None]
    assert main(["generate", "w5 w9 w11 w7", *common, "--tree", "[[0], [1], [0, 0]]"]) == 0
    assert trees[-1] == [[0], [1], [0, 0]]
    assert main(["generate", "w5 w9 w11 w7", *common, "--tree", "5", "--compare"]) == 0
    assert trees[-1] == DynamicTree(5) and "identical: True" in capsys.readouterr().err
    said = iter(["w5 w9 w11", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(said))
    assert main(["chat", *common]) == 0 and trees[-1] is None
    capsys.readouterr()
    for extra, named in [(["--lookup", "4"], "--lookup"), (["--draft-model", str(model_dir)], "--draft-model"),
                         (["--compile"], "--compile")]:
        assert main(["generate", "w5", *common, *extra]) == 2
        assert named in capsys.readouterr().err, extra
