"""No tracked file names a path of the machine it was written on: an adapter's base model, a bench report's heads
or prompts are named as any clone can read them (a hub name, a path relative to the repository)."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# An absolute path under a machine's home or scratch folders; not a URL's path (a host name or word before the slash).
LOCAL = re.compile(r"(?<![\w.~/-])/(?:" + "|".join(("root", "home", "tmp", "work", "Users", "private/var")) + r")/")
# Text the model wrote, not paths of a machine: the distilled conversations and its own prompts.
MODEL_WRITTEN = ("training/data/smollm2-135m-instruct/",)
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()  # its examples below


def local_paths(text: str) -> list[str]:
    """Each line of `text` that names a machine-local path, numbered from 1."""
    return [f"{number}: {line.strip()[:160]}" for number, line in enumerate(text.splitlines(), start=1)
            if LOCAL.search(line)]


def tracked_text_files() -> dict[str, str]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (an installed package): no tracked files to read")
    texts = {}
    for name in listed.decode().split("\0"):
        path = ROOT / name
        # not path.is_file(): a file deleted, not yet committed.
        if not name or name == THIS_FILE or name.startswith(MODEL_WRITTEN) or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary: weights, gzipped chunks, images
        try:
            texts[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return texts


@pytest.mark.parametrize("text, found", [
    ('"base_model_name_or_path": "/root/.cache/medusa_spec/smollm2-135m-instruct"', True),
    ('"heads": "/work/main/heads/smollm2-135m-instruct"', True),
    ("GGUF=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf bash scripts/gpu_train.sh", True),
    ("see /home/alice/runs", True),
    ('"heads": "heads/smollm2-135m-instruct"', False),
    ('"prompts": "../shared/data/eval/mt_bench_question.jsonl"', False),
    ("https://example.org/home/page and training/smollm2-135m-instruct/ and ~/work/x", False),
])
def test_the_check_finds_local_paths(text, found):
    assert bool(local_paths(text)) == found


def test_no_tracked_file_names_a_local_path():
    texts = tracked_text_files()
    assert "README.md" in texts and "heads/smollm2-135m-instruct/medusa_config.json" in texts  # the check reads
    found = {name: lines for name, text in texts.items() if (lines := local_paths(text))}
    assert not found, ("machine-local paths in tracked files (name the base model by its hub name, other paths "
                       f"relative to the repository): {found}")
