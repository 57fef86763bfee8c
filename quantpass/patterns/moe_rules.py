"""The rules of the MoE interpreter (`moe_interpreter`): one per op, over `Tag`s of FX nodes.

Every value inside an experts region gets a `Tag`: what it holds (`TagKind`: token data, expert ids,
router weights, a sort permutation, an expert weight, ...) and the order of its rows (`RowOrder`): "t" one row per
token `[T, ...]`, "t,k" `[T, k, ...]`, "tk" `[T*k, ...]` token-major, "sorted" `[T*k, ...]` in the
order of one `sort` of the expert ids. A rule `(interpreter, node) -> Tag | None` says what an op
makes of its inputs' tags, or refuses (None: the node is not part of the region). Rules check
what makes the math right: rows gathered by the same permutation they are un-permuted with,
`histc` counting exactly E experts, gathered weights in the same row order as the tokens, the
router weights multiplied in exactly once, the top-k sum over the k axis.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import sympy
import torch
import torch.fx as fx

from ..quant_registry.names import StrEnum
from .fx_match import argument, is_cast, op_name, shape, value
from .moe_activation import NotAnActivation, identify_activation

if TYPE_CHECKING:
    from .moe_interpreter import Interpreter


class TagKind(StrEnum):
    """What a tagged value holds."""

    DATA = "data"  # token activations
    ROUTER = "router"  # router (top-k) weights
    EXPERT = "expert"  # expert ids
    SORT = "sort"  # the sort of the expert ids: (sorted ids, permutation)
    SLOT = "slot"  # the sort's permutation: the [T*k] slot each sorted row comes from
    TOKEN = "token"  # permutation // k: the token of each sorted row
    SCRATCH = "scratch"  # empty_like(permutation): where the inverse permutation is written
    INVERSE = "inverse"  # the inverse permutation
    POSITIONS = "positions"  # arange(T*k)
    OFFSETS = "offsets"  # rows per expert, and their cumulative sums
    WEIGHT = "weight"  # a 3-D expert parameter
    BIAS = "bias"  # a 2-D expert bias
    GATHERED = "gathered"  # weights indexed by expert ids
    MUTATION = "mutation"  # the setitem that writes the inverse permutation


class RowOrder(StrEnum):
    """The order of a value's token rows."""

    T = "t"  # [T, ...]: one row per token
    T_K = "t,k"  # [T, k, ...]
    TK = "tk"  # [T*k, ...], token-major
    SORTED = "sorted"  # [T*k, ...] in the order of one sort of the expert ids


ROW_DIMS = {RowOrder.T: 1, RowOrder.TK: 1, RowOrder.SORTED: 1, RowOrder.T_K: 2}
UP, ACTIVATED, DOWN = 1, 2, 3  # stages of token data: 0 = entering the experts


class NotProven(Exception):
    """A region that looks like MoE experts but isn't a supported form; the message says why."""


@dataclass(frozen=True)
class Tag:
    kind: TagKind
    order: RowOrder | None = None  # row order (ROW_DIMS), None when the value has no token rows
    sort: fx.Node | None = None  # the sort a "sorted" order, permutation or offsets come from
    stage: int = 0  # data: 0 entering, UP, ACTIVATED, DOWN
    weighted: bool = False  # data: multiplied by the router weights
    param: fx.Node | None = None  # weight / bias / gathered: its parameter placeholder
    graph_transposed: bool = False  # weight: `.transpose(-2, -1)` applied in the graph


@dataclass
class Projection:
    node: fx.Node
    weight: fx.Node  # the 3-D parameter placeholder
    transposed: bool  # stored [E, in, out] (GPT-OSS) rather than [E, out, in]
    stage: int  # UP or DOWN: the stage of its output
    source: fx.Node  # its token-data operand


def sym(x) -> sympy.Expr:
    return x.node.expr if isinstance(x, torch.SymInt) else sympy.Integer(int(x))


