"""Tests marked `cuda` (pyproject's markers) need a CUDA device: without one they are skipped, and
scripts/gpu_check.py runs them (`pytest -m cuda`) where there is one."""

import os

import pytest
import torch

# Step costs are timed in each test, never read from or written to the user's cache: tests that count the timing
# would otherwise see another test's costs (test_cost_cache turns the files on in a folder of its own).
os.environ["MEDUSA_SPEC_STEP_COSTS"] = "0"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (scripts/gpu_check.py runs these where there is one)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
