"""scripts/gpu_check.py, the prepared GPU check, in the parts a CPU can run: its verify timing on a tiny model
(--device cpu), its refusal without CUDA, and the device wait its timing relies on; on CUDA, the timing itself."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from medusa_spec import autotree

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_verify_timing_on_a_tiny_model_on_cpu(tmp_path, capsys):
    gpu_check = load_gpu_check()
    rows = gpu_check.time_verify(gpu_check.random_model("tiny", "cpu", torch.float32), [1, 4, 8], context=16,
                                 repeats=1)
    assert [row["nodes"] for row in rows] == [1, 4, 8]
    assert rows[0]["verify_vs_smallest"] == 1.0 and all(row["verify_ms"] > 0 and row["draft_ms"] > 0 for row in rows)
    assert gpu_check.main(["--device", "cpu", "--shape", "tiny", "--dtype", "float32", "--skip-tests", "--sizes", "1",
                           "2", "--context", "16", "--repeats", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [row["nodes"] for row in report["rows"]] == [1, 2] and report["config"]["hidden_size"] == 64
    assert "| 2 |" in (tmp_path / "gpu_check.md").read_text() and "| nodes |" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refuses_without_cuda_with_a_message(tmp_path, capsys):
    assert load_gpu_check().main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device here" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_step_timing_waits_for_the_device(monkeypatch):
    """A CUDA op returns once queued: --tree auto's and the GPU check's timing waits for the device around each run."""
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: events.append("wait"))
    autotree._fastest_seconds({4: lambda: events.append("run")}, 2, torch.device("cuda"))
    assert events == ["wait", "run", "wait"] * 2


@pytest.mark.cuda
def test_verify_timing_on_cuda():
    gpu_check = load_gpu_check()
    rows = gpu_check.time_verify(gpu_check.random_model("tiny", "cuda", torch.bfloat16), [1, 4], context=32,
                                 repeats=2)
    assert [row["nodes"] for row in rows] == [1, 4] and all(row["verify_ms"] > 0 for row in rows)
