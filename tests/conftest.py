import os

import pytest
import torch

# Triton's interpreter must be chosen before any `triton.jit` runs: without CUDA, tests run the
# real Triton kernels through it. conftest is imported before any test module imports kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (the GPU tier); skipped without one")
    config.addinivalue_line("markers", "slow: more of a matrix the default tier samples (make test-slow)")
    # quantpass filters this torch warning itself (weight_cache.py: its forward pre-hook is global),
    # but pytest resets warning filters per test
    config.addinivalue_line("filterwarnings", "ignore:Using `torch.compile\\(module\\)` when there are global hooks")


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


@pytest.fixture(params=["avx2", "aten"])
def int4_kernel(request, monkeypatch):
    """Runs a cpu-backend test on quantpass's kernels (where they build) and on aten's."""
    from quantpass.kernels import cpu_avx2

    if request.param == "aten":
        monkeypatch.setattr(cpu_avx2, "available", lambda: (False, "turned off by the test"))
    elif not cpu_avx2.available()[0]:
        pytest.skip(f"quantpass's CPU kernels can't run here: {cpu_avx2.available()[1]}")
    return request.param
