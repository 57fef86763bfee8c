"""The cpu backend's C++ graph op (`quantpass::linear_cpu_cxx`, csrc/linear_op.cpp): on every route it
gives exactly what the Python `quantpass::linear_cpu` gives (the same kernel on its fast path, INT8/INT4
and every FP8/FP4 pair, that op itself off it), compiled graphs call it, and where it can't be built the
reason is named and graphs use the Python op."""

from dataclasses import replace

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import quantpass as qp
from quantpass.kernels import cpu, cpu_avx2, cpu_op
from quantpass.kernels.ops import key_arg
from quantpass.quant_registry import quantize
from quantpass.quant_registry.keys import (
    kFp8StaticTensorSym,
    kInt4StaticGroup128Sym,
    kInt8DynamicTokenSym,
    kInt8StaticChannelSym,
    needs_input_scale,
)

TABLES = cpu.graph_tables()
CXX = cpu_op.op(TABLES) if cpu_avx2.available()[0] else None
needs_op = pytest.mark.skipif(CXX is None, reason=f"no C++ op here: {cpu_op.reason(TABLES)}")
PYTHON = torch.ops.quantpass.linear_cpu.default


def both(x, qt, key, bias=None, activation=None, scale=None):
    scale = qt.scale if scale is None else scale
    args = (qt.data, scale, qt.scale2, bias, key_arg(key), key_arg(activation), "cpu", qt.data.shape[0], qt.input_scale)
    return PYTHON(x, *args), CXX(x, *args)


# every (weight, activation) pair the cpu backend runs on a format kernel (FP8, FP4)
FORMAT_PAIRS = [(key, activation) for key, family in cpu.FORMAT_KERNELS.items() for activation in family.MODES[key]]


