"""The experts subgraph in FX: op names, a region's node set, extracting it as a standalone
`GraphModule`, and erasing it after a rewrite.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

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
LINEAR_TARGETS = {torch._C._nn.linear, F.linear}
# How many nodes routing may take between a value and `topk`: a router linear's output reaches it
# (linear -> softmax -> topk), and a routing weight derives from it (routing_weights[...] <- to <-
# itruediv <- getitem <- topk), within this many.
ROUTER_HOPS = 6


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


def argument(node: fx.Node, index: int, name: str | tuple[str, ...], default=None):
    """A call's argument given by position `index` or keyword `name` (or any of several names)."""
    if len(node.args) > index:
        return node.args[index]
    return next((node.kwargs[n] for n in ((name,) if isinstance(name, str) else name) if n in node.kwargs), default)


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


def extract(nodes: list[fx.Node], inputs: list[fx.Node], output: fx.Node, sizes=None):
    """`nodes` (in graph order) as a standalone GraphModule taking `inputs`, returning `output`.

    `sizes` maps outside SymInt nodes to (input index, dim) — dim None for `numel()` — so a region
    captured with dynamic shapes runs on any token count.
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {node: graph.placeholder(f"input_{i}") for i, node in enumerate(inputs)}
    for node, (index, dim) in (sizes or {}).items():
        args = (env[inputs[index]],) if dim is None else (env[inputs[index]], dim)
        env[node] = graph.call_method("numel" if dim is None else "size", args)
    for node in nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[output])
    return fx.GraphModule(torch.nn.Module(), graph)


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
