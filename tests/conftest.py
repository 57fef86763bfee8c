import os

import pytest
import torch

# Triton's interpreter must be chosen before any `triton.jit` runs: without CUDA, tests run the
# real Triton kernels through it. conftest is imported before any test module imports kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (the GPU tier); skipped without one")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="GPU tier: needs a CUDA device, this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
