"""`QuantizePass`: the pass object the backend holds (quantize + verify), and its identity for caches."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

from ..quant_registry.spec import QuantizationConfig
from .quantize import PassResult, quantize_graph

PACKAGE = Path(__file__).resolve().parents[1]
SOURCE_SUFFIXES = (".py", ".c", ".cpp", ".h")


@functools.cache
def source_hash() -> str:
    """sha256 of every quantpass source file: patterns, passes and kernels all shape the graph (the C++
    graph op's schema and tags too, so its sources count)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in PACKAGE.rglob("*") if p.suffix in SOURCE_SUFFIXES):
        digest.update(path.relative_to(PACKAGE).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


class QuantizePass:
    """Find sites, rewrite a copy of the graph, quantize and verify. `uuid()` covers source and config."""

    def __init__(self, config: QuantizationConfig, verify=True, keep_original_weights=False, requantize=False):
        self.config = config
        self.verify = verify
        self.keep_original_weights = keep_original_weights
        self.requantize = requantize
        self.verified: set[tuple] = set()  # kinds of site already verified: a recompile doesn't redo them

    def uuid(self) -> str:
        flags = (self.verify, self.keep_original_weights, self.requantize)
        token = f"{source_hash()}|{self.config.to_json()}|flags={flags}"
        return hashlib.sha256(token.encode()).hexdigest()

    def __call__(self, gm, example_inputs, plan_only: bool = False) -> PassResult:
        grad = torch.is_grad_enabled()
        return quantize_graph(
            gm, example_inputs, self.config, grad, plan_only,
            self.verify, self.keep_original_weights, self.verified, self.requantize,
        )  # fmt: skip
