"""How a matched site is lowered: the quantpass op that replaces it, its weights' layout, verify's two sides.

`patterns/` says what a site is (its nodes, parameters, sizes); a `SiteLowering` says what the pass
does with a site of its kind, and `passes/lower.py` maps each site class to one. The pass is generic
over sites: it resolves the config by `site.fqn`, asks `choose_backend`, calls `rewrite` with one
placeholder per quantized tensor, quantizes each parameter in `site.params` and lets `prepare` lay
them out for the backend (through the weight cache, never baked into the graph), and verify compares
`run_original` with `run_quantized` on the activations that reach the site (`site.input_nodes`), or
on `sample_inputs` where those can't be had. Lowerings hold no state: one instance serves every site.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.fx as fx

from ..kernels.oracle import Capability, Selection, select
from ..patterns.site import Site
from ..quant_registry.qtensor import QTensor
from ..quant_registry.spec import QuantSpec


class SiteLowering(ABC):
    def weight_count(self, site: Site) -> int:
        """QTensors the rewritten op takes (what `prepare` returns)."""
        return 1

    def signature(self, site: Site) -> tuple:
        """Anything besides (spec, backend, transposes) that changes `prepare`'s result."""
        return ()

    def choose_backend(
        self, site: Site, spec: QuantSpec, capability: Capability, named: str
    ) -> tuple[QuantSpec, Selection]:
        """(the spec this site applies, the backend that runs it): the oracle's pick for `site.kind` unless
        a site runs its math some other way (the graph's own GEMMs on dequantized weights: weight-only)."""
        return spec, select(site.kind, spec.weight, spec.activation, capability, site.problem, named)

    @abstractmethod
    def prepare(self, site: Site, weights: list[QTensor], spec: QuantSpec, backend: str) -> list[QTensor]:
        """Each parameter quantized with `spec.weight` (`[..., N, K]`, formats.py's layout) -> the
        `weight_count` QTensors the rewritten op takes, in `backend`'s layout (cached by the caller)."""

    @abstractmethod
    def rewrite(
        self,
        site: Site,
        graph: fx.Graph,
        weights: list[list[fx.Node | None]],
        spec: QuantSpec,
        backend: str,
        device_type: str,
        differentiable: bool = False,
    ) -> fx.Node:
        """Replace the site's computation; `weights[i]` = [data, scale, scale2, input_scale] nodes of the
        i-th QTensor `prepare` returns. `differentiable`: grad mode is on (use ops with a backward).
        Returns the node that now stands for `site.output_node`."""

    @abstractmethod
    def sample_inputs(self, site: Site, like: torch.Tensor | None, device, dtype) -> list[torch.Tensor]:
        """Inputs for verify (activations only; parameters come from `run_*`'s `values`)."""

    @abstractmethod
    def run_original(self, site: Site, inputs: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        """The site's unquantized computation on `inputs`, with its parameters' `values`."""

    @abstractmethod
    def run_quantized(
        self, site: Site, inputs: list[torch.Tensor], weights: list[QTensor], spec: QuantSpec, backend: str,
        device_type: str,
    ) -> torch.Tensor:  # fmt: skip
        """The op `rewrite` emits, called eagerly on `inputs` with the prepared `weights`."""
