"""Unproven experts lowered GEMM by GEMM: each 3-D weight read through `quantpass::dequantize_weight`
under the graph's own expert matmuls, weight-only (`patterns/moe_expert_gemms.py` says why)."""

from __future__ import annotations

import torch

from ..kernels import ops
from ..kernels.oracle import Selection
from ..patterns.fx_match import value
from ..patterns.moe_expert_gemms import ExpertGemmSite
from ..patterns.site import ParamRef
from ..quant_registry.spec import QuantSpec
from .lower_site import SiteLowering

BACKEND = "reference"  # the dequantize op is the reference's `dequantize`; the GEMM is the graph's
SAMPLE_TOKENS = 16  # rows of each weight's sample input in `verify`


class ExpertGemmLowering(SiteLowering):
    def weight_count(self, site: ExpertGemmSite) -> int:
        return len(site.params)

    def choose_backend(self, site: ExpertGemmSite, spec, capability, named):
        applied = QuantSpec(spec.weight, activation=None)
        ignored = f"; backend {named!r} runs fused experts only" if named not in (None, "auto", BACKEND) else ""
        reason = (
            f"experts quantized one by one ({spec.weight} weights, dequantized per call, activations unquantized; "
            f"the graph's own {'/'.join(site.forms)} runs on them{ignored}): not a provable fused MoE: {site.why}"
        )
        return applied, Selection(BACKEND, reason)

    def prepare(self, site: ExpertGemmSite, weights, spec, backend):
        return weights  # formats.py's layout: what `dequantize_weight` reads

    def _dense(self, ref: ParamRef, tensors, spec) -> tuple:
        """`dequantize_weight`'s arguments for one weight: back to its stored layout and dtype."""
        stored = value(ref.node)
        rows, cols = (int(d) for d in ref.matrix(stored).shape[-2:])
        data, scale, scale2 = tensors[:3]  # (the rewrite's 4th slot, a static input scale, is never set here)
        return (data, scale, scale2, ops.key_arg(spec.weight), rows, cols, stored.dtype, ref.transposed)

    def rewrite(self, site: ExpertGemmSite, graph, weights, spec, backend, device_type, differentiable=False):
        """Every read of each weight placeholder reads the dequantized weight instead. No backward is
        needed for `differentiable`: gradients reach the inputs through the graph's own matmuls."""
        order = {node: i for i, node in enumerate(graph.nodes)}
        for ref, tensors in zip(site.params, weights):
            users = list(ref.node.users)
            with graph.inserting_before(min(users, key=order.get)):
                dense = graph.call_function(
                    torch.ops.quantpass.dequantize_weight.default, self._dense(ref, tensors, spec)
                )
            stored = value(ref.node)
            dense.meta["val"] = dense.meta["example_value"] = torch.empty_like(stored, requires_grad=False)
            for user in users:
                user.replace_input_with(ref.node, dense)
        return site.last

    def sample_inputs(self, site: ExpertGemmSite, like, device, dtype):
        """N(0, 1) rows for each weight. `like` is not used: the SQNR of a product linear in its
        input does not depend on the input's scale, and a graph input is no activation statistic."""
        generator = torch.Generator().manual_seed(0)
        shapes = [(SAMPLE_TOKENS, ref.matrix(value(ref.node)).shape[-1]) for ref in site.params]
        return [
            torch.randn(*s, generator=generator).to(device, value(r.node).dtype) for s, r in zip(shapes, site.params)
        ]

    def run_original(self, site: ExpertGemmSite, inputs, values):
        """Each sample row through every expert of every weight: [sum of T * E * N] fp32."""
        return _all_experts(inputs, [ref.matrix(v) for ref, v in zip(site.params, values)])

    def run_quantized(self, site: ExpertGemmSite, inputs, weights, spec, backend, device_type):
        dense = [
            torch.ops.quantpass.dequantize_weight(*self._dense(ref, qt.tensors(), spec))
            for ref, qt in zip(site.params, weights)
        ]
        return _all_experts(inputs, [ref.matrix(d) for ref, d in zip(site.params, dense)])


def _all_experts(inputs: list[torch.Tensor], matrices: list[torch.Tensor]) -> torch.Tensor:
    """Expert by expert: an fp32 copy of one expert's matrix at a time, not of the whole [E, N, K] weight
    (that made verify's transient 5x a weight's bf16 bytes: compiling Llama 4 peaked at 1.58x the
    unquantized run's RSS, 1.12x without verify; bench/README.md, "Memory")."""
    return torch.cat(
        [(x.float() @ w[e].float().t()).flatten() for x, w in zip(inputs, matrices) for e in range(len(w))]
    )
