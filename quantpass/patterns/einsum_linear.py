"""Linears written as an einsum: `einsum("bk,nk->bn", x, w)`, and on a weight of more than two dims XLNet's
`einsum("ibh,hnd->ibnd", x, q)` (the [H, n, d] weight is the linear [H] -> [n * d]) and
`einsum("ibnd,hnd->ibh", attn_vec, o)` ([n * d] -> [H]), Funnel's `einsum("td,dnh->tnh", r, r_kernel)`.

An equation is a linear when the weight's letters are the ones it contracts followed or preceded by
its free ones, the contracted letters end the activation's in the same order, no letter of the
weight is kept in the output otherwise (no batch letter: `"ibnd,snd->ibns"` is not a linear), and
the output is the activation's free letters then the weight's. The weight is then the parameter
viewed as a matrix (`ParamRef.shape`): [K, N] (contracted first: stored transposed) or [N, K]; the
site flattens the activation's contracted dims and unflattens the output's last dim.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from ..distributed import is_dtensor
from ..problem import Problem
from .fx_match import value
from .linear import LinearSite
from .site import ParamRef


def einsum_linear(equation: str, weight_is_first: bool) -> tuple[int, bool] | None:
    """(how many letters it contracts, the weight is stored [K, N]) where `equation` is a linear of
    its activation with its weight (the first or the second operand), else None."""
    if not isinstance(equation, str) or "->" not in equation or "." in equation:
        return None
    inputs, out = equation.replace(" ", "").split("->")
    operands = inputs.split(",")
    if len(operands) != 2 or any(len(set(o)) != len(o) for o in operands):
        return None
    w, x = operands if weight_is_first else operands[::-1]
    contracted = "".join(c for c in x if c in w)
    if not contracted or any(c in out for c in contracted) or not x.endswith(contracted):
        return None
    if w.startswith(contracted):
        free, stored_kn = w[len(contracted) :], True
    elif w.endswith(contracted):
        free, stored_kn = w[: len(w) - len(contracted)], False
    else:
        return None
    if not free or out != x[: len(x) - len(contracted)] + free:
        return None
    return len(contracted), stored_kn


def find_einsum_linear_sites(graph: fx.Graph, params: dict[fx.Node, ParamRef], claimed=frozenset()) -> list:
    sites = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not torch.einsum or node in claimed or len(node.args) != 3:
            continue
        equation, first, second = node.args
        weight_is_first = first in params and second not in params
        weight, x = (first, second) if weight_is_first else (second, first)
        stored = value(weight)
        if weight not in params or x in params or not isinstance(stored, torch.Tensor) or stored.dim() < 2:
            continue
        form = einsum_linear(equation, weight_is_first)
        if form is None or is_dtensor(stored):  # a shard's local view is no matrix of the whole
            continue
        contracted, stored_kn = form
        shape = tuple(int(d) for d in stored.shape)
        unflat = shape[contracted:] if stored_kn else shape[:-contracted]  # the weight's free dims: N
        n = math.prod(unflat)
        k = math.prod(shape) // n
        ref = params[weight]
        matrix = None if len(shape) == 2 else (k, n) if stored_kn else (n, k)
        ref = ParamRef(ref.node, ref.index, ref.name, transposed=stored_kn, shape=matrix)
        fqn = ref.name.removesuffix(".weight")
        site = LinearSite(fqn, [ref], Problem(n, k), node=node, x=x, flat=contracted, unflat=unflat)
        site.notes.append(f"einsum {equation!r}: the [{', '.join(map(str, shape))}] weight as a linear")
        sites.append(site)
    return sites
