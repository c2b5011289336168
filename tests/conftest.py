"""Shared pytest setup: GPU tests are skipped where no CUDA device exists."""

import os

import pytest
import torch

# Keep CPU tests deterministic and within the 2-core CI machine.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
