"""Grouped linears: a 2-D weight's rows split into G groups, group g multiplying slice g of the input.

DeepSeek-V4's attention output (`DeepseekV4GroupedLinear`, `self_attn.o_a_proj`: 8 groups of 1024 rows
x 4096 in V4-Flash, 33.5M weights a layer) computes

    w = self.weight.view(G, -1, K).transpose(1, 2)        # [G, K, R]
    y = torch.bmm(x, w)                                   # x [G, T, K] -> [G, T, R]

It is no `F.linear`, so it was left unquantized ("read by no linear the pass knows"). As a site it is
the weight `[G * R, K]` quantized as one linear weight (its scales, per-tensor ones included, are the
whole layer's: a checkpoint's), run as G linears on row slices (`passes/lower_grouped_linear.py`).

The same form on a 3-D weight `[G, R, K]` is G linears side by side: Inkling's shared experts
(`torch.bmm(x.expand(G, -1, -1), self.gate_proj.transpose(1, 2))`, every token through each of
them, no routing) were left unquantized as "outside the MoE forms". Those are quantized as G
matrices (per-matrix scales, as experts are), group g running on matrix g. A 3-D weight an MoE
site holds (experts, proven or not) is the MoE pass's, never a grouped linear.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..problem import Problem
from .fx_match import op_name, value
from .linear import LinearSite
from .site import ParamRef

BATCHED = {torch.bmm, torch.matmul, operator.matmul}
VIEWS = {"view", "reshape", "unflatten"}


@dataclass
class GroupedLinearSite(LinearSite):
    """`node` = bmm(x [G, T, K], weight viewed [G, K, R]); `groups` = G, `problem` one group's (R, K);
    `stacked`: the weight is stored `[G, R, K]` (group g is matrix g), else `[G * R, K]` (rows)."""

    groups: int = 1
    stacked: bool = False

    @property
    def input_nodes(self) -> list[fx.Node]:
        """None: x's rows are the groups' slices, each for its own weights; verify uses sample rows."""
        return []


def _swaps_last_two(node) -> fx.Node | None:
    """`source` where `node` is `source.transpose(1, 2)` (or (-2, -1), `.mT`) of a 3-D value, else None."""
    if not isinstance(node, fx.Node):
        return None
    if _is_mt(node):
        return node.args[0]
    if op_name(node) != "transpose":
        return None
    dims = {d % 3 for d in node.args[1:3] if isinstance(d, int)}
    return node.args[0] if dims == {1, 2} else None


def _is_mt(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is getattr and node.args[1] == "mT"


def find_grouped_linear_sites(graph: fx.Graph, params: dict, claimed=frozenset()) -> list[GroupedLinearSite]:
    """Every batched matmul whose second operand is a transposed `[G, R, K]`: a 2-D parameter viewed so,
    or a 3-D parameter."""
    sites = []
    for node in graph.nodes:
        if node in claimed or node.op != "call_function" or node.target not in BATCHED or len(node.args) != 2:
            continue
        x, operand = node.args
        grouped = _swaps_last_two(operand)
        stacked = grouped in params
        source = grouped if stacked else _viewed_param(grouped, params)
        if source is None or (shape := value(grouped)) is None or shape.dim() != 3 or _dims(x) != 3:
            continue
        groups, rows, k = (int(d) for d in shape.shape)
        if value(source).dim() != (3 if stacked else 2) or k != value(source).shape[-1]:
            continue  # not whole rows of the weight per group
        ref = ParamRef(params[source].node, params[source].index, params[source].name)
        site = GroupedLinearSite(
            ref.name.removesuffix(".weight"), [ref], Problem(rows, k), node=node, x=x, groups=groups, stacked=stacked
        )
        form = "matrices" if stacked else "groups"
        site.notes.append(f"{groups} {form} of {rows} rows, each a linear on its slice of the input")
        sites.append(site)
    return sites


def _viewed_param(node, params: dict) -> fx.Node | None:
    """The 2-D parameter `node` is a view of, or None."""
    if node is None or op_name(node) not in VIEWS or node.args[0] not in params:
        return None
    return node.args[0]


def _dims(node) -> int | None:
    found = value(node)
    return found.dim() if isinstance(found, torch.Tensor) else None
