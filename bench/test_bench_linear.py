"""Quantized linear kernels by provider, grouped by shape: bf16 `F.linear` vs each backend per format.

    make bench                                                # the cpu suite (and the MoE benches)
    pytest bench/test_bench_linear.py --benchmark-only --bench-suite gpu-quick --benchmark-json out.json

Each provider runs through `qp.linear(x, weight, spec, backend=provider)`, the eager entry point a
user has, with its weight layout prepared once; timings are for x [M, K] bf16 -> [M, N] bf16.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from providers import BASELINE, DTYPE, FP32, device, measure, skip_unless_runnable, spec_of

import quantpass as qp
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


def test_linear(benchmark, record, linear_case):
    shape, format_name, provider = linear_case
    row = dict(kind="linear", tag=shape.tag, m=shape.m, n=shape.n, k=shape.k)
    x = activation(shape.m, shape.k)
    if provider in (BASELINE, FP32):
        w = weight(shape.n, shape.k)
        if provider == FP32:
            x, w = x.float(), w.float()
        fn, weight_bytes = (lambda: F.linear(x, w)), w.numel() * w.element_size()
    else:
        problem = Problem(n=shape.n, k=shape.k, m=shape.m)
        skip_unless_runnable(record, provider, format_name, problem, group=shape.group, **row)
        w, spec = quantized(format_name, shape.n, shape.k), spec_of(format_name)
        fn, weight_bytes = (lambda: qp.linear(x, w, spec, backend=provider)), w.nbytes
    measure(
        benchmark,
        record,
        fn,
        group=shape.group,
        flops=2 * shape.m * shape.n * shape.k,
        weight_bytes=weight_bytes,
        reference=expected(shape.m, shape.n, shape.k),
        format=format_name,
        provider=provider,
        **row,
    )
