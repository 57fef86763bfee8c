"""The native and cpu backends: against the reference on odd shapes, `supports` answers per device,
the CUDA GEMMs' arguments against torch's own checks (fake CUDA tensors), graphs under aot_eager
and Inductor with a dynamic M, and the cpu backend's M switch."""

import os
import platform
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

from quantpass.kernels import cpu, cpu_aten_int4, cpu_avx2, cpu_fp4, cpu_fp8, cpu_op, oracle, reference
from quantpass.kernels import torch_ops as native
from quantpass.kernels.ops import key_arg, linear_call, prepare_weight
from quantpass.kernels.oracle import Capability, Problem
from quantpass.metrics import sqnr
from quantpass.quant_registry import QTensor, dequantize, quantize
from quantpass.quant_registry.formats import unpack_int4
from quantpass.quant_registry.keys import (
    kFp8Dynamic128Sym,
    kFp8DynamicTensorSym,
    kFp8DynamicTokenSym,
    kFp8Static128BlockSym,
    kFp8StaticChannelSym,
    kFp8StaticTensorSym,
    kInt4StaticGroup128Sym,
    kInt8DynamicTokenSym,
    kInt8StaticChannelSym,
    kMxfp4Static,
    kMxfp8Dynamic,
    kMxfp8Static,
    kNvfp4Dynamic,
    kNvfp4Static,
)

DTYPES = (torch.bfloat16, torch.float32)
M_VALUES = (1, 7, 33)
NK = ((48, 96), (96, 300))  # K = 300: no group divides it, data pads columns

# SQNR floors (dB) against the fp32 product of the unquantized operands: a few dB under the worst
# of 3 seeds x these shapes (Gaussian x and w), measured 2026-11-29.
FORMAT_FLOORS = {
    (kFp8StaticTensorSym, kFp8DynamicTensorSym): 24,  # measured >= 27.2
    (kFp8StaticChannelSym, kFp8DynamicTokenSym): 24,  # >= 26.1
    (kInt8StaticChannelSym, kInt8DynamicTokenSym): 35,  # >= 38.9
    (kFp8StaticChannelSym, None): 27,  # >= 29.7
    (kInt8StaticChannelSym, None): 38,  # >= 42.2
    (kInt4StaticGroup128Sym, None): 15.5,  # >= 18.0
    (kMxfp4Static, None): 15.5,  # >= 18.0
    (kNvfp4Static, None): 17,  # >= 19.2
}
# Against the reference (same quantized operands): fp32 agrees to fp32 rounding; bf16 output
# rounding alone costs ~50 dB (a bf16 ulp is 2^-8 relative).
REFERENCE_FLOORS = {torch.float32: 100, torch.bfloat16: 40}
# The cpu backend's aten kernels take fp32 activations as bf16 (10-80x faster): ~51 dB measured.
CPU_REFERENCE_FLOORS = {torch.float32: 45, torch.bfloat16: 40}
# quantpass's INT4 kernel quantizes activations to int8 per 128: >= 42.4 dB measured on these shapes
# (2026-12-01), under INT4's own ~19 dB against the unquantized product.
INT4_OURS_FLOORS = {torch.float32: 38, torch.bfloat16: 38}
NATIVE_ON_CPU = list(FORMAT_FLOORS)
CPU_KEYS = (kInt8StaticChannelSym, kInt4StaticGroup128Sym)
CPU_PAIRS = [
    (kInt8StaticChannelSym, None),
    (kInt4StaticGroup128Sym, None),
    (kInt8StaticChannelSym, kInt8DynamicTokenSym),
]

CPU = Capability("cpu")
SM89, SM90, SM100 = (Capability("cuda", sm, frozenset({"triton"})) for sm in (89, 90, 100))
BIG = Problem(n=4096, k=4096)


