"""The experts subgraph in FX: a region's node set. Building a standalone `GraphModule` from it and
erasing it after the rewrite make and change graphs, which detection does not: `passes/fx_utils.py`'s
`extract` and `erase_dead`."""

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
