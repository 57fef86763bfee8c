"""The `quantpass::` torch.library ops a rewritten graph calls, with exact fake implementations.

Every backend takes the same arguments, so the rewrite pass builds one argument list per site
and asks `linear_call(backend, device)` / `moe_call(...)` for the callable to put in the graph:
the `native` backend is a plain torch function that AOTAutograd traces into aten ops (Inductor
sees and fuses its activation quantization); the others are opaque custom ops that dispatch to
the backend module's kernel. Keys travel as their registered names ("" for no activation key).
A static activation key (`keys.needs_input_scale`: a checkpoint's calibrated scale) adds the
trailing `input_scale` tensor(s); the kernel finds them on the weight QTensor (`input_scale`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..moe_problem import GatedActivation, MoEProblem
from ..quant_registry.keys import KEYS, QuantKey, needs_input_scale
from ..quant_registry.qtensor import QTensor
from . import oracle

Tensor = torch.Tensor


def key_arg(key: QuantKey | None) -> str:
    return "" if key is None else str(key)


def key_from_arg(name: str) -> QuantKey | None:
    return KEYS[name] if name else None


def weight_view(data, scale, scale2, key: str, rows: int, cols: int, dtype, input_scale=None) -> QTensor:
    shape = torch.Size((*data.shape[:-2], rows, cols))
    return QTensor(data, scale, scale2, KEYS[key], shape, dtype, input_scale=input_scale)


def op_tensors(weight: QTensor, spec, fqn: str = "layer") -> list[torch.Tensor | None]:
    """[data, scale, scale2, input_scale] as a rewritten op takes one weight: the input scale only for
    a static activation key (a pre-quantized checkpoint's calibrated scale), which must then exist."""
    static = needs_input_scale(spec.activation)
    if static and weight.input_scale is None:
        raise ValueError(
            f"layer {fqn!r}: activation {spec.activation} needs a calibrated input scale (a checkpoint's "
            "input_scale) and its weights have none; use a dynamic activation key"
        )
    return [*weight.tensors(), weight.input_scale if static else None]


@torch.library.custom_op("quantpass::linear", mutates_args=())
def linear(
    x: Tensor,
    w_data: Tensor,
    w_scale: Tensor,
    w_scale2: Tensor | None,
    bias: Tensor | None,
    weight_key: str,
    activation_key: str,
    backend: str,
    out_features: int,
    input_scale: Tensor | None = None,
) -> Tensor:
    """x [..., K] -> [..., out_features] through `backend`'s kernel."""
    kernel = oracle.backend_module(backend).linear
    args = (w_data, w_scale, w_scale2, bias, weight_key, activation_key, out_features, input_scale)
    return run_linear(kernel, x, *args)


def run_linear(kernel, x, w_data, w_scale, w_scale2, bias, weight_key, activation_key, out_features, input_scale=None):
    """The op's body for a backend's `linear(x2d, QTensor, activation_key, bias)` (graph ops reuse it)."""
    dims = (out_features, x.shape[-1], x.dtype)
    weight = weight_view(w_data, w_scale, w_scale2, weight_key, *dims, input_scale=input_scale)
    out = kernel(x.reshape(-1, x.shape[-1]), weight, key_from_arg(activation_key), bias)
    return out.reshape(*x.shape[:-1], out_features)


@linear.register_fake
def _(x, w_data, w_scale, w_scale2, bias, weight_key, activation_key, backend, out_features, input_scale=None):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("quantpass::fused_moe", mutates_args=())
def fused_moe(
    hidden: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    w13_data: Tensor,
    w13_scale: Tensor,
    w13_scale2: Tensor | None,
    w2_data: Tensor,
    w2_scale: Tensor,
    w2_scale2: Tensor | None,
    b13: Tensor | None,
    b2: Tensor | None,
    expert_map: Tensor | None,
    weight_key: str,
    activation_key: str,
    backend: str,
    activation: str,
    gate_up_layout: str,
    apply_router_weight_on_input: bool,
    intermediate_size: int,
    alpha: float,
    limit: float,
    w13_input_scale: Tensor | None = None,
    w2_input_scale: Tensor | None = None,
) -> Tensor:
    """hidden [..., H], topk [..., k] -> [..., H]: the experts of one MoE layer, routing already done."""
    return run_fused_moe(oracle.backend_module(backend).fused_moe, hidden, topk_weights, topk_ids, w13_data, w13_scale,
                         w13_scale2, w2_data, w2_scale, w2_scale2, b13, b2, expert_map, weight_key, activation_key,
                         backend, activation, gate_up_layout, apply_router_weight_on_input, intermediate_size, alpha,
                         limit, w13_input_scale, w2_input_scale)  # fmt: skip


def run_fused_moe(kernel, hidden: Tensor, *op_args) -> Tensor:
    """The op's body for a backend's `fused_moe(problem)`, `op_args` after `hidden` as the op's (graph ops
    reuse it): hidden's leading dims flattened to tokens, and back."""
    return kernel(moe_problem(hidden.reshape(-1, hidden.shape[-1]), *op_args)).reshape(hidden.shape)


# torch.library's schema takes tensors and scalars, not dataclasses: `quantpass::fused_moe` (and the
# graph ops with its arguments) stay flat, and this is the one place their arguments become a MoEProblem.
def moe_problem(
    hidden, topk_weights, topk_ids, w13_data, w13_scale, w13_scale2, w2_data, w2_scale, w2_scale2, b13, b2,
    expert_map, weight_key, activation_key, backend, activation, gate_up_layout, apply_router_weight_on_input,
    intermediate_size, alpha, limit, w13_input_scale=None, w2_input_scale=None,
) -> MoEProblem:  # fmt: skip
    """`quantpass::fused_moe`'s arguments (hidden already [T, H]) as the `MoEProblem` backends take."""
    hidden_size, dtype, tokens = hidden.shape[-1], hidden.dtype, hidden.shape[0]
    w13 = weight_view(w13_data, w13_scale, w13_scale2, weight_key, 2 * intermediate_size, hidden_size, dtype,
                      input_scale=w13_input_scale)  # fmt: skip
    w2 = weight_view(w2_data, w2_scale, w2_scale2, weight_key, hidden_size, intermediate_size, dtype,
                     input_scale=w2_input_scale)  # fmt: skip
    return MoEProblem(
        hidden, topk_weights.reshape(tokens, -1), topk_ids.reshape(tokens, -1), w13, w2,
        gated=GatedActivation(activation, gate_up_layout, alpha, limit), activation_key=key_from_arg(activation_key),
        b13=b13, b2=b2, expert_map=expert_map, apply_router_weight_on_input=apply_router_weight_on_input,
    )  # fmt: skip


@fused_moe.register_fake
def _(hidden, *args, **kwargs):
    return torch.empty_like(hidden)


def linear_call(backend: str, device_type: str, differentiable: bool = False):
    """The callable a rewritten graph uses for a linear site on `backend` (same arguments for all).
    `differentiable`: the graph runs with grad mode on, so the site needs `quantpass::linear`'s
    backward (graph-visible forms would differentiate through rounding)."""
    if differentiable:
        return torch.ops.quantpass.linear.default
    op = oracle.backend_module(backend).graph_linear_op(device_type)  # e.g. a triton_op Inductor sees into
    return torch.ops.quantpass.linear.default if op is None else op


def moe_call(backend: str, device_type: str, differentiable: bool = False):
    op = None if differentiable else oracle.backend_module(backend).graph_moe_op(device_type)
    return torch.ops.quantpass.fused_moe.default if op is None else op


def dense_weight(backend: str, weight: QTensor, dtype: torch.dtype) -> torch.Tensor:
    """A backend-prepared weight as the dense `[..., N, K]` tensor it stands for."""
    return oracle.backend_module(backend).dequantize_prepared(weight, dtype)


# Gradients (grad mode on, e.g. adapters on a frozen quantized base): dX comes from the dequantized
# weight, the activation's quantization passes gradients straight through, and quantized weights
# get none (they are not inputs of the op that require grad).
def _setup_linear(ctx, inputs, output):
    x, w_data, w_scale, w_scale2, _bias, weight_key, _activation_key, backend, out_features, *_ = inputs
    ctx.save_for_backward(w_data, w_scale, w_scale2)
    ctx.meta = (weight_key, backend, out_features, x.shape[-1], x.dtype)


def _linear_backward(ctx, grad):
    w_data, w_scale, w_scale2 = ctx.saved_tensors
    weight_key, backend, out_features, in_features, dtype = ctx.meta
    weight = weight_view(w_data, w_scale, w_scale2, weight_key, out_features, in_features, dtype)
    grad_x = grad.to(dtype) @ dense_weight(backend, weight, dtype) if ctx.needs_input_grad[0] else None
    grad_bias = grad.reshape(-1, out_features).sum(0) if ctx.needs_input_grad[4] else None
    return grad_x, None, None, None, grad_bias, None, None, None, None, None


torch.library.register_autograd("quantpass::linear", _linear_backward, setup_context=_setup_linear)


MOE_TENSORS = 12  # quantpass::fused_moe's leading tensors: hidden, routing, w13/w2 data/scales, biases, expert_map


def _setup_moe(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:MOE_TENSORS])
    ctx.meta = inputs[MOE_TENSORS:21]  # keys, backend, gated activation, sizes (not the trailing input scales)