def check(out, x, w, qt, activation, bias, floor_vs_exact, reference_floors=REFERENCE_FLOORS):
    """Shape and dtype; near-exact vs the reference; the format's floor vs the unquantized product."""
    assert out.shape == (x.shape[0], w.shape[0]) and out.dtype == x.dtype
    ref = reference.linear(x, qt, activation, bias)
    assert sqnr(ref.float(), out.float()) >= reference_floors[x.dtype], "differs from reference"
    exact = x.float() @ w.float().t() + (0 if bias is None else bias.float())
    assert sqnr(exact, out.float()) >= floor_vs_exact, "below the format floor vs the unquantized product"


def operands(m, n, k, dtype):
    return torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype), torch.randn(n, dtype=dtype)


# --- numerics on CPU ---


@pytest.mark.parametrize("pair", NATIVE_ON_CPU, ids=lambda p: f"{p[0]}/{p[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize(("n", "k"), NK)
def test_native_matches_reference(pair, dtype, m, n, k):
    x, w, bias = operands(m, n, k, dtype)
    qt = quantize(w, pair[0])
    check(native.linear(x, qt, pair[1], bias), x, w, qt, pair[1], bias, FORMAT_FLOORS[pair])


@pytest.mark.parametrize("pair", CPU_PAIRS, ids=lambda p: f"{p[0]}-{p[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize(("n", "k"), NK)
def test_cpu_matches_reference(pair, dtype, m, n, k, int4_kernel):
    x, w, bias = operands(m, n, k, dtype)
    (key, activation), floor = pair, FORMAT_FLOORS[pair]
    int8_activations = key == kInt4StaticGroup128Sym and int4_kernel == "avx2"
    floors = INT4_OURS_FLOORS if int8_activations else CPU_REFERENCE_FLOORS
    qt = quantize(w, key)
    prepared = cpu.prepare_weight("linear", qt)
    check(cpu.linear(x, prepared, activation, bias), x, w, qt, activation, bias, floor, floors)
    check(cpu.linear(x, qt, activation, None), x, w, qt, activation, None, floor, floors)  # unprepared


@pytest.mark.parametrize("key", CPU_KEYS, ids=str)
def test_cpu_switches_on_m_at_run_time(key, monkeypatch, int4_kernel):
    """Both sides of the switch: the kernel up to the threshold, dequantize + matmul above."""
    monkeypatch.setitem(cpu.KERNEL_MAX_M, key, 4)
    monkeypatch.setitem(cpu.LINEAR_MAX_M, key, 4)
    calls = []
    for name in ("_our_kernel", "_aten_kernel"):
        kernel = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda x, *a, k=kernel, n=name: calls.append((n, x.shape[0])) or k(x, *a))
    _, w, bias = operands(1, 96, 300, torch.bfloat16)
    qt = quantize(w, key)
    prepared = cpu.prepare_weight("linear", qt)
    for m in (1, 4, 5, 33):
        x = torch.randn(m, 300, dtype=torch.bfloat16)
        ours = key == kInt4StaticGroup128Sym and int4_kernel == "avx2" and m <= 4
        floors = INT4_OURS_FLOORS if ours else CPU_REFERENCE_FLOORS
        check(cpu.linear(x, prepared, None, bias), x, w, qt, None, bias, FORMAT_FLOORS[(key, None)], floors)
    name = "_our_kernel" if int4_kernel == "avx2" else "_aten_kernel"
    assert calls == [(name, 1), (name, 4)]


@pytest.mark.skipif(not cpu_avx2.available()[0], reason=f"our kernels can't run: {cpu_avx2.available()[1]}")
@pytest.mark.parametrize("key", CPU_KEYS, ids=str)
def test_large_m_matmul_in_chunks_equals_one_matmul(key, monkeypatch):
    """Above the kernels' largest M the weight is dequantized a chunk of rows at a time into one buffer
    per thread: chunks of 16 rows over N = 67 (a partial last chunk) give the one matmul on the whole
    dequantized weight, and a second call reuses the buffer."""
    gen = torch.Generator().manual_seed(0)
    qt = quantize(torch.randn(67, 300, generator=gen), key)
    prepared = cpu.prepare_weight("linear", qt)
    dtype = torch.bfloat16 if cpu.NATIVE_LOW_PRECISION_MATMUL else torch.float32
    kp = prepared.data.shape[1] * (2 if key == kInt4StaticGroup128Sym else 1)
    monkeypatch.setattr(cpu, "CHUNK_BYTES", 16 * kp * dtype.itemsize)
    monkeypatch.setattr(cpu, "_CHUNKS", type(cpu._CHUNKS)())
    x = torch.randn(40, 300, generator=gen, dtype=torch.bfloat16)
    got = cpu._large_m_matmul(x, prepared)
    whole = F.pad(dequantize(qt, torch.float32), (0, kp - 300)).to(dtype)
    want = F.linear(F.pad(x, (0, kp - 300)).to(dtype), whole)  # the same sums, maybe blocked otherwise
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-4)
    buffer = cpu._CHUNKS.buffer
    assert buffer.numel() == 16 * kp
    assert torch.equal(cpu._large_m_matmul(x, prepared), got) and cpu._CHUNKS.buffer is buffer


