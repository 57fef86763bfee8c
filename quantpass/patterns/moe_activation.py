"""The gated activation of an experts region, identified by its structure (never by running it).

The nodes between the up projection(s) and the down projection are normalized into one expression
term, which must equal the same normalization of the reference's own `gated_activation`, traced
with `torch.fx` for each activation x gate/up layout (so what is matched is what the fused kernels
compute). Normalizing maps equivalent spellings to one form:

- casts between float dtypes (and `contiguous`) are dropped: they change rounding, not the math;
- a torch function, its method and its operator are one op (`torch.mul`, `x.mul`, `a * b`);
- `silu` and `gelu` expand to their formulas in primitive ops (`x * sigmoid(x)`, ...), so the op
  and the formula transformers writes out (`gelu_new`) give the same term;
- the gate and up halves of a fused `[.., 2I]` projection (`chunk`, `split`, slices) become
  `half(x, 0|1, concat|interleaved)`;
- products and sums are flattened and their operands sorted.

Every node must normalize: an op the normalizer does not know (`where`, `nan_to_num`, ...) is
refused, and one it knows that the candidates lack (an extra `clamp(max=50)`) makes the terms
differ. Either way the region is not proven, whatever the op does on typical inputs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from ..moe_problem import ACTIVATIONS, GATE_UP_LAYOUTS, gated_activation
from ..passes.fx_utils import mutated
from .fx_match import argument, op_name, shape, value

Term = tuple  # (op, *operands); an operand is a Term, a float constant, None or a string
ALIASES = {"div": "truediv", "true_divide": "truediv", "multiply": "mul", "subtract": "sub", "clip": "clamp"}
FLOAT_CASTS = {"to", "type", "float", "double", "half", "bfloat16", "contiguous"}
UNARY = {"sigmoid", "tanh", "erf", "exp", "neg"}
COMMUTATIVE = {"mul", "add"}
BINARY = {
    "sub": ("input", "other", "alpha"),
    "truediv": ("input", "other", "rounding_mode"),
    "pow": ("input", "exponent"),
}


CLAMPED = ("swigluoai", "silu_clamped")  # activations with a limit read from the graph's clamps


class NotAnActivation(ValueError):
    """The nodes are not one of the supported gated activations; the message says why."""


@dataclass(frozen=True)
class MatchedActivation:
    """A gated activation found in a graph: `moe_problem.GatedActivation`'s fields (what the fused op
    is given) and, for separate gate and up projections, which input is the gate."""

    activation: str  # moe_problem.ACTIVATIONS
    gate_up_layout: str  # "concat" | "interleaved"
    alpha: float = 0.0  # swigluoai only
    limit: float = 0.0  # swigluoai and silu_clamped
    gate_input: int = 0  # with separate gate and up projections: which input is the gate


def identify_activation(nodes: list[fx.Node], inputs: list[fx.Node], output: fx.Node) -> MatchedActivation:
    """Which gated activation `nodes` (in graph order) compute from the up projection(s) `inputs`.

    One input `[.., 2I]` (fused gate/up) or two `[.., I]` (separate gate and up projections).
    GPT-OSS's alpha and limit and DeepSeek-V4's limit are read from the graph's constants (`gate * alpha`,
    `clamp(max=limit)`) and must then appear exactly where the reference puts them. Raises NotAnActivation.
    """
    env: dict[fx.Node, Term] = {node: ("input", i) for i, node in enumerate(inputs)}
    inside = set(nodes)
    for node in nodes:
        writers = [user.name for user in node.users if mutated(user) is node and user not in inside]
        if writers:
            raise NotAnActivation(f"{node.name} is written in place by {', '.join(writers)}")
        env[node] = normalize(node, env)
    found = env[output]
    orders = [(0, 1), (1, 0)] if len(inputs) == 2 else [(0,)]
    layouts = GATE_UP_LAYOUTS if len(inputs) == 1 else ("concat",)
    for order in orders:
        for candidate in _candidates(nodes, layouts):
            if found == _traced(candidate, order):
                return replace(candidate, gate_input=order[0])
    raise NotAnActivation(
        f"it computes {render(found)}, which is none of {', '.join(ACTIVATIONS)} (gate/up concat or interleaved)"
    )


def _candidates(nodes, layouts):
    alphas, limits = set(), set()
    for node in nodes:
        name = op_name(node)
        if name == "mul":
            alphas |= {float(a) for a in node.args if isinstance(a, float)}
        elif name in ("clamp", "clamp_min", "clamp_max", "clip"):
            bounds = [*node.args[1:], *node.kwargs.values()]
            limits |= {abs(float(b)) for b in bounds if isinstance(b, int | float)}
    for layout in layouts:
        for activation in ACTIVATIONS:
            if activation not in CLAMPED:
                yield MatchedActivation(activation, layout)
        for limit in sorted(limits):
            yield MatchedActivation("silu_clamped", layout, limit=limit)
            for alpha in sorted(alphas):
                yield MatchedActivation("swigluoai", layout, alpha, limit)


@functools.cache
def _traced(candidate: MatchedActivation, order: tuple[int, ...]) -> Term:
    """The reference's `gated_activation` for `candidate`, traced and normalized. With two inputs the
    gate is input `order[0]`: traced as `gated_activation(cat([gate, up]))`, halves of a `cat` fold."""
    activation, layout, alpha, limit = candidate.activation, candidate.gate_up_layout, candidate.alpha, candidate.limit
    if len(order) == 1:
        graph = fx.symbolic_trace(lambda h: gated_activation(h, activation, layout, alpha, limit)).graph
    else:
        gate, up = order

        def two(x0, x1):
            return gated_activation(torch.cat([(x0, x1)[gate], (x0, x1)[up]], dim=-1), activation, layout, alpha, limit)

        graph = fx.symbolic_trace(two).graph
    return _normalize_graph(graph)


def _normalize_graph(graph: fx.Graph) -> Term:
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    env: dict[fx.Node, Term] = {node: ("input", i) for i, node in enumerate(placeholders)}
    for node in graph.nodes:
        if node.op in ("call_function", "call_method"):
            env[node] = normalize(node, env)
    return env[graph.output_node().args[0]]


# ----------------------------------------------------------------------------- normalizing


def normalize(node: fx.Node, env: dict[fx.Node, Term]) -> Term:
    """The term of `node`, its operands' terms in `env`; raises NotAnActivation naming the node."""
    name = op_name(node)
    name = ALIASES.get(name, name)
    rule = RULES.get(name, _unary if name in UNARY else None)
    if rule is None:
        raise NotAnActivation(f"{node.name} = {name or node.target}(...) is not an op of a gated activation")
    operand = functools.partial(_operand, node, env)
    return rule(node, name, operand)


