"""Reading FX nodes the way every matcher does: a call's op as one name, its arguments by position or
keyword, its example value and shape, and the op tables the linear and MoE matchers share."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

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


def reaches(node: fx.Node, found, hops: int, through=lambda node: True) -> fx.Node | None:
    """The first node `found` accepts among the users of `node` within `hops` steps, stepping on only
    through nodes `through` accepts; None if there is none (so: whether `node` reaches one)."""
    frontier = list(node.users)
    for _ in range(hops):
        if (hit := next((u for u in frontier if found(u)), None)) is not None:
            return hit
        frontier = [v for u in frontier if through(u) for v in u.users]
    return None


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


RESHAPES = {"view", "reshape", "unflatten", "transpose", "permute", "t", "unsqueeze", "squeeze", "expand", "getitem"}


def is_reshape(node: fx.Node) -> bool:
    """A view, transpose, index or cast of its input: the same values in another layout (`w.T` included)."""
    return op_name(node) in RESHAPES | CASTS or (node.op == "call_function" and node.target is getattr)