@pytest.mark.parametrize("key", CPU_KEYS, ids=str)
def test_cpu_through_the_graph_op(key, int4_kernel):
    """Prepared once (`ops.prepare_weight`), then the cpu backend's graph op in a graph."""
    x, w, bias = operands(7, 96, 300, torch.bfloat16)
    qt = quantize(w, key)
    prepared = prepare_weight("cpu", "linear", qt)
    op = linear_call("cpu", "cpu")
    cxx = cpu_op.op(cpu.graph_tables()) if int4_kernel == "avx2" else None
    assert op is (cxx or torch.ops.quantpass.linear_cpu.default)
    args = (prepared.data, prepared.scale, prepared.scale2, bias, key_arg(key), "", "cpu", 96)
    out = torch.compile(op, backend="aot_eager", fullgraph=True)(x.unsqueeze(0), *args)[0]
    assert torch.equal(out, cpu.linear(x, prepared, None, bias))


@pytest.mark.parametrize("language", ["python", "c++"])
def test_cpu_graph_op_routes_equal_the_backend(int4_kernel, language):
    """Each graph op's routes (our kernel straight from the graph; an activation key, aten's layout or
    an unprepared weight through `cpu.linear`) give what `cpu.linear` gives, on either side of the
    large-M switch: the Python `quantpass::linear_cpu` and the C++ `quantpass::linear_cpu_cxx`."""
    op = torch.ops.quantpass.linear_cpu.default
    if language == "c++":
        op = linear_call("cpu", "cpu")
        if op is torch.ops.quantpass.linear_cpu.default:
            pytest.skip(
                "the C++ op runs only where our kernels do and builds" if int4_kernel == "avx2" else "aten's kernels"
            )
    _, w, bias = operands(1, 96, 300, torch.bfloat16)
    for key, act in CPU_PAIRS:
        qt = quantize(w, key)
        for weight in (cpu.prepare_weight("linear", qt), qt):
            for m in (1, 9, 500):
                x = torch.randn(2, m, 300, dtype=torch.bfloat16)
                out = op(x, weight.data, weight.scale, None, bias, key_arg(key), key_arg(act), "cpu", 96)
                want = cpu.linear(x.reshape(-1, 300), weight, act, bias)
                assert out.shape == (2, m, 96) and torch.equal(out.reshape(-1, 96), want), (key, act, m)


@pytest.mark.skipif(not cpu_avx2.available()[0], reason=f"our kernels can't run: {cpu_avx2.available()[1]}")
def test_cpu_graph_op_under_inductor_with_dynamic_m():
    """One Inductor compile serves every M, on either side of the large-M switch (aten's routes are
    the op's eager ones, above)."""
    op, counter = linear_call("cpu", "cpu"), CompileCounterWithBackend("inductor")
    _, w, bias = operands(1, 96, 300, torch.bfloat16)
    weight = cpu.prepare_weight("linear", quantize(w, kInt4StaticGroup128Sym))
    key = key_arg(kInt4StaticGroup128Sym)
    g = torch.compile(lambda x: op(torch.relu(x), weight.data, weight.scale, None, bias, key, "", "cpu", 96),
                      backend=counter, dynamic=True, fullgraph=True)  # fmt: skip
    for m in (2, 9, 200):  # M = 3m rows (dynamic=True specializes a size of 1; duck sizing equal ones)
        x = torch.randn(3, m, 300, dtype=torch.bfloat16)
        want = cpu.linear(torch.relu(x).reshape(-1, 300), weight, None, bias)
        assert torch.equal(g(x).reshape(-1, 96), want), m
    assert counter.frame_count == 1, "a new M recompiled"


