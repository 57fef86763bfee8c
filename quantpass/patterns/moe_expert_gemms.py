"""Experts that can't be proven a fused MoE, quantized GEMM by GEMM.

When `find_moe_sites` cannot prove an experts region (an activation it does not know, a routing
form it does not follow), its 3-D expert weights are still quantized: each one is held quantized
with the moe spec's weight key and `quantpass::dequantize_weight` rebuilds the dense weight on
every call, so the graph's own `_grouped_mm` / `bmm` / `einsum` and everything between them
(routing, activation, combine) run unchanged. Activation quantization cannot apply to a GEMM that
is not ours: the site applies the spec weight-only, and its plan row says so and why (the lowering:
`passes/lower_expert_gemms.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from ..passes.fx_utils import mutated
from ..problem import Problem
from ..quant_registry.names import Kind
from .fx_match import op_name, value
from .site import ParamRef, Site


@dataclass(frozen=True)
class ExpertMatmul:
    """A matmul with a 3-D expert weight operand, found by `moe._anchor_groups`."""

    node: fx.Node
    weight: fx.Node  # the [E, ., .] parameter placeholder
    source: fx.Node  # its token operand
    transposed: bool  # the weight is stored [E, in, out] (contracted on dim -2)


@dataclass
class ExpertGemmSite(Site):
    """The 3-D weights of one unproven experts region; `params` in first-use order."""

    kind = Kind.MOE
    why: str = ""  # why the region is not a provable fused MoE
    forms: tuple[str, ...] = ()  # the graph's expert matmul ops (grouped_mm, bmm, einsum)
    last: fx.Node | None = None  # the last node that reads these weights (an expert matmul)

    @property
    def output_node(self) -> fx.Node:
        """The last reader of the weights: verify's graph run builds the site (and may release the
        original weights) when it gets there. The rewrite leaves it in place."""
        return self.last

    @property
    def input_nodes(self) -> list[fx.Node]:
        """None: an expert matmul's real rows can't be checked without their routing, so verify
        runs every expert on sample rows."""
        return []


def expert_gemm_site(
    fqn: str, matmuls: list[ExpertMatmul], params: dict, why: str, taken: set, order: dict[fx.Node, int]
) -> ExpertGemmSite:
    """The weights of an unproven experts region as one site. A weight `taken` by a proven region,
    written in place in the graph, or not floating point stays as it is; with none left the site
    is skipped, and its plan row says why."""
    refs: dict[fx.Node, ParamRef] = {}
    kept: dict[str, str] = {}  # weight name -> why it is not quantized here
    for matmul in matmuls:
        weight, name = matmul.weight, params[matmul.weight].name
        if weight in refs or name in kept:
            continue
        if weight in taken:
            kept[name] = "quantized by a proven experts region"
        elif any(mutated(user) is weight for user in weight.users):
            kept[name] = "written in place in the graph"
        elif not value(weight).is_floating_point():
            kept[name] = f"dtype {value(weight).dtype}"
        else:
            refs[weight] = ParamRef(weight, params[weight].index, name, matmul.transposed)
    forms = tuple(dict.fromkeys(op_name(m.node) for m in matmuls))
    if not refs:
        kept_text = (
            "; ".join(f"{name}: {reason}" for name, reason in kept.items()) or "no expert matmul outside proven regions"
        )
        skip = f"not a provable fused MoE ({why}), and no weight to quantize one by one ({kept_text})"
        return ExpertGemmSite(fqn, [], Problem(0, 0), skip, why=why, forms=forms)
    first = next(iter(refs.values()))
    experts, rows, cols = (int(d) for d in first.matrix(value(first.node)).shape)
    readers = [m.node for m in matmuls] + [user for weight in refs for user in weight.users]
    last = max(readers, key=order.get)
    site = ExpertGemmSite(
        fqn, list(refs.values()), Problem(rows, cols, experts=experts), why=why, forms=forms, last=last
    )
    site.notes += [f"{name} left unquantized: {reason}" for name, reason in kept.items()]
    return site
