"""Small FX helpers: copy a graph module, add placeholders, find the fake mode, count ops, extract
nodes as a standalone module, erase a dead region."""

from __future__ import annotations

import copy
import operator
from collections import Counter

import torch
import torch.fx as fx


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A fresh GraphModule with a copied graph: Dynamo's own graph module is never mutated."""
    return copy_graph(gm)[0]


def copy_graph(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    """`copy_graph_module`, and the map from each of `gm`'s nodes to its copy."""
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    value_map: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, value_map)
    old_output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    graph.output(out, type_expr=old_output.type).meta = copy.copy(old_output.meta)
    return fx.GraphModule(gm, graph, gm.__class__.__name__), value_map


def add_placeholders(graph: fx.Graph, names: list[str]) -> list[fx.Node]:
    """Append placeholders after the existing ones, in order, each named uniquely from `names`."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    taken = {n.target for n in placeholders}
    nodes = []
    anchor = placeholders[-1] if placeholders else None
    for name in names:
        unique, suffix = name, 1
        while unique in taken:
            unique, suffix = f"{name}_{suffix}", suffix + 1
        taken.add(unique)
        if anchor is None:
            with graph.inserting_before(next(iter(graph.nodes), None)):
                node = graph.placeholder(unique)
        else:
            with graph.inserting_after(anchor):
                node = graph.placeholder(unique)
        nodes.append(node)
        anchor = node
    return nodes


def set_placeholder_values(graph: fx.Graph, nodes: list[fx.Node], values: list[torch.Tensor]) -> None:
    """Give placeholders fake metadata for these values (static shapes) under the keys the graph's other
    placeholders use: Dynamo's carry `example_value` only. Inductor reads `val` when any placeholder has
    it (its C++-wrapper mode takes every input's fake value from there), so a `val` on ours alone would
    leave Dynamo's inputs without one."""
    fake_mode = detect_fake_mode(graph)
    if fake_mode is None:
        return
    others = [n for n in graph.nodes if n.op == "placeholder" and n not in nodes]
    keys = ["example_value"] + (["val"] if not others or any("val" in n.meta for n in others) else [])
    for node, value in zip(nodes, values, strict=True):
        fake = fake_mode.from_tensor(value, static_shapes=True)
        for key in keys:
            node.meta[key] = fake


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


def mutated_placeholders(graph: fx.Graph) -> set[fx.Node]:
    """Placeholders an in-place op writes into, directly or through views (`cache[:, i] = v`)."""
    found = set()
    for node in graph.nodes:
        target = mutated(node)
        for _ in range(16):  # views of views: follow the base operand
            if not isinstance(target, fx.Node) or target.op == "placeholder":
                break
            target = target.args[0] if target.args else None
        if isinstance(target, fx.Node) and target.op == "placeholder":
            found.add(target)
    return found


def state_changes(graph: fx.Graph) -> set[fx.Node]:
    """Calls nothing reads that read no tensor: in a Dynamo graph, changes of interpreter state that fx
    does not know as impure (`torch.vmap`'s `_vmap_increment_nesting` / `_vmap_decrement_nesting`, in
    Jamba's selective scan). Taken before a rewrite, for `eliminate_dead_code` to keep."""
    return {
        node
        for node in graph.nodes
        if node.op == "call_function"
        and not node.users
        and not any(isinstance(a.meta.get("example_value"), torch.Tensor) for a in node.all_input_nodes)
    }


def eliminate_dead_code(graph: fx.Graph, keep: set[fx.Node] = frozenset()) -> None:
    """DCE that keeps in-place writes and `keep` (`state_changes`): Dynamo graphs are not functionalized,
    so an unused `copy_`/`scatter_`/`setitem` still changes a tensor someone reads later (DeepSeek-V3's
    MLA key buffer and router group mask: plain DCE took its logits cosine to 0.69), and removing vmap's
    nesting calls broke every call inside the vmap."""
    graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or mutated(n) is not None or n in keep)


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
