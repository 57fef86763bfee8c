"""How an experts region computes, proven by a small abstract interpreter over FX nodes.

Starting from where tokens (`hidden` [T, H]) and top-k expert ids ([T, k]) enter the experts, the
`Interpreter` walks the graph forward in graph order and tags each node by the rules of `moe_rules`
(what the value holds and in which row order); nodes no rule accepts are not part of the region.
The router weights are the [T, k] tensor a stuck `mul` names on a first pass. A region is proven
when one value holds token data in token order [T, H] that went through the up projection(s), a
gated activation (identified structurally by `moe_activation`), the down projection and exactly
one multiplication by the router weights.

This covers transformers 5.x experts under `grouped_mm` (sort, `histc`/`cumsum` offsets,
`_grouped_mm` or `transformers::grouped_mm_fallback`, un-permute, `view(T, k, H).sum(1)`) and
`batched_mm` (`repeat_interleave`, `W[ids]` gathers, `bmm`), with or without biases and with
`[E, out, in]` or `[E, in, out]` weights, and the gather-einsum style (`W[topk_ids]`, `einsum`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
import torch.fx as fx

from .fx_match import is_cast, op_name, shape, value
from .moe_activation import MatchedActivation
from .moe_rules import DOWN, LAZY_RULES, RULES, UP, NotProven, Projection, RowOrder, Tag, TagKind, same


@dataclass
class Experts:
    """What the interpreter proved about one experts region."""

    output: fx.Node
    topk_weights: fx.Node
    up: list[Projection]
    down: Projection
    biases: dict[int, fx.Node]  # UP -> b13 [E, 2I], DOWN -> b2 [E, H] parameter placeholders
    router_on_input: bool
    activation: MatchedActivation
    tags: dict[fx.Node, Tag]
    middle: set[fx.Node]  # the gated activation's nodes


class Interpreter:
    """Tags the nodes reachable from one candidate region's boundaries, in graph order."""

    def __init__(self, order, params, hidden, topk_ids, topk_weights, experts: int):
        self.order = order  # node -> position in the graph
        self.params = params  # placeholder -> ParamRef, for the graph's nn.Parameters
        self.tokens, self.hidden_size = shape(hidden)
        self.topk = int(shape(topk_ids)[1])
        self.experts = experts
        self.tags: dict[fx.Node, Tag] = {
            hidden: Tag(TagKind.DATA, RowOrder.T),
            topk_ids: Tag(TagKind.EXPERT, RowOrder.T_K),
        }
        if topk_weights is not None:
            self.tags[topk_weights] = Tag(TagKind.ROUTER, RowOrder.T_K)
        self.projections: list[Projection] = []
        self.biases: dict[int, fx.Node] = {}
        self.middle: set[fx.Node] = set()
        self.activation: MatchedActivation | None = None
        self.router_candidates: list[fx.Node] = []  # mul operands that may be the router weights
        self.refusals: list[tuple[int, str]] = []  # (stage reached, why a node was refused)

    def tag(self, node) -> Tag | None:
        if not isinstance(node, fx.Node):
            return None
        if node in self.tags:
            return self.tags[node]
        if node in self.params:  # expert weights [E, ., .] and biases [E, N], tagged on first use
            dims = shape(node)
            if dims and dims[0] == self.experts and len(dims) in (2, 3):
                return Tag(TagKind.WEIGHT if len(dims) == 3 else TagKind.BIAS, param=node)
        lazy = LAZY_RULES.get(op_name(node))  # nodes not reached forward: no tagged inputs
        if lazy is not None and (tag := lazy(self, node)) is not None:
            self.tags[node] = tag
            return tag
        return None

    def refuse(self, node: fx.Node, why: str, stage: int = 0):
        self.refusals.append((stage, f"{why} (at {node.name} = {op_name(node) or node.target})"))

    def run(self, starts: list[fx.Node]) -> None:
        heap = [(self.order[u], u) for s in starts for u in s.users]
        heapq.heapify(heap)
        seen = set()
        while heap:
            _, node = heapq.heappop(heap)
            if node in seen or node in self.tags:
                continue
            seen.add(node)
            rule = RULES.get(op_name(node))
            tag = rule(self, node) if rule is not None else None
            if tag is None:
                continue
            self.tags[node] = tag
            for user in node.users:
                heapq.heappush(heap, (self.order[user], user))

    def furthest_refusal(self, default: str) -> str:
        return max(self.refusals, key=lambda r: r[0])[1] if self.refusals else default

    def result(self, topk_weights: fx.Node) -> Experts:
        """The proven region's output and facts, or NotProven with the furthest refusal."""
        outputs = [n for n, t in self.tags.items() if self._is_output(n, t)]
        terminal = [n for n in outputs if not any(u in outputs for u in n.users)]
        if not terminal:
            raise NotProven(self.furthest_refusal("no sum over the top-k experts in token order [T, H]"))
        if len(terminal) > 1:
            raise NotProven(f"{len(terminal)} candidate outputs: {', '.join(n.name for n in terminal)}")
        up = [p for p in self.projections if p.stage == UP]
        down = [p for p in self.projections if p.stage == DOWN]
        if len(up) not in (1, 2) or len(down) != 1 or self.activation is None:
            raise NotProven(f"expected 1 or 2 up projections and 1 down projection, found {len(up)} and {len(down)}")
        router_on_input = self.tags[up[0].source].weighted  # multiplied in before the up projection
        facts = (self.biases, router_on_input, self.activation, self.tags, self.middle)
        return Experts(terminal[0], topk_weights, up, down[0], *facts)

    def _is_output(self, node: fx.Node, tag: Tag) -> bool:
        dims = shape(node)
        return (
            tag.kind == TagKind.DATA
            and tag.order == RowOrder.T
            and tag.stage == DOWN
            and tag.weighted
            and dims is not None
            and len(dims) == 2
            and same(dims[0], self.tokens)
            and same(dims[1], self.hidden_size)
        )