def same(a, b) -> bool:
    """Two sizes (ints or SymInts) are the same expression; never adds a shape guard."""
    return sympy.expand(sym(a) - sym(b)) == 0


# ----------------------------------------------------------------------------- rules
# Each rule: (interpreter, node) -> the node's Tag, or None (the node is not part of the region).


def _cast(it: Interpreter, node):
    return it.tag(node.args[0])


def _reshape(it: Interpreter, node):
    tag, src = it.tag(node.args[0]), node.args[0]
    if tag is None or tag.order is None:
        return None
    before, after = shape(src), shape(node)
    if _same_dims(before, after):
        return tag
    tokens, k = it.tokens, it.topk
    if (
        tag.order == RowOrder.T_K
        and len(after) == len(before) - 1
        and same(after[0], tokens * k)
        and _same_dims(after[1:], before[2:])
    ):
        return replace(tag, order=RowOrder.TK)  # [T, k, ...] -> [T*k, ...]
    if (
        tag.order == RowOrder.TK
        and len(after) == len(before) + 1
        and _same_dims(after[:2], (tokens, k))
        and _same_dims(after[2:], before[1:])
    ):
        return replace(tag, order=RowOrder.T_K)  # [T*k, ...] -> [T, k, ...]
    return None


def _same_dims(a, b) -> bool:
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def _unsqueeze(it: Interpreter, node):
    tag = it.tag(node.args[0])
    dim = argument(node, 1, "dim")
    if tag is None or tag.order is None or not isinstance(dim, int):
        return None
    ndim = len(shape(node)) if op_name(node) == "unsqueeze" else len(shape(node.args[0]))
    return tag if dim % ndim >= ROW_DIMS[tag.order] else None  # never touches the row dims


def _sort(it: Interpreter, node):
    tag = it.tag(node.args[0])
    descending = argument(node, 2, "descending", False)
    if (
        tag is None
        or tag.kind != TagKind.EXPERT
        or tag.order != RowOrder.TK
        or descending
        or argument(node, 1, "dim", -1) not in (0, -1)
    ):
        return None
    return Tag(TagKind.SORT, sort=node)


def _getitem(it: Interpreter, node):
    src, index = node.args
    tag, index_tag = it.tag(src), it.tag(index)
    if tag is None:
        return None
    if tag.kind == TagKind.SORT and index in (0, 1):  # (sorted expert ids, permutation)
        return Tag(TagKind.EXPERT if index == 0 else TagKind.SLOT, RowOrder.SORTED, sort=src)
    if index_tag is None:
        return None
    if tag.kind in (TagKind.WEIGHT, TagKind.BIAS) and not tag.graph_transposed and index_tag.kind == TagKind.EXPERT:
        return Tag(TagKind.GATHERED, index_tag.order, index_tag.sort, param=tag.param)
    if tag.kind not in (TagKind.DATA, TagKind.ROUTER):
        return None
    if tag.order == RowOrder.T and index_tag.kind == TagKind.TOKEN:  # hidden[perm // k]
        return replace(tag, order=RowOrder.SORTED, sort=index_tag.sort)
    if tag.order == RowOrder.TK and index_tag.kind == TagKind.SLOT:  # flat[perm]
        return replace(tag, order=RowOrder.SORTED, sort=index_tag.sort)
    if (
        tag.order == RowOrder.SORTED and index_tag.kind == TagKind.INVERSE and index_tag.sort is tag.sort
    ):  # sorted[inv_perm]
        return replace(tag, order=RowOrder.TK, sort=None)
    return None


def _floordiv(it: Interpreter, node):
    tag = it.tag(node.args[0])
    if tag is not None and tag.kind == TagKind.SLOT and node.args[1] == it.topk:  # perm // k: the token of each row
        return replace(tag, kind=TagKind.TOKEN)
    return None