def test_cpu_prepared_layout_and_memory(int4_kernel):
    """One copy per weight: ours is the quantized weight itself; aten's replaces it. Running any M
    keeps nothing more (the large-M path dequantizes per call)."""
    w = torch.randn(96, 300, dtype=torch.bfloat16)
    for key in CPU_KEYS:
        qt = quantize(w, key)
        prepared = cpu.prepare_weight("linear", qt)
        assert cpu.prepare_weight("linear", prepared) is prepared  # idempotent
        if int4_kernel == "avx2":
            assert prepared is qt  # quantized fp32 scales, contiguous: nothing to copy
        tensors = prepared.tensors()
        for m in (1, 9, 500):
            cpu.linear(torch.randn(m, 300, dtype=torch.bfloat16), prepared, None, None)
        assert prepared.tensors() == tensors and len(vars(prepared)) == len(vars(qt))
    if int4_kernel == "avx2":
        return
    int8 = cpu.prepare_weight("linear", quantize(w, kInt8StaticChannelSym))
    assert int8.data.shape == (96, 304) and int8.data.dtype == torch.int8  # K padded to 8
    assert int8.scale.shape == (96,) and int8.scale.dtype == torch.bfloat16
    int4_ours = quantize(w, kInt4StaticGroup128Sym)
    int4 = cpu.prepare_weight("linear", int4_ours)
    assert int4.data.shape == (96, 192) and int4.data.dtype == torch.uint8  # Kp = 384, two per byte
    assert int4.scale.shape == (3, 96, 2) and not int4.scale[..., 1].any()
    scale = int4_ours.scale.to(torch.bfloat16).float()
    expected = unpack_int4(int4_ours.data).float().unflatten(-1, (-1, 128)) * scale.unsqueeze(-1)
    assert torch.equal(cpu.dequantize_int4(int4, torch.float32), expected.flatten(-2))
    assert int4.data.numel() == int4_ours.data.numel()  # no second copy of the codes


# Each documented layout against aten's packing in a process where ATEN_CPU_CAPABILITY selects it
# (a capability this CPU lacks falls back to a lower one: the check then says so and skips it).
# Rows: full blocks and a short one of every size aten takes (N % 16 == 0); K: even, not a group.
_INT4_LAYOUT_CHECK = """
import sys, torch
from quantpass.kernels import cpu_aten_int4
capability = torch.backends.cpu.get_cpu_capability()
if capability != sys.argv[1]:
    sys.exit(f"SKIP {sys.argv[1]} not available: aten runs {capability}")
assert cpu_aten_int4.int4_layout() == cpu_aten_int4.INT4_LAYOUTS[capability], cpu_aten_int4.int4_layout()
for rows in (16, 48, 64, 80, 112, 176, 208):
    for cols in (6, 258):
        codes = torch.randint(0, 16, (rows, cols), dtype=torch.int32)
        packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
        unpacked = cpu_aten_int4.unpack_int4_cpu(packed, rows, cols).to(torch.int32)
        assert torch.equal(unpacked, codes), (capability, rows, cols)
"""


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="INT4_LAYOUTS are x86-64's")
@pytest.mark.parametrize("capability", sorted(cpu_aten_int4.INT4_LAYOUTS))
def test_int4_layout_is_what_aten_packs(capability):
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability.lower(), "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run(
        [sys.executable, "-c", _INT4_LAYOUT_CHECK, capability], env=env, capture_output=True, text=True
    )
    if run.returncode and run.stderr.startswith("SKIP"):
        pytest.skip(run.stderr.strip())
    assert run.returncode == 0, run.stderr[-2000:]


