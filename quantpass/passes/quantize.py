"""The quantize pass: find sites, resolve the config, ask the oracle, rewrite a copy of the graph.

Quantized weights become new graph inputs (placeholders appended after Dynamo's); each `Binding`
tells the runtime wrapper how to produce them from the parameters passed on each call, through
the weight cache. Nothing quantized is baked into the graph. Order of work (docs/design.md §2):

1. decide every site (plan), 2. rewrite them all (placeholders without values yet), 3. quantize
one site at a time in the order the graph runs them, verifying each kind of site on the
activations that really reach it (build.py runs Dynamo's graph alongside), and release each
original parameter once the last site that reads it is done: peak memory stays near the
unquantized model plus one layer.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..distributed import adapt_sites, check_shards, local_tensor, normalize
from ..kernels.ops import op_tensors
from ..kernels.oracle import Capability, NoKernelError
from ..patterns.fx_match import is_reshape, op_name, reaches
from ..patterns.grouped_linear import GroupedLinearSite
from ..patterns.linear import find_linear_sites, picks_experts
from ..patterns.site import ParamRef, Site, param_refs
from ..plan import Plan, PlanRow
from ..quant_registry.formats import dequantize, quantize
from ..quant_registry.keys import needs_input_scale
from ..quant_registry.names import Kind
from ..quant_registry.qtensor import QTensor
from ..quant_registry.spec import QuantizationConfig, QuantSpec
from ..weight_cache import WEIGHTS
from .build import build_and_verify
from .frame_names import embedding_weights, name_from_the_model
from .fx_utils import add_placeholders, copy_graph, eliminate_dead_code, set_placeholder_values, state_changes
from .lower import lowering_for
from .lower_site import SiteLowering

logger = logging.getLogger("quantpass")


@dataclass
class QuantizedSite:
    site: Site
    spec: QuantSpec
    backend: str
    device_type: str
    row: PlanRow
    binding: Binding | None = None
    probe: tuple[list[fx.Node], fx.Node] | None = None  # (input nodes, output node) in Dynamo's graph

    @property
    def lowering(self) -> SiteLowering:
        return lowering_for(self.site)


@dataclass(eq=False)
class Binding:
    """How the runtime wrapper builds one site's extra graph inputs from the call's parameters.
    Sites that read the same parameters the same way (a linear called twice) share one."""

    param_indices: tuple[int, ...]
    token: int  # WEIGHTS.intern((site type, spec pair, backend, layout)): what is built
    build: Callable[[list[torch.Tensor]], tuple[list[QTensor], list[torch.Tensor]]] | None = None
    nodes: list[fx.Node] = field(default_factory=list)  # its placeholders in the rewritten graph
    release: tuple[bool, ...] = ()  # per parameter: its storage may be freed once quantized
    deferred: bool = True  # during the pass build.py releases (after the last site); later, build() does

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
    bindings: list[Binding] = field(default_factory=list)  # one per distinct set of extra inputs, in order
    raw_params: list[int] = field(default_factory=list)  # parameter inputs the graph still reads unquantized


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
            PlanRow(fqn, Kind.MOE, None, None, None, f"left to the linear pass: {why}") for fqn, why in matches.unproven
        ]
    routing = {n for site in moe_sites for n in (getattr(site, "topk_ids", None), getattr(site, "topk_weights", None))}
    linears = find_linear_sites(graph, example_inputs, claimed, expert_linears, routing - {None}, embedding_weights())
    held = {ref.index for site in moe_sites for ref in site.params}  # experts' 3-D weights: never grouped linears
    sites = [*moe_sites, *(s for s in linears if not (isinstance(s, GroupedLinearSite) and s.weight.index in held))]
    return adapt_sites(sites, example_inputs), rows + _unmatched_expert_weights(graph, example_inputs, sites)


BATCHED_MATMULS = {torch.bmm, torch.matmul, operator.matmul, torch.baddbmm, torch.einsum}


def _unmatched_expert_weights(graph: fx.Graph, example_inputs, sites: list[Site]) -> list[PlanRow]:
    """A row for each 3-D parameter a batched matmul reads (through a few views or casts) that no site holds
    (say, a matmul rather than a bmm on it): such weights were missing from the plan, silently. In a
    graph that picks no experts it is no expert weight (XLNet's `einsum("ibh,hnd->ibnd", x, q)`
    projections were counted as MoE layers of a dense model): a linear's row."""
    held = {ref.index for site in sites for ref in site.params}
    routed = any(picks_experts(node) for node in graph.nodes)
    rows = []
    for node, ref in param_refs(graph, example_inputs).items():
        if ref.index in held or example_inputs[ref.index].dim() != 3:
            continue
        reader = reaches(node, lambda u: u.target in BATCHED_MATMULS, 3, is_reshape)  # a conv's output is no weight
        if reader is None:
            continue
        if routed:
            reason = "3-D weight of a batched matmul outside the MoE forms quantpass recognises: left unquantized"
            rows.append(PlanRow(ref.name, Kind.MOE, None, None, None, reason))
            continue
        equation = reader.args[0]
        form = op_name(reader) + (f" {equation!r}" if isinstance(equation, str) else "")
        reason = f"3-D weight read by {form} in a graph that routes no experts: no linear form quantpass knows"
        rows.append(PlanRow(ref.name, Kind.LINEAR, None, None, None, f"{reason}; left unquantized"))
    return rows


