"""The examples run, and the README's API block is the quickstart's code."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quickstart_runs():
    # A few seconds alone; the timeout only stops a hang, with room for a machine busy with other work.
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr
    assert "identical to transformers greedy: True" in done.stdout


def readme_api_block() -> str:
    return re.search(r"## Python API\n.*?```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)


def test_readme_api_block_is_taken_from_the_quickstart():
    block = readme_api_block()
    example = {line.strip() for line in (ROOT / "examples" / "quickstart.py").read_text().splitlines()}
    stale = [line for line in block.splitlines() if line.strip() and line.strip() not in example]
    assert not stale, f"README's API block differs from examples/quickstart.py: {stale}"


def test_readme_api_block_runs_as_pasted(tmp_path):
    # Taken line by line from the quickstart is not enough: a name the quickstart defines on a line the block leaves
    # out (a `with` line) made the pasted block fail with a NameError.
    done = subprocess.run([sys.executable, "-c", readme_api_block()], capture_output=True, text=True, timeout=900,
                          cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp_path)})  # its heads folder lands here
    assert done.returncode == 0, done.stderr
