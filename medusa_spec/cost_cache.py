"""Step costs kept on disk, so that a new process (a CLI command, a fresh MedusaModel) does not time them again.

generate(tree=None) prices its trees with verify and drafting seconds timed on this machine (autotree.StepCosts): a
few seconds at the first call, as long as the call itself on a small CPU. They depend on the machine, the base
model's architecture and dtype, the heads' config and this code, not on the weights' values or the text: one file
per such key under cache_root()/step_costs, as torch's inductor keeps compiled kernels. MEDUSA_SPEC_STEP_COSTS=0
turns the files off (timed in every process, as before); delete the folder to time again, e.g. after a change of
the machine's load the key cannot see. The folder keeps the KEEP_FILES most recently written files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import tempfile
import warnings
from pathlib import Path

import torch
import transformers

from .base import model_device_dtype
from .default_model import cache_root

SWITCH = "MEDUSA_SPEC_STEP_COSTS"
# Files kept: each change of the code, the heads' config or the machine writes a new one, and the old ones would pile
# up; past this many, the least recently written go (a few KB each: room for every recent heads x dtype x kind).
KEEP_FILES = 64


def costs_file(mm, dynamic: bool) -> Path | None:
    """The file that keeps `mm`'s step costs of this kind (eagle heads' dynamic trees, or static trees) on this
    machine; None where the files are off."""
    if os.environ.get(SWITCH, "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    device, dtype = model_device_dtype(mm.base_model)
    key = {"device": device_name(device), "threads": torch.get_num_threads(), "dtype": str(dtype),
           "dynamic": dynamic, "torch": torch.__version__, "transformers": transformers.__version__,
           "code": source_digest(), "spec": repr(mm.spec),
           "base": mm.base_model.config.to_dict(), "heads": dataclasses.asdict(mm.config)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return cache_root() / "step_costs" / f"{digest}.json"


def device_name(device: torch.device) -> str:
    """The processor that runs the steps: a CUDA device's name, else the CPU's model name (Linux) or platform's."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    if device.type != "cpu":
        return device.type
    try:
        with open("/proc/cpuinfo") as info:
            names = [line.split(":", 1)[1].strip() for line in info if line.startswith("model name")]
        return f"cpu:{names[0]} x{len(names)}" if names else f"cpu:{platform.processor()}"
    except OSError:
        return f"cpu:{platform.processor() or platform.machine()}"


def source_digest() -> str:
    """A digest of this package's Python sources: costs timed by other code are not reused (the version number does
    not change with every commit)."""
    package = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def read(path: Path | None) -> dict | None:
    """The costs kept in `path`, or None where there are none (or the file is unreadable: they are timed again)."""
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write(path: Path | None, costs: dict) -> None:
    """Keep `costs` in `path`, written whole or not at all (a temporary file renamed over it); a folder that cannot
    be written only warns: the costs are then timed again in the next process."""
    if path is None:
        return
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(handle, "w") as file:
            json.dump(costs, file)
        os.replace(temporary, path)
        prune(path.parent, keep=path)
    except OSError as error:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
        warnings.warn(f"could not keep the step costs in {path} ({error}); they will be timed again in the next "
                      f"process. Set {SWITCH}=0 to stop trying, or MEDUSA_SPEC_CACHE to a writable folder",
                      stacklevel=3)


def prune(folder: Path, keep: Path) -> None:
    """Delete the cost files of `folder` past the KEEP_FILES most recently written, never `keep` (just written)."""
    def written(path: Path) -> float:
        try:
            return path.stat().st_mtime
        except OSError:  # deleted by another process meanwhile
            return float("-inf")

    files = sorted(folder.glob("*.json"), key=written, reverse=True)
    for old in files[KEEP_FILES:]:
        if old != keep:
            old.unlink(missing_ok=True)
