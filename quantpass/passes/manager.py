"""The pass manager: run quantize (+ verify) and give the passes' identity for caches."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

from ..quant_registry.spec import QuantizationConfig
from .quantize import PassResult, quantize_graph
from .verify import verify_sites

PACKAGE = Path(__file__).resolve().parents[1]


@functools.cache
def source_hash() -> str:
    """sha256 of every quantpass source file: patterns, passes and kernels all shape the graph."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(path.relative_to(PACKAGE).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


class QuantizePass:
    """Find sites, rewrite a copy of the graph, verify it. `uuid()` covers source and config."""

    def __init__(self, config: QuantizationConfig, verify: bool = True):
        self.config = config
        self.verify = verify

    def uuid(self) -> str:
        token = f"{source_hash()}|{self.config.to_json()}|verify={self.verify}"
        return hashlib.sha256(token.encode()).hexdigest()

    def __call__(self, gm, example_inputs, plan_only: bool = False) -> PassResult:
        result = quantize_graph(gm, example_inputs, self.config, torch.is_grad_enabled(), plan_only)
        if self.verify and result.sites:
            verify_sites(result.sites, example_inputs)
        return result
