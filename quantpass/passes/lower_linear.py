"""Linear sites lowered to `quantpass::linear`: the op call `rewrite` emits, and verify's two sides."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import ops
from ..patterns.fx_match import value
from ..patterns.linear import LinearSite
from ..quant_registry.names import Kind
from .lower_site import SiteLowering


class LinearLowering(SiteLowering):
    def prepare(self, site: LinearSite, weights, spec, backend):
        return [ops.prepare_weight(backend, Kind.LINEAR, weights[0])]

    def op_args(self, site: LinearSite, x, tensors, bias, spec, backend) -> tuple:
        """`quantpass::linear`'s arguments: `x`, the weight's tensors, bias, keys, backend, N."""
        data, scale, scale2, input_scale = tensors  # input_scale: static activation keys only
        key, act = ops.key_arg(spec.weight), ops.key_arg(spec.activation)
        static = () if input_scale is None else (input_scale,)
        return (x, data, scale, scale2, bias, key, act, backend, site.problem.n, *static)

    def rewrite(self, site: LinearSite, graph, weights, spec, backend, device_type, differentiable=False):
        target = ops.linear_call(backend, device_type, differentiable)
        swap = site.left and value(site.x).dim() > 1  # `W @ x` = (x^T @ W^T)^T over the last two dims
        with graph.inserting_before(site.node):
            x = _swapped(graph, site.x) if swap else site.x
            x = _call(graph, torch.flatten, x, -site.flat) if site.flat > 1 else x  # an einsum's K dims
            new = graph.call_function(target, self.op_args(site, x, weights[0], site.bias, spec, backend))
            new.meta.update(site.node.meta)
            if swap:
                _set_value(new, value(site.node).transpose(-2, -1))
                new = _swapped(graph, new)
                new.meta.update(site.node.meta)
            if len(site.unflat) > 1:  # an einsum's output: the weight's free dims
                _set_value(new, value(site.node).flatten(-len(site.unflat)))
                new = _call(graph, torch.unflatten, new, -1, site.unflat)
                new.meta.update(site.node.meta)
        site.node.replace_all_uses_with(new)
        graph.erase_node(site.node)
        return new

    def sample_inputs(self, site: LinearSite, like, device, dtype):
        x = torch.randn(16, site.problem.k, device=device, dtype=torch.float32)
        if like is not None and like.is_floating_point() and like.numel() > 1:
            x = x * like.float().std() + like.float().mean()
        return [x.to(dtype)]

    def run_original(self, site: LinearSite, inputs, values):
        return F.linear(inputs[0], site.weight.matrix(values[0]).to(inputs[0].dtype))

    def run_quantized(self, site: LinearSite, inputs, weights, spec, backend, device_type):
        target = ops.linear_call(backend, device_type)
        bias = inputs[1] if len(inputs) > 1 else None  # real activations come with the layer's bias
        tensors = ops.op_tensors(weights[0], spec, site.fqn)
        return target(*self.op_args(site, inputs[0], tensors, bias, spec, backend))


def _swapped(graph, node):
    """`node.transpose(-2, -1)`, its example value with it."""
    return _call(graph, torch.transpose, node, -2, -1)


def _call(graph, view, node, *args):
    """`view(node, *args)` (a transpose, flatten or unflatten), its example value with it."""
    viewed = graph.call_function(view, (node, *args))
    _set_value(viewed, view(value(node), *args))
    return viewed


def _set_value(node, example) -> None:
    node.meta["val"] = node.meta["example_value"] = example
