"""The quantize pass: find sites, resolve the config, ask the oracle, rewrite a copy of the graph.

Quantized weights become new graph inputs (placeholders appended after Dynamo's); each
`Binding` tells the runtime wrapper how to produce them from the parameters passed on each call,
through the weight cache. Nothing quantized is baked into the graph.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..kernels.oracle import Capability, NoKernelError
from ..patterns.linear import find_linear_sites
from ..patterns.site import Site
from ..plan import Plan, PlanRow
from ..quant_registry.qtensor import QTensor
from ..quant_registry.spec import QuantizationConfig, QuantSpec
from ..weight_cache import WEIGHTS
from .fx_utils import add_placeholders, copy_graph_module, eliminate_dead_code

logger = logging.getLogger("quantpass")

PROGRESS_MIN_SITES = 200  # show a progress bar when quantizing at least this many sites


@dataclass
class QuantizedSite:
    site: Site
    spec: QuantSpec
    backend: str
    device_type: str
    row: PlanRow
    binding: Binding | None = None


@dataclass
class Binding:
    """How the runtime wrapper builds one site's extra graph inputs from the call's parameters."""

    param_indices: tuple[int, ...]
    token: int  # WEIGHTS.intern((site type, spec pair, backend, layout)): what is built
    build: Callable[[list[torch.Tensor]], tuple[list[QTensor], list[torch.Tensor]]]

    def tensors(self, args) -> list[torch.Tensor]:
        return WEIGHTS.get([args[i] for i in self.param_indices], self.token, self.build)[1]

    def qtensors(self, args) -> list[QTensor]:
        return WEIGHTS.get([args[i] for i in self.param_indices], self.token, self.build)[0]


@dataclass
class PassResult:
    graph_module: fx.GraphModule | None
    plan: Plan
    sites: list[QuantizedSite] = field(default_factory=list)
    extra_inputs: list[torch.Tensor] = field(default_factory=list)


def find_sites(graph: fx.Graph, example_inputs) -> tuple[list[Site], list[PlanRow]]:
    """MoE sites first (their regions are claimed), then linear sites outside them."""
    try:
        from ..patterns.moe import find_moe_sites
    except ImportError:  # MoE recognition not available: every matmul is a linear candidate
        moe_sites, claimed, expert_linears, rows = [], set(), {}, []
    else:
        matches = find_moe_sites(graph, example_inputs)
        moe_sites, claimed, expert_linears = matches.sites, matches.claimed, matches.expert_linears
        moe_sites = [*moe_sites, *matches.expert_gemms]  # unproven experts: quantized GEMM by GEMM
        rows = [
            PlanRow(fqn, "moe", None, None, None, f"left to the linear pass: {why}") for fqn, why in matches.unproven
        ]
    return [*moe_sites, *find_linear_sites(graph, example_inputs, claimed, expert_linears)], rows


def plan_sites(sites, example_inputs, config: QuantizationConfig, grad_enabled: bool) -> list[QuantizedSite | PlanRow]:
    """Decide every site: a QuantizedSite, or a PlanRow saying why it is left alone."""
    decided = []
    for site in sites:
        config_kind = getattr(site, "config_kind", site.kind)
        left = lambda reason, s=site: PlanRow(s.fqn, s.kind, None, None, None, reason)  # noqa: E731
        if site.skip_reason:
            decided.append(left(site.skip_reason))
            continue
        spec, why = config.resolve_with_reason(site.fqn, config_kind)
        default_ignore = getattr(site, "default_ignore", None)
        if spec is not None and default_ignore and not config.matches_target(site.fqn):
            decided.append(left(f"{default_ignore}: left alone by default (name it in targets to quantize)"))
            continue
        if spec is None:
            decided.append(left(why))
            continue
        values = [example_inputs[p.index] for p in site.params]
        if grad_enabled and any(v.requires_grad for v in values):
            decided.append(left("weight requires grad with grad mode on: quantpass is for inference (use no_grad)"))
            continue
        capability = Capability.detect(values[0].device)
        try:
            spec, selection = site.choose_backend(spec, capability, config.backend_for(site.kind))
        except NoKernelError as e:
            raise NoKernelError(f"layer {site.fqn!r}: {e}") from None
        notes = "".join(f"; {note}" for note in site.notes)
        row = PlanRow(
            site.fqn,
            site.kind,
            str(spec.weight),
            None if spec.activation is None else str(spec.activation),
            selection.backend,
            f"{why}: {selection.reason}{notes}",
            dict(selection.rejected),
            format=spec.name(),
        )
        decided.append(QuantizedSite(site, spec, selection.backend, capability.device, row))
    return decided


def _binding(q: QuantizedSite) -> Binding:
    site, spec, backend = q.site, q.spec, q.backend

    def build(values):
        qtensors = site.quantize(values, spec, backend)
        return qtensors, [t for qt in qtensors for t in qt.tensors() if t is not None]

    token = (type(site).__name__, spec.pair, backend, tuple(p.transposed for p in site.params), site.signature())
    return Binding(tuple(p.index for p in site.params), WEIGHTS.intern(token), build)


def quantize_graph(
    gm: fx.GraphModule, example_inputs, config: QuantizationConfig, grad_enabled: bool, plan_only: bool = False
) -> PassResult:
    new_gm = copy_graph_module(gm)  # sites are found on (and rewrite) the copy
    sites, rows = find_sites(new_gm.graph, example_inputs)
    decided = plan_sites(sites, example_inputs, config, grad_enabled)
    plan = Plan(rows + [d.row if isinstance(d, QuantizedSite) else d for d in decided])
    chosen = [d for d in decided if isinstance(d, QuantizedSite)]
    if plan_only or not chosen:
        return PassResult(None, plan)
    extra_inputs = []
    progress = _progress(len(chosen))
    for q in chosen:
        q.binding = _binding(q)
        tensors = q.binding.tensors(example_inputs)
        qtensors = q.binding.qtensors(example_inputs)
        q.row.bytes = sum(qt.nbytes for qt in qtensors)
        q.row.original_bytes = sum(example_inputs[p.index].nbytes for p in q.site.params)
        names = [f"quantpass_{q.site.fqn.replace('.', '_')}_{i}" for i in range(len(tensors))]
        nodes = iter(add_placeholders(new_gm.graph, names, tensors))
        weights = [[next(nodes), next(nodes), next(nodes) if qt.scale2 is not None else None] for qt in qtensors]
        q.site.rewrite(new_gm.graph, weights, q.spec, q.backend, q.device_type)
        extra_inputs.extend(tensors)
        progress.update()
    progress.close()
    eliminate_dead_code(new_gm.graph)
    new_gm.graph.lint()
    new_gm.recompile()
    return PassResult(new_gm, plan, chosen, extra_inputs)


class _NoProgress:
    def update(self):
        pass

    def close(self):
        pass


def _progress(total: int):
    if total < PROGRESS_MIN_SITES:
        return _NoProgress()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="quantpass: quantizing weights", unit="site")