def prove(order, params, hidden: fx.Node, topk_ids: fx.Node, experts: int, topk_weights=None) -> Experts:
    """Prove the experts region entered by `hidden` [T, H] and `topk_ids` [T, k], or raise NotProven.

    The router weights [T, k] are found by a first pass: the `mul` that gets stuck on an unknown
    operand names them; the second pass then proves the whole region.
    """
    it = Interpreter(order, params, hidden, topk_ids, topk_weights, experts)
    it.run([node for node in (hidden, topk_ids, topk_weights) if node is not None])
    if topk_weights is None:
        for candidate in it.router_candidates:
            router = router_root(candidate, it.tokens, it.topk)
            if router is not None:
                return prove(order, params, hidden, topk_ids, experts, router)
        raise NotProven(it.furthest_refusal("no multiplication by [T, k] router weights after the experts"))
    return it.result(topk_weights)


ROUTER_PASSTHROUGH = {"unsqueeze", "reshape", "view", "flatten", "getitem", "to", "type", "float", "half", "bfloat16"}


def router_root(node: fx.Node, tokens, topk: int) -> fx.Node | None:
    """Walk back from a multiplier through views and row gathers to the [T, k] float tensor it comes from.

    At k = 1 a column view of the flat, gathered [T*k] weights also looks like [T, k]: it is passed
    over for the [T, k] tensor further back, and taken only if there is none."""
    column = None
    for _ in range(8):
        dims = shape(node)
        if dims is not None and len(dims) == 2 and same(dims[0], tokens) and same(dims[1], topk):
            if not value(node).is_floating_point():
                return column
            if not (topk == 1 and _column_of_flat(node)):
                return node
            column = column or node
        if op_name(node) not in ROUTER_PASSTHROUGH or not isinstance(node.args[0], fx.Node):
            return column
        node = node.args[0]
    return column


def _column_of_flat(node: fx.Node) -> bool:
    source = node.args[0] if node.args else None
    return (
        op_name(node) in ("unsqueeze", "view", "reshape")
        and isinstance(source, fx.Node)
        and len(shape(source) or ()) == 1
    )


ROW_GATHERS = {"getitem", "repeat_interleave"}


def hidden_root(node: fx.Node) -> fx.Node:
    """Walk back from a projection's input through casts, row gathers and router scaling to [T, H]."""
    for _ in range(8):
        name = op_name(node)
        if (is_cast(node) or name in ("unsqueeze", "squeeze", *ROW_GATHERS)) and isinstance(node.args[0], fx.Node):
            node = node.args[0]
        elif name == "mul" and len(data := [a for a in node.args[:2] if (shape(a) or (1,))[-1] != 1]) == 1:
            node = data[0]  # x * router[..., None]: router weights applied on the input
        else:
            break
    return node


ID_PASSTHROUGH = {"reshape", "view", "flatten", "to", "float", "int", "long", "cumsum", "histc", "sort", "getitem"}


def ids_root(node) -> fx.Node | None:
    """Walk back from a gather index or grouped_mm offsets to the [T, k] integer expert ids."""
    for _ in range(10):
        if not isinstance(node, fx.Node):
            return None
        dims, val = shape(node), value(node)
        if dims is not None and len(dims) == 2 and not val.is_floating_point() and val.dtype != torch.bool:
            return node
        if op_name(node) not in ID_PASSTHROUGH:
            return None
        node = node.args[0]
    return None
