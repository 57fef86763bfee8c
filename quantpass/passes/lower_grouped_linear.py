"""Grouped linears lowered to G `quantpass::linear` calls, one per row slice of the quantized weight,
stacked back into the batched matmul's `[G, T, R]` (`patterns/grouped_linear.py` says what they are)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import ops
from ..patterns.fx_match import value
from ..patterns.grouped_linear import GroupedLinearSite
from ..quant_registry.formats import dequantize, quantize
from ..quant_registry.names import Kind
from ..quant_registry.qtensor import QTensor
from .lower_linear import LinearLowering


class GroupedLinearLowering(LinearLowering):
    def weight_count(self, site: GroupedLinearSite) -> int:
        return site.groups

    def signature(self, site: GroupedLinearSite) -> tuple:
        return (site.groups,)

    def prepare(self, site: GroupedLinearSite, weights, spec, backend):
        rows, weight = site.problem.n, weights[0]
        groups = [
            weight[g] if site.stacked else group_rows(weight, g * rows, (g + 1) * rows, site.fqn)
            for g in range(site.groups)
        ]
        return [ops.prepare_weight(backend, Kind.LINEAR, group) for group in groups]

    def rewrite(self, site: GroupedLinearSite, graph, weights, spec, backend, device_type, differentiable=False):
        target = ops.linear_call(backend, device_type, differentiable)
        x, out = value(site.x), value(site.node)
        parts = []
        with graph.inserting_before(site.node):
            for g in range(site.groups):
                rows = graph.call_function(torch.select, (site.x, 0, g))
                rows.meta["val"] = rows.meta["example_value"] = x[g]
                part = graph.call_function(target, self.op_args(site, rows, weights[g], None, spec, backend))
                part.meta["val"] = part.meta["example_value"] = out[g]
                parts.append(part)
            new = graph.call_function(torch.stack, (parts, 0))
        new.meta.update(site.node.meta)
        site.node.replace_all_uses_with(new)
        graph.erase_node(site.node)
        return new

    def run_original(self, site: GroupedLinearSite, inputs, values):
        """Sample rows through every group's weights: `[T, G * R]`."""
        weight = site.weight.matrix(values[0]).reshape(-1, site.problem.k)  # [G * R, K]
        return F.linear(inputs[0], weight.to(inputs[0].dtype))

    def run_quantized(self, site: GroupedLinearSite, inputs, weights, spec, backend, device_type):
        target = ops.linear_call(backend, device_type)
        outputs = [
            target(*self.op_args(site, inputs[0], ops.op_tensors(w, spec, site.fqn), None, spec, backend))
            for w in weights
        ]
        return torch.cat(outputs, dim=-1)


def group_rows(weight: QTensor, start: int, stop: int, name: str) -> QTensor:
    """Rows `start:stop` with their scales; where they split a row group of the format's scales (FP8
    128x128 blocks over groups of fewer rows), quantized again from their dequantized values."""
    group = weight.key.group_shape.row
    if group == -1 or (start % group == 0 and (stop % group == 0 or stop == weight.shape[-2])):
        return weight.rows(start, stop).contiguous()
    part = quantize(dequantize(weight, torch.float32)[start:stop].contiguous(), weight.key, name)
    return QTensor(part.data, part.scale, part.scale2, part.key, part.shape, weight.dtype)
