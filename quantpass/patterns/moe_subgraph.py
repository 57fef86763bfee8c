"""The experts subgraph in FX: op names, a region's node set, extracting it as a standalone
`GraphModule`, identifying its gated activation numerically, and erasing it after a rewrite.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..kernels.reference import ACTIVATIONS, GATE_UP_LAYOUTS, gated_activation
from ..passes.fx_utils import mutated

CASTS = {"to", "type", "float", "double", "half", "bfloat16", "int", "long", "contiguous"}
# `transformers::grouped_mm_fallback` is the opaque op transformers calls for non-bf16 weights under
# compile (torch._grouped_mm compiles only in bf16); same (input, weight [E, in, out], offs) math.
GROUPED_MM_TARGETS = {
    torch._grouped_mm,
    getattr(F, "grouped_mm", torch._grouped_mm),
    torch.ops.aten._grouped_mm.default,
}
GROUPED_MM_OPS = {"transformers.grouped_mm_fallback", "transformers.grouped_mm_fallback.default"}
PROBE_SCALE = 4.0  # probe values ~N(0, 4^2): GPT-OSS's clamps (|x| > limit=7) are hit often
PROBE_TOLERANCE = 1e-5  # same math in fp32 agrees to ~1e-7; gelu vs gelu_tanh on the probes: 5e-3


def value(node):
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def shape(node) -> tuple | None:
    val = value(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def op_name(node: fx.Node) -> str | None:
    """A call's op as one name: the method name, or a torch/operator function's `__name__`."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method":
        return node.target
    if node.op != "call_function":
        return None
    target = node.target
    if target in GROUPED_MM_TARGETS or str(target) in GROUPED_MM_OPS:
        return "grouped_mm"
    module = getattr(target, "__module__", None) or ""
    if module in ("_operator", "operator") or module.startswith("torch"):
        return getattr(target, "__name__", None)
    return None


def is_cast(node) -> bool:
    return isinstance(node, fx.Node) and op_name(node) in CASTS


# ----------------------------------------------------------------------------- region


def collect_region(output: fx.Node, inputs: set[fx.Node], allowed: set[fx.Node]) -> tuple[set[fx.Node], list[fx.Node]]:
    """Every node `output` is computed from, back to `inputs`, plus in-place writers of those nodes.

    Returns (region, outside size nodes: SymInts the region reads). Raises ValueError when the
    region reads a tensor from outside `inputs` or writes into one: then it is not self-contained.
    """
    region, sizes, stack = set(), [], [output]
    while stack:
        node = stack.pop()
        if node in region:
            continue
        if node not in allowed:
            raise ValueError(f"the experts read `{node.format_node()}`, which is not part of a supported form")
        region.add(node)
        for source in node.all_input_nodes:
            if source in inputs or source in region:
                continue
            if not isinstance(value(source), int | torch.SymInt):
                stack.append(source)
            elif source not in sizes:
                sizes.append(source)
        stack.extend(user for user in node.users if mutated(user) is node)  # inv[perm] = ..., out.add_(bias)
    for node in region:
        written = mutated(node)
        if written is not None and written not in region:
            raise ValueError(f"`{node.format_node()}` writes into {written.name}, outside the experts")
    return region, sizes


# ----------------------------------------------------------------------------- extraction


def extract(nodes: list[fx.Node], inputs: list[fx.Node], output: fx.Node, sizes=None, drop_casts=False):
    """`nodes` (in graph order) as a standalone GraphModule taking `inputs`, returning `output`.

    `sizes` maps outside SymInt nodes to (input index, dim) — dim None for `numel()` — so a region
    captured with dynamic shapes runs on any token count. `drop_casts` makes casts the identity
    (to compare the math, not the rounding).
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {node: graph.placeholder(f"input_{i}") for i, node in enumerate(inputs)}
    for node, (index, dim) in (sizes or {}).items():
        args = (env[inputs[index]],) if dim is None else (env[inputs[index]], dim)
        env[node] = graph.call_method("numel" if dim is None else "size", args)
    for node in nodes:
        if drop_casts and is_cast(node):
            env[node] = env[node.args[0]]
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[output])
    return fx.GraphModule(torch.nn.Module(), graph)


@dataclass(frozen=True)
class GatedActivation:
    activation: str  # reference.ACTIVATIONS
    gate_up_layout: str  # "concat" | "interleaved"
    alpha: float = 0.0  # swigluoai only
    limit: float = 0.0
    gate_input: int = 0  # with separate gate and up projections: which input is the gate


def identify_activation(nodes, inputs, output, width: int) -> GatedActivation | None:
    """Which gated activation `nodes` compute from the up projection(s), by running them on probes.

    One input `[.., 2I]` (fused gate/up) or two `[.., I]` (separate gate and up projections). The
    candidates are every activation x layout of the reference; GPT-OSS's alpha and limit are read
    from the graph's constants (`gate * alpha`, `clamp(max=limit)`).
    """
    try:
        module = extract(nodes, inputs, output, drop_casts=True)
    except KeyError:
        return None
    lead = (8,) if len(shape(inputs[0])) == 2 else (4, 2)
    generator = torch.Generator().manual_seed(0)
    probes = [torch.randn(*lead, width, generator=generator) * PROBE_SCALE for _ in inputs]
    try:
        with torch.no_grad():
            out = module(*probes).float()
    except Exception:
        return None
    orders = [(0, 1), (1, 0)] if len(inputs) == 2 else [(0,)]
    for order in orders:
        h = torch.cat([probes[i] for i in order], dim=-1)
        for candidate in _candidates(nodes, layouts=GATE_UP_LAYOUTS if len(inputs) == 1 else ("concat",)):
            ref = gated_activation(h, candidate.activation, candidate.gate_up_layout, candidate.alpha, candidate.limit)
            if ref.shape == out.shape and torch.allclose(out, ref, rtol=PROBE_TOLERANCE, atol=PROBE_TOLERANCE):
                return replace(candidate, gate_input=order[0])
    return None


def _candidates(nodes, layouts):
    alphas, limits = set(), set()
    for node in nodes:
        name = op_name(node)
        if name == "mul":
            alphas |= {float(a) for a in node.args if isinstance(a, float)}
        elif name in ("clamp", "clamp_min", "clamp_max"):
            bounds = [*node.args[1:], *node.kwargs.values()]
            limits |= {abs(float(b)) for b in bounds if isinstance(b, int | float)}
    for layout in layouts:
        for activation in ACTIVATIONS:
            if activation != "swigluoai":
                yield GatedActivation(activation, layout)
        for alpha in alphas:
            for limit in limits:
                yield GatedActivation("swigluoai", layout, alpha, limit)


# ----------------------------------------------------------------------------- rewrite support


def erase_dead(graph: fx.Graph, region: set[fx.Node]) -> int:
    """Erase the region's nodes nothing outside needs, in-place ops included (DCE keeps those).

    A node stays if a user outside the erased set reads it; an in-place op stays if the tensor it
    writes into stays (someone still reads the mutated value).
    """
    dead = {n for n in region if n.graph is graph}

    def needed(node):
        written = mutated(node)
        return any(u not in dead for u in node.users) or (written is not None and written not in dead)

    while keep := {n for n in dead if needed(n)}:
        dead -= keep
    for node in reversed(list(graph.nodes)):
        if node in dead:
            graph.erase_node(node)
    return len(dead)
