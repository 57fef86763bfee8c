"""`qp.linear`: one quantized linear, eagerly, through the same oracle and kernels as a graph."""

from __future__ import annotations

import weakref

import torch

from .kernels import ops
from .kernels.oracle import Capability, Problem, select
from .quant_registry.names import Kind
from .quant_registry.qtensor import QTensor
from .quant_registry.spec import QuantSpec

_prepared: dict[tuple[int, str], tuple[weakref.ref, QTensor]] = {}


def _prepare(weight: QTensor, backend: str) -> QTensor:
    """The backend's layout of `weight`, computed once per (QTensor object, backend)."""
    key = (id(weight), backend)
    entry = _prepared.get(key)
    if entry is not None and entry[0]() is weight:
        return weight if entry[1] is None else entry[1]
    prepared = ops.prepare_weight(backend, Kind.LINEAR, weight)
    # identity preparations store None: holding `weight` itself would keep it alive forever
    kept = None if prepared is weight else prepared
    _prepared[key] = (weakref.ref(weight, lambda _, key=key: _prepared.pop(key, None)), kept)
    return prepared


def linear(
    x: torch.Tensor,
    weight: QTensor,
    spec: QuantSpec | str | dict | None = None,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """x [..., K] @ dequantized(weight [N, K]).T (+ bias), with the activation quantized per `spec`.

    `weight` is a QTensor (`qp.quantize(w, "int8_weight_only")`); `spec` defaults to its key with
    that key's default activation. The oracle's choice is cached per (device, spec, shape, backend),
    the backend's weight layout per QTensor object.
    """
    if not isinstance(weight, QTensor):
        raise TypeError(
            f"qp.linear takes a quantized weight, got {type(weight).__name__}: quantize it once first, "
            "e.g. qp.linear(x, qp.quantize(weight, 'int8_weight_only'))"
        )
    spec = QuantSpec(weight.key) if spec is None else QuantSpec.coerce(spec, "spec")
    if spec.weight != weight.key:
        raise ValueError(f"spec weight {spec.weight} does not match the QTensor's key {weight.key}")
    n, k = weight.shape[-2], weight.shape[-1]
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects {k}")
    m = x.numel() // k
    capability = Capability.detect(x.device)
    selection = select(Kind.LINEAR, spec.weight, spec.activation, capability, Problem(n, k, m), backend)
    prepared = _prepare(weight, selection.backend)
    call = ops.linear_call(selection.backend, x.device.type)
    key, activation = ops.key_arg(spec.weight), ops.key_arg(spec.activation)
    data, scale, scale2, input_scale = ops.op_tensors(prepared, spec)
    static = () if input_scale is None else (input_scale,)  # a checkpoint's calibrated activation scale
    return call(x, data, scale, scale2, bias, key, activation, selection.backend, n, *static)