def _operand(node: fx.Node, env: dict, arg):
    if isinstance(arg, fx.Node):
        if arg not in env:
            raise NotAnActivation(f"{node.name} reads {arg.name}, which is not part of the activation")
        return env[arg]
    if isinstance(arg, bool) or not isinstance(arg, int | float):
        return arg
    return float(arg)


def _bind(node: fx.Node, params: tuple[str, ...], defaults: dict | None = None) -> list:
    """The node's arguments by parameter name; an argument the op's rule does not expect raises."""
    defaults = defaults or {}
    if len(node.args) > len(params):
        raise NotAnActivation(f"{node.name}: {len(node.args)} arguments to {op_name(node)}, expected {len(params)}")
    bound = dict(zip(params, node.args))
    for key, val in node.kwargs.items():
        if key not in params or key in bound:
            raise NotAnActivation(f"{node.name}: {op_name(node)}({key}=...) is not a supported argument")
        bound[key] = val
    missing = [p for p in params if p not in bound and p not in defaults]
    if missing:
        raise NotAnActivation(f"{node.name}: {op_name(node)} without {missing[0]}")
    return [bound.get(p, defaults.get(p)) for p in params]


def make(op: str, *operands) -> Term:
    """A term with products and sums flattened and their operands sorted."""
    if op not in COMMUTATIVE:
        return (op, *operands)
    flat = []
    for operand in operands:
        flat.extend(operand[1:] if isinstance(operand, tuple) and operand[0] == op else [operand])
    return (op, *sorted(flat, key=repr))


def _substitute(term, variable: Term, replacement: Term):
    if term == variable:
        return replacement
    if not isinstance(term, tuple):
        return term
    return make(term[0], *(_substitute(t, variable, replacement) for t in term[1:]))


def _cast(node, name, operand):
    source = node.args[0]
    before, after = value(source), value(node)
    floats = all(isinstance(v, torch.Tensor) and v.is_floating_point() for v in (before, after))
    if not floats:
        raise NotAnActivation(f"{node.name} = {name}(...) is not a cast between float dtypes")
    return operand(source)


def _commutative(node, name, operand):
    params, defaults = ("input", "other", "alpha"), {"alpha": None}
    left, right, alpha = _bind(node, params, defaults)
    if alpha is not None:
        raise NotAnActivation(f"{node.name}: {name}(alpha={alpha}) is not supported")
    return make(name, operand(left), operand(right))


def _binary(node, name, operand):
    params = BINARY[name]
    left, right, *options = _bind(node, params, dict.fromkeys(params[2:]))
    if any(option is not None for option in options):
        raise NotAnActivation(f"{node.name}: {name}({params[2]}={options[0]!r}) is not supported")
    return (name, operand(left), operand(right))


def _unary(node, name, operand):
    (source,) = _bind(node, ("input",))
    return (name, operand(source))


def _silu(node, name, operand):
    source, inplace = _bind(node, ("input", "inplace"), {"inplace": False})
    if inplace:
        raise NotAnActivation(f"{node.name}: silu(inplace=True) is not supported")
    return _expanded("silu", operand(source))


def _gelu(node, name, operand):
    source, approximate = _bind(node, ("input", "approximate"), {"approximate": "none"})
    if approximate not in ("none", "tanh"):
        raise NotAnActivation(f"{node.name}: gelu(approximate={approximate!r}) is not supported")
    return _expanded("gelu" if approximate == "none" else "gelu_tanh", operand(source))


