"""The `quantpass::` torch.library ops a rewritten graph calls, with exact fake implementations.

Every backend takes the same arguments, so the rewrite pass builds one argument list per site
and asks `linear_call(backend, device)` / `moe_call(...)` for the callable to put in the graph:
the `native` backend is a plain torch function that AOTAutograd traces into aten ops (Inductor
sees and fuses its activation quantization); the others are opaque custom ops that dispatch to
the backend module's kernel. Keys travel as their registered names ("" for no activation key).
"""

from __future__ import annotations

import torch

from ..quant_registry.keys import KEYS, QuantKey
from ..quant_registry.qtensor import QTensor
from . import oracle

Tensor = torch.Tensor


def key_arg(key: QuantKey | None) -> str:
    return "" if key is None else str(key)


def key_from_arg(name: str) -> QuantKey | None:
    return KEYS[name] if name else None


def weight_view(data, scale, scale2, key: str, rows: int, cols: int, dtype) -> QTensor:
    return QTensor(data, scale, scale2, KEYS[key], torch.Size((*data.shape[:-2], rows, cols)), dtype)


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
) -> Tensor:
    """x [..., K] -> [..., out_features] through `backend`'s kernel."""
    kernel = oracle.backend_module(backend).linear
    return run_linear(kernel, x, w_data, w_scale, w_scale2, bias, weight_key, activation_key, out_features)


def run_linear(kernel, x, w_data, w_scale, w_scale2, bias, weight_key, activation_key, out_features):
    """The op's body for a backend's `linear(x2d, QTensor, activation_key, bias)` (graph ops reuse it)."""
    weight = weight_view(w_data, w_scale, w_scale2, weight_key, out_features, x.shape[-1], x.dtype)
    out = kernel(x.reshape(-1, x.shape[-1]), weight, key_from_arg(activation_key), bias)
    return out.reshape(*x.shape[:-1], out_features)


@linear.register_fake
def _(x, w_data, w_scale, w_scale2, bias, weight_key, activation_key, backend, out_features):
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
) -> Tensor:
    """hidden [T, H], topk [T, k] -> [T, H]: the experts of one MoE layer, routing already done."""
    kernel = oracle.backend_module(backend).fused_moe
    weights = (w13_data, w13_scale, w13_scale2, w2_data, w2_scale, w2_scale2)
    gated = (activation, gate_up_layout, apply_router_weight_on_input, alpha, limit)
    return run_fused_moe(kernel, hidden, topk_weights, topk_ids, *weights, b13, b2, expert_map,
                         weight_key, activation_key, intermediate_size, *gated)  # fmt: skip


def run_fused_moe(
    kernel, hidden, topk_weights, topk_ids, w13_data, w13_scale, w13_scale2, w2_data, w2_scale, w2_scale2,
    b13, b2, expert_map, weight_key, activation_key, intermediate_size, activation, gate_up_layout,
    apply_router_weight_on_input, alpha, limit,
):  # fmt: skip
    """The op's body for a backend's `fused_moe` (see `reference.fused_moe`; graph ops reuse it)."""
    hidden_size, dtype = hidden.shape[-1], hidden.dtype
    w13 = weight_view(w13_data, w13_scale, w13_scale2, weight_key, 2 * intermediate_size, hidden_size, dtype)
    w2 = weight_view(w2_data, w2_scale, w2_scale2, weight_key, hidden_size, intermediate_size, dtype)
    flat = hidden.reshape(-1, hidden_size)
    routing = (topk_weights.reshape(flat.shape[0], -1), topk_ids.reshape(flat.shape[0], -1))
    gated = (activation, gate_up_layout, apply_router_weight_on_input, alpha, limit)
    out = kernel(flat, *routing, w13, w2, b13, b2, expert_map, key_from_arg(activation_key), *gated)
    return out.reshape(hidden.shape)


@fused_moe.register_fake
def _(hidden, *args, **kwargs):
    return torch.empty_like(hidden)


def linear_call(backend: str, device_type: str):
    """The callable a rewritten graph uses for a linear site on `backend` (same arguments for all)."""
    if backend == "native":
        from .native import linear_graph

        return linear_graph
    module = oracle.backend_module(backend)
    graph_op = getattr(module, "graph_linear_op", None)  # e.g. a triton_op Inductor can see into
    if graph_op is not None and (op := graph_op(device_type)) is not None:
        return op
    return torch.ops.quantpass.linear.default


def moe_call(backend: str, device_type: str):
    module = oracle.backend_module(backend)
    graph_op = getattr(module, "graph_moe_op", None)
    if graph_op is not None and (op := graph_op(device_type)) is not None:
        return op
    return torch.ops.quantpass.fused_moe.default


def prepare_weight(backend: str, kind: str, weight: QTensor) -> QTensor:
    """A backend's own layout of a quantized linear weight (identity unless it defines one)."""
    prepare = getattr(oracle.backend_module(backend), "prepare_weight", None)
    return weight if prepare is None else prepare(kind, weight)


def prepare_moe_weights(backend: str, w13: QTensor, w2: QTensor, gate_up_layout: str) -> tuple[QTensor, QTensor]:
    prepare = getattr(oracle.backend_module(backend), "prepare_moe_weights", None)
    return (w13, w2) if prepare is None else prepare(w13, w2, gate_up_layout)


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
