"""The experts subgraph in FX: a region's node set, extracting it as a standalone `GraphModule`, and
erasing it after a rewrite.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..passes.fx_utils import mutated
from .fx_match import value

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