def test_int4_layout_unknown_keeps_the_kernel(monkeypatch):
    monkeypatch.setattr(cpu_avx2, "available", lambda: (False, "turned off by the test"))
    monkeypatch.setattr(cpu, "_int4_layout", lambda: None)
    monkeypatch.setitem(cpu.KERNEL_MAX_M, kInt4StaticGroup128Sym, 1)
    x, w, _ = operands(7, 48, 96, torch.float32)
    qt = quantize(w, kInt4StaticGroup128Sym)
    check(
        cpu.linear(x, qt, None, None),
        x,
        w,
        qt,
        None,
        None,
        FORMAT_FLOORS[(kInt4StaticGroup128Sym, None)],
        CPU_REFERENCE_FLOORS,
    )


def test_errors_name_the_bad_value():
    x, w, _ = operands(2, 48, 96, torch.float32)
    with pytest.raises(ValueError, match=r"kInt4StaticGroup128Sym with activation kFp8DynamicTokenSym; valid pairs"):
        native.linear(x, quantize(w, kInt4StaticGroup128Sym), kFp8DynamicTokenSym, None)
    with pytest.raises(
        ValueError, match=r"no kernel for weight kInt4StaticGroup128Sym with activation kInt8DynamicTokenSym"
    ):
        cpu.linear(x, quantize(w, kInt4StaticGroup128Sym), kInt8DynamicTokenSym, None)


# --- supports: what runs where, and why not ---

# fmt: off
SUPPORTS_CASES = [
    # backend, capability, weight, activation, problem, ok, reason contains
    (native, CPU,   kFp8StaticTensorSym,   kFp8DynamicTensorSym, Problem(96, 300), True,  "torch._scaled_mm on CPU"),
    (native, CPU,   kFp8StaticChannelSym,  kFp8DynamicTokenSym,  BIG,              True,  "torch._scaled_mm on CPU"),
    (native, CPU,   kInt8StaticChannelSym, kInt8DynamicTokenSym, BIG,              True,  "torch._int_mm on CPU"),
    (native, CPU,   kFp8Static128BlockSym, kFp8Dynamic128Sym,    BIG,              False, "on CPU takes only per-tensor and per-row FP8 scales"),
    (native, CPU,   kMxfp8Static,          kMxfp8Dynamic,        BIG,              False, "on CPU takes only per-tensor and per-row"),
    (native, CPU,   kNvfp4Static,          kNvfp4Dynamic,        BIG,              False, "on CPU takes only per-tensor and per-row"),
    (native, CPU,   kMxfp4Static,          None,                 Problem(48, 300), True,  "dequantize + F.linear"),
    (native, CPU,   kMxfp4Static,          kMxfp8Dynamic,        BIG,              False, "no kernel for kMxfp4Static with activation kMxfp8Dynamic"),
    (native, SM89,  kFp8StaticChannelSym,  kFp8DynamicTokenSym,  BIG,              True,  "cuda sm89"),
    (native, Capability("cuda", 80), kFp8StaticTensorSym, kFp8DynamicTensorSym, BIG, False, "compute capability 8.9 or 9.0+; this device is sm80"),
    (native, SM90,  kFp8StaticChannelSym,  kFp8DynamicTokenSym,  Problem(96, 300), False, "K % 16 == 0; got N=96, K=300"),
    (native, SM90,  kFp8StaticChannelSym,  kFp8DynamicTokenSym,  Problem(200, 256), False, "N % 16 == 0"),
    (native, SM89,  kInt8StaticChannelSym, kInt8DynamicTokenSym, BIG,              True,  "torch._int_mm on cuda sm89"),
    (native, SM90,  kInt8StaticChannelSym, kInt8DynamicTokenSym, Problem(96, 300), False, "K % 8 == 0; got N=96, K=300"),
    (native, SM89,  kFp8Static128BlockSym, kFp8Dynamic128Sym,    BIG,              False, "only supported in CUDA for SM90"),
    (native, SM90,  kFp8Static128BlockSym, kFp8Dynamic128Sym,    Problem(256, 300), True, "BlockWise128x128 on cuda sm90"),
    (native, SM90,  kFp8Static128BlockSym, kFp8Dynamic128Sym,    Problem(200, 256), False, "N % 128 == 0; got N=200"),
    (native, SM100, kFp8Static128BlockSym, kFp8Dynamic128Sym,    BIG,              False, "scaling only supported in CUDA for SM90'; this device is sm100"),
    (native, SM90,  kMxfp8Static,          kMxfp8Dynamic,        BIG,              False, "needs sm100+; this device is sm90"),
    (native, SM100, kMxfp8Static,          kMxfp8Dynamic,        Problem(96, 300), True,  "BlockWise1x32"),
    (native, SM90,  kNvfp4Static,          kNvfp4Dynamic,        BIG,              False, "needs sm100+; this device is sm90"),
    (native, SM100, kNvfp4Static,          kNvfp4Dynamic,        BIG,              True,  "BlockWise1x16"),
    (native, SM100, kNvfp4Static,          kNvfp4Dynamic,        Problem(96, 300), False, "K % 32 == 0; got N=96, K=300 (padded to 304)"),
    (native, SM100, kInt4StaticGroup128Sym, None,                Problem(48, 300), True,  "dequantize + F.linear"),
    (native, Capability("mps"), kFp8StaticChannelSym, kFp8DynamicTokenSym, BIG,     False, "got device 'mps'"),
    (native, CPU,   kInt8StaticChannelSym, None,                 BIG,              True,  "dequantize + F.linear"),
    (cpu,    SM90,  kInt8StaticChannelSym, None,                 BIG,              False, "run on cpu, not cuda"),
    (cpu,    CPU,   kInt8StaticChannelSym, kInt8DynamicTokenSym, BIG,              True,  "activations fake-quantized per token"),
    (cpu,    CPU,   kInt4StaticGroup128Sym, kInt8DynamicTokenSym, BIG,             False, "no CPU kernel for weight kInt4StaticGroup128Sym with activation kInt8DynamicTokenSym"),
    (cpu,    CPU,   kFp8StaticChannelSym,  kMxfp8Dynamic,        BIG,              False, "no FP8 CPU kernel for weight kFp8StaticChannelSym with activation kMxfp8Dynamic"),
]
# fmt: on


