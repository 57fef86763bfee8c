"""MoE sites: the experts of each MoE layer in a Dynamo graph, replaced by one `quantpass::fused_moe`.

`find_moe_sites` anchors on matmuls with a 3-D parameter operand (`_grouped_mm` /
`transformers::grouped_mm_fallback`, `bmm` or `einsum` on `W[ids]`), groups them by the top-k
expert ids they are routed by, and proves each group's region with the interpreter of
`moe_interpreter` — everything is read from the graph (shapes, ops, constants), never from class
names. Routing (softmax/sigmoid, top-k, renormalisation, group top-k, scaling) stays in the
graph: a site starts where `hidden` [T, H], `topk_weights` and `topk_ids` [T, k] enter the experts.
A group that can't be proven is not left unquantized: its 3-D weights become an `ExpertGemmSite`
(`moe_expert_gemms`), quantized weight-only under the graph's own expert matmuls. ModuleList
experts (one `nn.Linear` per expert) can't be proven fused: their weights are listed in
`expert_linears` so the linear pass quantizes them with the `moe` spec.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..passes.fx_utils import extract
from ..problem import Problem
from ..quant_registry.names import Kind
from .fx_match import argument, op_name, shape, value
from .moe_expert_gemms import ExpertGemmSite, ExpertMatmul, expert_gemm_site
from .moe_interpreter import hidden_root, ids_root, prove
from .moe_modulelist import find_module_list_experts
from .moe_rules import DOWN, UP, NotProven, same, sym
from .moe_subgraph import collect_region
from .site import ParamRef, Site, param_refs


@dataclass
class MoEMatches:
    sites: list[MoESite] = field(default_factory=list)  # proven experts regions -> quantpass::fused_moe
    expert_gemms: list[ExpertGemmSite] = field(default_factory=list)  # unproven: quantized GEMM by GEMM
    claimed: set[fx.Node] = field(default_factory=set)  # every node of those regions: not linear sites
    expert_linears: dict[fx.Node, str] = field(default_factory=dict)  # weight placeholder -> experts FQN
    unproven: list[tuple[str, str]] = field(default_factory=list)  # (fqn, why) ModuleList: to the linear pass


@dataclass
class MoESite(Site):
    """One experts region. `params` = [w13, w2], or [w1 (gate), w3 (up), w2] when gate and up are
    separate parameters (gather-einsum style); the lowering prepares [w13, w2] either way."""

    kind = Kind.MOE
    hidden: fx.Node | None = None  # [T, H] tokens entering the experts
    topk_weights: fx.Node | None = None  # [T, k]
    topk_ids: fx.Node | None = None  # [T, k]
    output: fx.Node | None = None  # [T, H], the region's result
    b13: fx.Node | None = None  # [E, 2I] bias placeholder (same gate/up layout as w13)
    b2: fx.Node | None = None  # [E, H]
    activation: str = "silu"
    gate_up_layout: str = "concat"
    apply_router_weight_on_input: bool = False
    alpha: float = 0.0  # swigluoai only
    limit: float = 0.0  # swigluoai and silu_clamped
    form: str = ""  # grouped_mm | batched_mm | einsum
    tokens: int | None = None  # T of a static capture (None: dynamic)
    region: set[fx.Node] = field(default_factory=set, repr=False)
    original: fx.GraphModule | None = field(default=None, repr=False)  # the region, standalone
    bias_refs: list[weakref.ref | None] = field(default_factory=list, repr=False)  # b13/b2 Parameters, for verify

    def biases(self, device) -> list[torch.Tensor | None]:
        """The example biases (weakly held: the graph reads the live ones from its placeholders)."""
        return [None if ref is None else ref().to(device) for ref in self.bias_refs]

    @property
    def output_node(self) -> fx.Node:
        return self.output

    @property
    def input_nodes(self) -> list[fx.Node]:
        return [self.hidden, self.topk_weights, self.topk_ids]


def find_moe_sites(graph: fx.Graph, example_inputs) -> MoEMatches:
    """Every MoE experts region of `graph`: proven sites, unproven look-alikes, ModuleList experts.

    Call it on the graph you will rewrite (sites hold its nodes), from inside the Dynamo backend:
    placeholders name their parameters only until the backend returns (`meta["grapharg"]`).
    """
    params = param_refs(graph, example_inputs)
    order = {node: i for i, node in enumerate(graph.nodes)}
    matches, unproven = MoEMatches(), []
    for ids, anchors in _anchor_groups(graph, params).items():
        fqn = _experts_fqn([params[a.weight].name for a in anchors])
        try:
            if isinstance(ids, str):  # "<route> <module>": no expert ids to prove a region from
                raise NotProven(WHY_UNROUTED[ids.partition(" ")[0]])
            if ids is None:
                raise NotProven("its expert ids don't come from a [T, k] integer tensor (top-k indices)")
            site = _site(graph, order, params, example_inputs, ids, anchors, fqn)
        except NotProven as error:
            unproven.append((fqn, anchors, str(error)))
            continue
        matches.sites.append(site)
        matches.claimed |= site.region
    taken = {ref.node for site in matches.sites for ref in site.params}
    for fqn, anchors, why in unproven:
        anchors = [a for a in anchors if a.node not in matches.claimed]
        matches.expert_gemms.append(expert_gemm_site(fqn, anchors, params, why, taken, order))
        matches.claimed |= {a.node for a in anchors}  # JetMoE's F.linear on W[i]: not a linear site
    for fqn, weights in find_module_list_experts(graph, params).items():
        matches.expert_linears.update(dict.fromkeys(weights, fqn))
        matches.unproven.append((fqn, f"{len(weights)} per-expert linears (ModuleList): no fused form to prove"))
    return matches


DENSE = "dense"  # the route of a bmm on the 3-D parameter itself (no gather by expert ids)
SLICED = "sliced"  # the route of F.linear on one expert's slice of the 3-D parameter (`W[i]`)
WHY_UNROUTED = {
    DENSE: "a bmm of every expert's weight with its own slice of an [E, T, H] batch: no expert ids",  # Llama 4
    SLICED: "F.linear on one expert's weight W[i] at a time (a loop over the experts in the model's code): "
    "no expert ids",  # JetMoE
}


def _anchor_groups(graph, params) -> dict[fx.Node | str | None, list[ExpertMatmul]]:
    """Matmuls with a 3-D parameter operand, by the [T, k] expert ids they are routed by; a bmm on the
    parameter itself (every expert on its own slice of the batch) or F.linear on one expert's slice by
    its module, as "dense <module>" / "sliced <module>"."""
    groups: dict[fx.Node | str | None, list[ExpertMatmul]] = {}
    for node in graph.nodes:
        name = op_name(node)
        found = None
        if name == "grouped_mm":  # x [M, in] @ weight [E, in, out]: W.transpose(-2, -1) of an [E, out, in] W
            weight = node.args[1]
            stored_out_in = op_name(weight) == "transpose" and {d % 3 for d in weight.args[1:3]} == {1, 2}
            weight = weight.args[0] if stored_out_in else weight
            found = (weight, node.args[0], argument(node, 2, "offs"), not stored_out_in)
        elif name in ("bmm", "einsum"):
            operands = list(node.args[:2] if name == "bmm" else node.args[1:])
            for i, operand in enumerate(operands):
                others = operands[:i] + operands[i + 1 :]
                other = others[0] if len(others) == 1 else None
                transposed = i == 1 if name == "bmm" else _einsum_transposed(node.args[0], i)
                if (
                    isinstance(operand, fx.Node)
                    and op_name(operand) == "getitem"
                    and isinstance(operand.args[1], fx.Node)
                ):
                    found = (operand.args[0], other, operand.args[1], transposed)
                elif name == "bmm" and operand in params:  # every expert on its slice of an [E, T, in] batch
                    found = (operand, other, DENSE, transposed)
        elif name == "linear":  # x @ W[i].T: one expert's [out, in] slice
            weight = argument(node, 1, "weight")
            if op_name(weight) == "getitem" and isinstance(weight.args[1], int):
                found = (weight.args[0], node.args[0], SLICED, False)
        if found is None or found[0] not in params or len(shape(found[0])) != 3 or found[1] is None:
            continue
        weight, source, route, transposed = found
        key = f"{route} {params[weight].name.rpartition('.')[0]}" if route in WHY_UNROUTED else ids_root(route)
        groups.setdefault(key, []).append(ExpertMatmul(node, weight, source, transposed))
    return groups


def _einsum_transposed(equation, operand: int) -> bool:
    """Whether einsum operand `operand` (a gathered weight `W[ids]`) is contracted on its dim -2, i.e.
    W is stored [E, in, out]; on anything unexpected, False (the stored layout is quantized as is)."""
    if not isinstance(equation, str) or "->" not in equation:
        return False
    inputs, out = equation.replace(" ", "").split("->")
    subscripts = inputs.split(",")
    if operand >= len(subscripts) or len(subscripts[operand]) < 2:
        return False
    second_last, last = subscripts[operand][-2:]
    return second_last not in out and last in out


def _experts_fqn(names: list[str]) -> str:
    """The module holding the experts' parameters: their common dotted prefix."""
    common = []
    for parts in zip(*(name.split(".") for name in names)):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    if len(common) == len(names[0].split(".")):  # one parameter: its module
        common = common[:-1]
    return ".".join(common) or names[0]