def _value(node) -> torch.Tensor | None:
    value = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def declared_spec(site: Site, example_inputs):
    """(QuantSpec, source) the site's weights were declared with (a pre-quantized checkpoint), or None."""
    found = {WEIGHTS.declared(example_inputs[p.index]) for p in site.params}
    if len(found) > 1:
        specs = ", ".join(sorted(str(None if f is None else f[0].name()) for f in found))
        raise ValueError(
            f"layer {site.fqn!r}: its weights come quantized differently ({specs}); quantpass can't mix them"
        )
    return found.pop() if found else None


def plan_sites(
    sites, example_inputs, config: QuantizationConfig, grad_enabled: bool, requantize: bool = False
) -> list[QuantizedSite | PlanRow]:
    """Decide every site: a QuantizedSite, or a PlanRow saying why it is left alone."""
    decided = []
    for site in sites:
        left = lambda reason, s=site: PlanRow(s.fqn, s.kind, None, None, None, reason)  # noqa: E731
        if site.skip_reason:
            decided.append(left(site.skip_reason))
            continue
        declared = declared_spec(site, example_inputs)
        spec, why = config.resolve_with_reason(site.fqn, site.config_kind, *(declared or ()), requantize=requantize)
        if spec is not None and site.default_ignore and not config.matches_target(site.fqn) and declared is None:
            decided.append(left(f"{site.default_ignore}: left alone by default (name it in targets to quantize)"))
            continue
        if spec is None:
            noted = (WEIGHTS.source(example_inputs[p.index]) for p in site.params if declared is None)
            decided.append(left(next(filter(None, noted), why)))  # a checkpoint's unquantized layer says so
            continue
        activation = _value(site.input_nodes[0]) if site.input_nodes else None
        if activation is not None and not activation.is_floating_point():
            decided.append(left(f"its input is {activation.dtype}, not floating point (eager raises on it too)"))
            continue
        values = [example_inputs[p.index] for p in site.params]
        capability = Capability.detect(values[0].device)
        try:
            spec, selection = lowering_for(site).choose_backend(site, spec, capability, config.backend_for(site.kind))
        except NoKernelError as e:
            raise NoKernelError(f"layer {site.fqn!r}: {e}") from None
        notes = "".join(f"; {note}" for note in [*site.notes, *check_shards(site, values, spec)])
        if grad_enabled and any(v.requires_grad for v in values):
            notes += "; weight requires grad: inputs get gradients through the dequantized weight, the weight none"
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


def quantized_weight(param: torch.Tensor, ref: ParamRef, spec: QuantSpec) -> QTensor:
    """`param` quantized with `spec.weight` in `[..., N, K]` layout: its kept canonical value when it
    has one (a released parameter, a checkpoint's tensors), else quantized from its data."""
    key = (spec.weight, ref.transposed)
    found = WEIGHTS.canonical(param, key)
    if found is not None:
        return found
    if WEIGHTS.is_released(param):  # only another format's value is left: go through its dequantized values
        (other_key, transposed), other = next(iter(WEIGHTS.record(param).canonical.items()))
        logger.warning(
            "quantpass: %s was released after quantizing to %s; quantizing it to %s from those dequantized values",
            ref.name, other_key, spec.weight,
        )  # fmt: skip
        dense = dequantize(other)
        dense = dense if transposed == ref.transposed else dense.transpose(-2, -1)
        return quantize(dense.contiguous(), spec.weight, name=ref.name)
    return quantize(ref.matrix(param.detach()).contiguous(), spec.weight, name=ref.name)


def quantize_site(site: Site, params: list[torch.Tensor], spec: QuantSpec, backend: str) -> list[QTensor]:
    """A site's weights as its rewritten op takes them: each parameter quantized, then prepared."""
    weights = [quantized_weight(p, ref, spec) for p, ref in zip(params, site.params)]
    return lowering_for(site).prepare(site, weights, spec, backend)