@pytest.mark.parametrize(("module", "capability", "weight", "activation", "problem", "ok", "reason"), SUPPORTS_CASES)
def test_supports(module, capability, weight, activation, problem, ok, reason):
    got_ok, got_reason = module.supports("linear", capability, weight, activation, problem)
    assert (got_ok, reason in got_reason) == (ok, True), got_reason


def test_cpu_int4_supports_per_kernel(int4_kernel):
    """quantpass's kernels (INT4 takes any N; the reason names the activation mode) or aten's (its
    INT4 packing needs N % 16 == 0)."""
    ok, why = cpu.supports("linear", CPU, kInt4StaticGroup128Sym, None, Problem(40, 256))
    if int4_kernel == "avx2":
        assert ok and why.startswith("INT4 on quantpass's AVX2 kernels") and "with int8 activations" in why
        assert f"for M <= {cpu.LINEAR_MAX_M[kInt4StaticGroup128Sym]}, dequantize + matmul above" in why
        why = cpu.supports("linear", CPU, kInt8StaticChannelSym, None, Problem(96, 300))[1]
        assert why.startswith("INT8 on quantpass's AVX2 kernels") and "with int16 activations" in why
    else:
        assert not ok and "N % 16 == 0; got N=40" in why
        assert (
            "torch._weight_int4pack_mm_for_cpu for M <= "
            in cpu.supports("linear", CPU, kInt4StaticGroup128Sym, None, BIG)[1]
        )
        why = cpu.supports("linear", CPU, kInt8StaticChannelSym, None, Problem(96, 300))[1]
        assert why.startswith("torch._weight_int8pack_mm for M <= 128")