def _moe_backward(ctx, grad):
    """Recompute the experts in plain torch on dense weights and differentiate that."""
    from . import reference

    hidden, topk_weights, *tensors = ctx.saved_tensors
    backend = ctx.meta[2]
    inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in (hidden, topk_weights)]
    with torch.enable_grad():
        problem = moe_problem(inputs[0].reshape(-1, hidden.shape[-1]), inputs[1], *tensors, *ctx.meta)
        dense = {name: dense_weight(backend, getattr(problem, name), hidden.dtype) for name in ("w13", "w2")}
        problem = replace(problem, activation_key=None, **dense)
        out = reference.fused_moe(problem, expert_matmul=_dense_matmul)
        needed = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out.reshape(grad.shape), needed, grad, allow_unused=True))
    grad_hidden, grad_topk = (next(grads) if t.requires_grad else None for t in inputs)
    return grad_hidden, grad_topk, *([None] * 21)


def _dense_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`reference.fused_moe`'s per-expert product when its weights are already dense tensors."""
    return x @ weight.t().float()


torch.library.register_autograd("quantpass::fused_moe", _moe_backward, setup_context=_setup_moe)


def prepare_weight(backend: str, kind: str, weight: QTensor) -> QTensor:
    """A backend's own layout of a quantized linear weight (most keep the canonical one)."""
    return oracle.backend_module(backend).prepare_weight(kind, weight)


