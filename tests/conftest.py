"""Tests marked `cuda` (pyproject's markers) need a CUDA device: without one they are skipped, and
scripts/gpu_check.py runs them (`pytest -m cuda`) where there is one."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (scripts/gpu_check.py runs these where there is one)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
