"""Small FX helpers: copy a graph module, add placeholders, find the fake mode, count ops."""

from __future__ import annotations

import copy
from collections import Counter

import torch
import torch.fx as fx


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A fresh GraphModule with a copied graph: Dynamo's own graph module is never mutated."""
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    value_map: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, value_map)
    old_output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    graph.output(out, type_expr=old_output.type).meta = copy.copy(old_output.meta)
    return fx.GraphModule(gm, graph, gm.__class__.__name__)


def add_placeholders(graph: fx.Graph, names: list[str], values: list[torch.Tensor]) -> list[fx.Node]:
    """Append placeholders (after the existing ones, in order) with fake `val` metadata."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode(graph)
    nodes = []
    anchor = placeholders[-1] if placeholders else None
    for name, value in zip(names, values):
        if anchor is None:
            with graph.inserting_before(next(iter(graph.nodes))):
                node = graph.placeholder(name)
        else:
            with graph.inserting_after(anchor):
                node = graph.placeholder(name)
        if fake_mode is not None:
            fake = fake_mode.from_tensor(value, static_shapes=True)
            node.meta["val"] = node.meta["example_value"] = fake
        nodes.append(node)
        anchor = node
    return nodes


def detect_fake_mode(graph: fx.Graph):
    from torch._guards import detect_fake_mode as detect

    values = [n.meta.get("example_value", n.meta.get("val")) for n in graph.nodes if n.op == "placeholder"]
    return detect([v for v in values if isinstance(v, torch.Tensor)])


def op_counts(gm: fx.GraphModule) -> Counter:
    """How many call nodes of each target (by readable name) a graph holds."""
    counts = Counter()
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            counts[target_name(node.target)] += 1
    return counts


def target_name(target) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return str(target).removesuffix(".default")
    module = getattr(target, "__module__", "") or ""
    return f"{module}.{getattr(target, '__name__', repr(target))}".lstrip(".")