def _histc(it: Interpreter, node):
    tag = it.tag(node.args[0])
    bins, low, high = argument(node, 1, "bins", 100), argument(node, 2, "min", 0), argument(node, 3, "max", 0)
    if tag is None or tag.kind != TagKind.EXPERT or tag.order != RowOrder.SORTED:
        return None
    if (bins, low, high) != (it.experts, 0, it.experts - 1):
        it.refuse(node, f"histc(bins={bins}, min={low}, max={high}) does not count {it.experts} experts")
        return None
    return Tag(TagKind.OFFSETS, sort=tag.sort)  # counts per expert; cumsum keeps the tag


def _cumsum(it: Interpreter, node):
    tag = it.tag(node.args[0])
    return tag if tag is not None and tag.kind == TagKind.OFFSETS and argument(node, 1, "dim") == 0 else None


def _empty_like(it: Interpreter, node):
    tag = it.tag(node.args[0])
    return Tag(TagKind.SCRATCH, sort=tag.sort) if tag is not None and tag.kind == TagKind.SLOT else None


def _arange(it: Interpreter, node):
    args = [a for a in node.args if not isinstance(a, torch.dtype)]
    end = args[0] if len(args) == 1 else None
    if isinstance(end, fx.Node):
        end = value(end)
    if end is not None and same(end, it.tokens * it.topk):
        return Tag(TagKind.POSITIONS)
    return None


def _setitem(it: Interpreter, node):
    target, index, new = node.args
    tags = [it.tag(target), it.tag(index), it.tag(new)]
    if (
        None in tags
        or [t.kind for t in tags] != [TagKind.SCRATCH, TagKind.SLOT, TagKind.POSITIONS]
        or tags[0].sort is not tags[1].sort
    ):
        return None
    it.tags[target] = Tag(TagKind.INVERSE, sort=tags[0].sort)  # inv[perm] = arange(T*k): the inverse permutation
    return Tag(TagKind.MUTATION)


def _repeat_interleave(it: Interpreter, node):
    tag = it.tag(node.args[0])
    repeats, dim = argument(node, 1, "repeats"), argument(node, 2, "dim")
    if (
        tag is not None
        and tag.kind in (TagKind.DATA, TagKind.ROUTER)
        and tag.order == RowOrder.T
        and repeats == it.topk
        and dim == 0
    ):
        return replace(tag, order=RowOrder.TK)
    return None


def _transpose(it: Interpreter, node):
    tag = it.tag(node.args[0])
    dims = {d % 3 for d in node.args[1:3] if isinstance(d, int)}
    if tag is not None and tag.kind == TagKind.WEIGHT and dims == {1, 2} and not tag.graph_transposed:
        return replace(tag, graph_transposed=True)
    return None


def _project(it: Interpreter, node, source, weight, transposed: bool, source_order=None, out_order=None):
    """Record a projection of `source` token data by expert weight `weight`; tag its output."""
    tag = it.tag(source)
    if tag is None and it.activation is None:
        tag = _resolve_activation(it, node, source)
    if tag is None or tag.kind != TagKind.DATA or tag.stage not in (0, ACTIVATED):
        return None
    if source_order is not None and tag.order != source_order:
        return None
    stage = UP if tag.stage == 0 else DOWN
    it.projections.append(Projection(node, weight, transposed, stage, source))
    return replace(tag, stage=stage, order=out_order or tag.order)


def _grouped_mm(it: Interpreter, node):
    source, weight, offsets = node.args[0], node.args[1], argument(node, 2, "offs")
    weight_tag, offsets_tag = it.tag(weight), it.tag(offsets)
    if (
        weight_tag is None
        or weight_tag.kind != TagKind.WEIGHT
        or offsets_tag is None
        or offsets_tag.kind != TagKind.OFFSETS
    ):
        return None
    if argument(node, 3, "bias") is not None:
        return None
    tag = _project(it, node, source, weight_tag.param, transposed=not weight_tag.graph_transposed)
    if tag is not None and (tag.order != RowOrder.SORTED or tag.sort is not offsets_tag.sort):
        it.refuse(node, "grouped_mm rows are not sorted by the expert ids its offsets count", tag.stage)
        return None
    return tag


