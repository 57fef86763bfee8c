"""Quantized linear kernels by provider, grouped by shape: bf16 `F.linear` vs each backend per format.

    make bench                                                # the cpu suite (and the MoE benches)
    pytest bench/test_bench_linear.py --benchmark-only --bench-suite gpu-quick --benchmark-json out.json

Each backend runs through `qp.linear(x, weight, spec, backend=provider)`, the eager entry point a
user has, with its weight layout prepared once; `<backend>_compiled` runs the graph op a rewritten
model calls under `torch.compile`, `<backend>_gemm` the GEMM alone on pre-quantized activations
(providers.py). Timings are for x [M, K] bf16 -> [M, N] bf16.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from providers import BASELINE, DTYPE, FP32, backend_of, clone, device, measure, skip_unless_runnable, spec_of
from providers import weight_copies as copies_for

import quantpass as qp
from quantpass.kernels import ops
from quantpass.kernels.oracle import Problem


@functools.cache
def weight(n: int, k: int) -> torch.Tensor:
    torch.manual_seed(n * 100_003 + k)
    return (torch.randn(n, k, device=device()) * 0.02).to(DTYPE)  # [N, K], std like trained LLM weights


@functools.cache
def activation(m: int, k: int) -> torch.Tensor:
    torch.manual_seed(m * 100_003 + k + 1)
    return torch.randn(m, k, device=device()).to(DTYPE)


@functools.cache
def quantized(format_name: str, n: int, k: int) -> qp.QTensor:
    return qp.quantize(weight(n, k), spec_of(format_name).weight)


@functools.cache
def expected(m: int, n: int, k: int) -> torch.Tensor:
    """The unquantized result in fp32: what SQNR is measured against."""
    return activation(m, k).float() @ weight(n, k).float().t()


def call_for(provider: str, format_name: str, x: torch.Tensor, w):
    """A no-argument callable running `provider` on x with weight `w` (a tensor or QTensor)."""
    if provider == BASELINE:
        return lambda: F.linear(x, w)
    if provider == FP32:
        x32, w32 = x.float(), w.float()
        return lambda: F.linear(x32, w32)
    spec, backend = spec_of(format_name), backend_of(provider)
    if provider.endswith("_gemm"):
        return gemm_only(backend, x, w, spec)
    if provider.endswith("_compiled"):
        compiled = compiled_op(backend, format_name, w.shape[0])
        return lambda: compiled(x, *w.tensors())
    return lambda: qp.linear(x, w, spec, backend=backend)


@functools.cache
def compiled_op(backend: str, format_name: str, n: int):
    """The graph op a rewritten model calls for this backend, under torch.compile (weights are
    inputs: one compile serves every weight copy)."""
    spec = spec_of(format_name)
    op = ops.linear_call(backend, device().type)
    keys = (ops.key_arg(spec.weight), ops.key_arg(spec.activation), backend, n)
    return torch.compile(lambda x, data, scale, scale2: op(x, data, scale, scale2, None, *keys), dynamic=False)


def gemm_only(backend: str, x: torch.Tensor, w: qp.QTensor, spec):
    """The GEMM on activations quantized once, before timing."""
    if backend == "native":
        from quantpass.kernels import torch_ops as native
        from quantpass.quant_registry import formats

        gemm = native._GEMM_FUNCTIONS[native.GEMMS[(spec.weight, spec.activation)]]
        xq = formats.quantize(x, spec.activation)
        return lambda: gemm(x, w, xq)
    from quantpass.kernels.triton.gemm import quantized_matmul
    from quantpass.kernels.triton.quant import quantize_activation

    xq = quantize_activation(x, spec.activation)
    return lambda: quantized_matmul(xq, w, None, x.dtype)


def test_linear(benchmark, record, linear_case):
    shape, format_name, provider = linear_case
    row = dict(kind="linear", tag=shape.tag, m=shape.m, n=shape.n, k=shape.k)
    x = activation(shape.m, shape.k)
    if provider in (BASELINE, FP32):
        w = weight(shape.n, shape.k)
        weight_bytes = w.numel() * (4 if provider == FP32 else w.element_size())
    else:
        problem = Problem(n=shape.n, k=shape.k, m=shape.m)
        skip_unless_runnable(record, provider, format_name, problem, group=shape.group, **row)
        w = quantized(format_name, shape.n, shape.k)
        weight_bytes = w.nbytes
    copies = [w] + [clone(w) for _ in range(copies_for(weight_bytes, shape.m) - 1)]
    measure(
        benchmark,
        record,
        [call_for(provider, format_name, x, copy) for copy in copies],
        group=shape.group,
        flops=2 * shape.m * shape.n * shape.k,
        weight_bytes=weight_bytes,
        reference=expected(shape.m, shape.n, shape.k),
        format=format_name,
        provider=provider,
        **row,
    )