def _clamp(node, name, operand):
    if name == "clamp_min":
        source, low = _bind(node, ("input", "min"))
        return ("clamp", operand(source), operand(low), None)
    if name == "clamp_max":
        source, high = _bind(node, ("input", "max"))
        return ("clamp", operand(source), None, operand(high))
    source, low, high = _bind(node, ("input", "min", "max"), {"min": None, "max": None})
    return ("clamp", operand(source), operand(low), operand(high))


def _last_dim(node: fx.Node, source, dim) -> bool:
    dims = shape(source)
    return dim == -1 or (dims is not None and dim == len(dims) - 1)


def _chunk(node, name, operand):
    source, chunks, dim = _bind(node, ("input", "chunks", "dim"), {"dim": 0})
    if chunks != 2 or not _last_dim(node, source, dim):
        raise NotAnActivation(f"{node.name}: chunk({chunks}, dim={dim}) does not halve the last dim")
    return ("pair", operand(source), "concat")


def _split(node, name, operand):
    source, dim = node.args[0], argument(node, 2, "dim")
    size = argument(node, 1, ("split_size", "split_size_or_sections"))
    width = (shape(source) or (None,))[-1]
    half = width // 2 if isinstance(width, int) and width % 2 == 0 else None
    if half is None or size not in (half, [half, half], (half, half)) or not _last_dim(node, source, dim or 0):
        raise NotAnActivation(f"{node.name}: split({size}, dim={dim}) does not halve the last dim")
    return ("pair", operand(source), "concat")


def _getitem(node, name, operand):
    source, index = node.args
    term = operand(source)
    if isinstance(term, tuple) and term[0] == "pair" and index in (0, 1):
        return _half(term[1], index, term[2])
    which, layout = _sliced_half(source, index)
    return _half(term, which, layout)


def _half(source: Term, which: int, layout: str) -> Term:
    """One half of a fused gate/up tensor; a half of `cat([x0, x1])` (two projections) is x0 or x1."""
    if source[0] == "cat" and layout == "concat" and all(part[0] == "input" for part in source[1:]):
        return source[1 + which]
    return ("half", source, which, layout)


def _sliced_half(source: fx.Node, index) -> tuple[int, str]:
    """(0 | 1, layout) for `x[..., ::2]`, `x[..., 1::2]`, `x[..., :I]`, `x[..., I:]` (also `x[:, ...]`)."""
    dims = shape(source)
    index = index if isinstance(index, tuple) else (index,)
    leading, last = index[:-1], index[-1] if index else None
    full = slice(None)
    ok_leading = leading in ((Ellipsis,), (full,) * (len(dims or ()) - 1))
    if ok_leading and isinstance(last, slice):
        start, stop, step = last.start or 0, last.stop, last.step or 1
        width = dims[-1] if dims is not None else None
        if step == 2 and stop is None and start in (0, 1):
            return start, "interleaved"
        if step == 1 and isinstance(width, int) and width % 2 == 0:
            if (start, stop) == (0, width // 2):
                return 0, "concat"
            if start == width // 2 and stop in (None, width):
                return 1, "concat"
    raise NotAnActivation(f"indexing {source.name}[{index}] is not a gate/up half")


def _cat(node, name, operand):
    tensors, dim = _bind(node, ("tensors", "dim"), {"dim": 0})
    if dim != -1 or not isinstance(tensors, list | tuple):
        raise NotAnActivation(f"{node.name}: cat(dim={dim}) is not a gate/up concatenation")
    return ("cat", *(operand(t) for t in tensors))


RULES: dict[str, Callable] = {
    **dict.fromkeys(FLOAT_CASTS, _cast),
    **dict.fromkeys(COMMUTATIVE, _commutative),
    **dict.fromkeys(BINARY, _binary),
    "silu": _silu,
    "gelu": _gelu,
    **dict.fromkeys(("clamp", "clamp_min", "clamp_max"), _clamp),
    "chunk": _chunk,
    "split": _split,
    "getitem": _getitem,
    "cat": _cat,
}


# Composite activations written out in primitive ops (transformers' own spellings: `SiLU`'s
# definition, `GELUActivation._gelu_python`, `NewGELUActivation`); `silu`/`gelu` nodes expand to these.
EXPANSIONS: dict[str, Callable] = {
    "silu": lambda x: x * torch.sigmoid(x),
    "gelu": lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))),
    "gelu_tanh": lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))),
}


@functools.cache
def _expansion(name: str) -> Term:
    return _normalize_graph(fx.symbolic_trace(EXPANSIONS[name]).graph)


def _expanded(name: str, operand: Term) -> Term:
    return _substitute(_expansion(name), ("input", 0), operand)


def render(term, limit: int = 240) -> str:
    """A term as text for error messages, e.g. `mul(half(in0, 1, concat), sigmoid(...), ...)`."""

    def text(t):
        if isinstance(t, tuple) and t and t[0] == "input":
            return f"in{t[1]}"
        if isinstance(t, tuple):
            return f"{t[0]}({', '.join(text(a) for a in t[1:])})"
        return f"{t:g}" if isinstance(t, float) else str(t)

    out = text(term)
    return out if len(out) <= limit else out[: limit - 3] + "..."