def _bmm(it: Interpreter, node):
    left, right = node.args[:2]
    # W[ids] [S, out, in] @ x [S, in, 1], or x [S, 1, in] @ W[ids] [S, in, out] (weights stored transposed)
    for weight, source, transposed, column in ((left, right, False, -1), (right, left, True, -2)):
        weight_tag = it.tag(weight)
        if weight_tag is None or weight_tag.kind != TagKind.GATHERED or len(shape(weight_tag.param)) != 3:
            continue
        if shape(source)[column] == 1:  # one token row per batch entry
            tag = _project(it, node, source, weight_tag.param, transposed)
            if tag is not None and tag.order != weight_tag.order:
                it.refuse(node, "bmm rows and gathered expert weights are in different orders", tag.stage)
                return None
            return tag
    return None


def _einsum(it: Interpreter, node):
    equation, *operands = node.args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if len(operands) != 2 or "->" not in equation:
        return None
    inputs, out = equation.replace(" ", "").split("->")
    subscripts = inputs.split(",")
    tags = [it.tag(o) for o in operands]
    kinds = [t.kind if t is not None else None for t in tags]
    if TagKind.GATHERED in kinds:  # a projection: x [T, in] or [T, k, in] by W[topk_ids] [T, k, ., .]
        g = kinds.index(TagKind.GATHERED)
        weight_subs, source_subs = subscripts[g], subscripts[1 - g]
        if len(weight_subs) != 4 or tags[g].order != RowOrder.T_K:
            return None
        token, slot, p, q = weight_subs
        contracted = p if p not in out else q  # the weight's `in` dim: q for [E, out, in] storage
        lead, order = {2: (token, RowOrder.T), 3: (token + slot, RowOrder.T_K)}.get(len(source_subs), ("", None))
        if source_subs != lead + contracted or out != token + slot + ({p, q} - {contracted}).pop():
            return None
        return _project(
            it, node, operands[1 - g], tags[g].param, contracted == p, source_order=order, out_order=RowOrder.T_K
        )
    if kinds.count(TagKind.DATA) == 1 and None in kinds and isinstance(operands[kinds.index(None)], fx.Node):
        it.router_candidates.append(operands[kinds.index(None)])
    if sorted(k or "" for k in kinds) == [TagKind.DATA, TagKind.ROUTER]:  # the combine: sum_k router[t, k] * y[t, k, h]
        d = kinds.index(TagKind.DATA)
        data_subs, router_subs = subscripts[d], subscripts[1 - d]
        if (
            tags[d].order != RowOrder.T_K
            or tags[1 - d].order != RowOrder.T_K
            or len(data_subs) != 3
            or router_subs != data_subs[:2]
        ):
            return None
        if out == data_subs[0] + data_subs[2]:
            return _weighted(it, node, tags[d], order=RowOrder.T)
    return None


def _weighted(it: Interpreter, node, tag: Tag, order: str):
    if tag.weighted:
        it.refuse(node, "router weights applied twice", tag.stage)
        return None
    return replace(tag, weighted=True, order=order)


def _mul(it: Interpreter, node):
    left, right = node.args[:2]
    tags = [it.tag(left), it.tag(right)]
    for data, other, other_node in ((tags[0], tags[1], right), (tags[1], tags[0], left)):
        if data is None or data.kind != TagKind.DATA:
            continue
        if other is not None and other.kind == TagKind.ROUTER and other.order == data.order and other.sort is data.sort:
            per_row = all(d == 1 for d in shape(other_node)[ROW_DIMS[data.order] :])  # router[..., None]
            return _weighted(it, node, data, data.order) if per_row else None
        if other is None and isinstance(other_node, fx.Node):
            it.router_candidates.append(other_node)
    return None


