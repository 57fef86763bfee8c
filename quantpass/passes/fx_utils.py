"""Small FX helpers: copy a graph module, add placeholders, find the fake mode, count ops."""

from __future__ import annotations

import copy
import operator
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


# In-place writes written as Python operators (`x[i] = v`, `x += y`) in Dynamo graphs.
INPLACE_OPERATORS = {
    operator.setitem,
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
}


def mutated(node: fx.Node) -> fx.Node | None:
    """The node an in-place op writes into (`x.add_(b)`, `x[i] = v`, `x /= y`), else None."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.op == "call_function" and node.target in INPLACE_OPERATORS:
        return node.args[0]
    if node.op == "call_method":
        name = node.target
    elif node.op == "call_function" and (getattr(node.target, "__module__", None) or "").startswith("torch"):
        name = getattr(node.target, "__name__", None)
    else:
        name = None
    return node.args[0] if name and name.endswith("_") and not name.startswith("_") else None


def eliminate_dead_code(graph: fx.Graph) -> None:
    """DCE that keeps in-place writes: Dynamo graphs are not functionalized, so an unused
    `copy_`/`scatter_`/`setitem` still changes a tensor someone reads later (DeepSeek-V3's MLA
    key buffer and router group mask: plain DCE took its logits cosine to 0.69)."""
    graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or mutated(n) is not None)