def prepare_moe_weights(backend: str, w13: QTensor, w2: QTensor, gate_up_layout: str) -> tuple[QTensor, QTensor]:
    return oracle.backend_module(backend).prepare_moe_weights(w13, w2, gate_up_layout)


@torch.library.custom_op("quantpass::dequantize_weight", mutates_args=())
def dequantize_weight(
    data: Tensor,
    scale: Tensor,
    scale2: Tensor | None,
    weight_key: str,
    rows: int,
    cols: int,
    dtype: torch.dtype,
    transposed: bool,
) -> Tensor:
    """A quantized `[..., rows, cols]` weight -> the dense weight in `dtype`, contiguous, in its stored
    layout (`[..., cols, rows]` when `transposed`). For GEMMs that stay the graph's own (experts that
    can't be proven a fused MoE): the weight is held quantized and rebuilt on every call, so only the
    weight's quantization applies, never the activations'."""
    from ..quant_registry.formats import dequantize

    dense = dequantize(weight_view(data, scale, scale2, weight_key, rows, cols, dtype))
    return (dense.transpose(-2, -1) if transposed else dense).contiguous()


@dequantize_weight.register_fake
def _(data, scale, scale2, weight_key, rows, cols, dtype, transposed):
    return data.new_empty((*data.shape[:-2], *((cols, rows) if transposed else (rows, cols))), dtype=dtype)
