"""Experts that can't be proven a fused MoE, quantized GEMM by GEMM.

When `find_moe_sites` cannot prove an experts region (an activation it does not know, a routing
form it does not follow), its 3-D expert weights are still quantized: each one is held quantized
with the moe spec's weight key and `quantpass::dequantize_weight` rebuilds the dense weight on
every call, so the graph's own `_grouped_mm` / `bmm` / `einsum` and everything between them
(routing, activation, combine) run unchanged. Activation quantization cannot apply to a GEMM that
is not ours: the site applies the spec weight-only, and its plan row says so and why.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..kernels import ops
from ..kernels.oracle import Problem, Selection
from ..passes.fx_utils import mutated
from ..quant_registry.spec import QuantSpec
from .moe_subgraph import op_name, value
from .site import ParamRef, Site

BACKEND = "reference"  # the dequantize op is the reference's `dequantize`; the GEMM is the graph's
SAMPLE_TOKENS = 16  # rows of each weight's sample input in `verify`


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

    kind = "moe"
    why: str = ""  # why the region is not a provable fused MoE
    forms: tuple[str, ...] = ()  # the graph's expert matmul ops (grouped_mm, bmm, einsum)
    last: fx.Node | None = None  # the last node that reads these weights (an expert matmul)

    @property
    def weight_count(self) -> int:
        return len(self.params)

    @property
    def output_node(self) -> fx.Node:
        """The last reader of the weights: verify's graph run builds the site (and may release the
        original weights) when it gets there. `rewrite` leaves it in place."""
        return self.last

    @property
    def input_nodes(self) -> list[fx.Node]:
        """None: an expert matmul's real rows can't be checked without their routing, so verify
        runs every expert on sample rows (`sample_inputs`)."""
        return []

    def choose_backend(self, spec, capability, named):
        applied = QuantSpec(spec.weight, activation=None)
        ignored = f"; backend {named!r} runs fused experts only" if named not in (None, "auto", BACKEND) else ""
        reason = (
            f"experts quantized one by one ({spec.weight} weights, dequantized per call, activations unquantized; "
            f"the graph's own {'/'.join(self.forms)} runs on them{ignored}): not a provable fused MoE: {self.why}"
        )
        return applied, Selection(BACKEND, reason)

    def prepare(self, weights, spec, backend):
        return weights  # formats.py's layout: what `dequantize_weight` reads

    def _dense(self, ref: ParamRef, tensors, spec) -> tuple:
        """`dequantize_weight`'s arguments for one weight: back to its stored layout and dtype."""
        stored = value(ref.node)
        rows, cols = (int(d) for d in ref.matrix(stored).shape[-2:])
        data, scale, scale2 = tensors[:3]  # (the rewrite's 4th slot, a static input scale, is never set here)
        return (data, scale, scale2, ops.key_arg(spec.weight), rows, cols, stored.dtype, ref.transposed)

    def rewrite(self, graph, weights, spec, backend, device_type, differentiable=False):
        """Every read of each weight placeholder reads the dequantized weight instead. No backward is
        needed for `differentiable`: gradients reach the inputs through the graph's own matmuls."""
        order = {node: i for i, node in enumerate(graph.nodes)}
        for ref, tensors in zip(self.params, weights):
            users = list(ref.node.users)
            with graph.inserting_before(min(users, key=order.get)):
                dense = graph.call_function(
                    torch.ops.quantpass.dequantize_weight.default, self._dense(ref, tensors, spec)
                )
            stored = value(ref.node)
            dense.meta["val"] = dense.meta["example_value"] = torch.empty_like(stored, requires_grad=False)
            for user in users:
                user.replace_input_with(ref.node, dense)
        return self.last

    def sample_inputs(self, like, device, dtype):
        """N(0, 1) rows for each weight. `like` is not used: the SQNR of a product linear in its
        input does not depend on the input's scale, and a graph input is no activation statistic."""
        generator = torch.Generator().manual_seed(0)
        shapes = [(SAMPLE_TOKENS, ref.matrix(value(ref.node)).shape[-1]) for ref in self.params]
        return [
            torch.randn(*s, generator=generator).to(device, value(r.node).dtype) for s, r in zip(shapes, self.params)
        ]

    def run_original(self, inputs, values):
        """Each sample row through every expert of every weight: [sum of T * E * N] fp32."""
        return _all_experts(inputs, [ref.matrix(v) for ref, v in zip(self.params, values)])

    def run_quantized(self, inputs, weights, spec, backend, device_type):
        dense = [
            torch.ops.quantpass.dequantize_weight(*self._dense(ref, qt.tensors(), spec))
            for ref, qt in zip(self.params, weights)
        ]
        return _all_experts(inputs, [ref.matrix(d) for ref, d in zip(self.params, dense)])


def _all_experts(inputs: list[torch.Tensor], matrices: list[torch.Tensor]) -> torch.Tensor:
    outs = [torch.einsum("tk,enk->ten", x.float(), w.float()).flatten() for x, w in zip(inputs, matrices)]
    return torch.cat(outs)


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