def _site(graph, order, params, example_inputs, topk_ids, anchors, fqn) -> MoESite:
    hidden = hidden_root(anchors[0].source)
    dims, ids_dims = shape(hidden), shape(topk_ids)
    experts = int(shape(anchors[0].weight)[0])
    if dims is None or len(dims) != 2 or not same(dims[0], ids_dims[0]):
        raise NotProven(f"tokens enter the experts as {hidden.name} {dims}, not [T, H] with T = {ids_dims[0]}")
    found = prove(order, params, hidden, topk_ids, experts)
    projections = [*found.up, found.down]
    unused = {a.node for a in anchors} - {p.node for p in projections}
    if unused:
        raise NotProven(f"expert matmul {sorted(n.name for n in unused)} is not part of the proven experts")
    up = found.up if len(found.up) == 1 or found.activation.gate_input == 0 else found.up[::-1]
    refs = [ParamRef(p.weight, params[p.weight].index, params[p.weight].name, p.transposed) for p in [*up, found.down]]
    intermediate, hidden_size = _sizes(refs, fqn)
    inputs = [hidden, found.topk_weights, topk_ids, *(r.node for r in refs)]
    biases = [found.biases.get(UP), found.biases.get(DOWN)]
    inputs += [b for b in biases if b is not None]
    try:
        region, sizes = collect_region(found.output, set(inputs), set(found.tags) | found.middle)
        original = extract(sorted(region, key=order.get), inputs, found.output, _size_sources(sizes, inputs, fqn))
    except ValueError as error:
        raise NotProven(str(error)) from None
    tokens = dims[0] if isinstance(dims[0], int) else None
    topk = int(ids_dims[1])
    site = MoESite(
        fqn,
        refs,
        Problem(intermediate, hidden_size, tokens, experts, topk, found.activation.activation, biases != [None, None]),
        hidden=hidden,
        topk_weights=found.topk_weights,
        topk_ids=topk_ids,
        output=found.output,
        b13=biases[0],
        b2=biases[1],
        activation=found.activation.activation,
        gate_up_layout=found.activation.gate_up_layout,
        apply_router_weight_on_input=found.router_on_input,
        alpha=found.activation.alpha,
        limit=found.activation.limit,
        form={"grouped_mm": "grouped_mm", "bmm": "batched_mm"}.get(op_name(found.down.node), "einsum"),
        tokens=tokens,
        region=region,
        original=original,
        bias_refs=[None if b is None else weakref.ref(example_inputs[params[b].index]) for b in biases],
    )
    site.notes.append(_describe(site))
    return site


