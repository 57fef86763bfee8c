"""Shared by the Triton kernel tests: poisoned allocations and the pairs the oracle routes to Triton."""

import pytest
import torch

from quantpass import envs
from quantpass.kernels import oracle

triton = pytest.importorskip("triton", reason="the Triton backend tests need triton installed")

# Every (weight, activation) pair a candidate table offers the triton backend: a new row gets tested.
LINEAR_PAIRS = [pair for pair, backends in oracle.LINEAR_CANDIDATES.items() if "triton" in backends]
MOE_PAIRS = [pair for pair, backends in oracle.MOE_CANDIDATES.items() if "triton" in backends]


# The CPU tier launches kernels on CPU tensors through Triton's interpreter. conftest turns it on only
# without CUDA; on a CUDA machine these tests skip (the gpu-marked ones run there instead), unless
# TRITON_INTERPRET=1 is set by hand.
# Interpreters before Triton 3.9 differ from compiled Triton where byte-exact tests look (measured with
# 3.6.0, 2026-11-29): fp8 conversions drop the sign of zero, and tl.dot_scaled rejects the format
# strings a compiled kernel passes as constexprs. GPU runs are unaffected; the CPU tier skips.
INTERPRETER_MIN_TRITON = (3, 9)
_triton_version = tuple(int(part) for part in triton.__version__.split(".")[:2])
on_interpreter = pytest.mark.skipif(
    not envs.triton_interpret() or _triton_version < INTERPRETER_MIN_TRITON,
    reason=(
        "CPU tier: needs Triton's interpreter (TRITON_INTERPRET=1; set without CUDA)"
        if not envs.triton_interpret()
        else f"Triton {triton.__version__}'s interpreter mis-converts (signed fp8 zeros, dot_scaled formats); needs 3.9+"
    ),
)


def pair_id(pair) -> str:
    weight, activation = pair
    return f"{weight}-{activation}"


def poison_empty(monkeypatch) -> None:
    """Make `torch.empty` return all-0xFF bytes (NaN for float types, -1 / 255 for ints), so any
    output element a kernel forgets to write fails the test instead of passing as leftover zeros."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        if tensor.numel() and tensor.dtype != torch.bool:
            tensor.reshape(-1).view(torch.uint8).fill_(0xFF)
        return tensor

    monkeypatch.setattr(torch, "empty", poisoned)


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
