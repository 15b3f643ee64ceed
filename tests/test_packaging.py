"""What an installed package needs at run time ships inside it: the default heads, the benchmark prompts."""

import hashlib
import subprocess
from pathlib import Path

import pytest
import tomllib

from medusa_spec import bench, default_model
from medusa_spec.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_listed_in_pyproject():
    # pyproject lists packages by name (one is mapped from heads/), so a new subpackage must be added there.
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "medusa_spec").rglob("__init__.py")}
    assert found - listed == set(), "add these packages to [tool.setuptools] packages in pyproject.toml"


def test_shipped_heads_are_found_through_the_package():
    folder = default_model.shipped_heads()
    assert folder.resolve() == (ROOT / "heads" / default_model.MODEL_NAME).resolve()
    assert all((folder / name).is_file() for name in default_model.HEAD_FILES)


def test_incomplete_heads_name_the_folder_and_the_fix(monkeypatch):
    monkeypatch.setattr(default_model, "MODEL_NAME", "no-such-model")
    with pytest.raises(FileNotFoundError, match="no-such-model lacks medusa_config.json.*reinstall medusa_spec"):
        default_model.shipped_heads()


def test_bench_defaults_to_the_shipped_mt_bench():
    args = build_parser().parse_args(["bench"])
    assert [Path(spec) for spec in args.prompts] == [bench.MT_BENCH]
    assert bench.MT_BENCH.is_relative_to(ROOT / "medusa_spec")
    prompts = bench.read_eval_prompts(args.prompts, per_category=1)
    assert len(prompts) == 8 and len({category for category, _ in prompts}) == 8
    assert "Apache-2.0" in (bench.MT_BENCH.parent / "SOURCE.md").read_text()
    assert (bench.MT_BENCH.parent / "NOTICE").is_file()  # each eval dataset's licence and attribution, in the wheel


def test_one_copy_of_each_adapter():
    # git keeps every version of a binary file forever, so weights committed twice cost every clone twice: an adapter
    # lives in one folder (heads/ for the shipped ones), and runs that train on it read it from there.
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "*.safetensors", "*.pt", "*.bin"], cwd=ROOT,
                                capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no tracked files to compare")
    by_digest = {}
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            by_digest.setdefault(hashlib.sha256((ROOT / name).read_bytes()).hexdigest(), []).append(name)
    twice = [names for names in by_digest.values() if len(names) > 1]
    assert not twice, f"the same weights are tracked more than once: {twice}; keep one copy"