def _sizes(refs: list[ParamRef], fqn: str) -> tuple[int, int]:
    """(I, H) from the weights as the math uses them: w13 [E, 2I, H] (or [E, I, H] twice), w2 [E, H, I]."""
    w2 = refs[-1].matrix(value(refs[-1].node))
    hidden_size, intermediate = int(w2.shape[1]), int(w2.shape[2])
    up_rows = sum(int(r.matrix(value(r.node)).shape[1]) for r in refs[:-1])
    up_cols = {int(r.matrix(value(r.node)).shape[2]) for r in refs[:-1]}
    if up_rows != 2 * intermediate or up_cols != {hidden_size}:
        raise NotProven(
            f"{fqn}: gate/up weights give [E, {up_rows}, {up_cols}], expected [E, 2*{intermediate}, {hidden_size}]"
        )
    return intermediate, hidden_size


def _size_sources(sizes: list[fx.Node], inputs: list[fx.Node], fqn: str) -> dict:
    """Each outside SymInt the region reads, as a size of its inputs: T, H, k or T*k."""
    hidden, ids = shape(inputs[0]), shape(inputs[2])
    known = [((0, 0), hidden[0]), ((0, 1), hidden[1]), ((2, 1), ids[1]), ((2, None), ids[0] * ids[1])]
    sources = {}
    for node in sizes:
        match = [
            where for where, size in known if isinstance(value(node), int | torch.SymInt) and same(size, value(node))
        ]
        if not match:
            raise ValueError(
                f"{fqn}: size {node.name} = {sym(value(node))} is not T, H, k or T*k of the experts' inputs"
            )
        sources[node] = match[0]
    return sources


def _describe(site: MoESite) -> str:
    details = [f"{site.form} experts", f"{site.activation} ({site.gate_up_layout} gate/up)"]
    if site.activation == "swigluoai":
        details[-1] += f" alpha={site.alpha:g} limit={site.limit:g}"
    elif site.activation == "silu_clamped":
        details[-1] += f" limit={site.limit:g}"
    if site.b13 is not None or site.b2 is not None:
        details.append("biases fused")
    if site.apply_router_weight_on_input:
        details.append("router weight on input")
    return ", ".join(details)
