"""ModuleList experts: one `nn.Linear` per expert, `<experts>.<e>.<name>.weight`, found by structure.

No fused form can be proven for them (each expert is its own set of linears, often behind a
data-dependent `torch.where`), so the linear pass quantizes each with the `moe` spec. A numbered
group of linears is taken for experts when (1) the experts read the same token tensor (possibly
row-gathered) and (2) an expert's output is combined with a value derived from `topk` — this
tells experts apart from a list of layers (each reads the previous one's output) or of parallel
heads (no router).
"""

from __future__ import annotations

import re

import torch.fx as fx

from .fx_match import LINEAR_TARGETS, ROUTER_HOPS, is_cast, op_name, shape

INDEXED = re.compile(r"^(?P<experts>.+)\.(?P<index>\d+)\.(?P<rest>[^\d].*)$")  # greedy: the last index
INPUT_HOPS = 4  # hidden[None, top_x].reshape(-1, H): a couple of row gathers and views
COMBINE_HOPS = 4  # expert output * routing_weights[top_x, idx, None]: within a few nodes
ROW_OPS = {"getitem", "reshape", "view", "index_select", "unsqueeze", "squeeze"}


def find_module_list_experts(graph: fx.Graph, params) -> dict[str, list[fx.Node]]:
    """{experts module FQN: the weight placeholders of its per-expert linears}."""
    groups: dict[str, dict[int, list[fx.Node]]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in LINEAR_TARGETS:
            continue
        weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        if weight not in params or len(shape(weight) or ()) != 2:
            continue
        if match := INDEXED.match(params[weight].name):
            groups.setdefault(match["experts"], {}).setdefault(int(match["index"]), []).append(node)
    found = {}
    for fqn, experts in groups.items():
        if len(experts) < 2 or not _read_same_tokens(experts.values()):
            continue
        if any(_combined_with_router(linear) for linears in experts.values() for linear in linears):
            found[fqn] = [
                linear.args[1] if len(linear.args) > 1 else linear.kwargs["weight"]
                for e in experts.values()
                for linear in e
            ]
    return found


def _token_source(node) -> fx.Node:
    for _ in range(INPUT_HOPS):
        if not isinstance(node, fx.Node) or not (is_cast(node) or op_name(node) in ROW_OPS):
            break
        node = node.args[0]
    return node


def _read_same_tokens(experts) -> bool:
    sources = [{_token_source(linear.args[0]) for linear in linears} for linears in experts]
    return bool(set.intersection(*sources))


def _combined_with_router(linear: fx.Node) -> bool:
    path, frontier = {linear}, [linear]
    for _ in range(COMBINE_HOPS):
        frontier = [user for node in frontier for user in node.users if user not in path]
        path.update(frontier)
        for node in frontier:
            if any(_from_topk(other) for other in node.all_input_nodes if other not in path):
                return True
    return False


def _from_topk(node: fx.Node) -> bool:
    frontier = [node]
    for _ in range(ROUTER_HOPS):
        if any(op_name(n) == "topk" for n in frontier):
            return True
        frontier = [s for n in frontier if n.op in ("call_function", "call_method") for s in n.all_input_nodes]
        frontier = [s for s in frontier if s.op != "placeholder" and s.target not in LINEAR_TARGETS]
    return False