def _add(it: Interpreter, node):
    left, right = node.args[:2]
    tag, bias = it.tag(left), it.tag(right)
    if (
        tag is None
        or bias is None
        or tag.kind != TagKind.DATA
        or bias.kind != TagKind.GATHERED
        or len(shape(bias.param)) != 2
    ):
        return None
    if tag.stage not in (UP, DOWN) or tag.stage in it.biases or bias.order != tag.order or bias.sort is not tag.sort:
        return None
    if op_name(node) == "add_" and min(left.users, key=it.order.get) is not node:
        it.refuse(node, "bias added in place after the projection's output was read", tag.stage)
        return None
    it.biases[tag.stage] = bias.param
    return tag


def _sum(it: Interpreter, node):
    tag = it.tag(node.args[0])
    dim = argument(node, 1, "dim")
    if tag is None or tag.kind != TagKind.DATA or tag.order != RowOrder.T_K or argument(node, 2, "keepdim", False):
        return None
    return replace(tag, order=RowOrder.T) if dim in (1, -len(shape(node.args[0])) + 1) else None


MAX_ACTIVATION_NODES = 64  # a gated activation is a handful of elementwise ops


def _resolve_activation(it: Interpreter, projection: fx.Node, source: fx.Node) -> Tag | None:
    """The gated activation feeding a down projection: untagged nodes leading back to the up outputs."""
    chain = [source]  # casts / trailing unsqueezes between the activation and the projection
    while is_cast(chain[-1]) or op_name(chain[-1]) in ("unsqueeze", "squeeze"):
        chain.append(chain[-1].args[0])
    core = chain[-1]
    nodes, inputs, stack = set(), [], [core]
    while stack:
        node = stack.pop()
        if node in nodes or node in inputs:
            continue
        tag = it.tags.get(node)
        if tag is not None and tag.kind == TagKind.DATA and tag.stage == UP:
            inputs.append(node)
            continue
        if tag is not None or node.op not in ("call_function", "call_method") or len(nodes) > MAX_ACTIVATION_NODES:
            it.refuse(projection, f"the activation reads {node.name} from outside the up projections", UP)
            return None
        nodes.add(node)
        stack.extend(node.all_input_nodes)
    tags = [it.tags[i] for i in inputs]
    if not inputs or any(
        t.order != tags[0].order or t.sort is not tags[0].sort or t.weighted != tags[0].weighted for t in tags
    ):
        return None
    inputs.sort(key=it.order.get)
    try:
        found = identify_activation(sorted(nodes, key=it.order.get), inputs, core)
    except NotAnActivation as error:
        it.refuse(projection, f"the gated activation is not proven: {error}", UP)
        return None
    it.activation, it.middle = found, nodes | set(chain[:-1])
    tag = replace(tags[0], stage=ACTIVATED)
    for node in it.middle:
        it.tags[node] = tag
    return tag


LAZY_RULES = {"transpose": _transpose, "arange": _arange}  # views of parameters, aranges

RULES: dict[str, Callable[[Interpreter, fx.Node], Tag | None]] = {
    **dict.fromkeys(("to", "type", "float", "double", "half", "bfloat16", "int", "long", "contiguous"), _cast),
    **dict.fromkeys(("reshape", "view", "flatten"), _reshape),
    **dict.fromkeys(("unsqueeze", "squeeze"), _unsqueeze),
    "sort": _sort,
    "getitem": _getitem,
    "floordiv": _floordiv,
    "histc": _histc,
    "cumsum": _cumsum,
    "empty_like": _empty_like,
    "setitem": _setitem,
    "repeat_interleave": _repeat_interleave,
    "transpose": _transpose,
    "grouped_mm": _grouped_mm,
    "bmm": _bmm,
    "einsum": _einsum,
    "mul": _mul,
    **dict.fromkeys(("add", "add_"), _add),
    "sum": _sum,
}