def _binding(q: QuantizedSite) -> Binding:
    site, spec, backend, lowering = q.site, q.spec, q.backend, q.lowering
    transposes = tuple(p.transposed for p in site.params)
    token = (type(site).__name__, spec.pair, backend, transposes, lowering.signature(site))
    binding = Binding(tuple(p.index for p in site.params), WEIGHTS.intern(token))

    def build(params):
        weights = [quantized_weight(p, ref, spec) for p, ref in zip(params, site.params)]
        qtensors = lowering.prepare(site, weights, spec, backend)
        for param, ref, weight, release in zip(params, site.params, weights, binding.release):
            if release:  # the source for restoring and for other layouts once its storage is freed
                WEIGHTS.set_canonical(param, (spec.weight, ref.transposed), weight, spec.activation)
                if not binding.deferred:  # another instance through this graph, new data: free it now
                    WEIGHTS.release(param)
        return qtensors, [t for qt in qtensors for t in op_tensors(qt, spec, site.fqn) if t is not None]

    binding.build = build
    return binding


def _rewrite(graph: fx.Graph, chosen: list[QuantizedSite], differentiable: bool) -> list[Binding]:
    """Replace every chosen site by its quantized op; weights arrive through new placeholders."""
    bindings: dict[tuple, Binding] = {}
    replaced: dict[fx.Node, fx.Node] = {}
    for q in chosen:
        binding = _binding(q)
        binding = bindings.setdefault((binding.param_indices, binding.token), binding)
        has_scale2, static = q.spec.weight.scale2 is not None, needs_input_scale(q.spec.activation)
        if not binding.nodes:
            slots = 2 + has_scale2 + static  # data, scale (, scale2) (, input_scale)
            count = q.lowering.weight_count(q.site) * slots
            names = [f"quantpass_{q.site.fqn.replace('.', '_')}_{i}" for i in range(count)]
            binding.nodes = add_placeholders(graph, names)
        q.binding = binding
        nodes = iter(binding.nodes)
        present = (True, True, has_scale2, static)
        weights = [[next(nodes) if p else None for p in present] for _ in range(q.lowering.weight_count(q.site))]
        q.site.remap(replaced)
        old = q.site.output_node
        replaced[old] = q.lowering.rewrite(q.site, graph, weights, q.spec, q.backend, q.device_type, differentiable)
    return list(bindings.values())


def _raw_params(graph: fx.Graph, example_inputs) -> list[int]:
    """Indices of the parameter inputs the graph reads as they are (not through a quantized site)."""
    return sorted({ref.index for node, ref in param_refs(graph, example_inputs).items() if node.users})


def quantize_graph(
    gm: fx.GraphModule,
    example_inputs,
    config: QuantizationConfig,
    grad_enabled: bool,
    plan_only: bool = False,
    verify: bool = True,
    keep_original_weights: bool = False,
    verified: set | None = None,
    requantize: bool = False,
) -> PassResult:
    gm = normalize(gm, example_inputs)  # a sharded model's layers spelled on local tensors (a copy)
    new_gm, copies = copy_graph(gm)  # sites are found on (and rewrite) the copy
    sites, rows = find_sites(new_gm.graph, example_inputs)
    refs = param_refs(new_gm.graph, example_inputs).values()
    frame = name_from_the_model(sites, rows, example_inputs, config, {r.index: r.name for r in refs})  # in the model
    decided = plan_sites(sites, example_inputs, config, grad_enabled, requantize)
    read = [(f"{frame}." if frame else "") + ref.name for ref in refs]
    plan = Plan(rows + [d.row if isinstance(d, QuantizedSite) else d for d in decided], [frame] if frame else [], read)
    chosen = [d for d in decided if isinstance(d, QuantizedSite)]
    if plan_only or not chosen:
        return PassResult(None, plan, raw_params=_raw_params(gm.graph, example_inputs))
    originals = {copy: original for original, copy in copies.items()}
    for q in chosen:  # where verify finds each site's activations in Dynamo's graph
        q.probe = ([originals[n] for n in q.site.input_nodes], originals[q.site.output_node])
    state = state_changes(new_gm.graph)
    bindings = _rewrite(new_gm.graph, chosen, differentiable=grad_enabled)
    eliminate_dead_code(new_gm.graph, keep=state)
    raw = set(_raw_params(new_gm.graph, example_inputs))
    for binding in bindings:
        binding.release = tuple(not keep_original_weights and i not in raw for i in binding.param_indices)
    build_and_verify(gm, example_inputs, chosen, verify, verified)
    for binding in bindings:
        binding.deferred = False
    extra_inputs = []
    for binding in bindings:
        tensors = binding.tensors(example_inputs)
        set_placeholder_values(new_gm.graph, binding.nodes, tensors)
        extra_inputs.extend(tensors)
    for q in chosen:
        q.row.bytes = sum(qt.nbytes for qt in q.binding.qtensors(example_inputs))
        q.row.original_bytes = sum(_nbytes(example_inputs[p.index]) for p in q.site.params)
    new_gm.graph.lint()
    new_gm.recompile()
    return PassResult(new_gm, plan, chosen, extra_inputs, bindings, sorted(raw))


def _nbytes(tensor: torch.Tensor) -> int:
    tensor = local_tensor(tensor)  # a sharded weight: this rank's shard
    return tensor.numel() * tensor.element_size()  # not the storage's: a released one holds none
