"""Expert-parallel graphs, rewritten into the single-device experts the MoE finder proves (a pass that
runs before detection: `distributed.normalize`).

`patterns/expert_parallel.py` matches each rank's prologue (global expert ids -> local ones, other
ranks' routes parked on a sentinel id with router weight 0) and the sentinel masks inside the
experts; this pass parks those routes on the last local expert instead (still with weight 0: same
output), which makes every sentinel mask provably empty, and drops the masks.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..patterns.expert_parallel import EP_META, SENTINEL_META, prologue, sentinel_edits


def normalize_expert_parallel(graph: fx.Graph) -> int:
    """Rewrite each recognised prologue and drop its sentinel masks (module docstring); a prologue
    whose masks feed anything else is left as it is. Returns how many were rewritten."""
    count = 0
    for where in list(graph.find_nodes(op="call_function", target=torch.where)):
        experts = prologue(where)
        if experts is None:
            continue
        edits = sentinel_edits(graph, where, experts.local)
        if edits is None:
            continue
        where.update_arg(1, experts.local - 1)
        where.meta[EP_META] = experts
        for node, replacement in edits:
            if replacement is not None:
                node.replace_all_uses_with(replacement)
        for node, _ in reversed(edits):
            graph.erase_node(node)
        for node in reversed(list(graph.nodes)):  # the masks themselves, now unread
            if node.meta.get(SENTINEL_META) and not node.users:
                graph.erase_node(node)
        count += 1
    return count