@needs_op
@pytest.mark.parametrize("key", [kInt4StaticGroup128Sym, kInt8StaticChannelSym], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fast_path_equals_the_python_op(key, dtype):
    """Odd K and N, 2-D and 3-D x, every x dtype with and without a bias of another dtype, M up to the
    format's limit (the kernel) and past it (dequantize + matmul through the Python op)."""
    gen = torch.Generator().manual_seed(0)
    qt = quantize(torch.randn(67, 300, generator=gen), key)
    most = cpu.LINEAR_MAX_M[key]
    for shape in [(1, 300), (3, 300), (2, 2, 300), (most, 300), (most + 1, 300), (2, most, 300)]:
        x = torch.randn(shape, generator=gen).to(dtype)
        for bias in (None, torch.randn(67, generator=gen).to(torch.bfloat16)):
            want, got = both(x, qt, key, bias)
            assert got.shape == (*shape[:-1], 67) and got.dtype == dtype
            assert torch.equal(got, want), (shape, bias is None)


@needs_op
@pytest.mark.parametrize("pair", FORMAT_PAIRS, ids=lambda pair: f"{pair[0]}-{pair[1]}")
def test_format_kernels_equal_the_python_op(pair):
    """The FP8 and FP4 kernels straight from C++: K = 300 (inside a padded last scale group), N = 67, 2-D and
    3-D x, every x dtype, with and without a bias of another dtype, M up to the kernel's largest and past it
    (the reference, through the Python op); a static activation key with its input scale."""
    key, activation = pair
    gen = torch.Generator().manual_seed(0)
    qt = quantize(torch.randn(67, 300, generator=gen), key)
    if needs_input_scale(activation):
        qt = replace(qt, input_scale=torch.tensor(0.01))
    most = cpu.FORMAT_KERNELS[key].MAX_M
    for shape in [(1, 300), (3, 300), (2, 2, 300), (most, 300), (most + 1, 300)]:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.randn(shape, generator=gen).to(dtype)
            for bias in (None, torch.randn(67, generator=gen).to(torch.bfloat16)):
                want, got = both(x, qt, key, bias, activation)
                assert got.shape == (*shape[:-1], 67) and got.dtype == dtype
                assert torch.equal(got, want), (shape, dtype, bias is None)


@needs_op
def test_format_kernels_off_the_fast_path_are_the_python_op():
    """What the C++ op leaves to the Python one: a static activation key without an input scale (its error),
    fp16 scales (converted there), an x dtype the kernels don't read, a column stride of 2."""
    gen = torch.Generator().manual_seed(2)
    static = (kFp8StaticTensorSym, kFp8StaticTensorSym)
    qt = quantize(torch.randn(40, 256, generator=gen), kFp8StaticTensorSym)
    x = torch.randn(3, 256, generator=gen)
    with pytest.raises(ValueError, match="needs"):
        CXX(x, qt.data, qt.scale, None, None, *map(key_arg, static), "cpu", 40, None)
    assert torch.equal(*both(x, qt, kFp8StaticTensorSym, scale=qt.scale.half()))
    assert torch.equal(*both(x.double(), qt, kFp8StaticTensorSym))
    assert torch.equal(*both(torch.randn(3, 512, generator=gen)[:, ::2], qt, kFp8StaticTensorSym))


@needs_op
def test_off_the_fast_path_it_is_the_python_op():
    """Non-unit column stride, an activation key (W8A8), a weight the kernels don't read (aten's INT8
    scales [N]), an x dtype they don't read, and a key with no kernel all go through the Python op."""
    gen = torch.Generator().manual_seed(1)
    int8 = quantize(torch.randn(40, 256, generator=gen), kInt8StaticChannelSym)
    x = torch.randn(256, 3, generator=gen).t()  # stride(1) == 256
    assert torch.equal(*both(x, int8, kInt8StaticChannelSym))
    x = torch.randn(5, 256, generator=gen)
    assert torch.equal(*both(x, int8, kInt8StaticChannelSym, activation=kInt8DynamicTokenSym))
    assert torch.equal(*both(x, int8, kInt8StaticChannelSym, scale=int8.scale.reshape(-1)))
    assert torch.equal(*both(x.double(), int8, kInt8StaticChannelSym))


@needs_op
@pytest.mark.parametrize("fmt", ["int4_weight_only", "fp8_per_channel", "mxfp8", "nvfp4", "mxfp4"])
def test_compiled_graphs_call_it(fmt):
    """A model compiled on the cpu backend runs the C++ op and not the Python one (seen by the profiler),
    under Inductor: INT4 and the format kernels."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    compiled = torch.compile(model, backend=qp.backend(linear=fmt, backend="cpu"))
    x = torch.randn(2, 256)
    with torch.no_grad():
        compiled(x)
        with torch.profiler.profile() as prof:
            compiled(x)
    names = [event.name for event in prof.events()]
    assert names.count("quantpass::linear_cpu_cxx") == 2 and "quantpass::linear_cpu" not in names


@needs_op
def test_compiled_graphs_pass_no_keyword_arguments():
    """Both graph ops fix only their inputs' stride order: under Inductor's default for custom ops
    (exact strides) its wrapper passed `input_scale=None` by keyword, 25-40 us more per call at decode.
    The wrapper's code calls the op with positional arguments only."""
    assert all(torch.Tag.needs_fixed_stride_order in op.tags for op in (CXX, PYTHON))
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.Linear(128, 64))
    compiled = torch.compile(model, backend=qp.backend(linear="int8_weight_only", backend="cpu"))
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        _, (code,) = run_and_get_code(compiled, torch.randn(1, 256))
    calls = [line for line in code.splitlines() if "torch.ops.quantpass.linear_cpu_cxx.default(" in line]
    assert len(calls) == 2 and not any("=None)" in line or "input_scale" in line for line in calls), calls


def test_unavailable_reasons(monkeypatch):
    load = cpu_op._load.__wrapped__
    monkeypatch.setattr(cpu_avx2, "available", lambda: (False, "turned off by the test"))
    assert load(TABLES) == (None, "quantpass's C kernels are not available: turned off by the test")
    monkeypatch.undo()
    if not cpu_avx2.available()[0]:
        pytest.skip(f"the C kernels can't run here: {cpu_avx2.available()[1]}")
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert load(TABLES) == (None, "building csrc/linear_op.cpp with /nonexistent/c++ failed")
    monkeypatch.setattr(cpu_op, "op", lambda tables: None)
    assert cpu.graph_linear_op("cpu") is PYTHON