def test_supports_moe_and_missing_ops(monkeypatch):
    monkeypatch.setattr(cpu_avx2, "available", lambda: (False, "turned off by the test"))
    pair = (kInt8StaticChannelSym, None)
    ok, why = native.supports("moe", CPU, *pair, BIG)  # native MoE (torch._grouped_mm) is CUDA-only
    assert not ok and "slower than the reference loop on CPU" in why
    ok, why = cpu.supports("moe", CPU, *pair, BIG)  # the reference loop with the cpu kernels per expert
    assert ok and why.startswith("per-expert loop: torch._weight_int8pack_mm")
    assert cpu.supports("attention", CPU, *pair, BIG) == (False, "no cpu kernel for site kind 'attention'")
    monkeypatch.delattr(F, "scaled_mm")
    ok, why = native.supports("linear", SM100, kMxfp8Static, kMxfp8Dynamic, BIG)
    assert not ok and "needs torch.nn.functional.scaled_mm" in why
    monkeypatch.delattr(torch, "_weight_int4pack_mm_for_cpu")
    ok, why = cpu.supports("linear", CPU, kInt4StaticGroup128Sym, None, BIG)
    assert not ok and "has no torch._weight_int4pack_mm_for_cpu" in why


@pytest.mark.parametrize("backend", ["native", "cpu"])
def test_every_oracle_row_is_answered(backend):
    """Each linear pair listing the backend: an answer with a reason on every reference device, and
    the pairs that run on CPU are the ones this file runs (FP4's and FP8's: tests/test_cpu_fp4.py and
    tests/test_cpu_fp8.py, where their kernels build)."""
    module = oracle.backend_module(backend)
    runs_on_cpu = set()
    for pair, backends in oracle.LINEAR_CANDIDATES.items():
        if backend not in backends:
            continue
        for capability in (CPU, SM89, SM90, SM100):
            ok, why = module.supports("linear", capability, *pair, BIG)
            assert why, (pair, capability)
            if ok and capability is CPU:
                runs_on_cpu.add(pair)
    families = {(w, a) for m in (cpu_fp4, cpu_fp8) if m.available()[0] for w, acts in m.MODES.items() for a in acts}
    expected = set(NATIVE_ON_CPU) if backend == "native" else set(CPU_PAIRS) | families & set(oracle.LINEAR_CANDIDATES)
    assert runs_on_cpu == expected


# --- CUDA paths: our arguments against torch's meta checks, on fake CUDA tensors ---


def fake_cuda(t):
    return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")


def fake_cuda_qtensor(qt):
    return QTensor(fake_cuda(qt.data), fake_cuda(qt.scale), fake_cuda(qt.scale2), qt.key, qt.shape, qt.dtype)


CUDA_CAPABILITY = {native.FP8_GEMM: SM90, native.INT8_GEMM: SM90, native.FP8_BLOCK_GEMM: SM90}


@pytest.mark.parametrize("pair", list(native.GEMMS), ids=lambda p: f"{p[0]}/{p[1]}")
@pytest.mark.parametrize(("m", "n", "k"), [(1, 256, 512), (7, 256, 300), (33, 384, 640), (130, 128, 128)])
def test_cuda_gemm_arguments_pass_torchs_checks(pair, m, n, k, monkeypatch):
    """Where `supports` says yes, torch's `_scaled_mm`/`scaled_mm`/`_int_mm` meta checks accept our
    operands (shapes, strides, dtypes, recipes, swizzle); where it refuses on shape, torch does too.
    The SM rules themselves live in the CUDA kernels and are not checkable here."""
    gemm = native.GEMMS[pair]
    capability = CUDA_CAPABILITY.get(gemm, SM100)
    ok, why = native.supports("linear", capability, *pair, Problem(n, k))
    rows_seen = []
    int_mm = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: rows_seen.append(a.shape[0]) or int_mm(a, b))
    x = torch.randn(m, k, dtype=torch.bfloat16)
    qt, xq = quantize(torch.randn(n, k), pair[0]), quantize(x, pair[1])
    if not ok and gemm is native.INT8_GEMM:
        return  # `_int_mm`'s K % 8 rule is in its CUDA kernel, not in its meta function
    with FakeTensorMode(allow_non_fake_inputs=True):
        run = lambda: native._GEMM_FUNCTIONS[gemm](fake_cuda(x), fake_cuda_qtensor(qt), fake_cuda_qtensor(xq))  # noqa: E731
        if not ok:
            with pytest.raises(RuntimeError, match="divisible by 16"):
                run()
            return
        out = run()
    assert out.shape == (m, n) and out.device.type == "cuda", why
    assert out.dtype == (torch.float32 if gemm is native.INT8_GEMM else torch.bfloat16)
    assert all(rows > 16 for rows in rows_seen), "cuBLASLt's int8 GEMM needs M > 16"


# --- graphs: dynamic M, no recompile ---


def compiled_linear_graph(backend, pair, n):
    counter = CompileCounterWithBackend(backend)
    op = linear_call("native", "cpu")  # resolved as the pass does, outside the traced code: Dynamo
    # can't trace the registry's first import of a backend module (importlib), and which test ran first
    # in this process decided whether it had to

    def f(x, data, scale, scale2, bias):
        args = (data, scale, scale2, bias, key_arg(pair[0]), key_arg(pair[1]), "native", n)
        return op(torch.relu(x), *args)

    return torch.compile(f, backend=counter, dynamic=True, fullgraph=True), counter


@pytest.mark.parametrize(
    "pair",
    [p for p in NATIVE_ON_CPU if p[1] is not None] + [(kInt4StaticGroup128Sym, None), (kNvfp4Static, None)],
    ids=lambda p: f"{p[0]}/{p[1]}",
)
def test_linear_graph_aot_eager_dynamic_m(pair):
    _, w, bias = operands(1, 96, 300, torch.bfloat16)
    qt = quantize(w, pair[0])
    f, counter = compiled_linear_graph("aot_eager", pair, 96)
    frames = None
    for m in (7, 33):
        x = torch.randn(2, m, 300, dtype=torch.bfloat16)  # leading dims fold into M
        out = f(x, qt.data, qt.scale, qt.scale2, bias)
        assert out.shape == (2, m, 96)
        ref = reference.linear(torch.relu(x).reshape(-1, 300), qt, pair[1], bias)
        assert sqnr(ref.float(), out.reshape(-1, 96).float()) >= REFERENCE_FLOORS[torch.bfloat16]
        frames = frames or counter.frame_count
    assert counter.frame_count == frames, "a new M recompiled"


def test_linear_graph_inductor_fuses_activation_quantization():
    """FP8 per-row W8A8 under Inductor on CPU: two M, one compile; the activation quantization
    lands in the same generated kernel as its producer (relu) and the GEMM is `_scaled_mm`."""
    from torch._inductor.utils import run_and_get_code

    pair = (kFp8StaticChannelSym, kFp8DynamicTokenSym)
    _, w, bias = operands(1, 96, 256, torch.bfloat16)
    qt = quantize(w, pair[0])
    f, counter = compiled_linear_graph("inductor", pair, 96)
    x = torch.randn(7, 256, dtype=torch.bfloat16)
    out, code = run_and_get_code(f, x, qt.data, qt.scale, None, bias)  # (it resets dynamo first)
    assert "_scaled_mm" in code[0]
    kernels = re.findall(r"cpp_fused_\w+", code[0])
    assert any("relu" in name and "amax" in name for name in kernels), kernels
    frames = counter.frame_count
    for m in (7, 33):
        x = torch.randn(m, 256, dtype=torch.bfloat16)
        out = f(x, qt.data, qt.scale, None, bias)
        ref = reference.linear(torch.relu(x), qt, pair[1], bias)
        # Inductor's bf16 rounding of fused math differs from eager (docs/design.md §7): looser floor
        assert out.shape == (m, 96) and sqnr(ref.float(), out.float()) >= 30
    assert counter.frame_count == frames, "a new M recompiled"
