"""quantpass's INT4 and INT8 CPU kernels (csrc/linear_avx2.c): every tile and tail path of every mode
(the integer modes on each of their tile sets, AVX2 and AVX-512 VNNI) against a float64 emulation of the
same arithmetic on odd shapes (outputs poisoned with NaN), the dtypes of x, bias and out, 1 vs 2 threads
bit for bit, non-finite activations, the build cache, and each reason they can't run."""

import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_tiles import on_tiles

from quantpass.kernels import cpu_avx2
from quantpass.metrics import sqnr
from quantpass.quant_registry import dequantize, quantize
from quantpass.quant_registry.formats import unpack_int4
from quantpass.quant_registry.keys import kInt4StaticGroup128Sym, kInt8StaticChannelSym

needs_kernel = pytest.mark.skipif(not cpu_avx2.available()[0], reason=f"kernel can't run: {cpu_avx2.available()[1]}")
KEYS = {4: kInt4StaticGroup128Sym, 8: kInt8StaticChannelSym}
PROBE = cpu_avx2.CSRC / "bench_probes.c"
QMAX = {"int8": 127.0, "int16": 32767.0}  # the integer modes' activation range, per block of 128
# fp32 sums of exact products (or of exact integer dot products) against float64: >= 106 dB measured
# on these shapes (2026-12-01); one wrong block or row would be < 40 dB, bf16 rounding alone ~50 dB.
FLOOR_DB = 95
M_VALUES = (1, 2, 3, 4, 5, 8, 9, 33)  # tiles of 1-4 activation rows and their repeats
N_VALUES = (1, 2, 3, 5, 9, 17, 67)  # every tile width (8, 4, 2 rows) with tails


# (weight bits, tile set): each set runs where the CPU has it
TILE_SETS = {4: cpu_avx2.INT4_TILES, 8: cpu_avx2.INT8_TILES}
PATHS = [pytest.param(bits, tiles, id=f"int{bits}-{tiles}") for bits, sets in TILE_SETS.items() for tiles in sets]


def tiles_for(bits, name):
    """The kernels on format `bits`'s tile set `name` for the block; skips where the CPU lacks it."""
    return on_tiles(cpu_avx2.int4_tiles if bits == 4 else cpu_avx2.int8_tiles, name)


def weight(n, k, bits, seed=0):
    return quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), KEYS[bits])


def dequantized(qt, bits) -> torch.Tensor:
    """float64 [N, kp]: the kernel's weight columns (INT4: the data's padded Kp)."""
    if bits == 8:
        return qt.data.double() * qt.scale.double()
    values = unpack_int4(qt.data).double().unflatten(-1, (-1, 128)) * qt.scale.double().unsqueeze(-1)
    return values.flatten(-2)


def expected(x, qt, bits, mode):
    """float64 result of the kernel's arithmetic: exact, or x quantized per block of 128 columns as the
    kernel does (scale max|x| / qmax, x * (qmax / max|x|) rounded to nearest even, in fp32)."""
    w = dequantized(qt, bits)
    x = F.pad(x.float(), (0, w.shape[1] - x.shape[1]))
    if mode == "exact":
        return x.double() @ w.T
    pad = -w.shape[1] % 128
    blocks = F.pad(x, (0, pad)).unflatten(-1, (-1, 128))
    top = blocks.abs().amax(-1, keepdim=True)
    q = (blocks * torch.where(top > 0, QMAX[mode] / top, 0.0)).round()
    return (q.double() * (top / QMAX[mode]).double()).flatten(-2) @ F.pad(w, (0, pad)).T


@needs_kernel
@pytest.mark.parametrize("decode", cpu_avx2.DECODE_TILES)
@pytest.mark.parametrize("bits, tiles", PATHS)
@pytest.mark.parametrize("k", [100, 300, 1000])
def test_every_path_matches_its_arithmetic_on_odd_shapes(k, bits, tiles, decode):
    with tiles_for(bits, tiles), on_tiles(cpu_avx2.decode_tiles, decode):
        _every_path_matches(k, bits)


def _every_path_matches(k, bits):
    for n in N_VALUES:
        qt = weight(n, k, bits, seed=n)
        for m in M_VALUES:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            for mode in cpu_avx2.FORMAT_MODES[bits]:
                out = torch.full((m, n), float("nan"))
                got = cpu_avx2.linear(x, qt.data, qt.scale, out=out, mode=mode)
                assert got is out and not got.isnan().any(), (m, n, k, mode)
                assert sqnr(expected(x, qt, bits, mode), got) >= FLOOR_DB, (m, n, k, mode)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_large_m_scratch_is_allocated_per_call(bits):
    """M = 300 needs more scratch than the kernel keeps between calls (1 MiB): a fresh allocation."""
    qt, x = weight(9, 1000, bits), torch.randn(300, 1000)
    assert cpu_avx2.library().qp_scratch_bytes(300, 1000 if bits == 8 else 1024, bits, 0) > 1 << 20
    got = cpu_avx2.linear(x, qt.data, qt.scale, out=torch.full((300, 9), float("nan")))
    assert sqnr(expected(x, qt, bits, "exact"), got) >= FLOOR_DB


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_dtypes_of_x_bias_and_out(bits):
    """Each output is the fp32 result plus the bias, rounded once to out's dtype, bit for bit."""
    qt, x32 = weight(40, 300, bits), torch.randn(5, 300)
    bias32 = torch.randn(40)
    for mode in cpu_avx2.FORMAT_MODES[bits]:
        for dtype in cpu_avx2.DTYPES:
            x = x32.to(dtype)
            plain = cpu_avx2.linear(x.float(), qt.data, qt.scale, mode=mode)
            for bias in (None, bias32.bfloat16(), bias32):
                got = cpu_avx2.linear(x, qt.data, qt.scale, bias, mode=mode)
                want = plain if bias is None else plain + bias.float()
                assert got.dtype == dtype and torch.equal(got, want.to(dtype)), (mode, dtype, bias)
            out = torch.empty(5, 40)  # out's dtype rules: x bf16/fp16 in, fp32 out
            assert torch.equal(cpu_avx2.linear(x, qt.data, qt.scale, out=out, mode=mode), plain)


@needs_kernel
@pytest.mark.parametrize("bits, tiles", PATHS)
def test_one_and_two_threads_agree_bit_for_bit(bits, tiles):
    """200 x 4096 is enough work for two threads; each output is one thread's sum in a fixed order."""
    qt = weight(200, 4096, bits)
    threads = torch.get_num_threads()
    with tiles_for(bits, tiles), contextlib.ExitStack() as stack:
        stack.callback(torch.set_num_threads, threads)
        for m in (1, 3, 9):
            x = torch.randn(m, 4096).bfloat16()
            for mode in cpu_avx2.FORMAT_MODES[bits]:
                torch.set_num_threads(1)
                one = cpu_avx2.linear(x, qt.data, qt.scale, mode=mode)
                torch.set_num_threads(2)
                assert torch.equal(one, cpu_avx2.linear(x, qt.data, qt.scale, mode=mode)), (m, mode)


@needs_kernel
@pytest.mark.parametrize("bits, tiles", PATHS)
def test_non_finite_activations_give_non_finite_rows(bits, tiles):
    qt, x = weight(17, 300, bits), torch.randn(3, 300)
    x[0, 5], x[1, 200] = float("nan"), float("inf")
    with tiles_for(bits, tiles):
        _non_finite_rows(qt, x, bits)


def _non_finite_rows(qt, x, bits):
    for mode in cpu_avx2.FORMAT_MODES[bits]:
        got = cpu_avx2.linear(x, qt.data, qt.scale, mode=mode)
        assert got[0].isnan().all() and not got[1].isfinite().any(), mode
        assert sqnr(expected(x[2:], qt, bits, mode), got[2:]) >= FLOOR_DB, mode


@needs_kernel
def test_int4_tile_sets_agree_and_bad_names_are_named():
    """Both tile sets form the same exact integer sums per group; only their fp32 sums (8 vs 16 lanes)
    may round differently."""
    qt, x = weight(67, 1000, 4), torch.randn(5, 1000)
    with pytest.raises(ValueError, match=r"invalid INT4 tiles 'avx512'; valid: avx2, avx512-vnni"):
        cpu_avx2.int4_tiles("avx512")
    outs = []
    for tiles in cpu_avx2.INT4_TILES:
        with tiles_for(4, tiles):
            assert cpu_avx2.int4_tiles() == tiles
            outs.append(cpu_avx2.linear(x, qt.data, qt.scale, mode="int8"))
    assert sqnr(outs[0].double(), outs[1]) >= 120  # measured 131 dB: fp32 rounding only


@needs_kernel
def test_int8_tile_sets_agree_bit_for_bit_and_bad_names_are_named():
    """The VNNI tiles add the AVX2 tiles' integer lanes pairwise before the same fp32 arithmetic: the same
    outputs on every tile and tail (1 activation row runs on the AVX2 tiles in both sets)."""
    with pytest.raises(ValueError, match=r"invalid INT8 tiles 'vnni'; valid: avx2, avx512-vnni"):
        cpu_avx2.int8_tiles("vnni")
    for n, k in ((67, 1000), (9, 300), (17, 129)):
        qt = weight(n, k, 8, seed=n)
        for m in M_VALUES:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
            outs = []
            for tiles in cpu_avx2.INT8_TILES:
                with tiles_for(8, tiles):
                    assert cpu_avx2.int8_tiles() == tiles
                    outs.append(
                        cpu_avx2.linear(x, qt.data, qt.scale, out=torch.full((m, n), float("nan")), mode="int16")
                    )
            assert torch.equal(*outs), (n, k, m)


@needs_kernel
@pytest.mark.parametrize("bits, tiles", PATHS)
def test_decode_tile_heights_agree_bit_for_bit(bits, tiles):
    """One activation row on 8-row or 4-row tiles: each output the same sum in the same order."""
    with pytest.raises(ValueError, match=r"invalid decode tiles '2-row'; valid: 8-row, 4-row"):
        cpu_avx2.decode_tiles("2-row")
    with tiles_for(bits, tiles):
        for n, k in ((67, 1000), (9, 300), (4096 + 5, 256)):
            qt, x = weight(n, k, bits, seed=n), torch.randn(1, k).bfloat16()
            for mode in cpu_avx2.FORMAT_MODES[bits]:
                outs = []
                for decode in cpu_avx2.DECODE_TILES:
                    with on_tiles(cpu_avx2.decode_tiles, decode):
                        outs.append(cpu_avx2.linear(x, qt.data, qt.scale, mode=mode))
                assert torch.equal(*outs), (n, k, mode)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_rows_equal_quantpass_dequantize(bits):
    """Any run of rows, every dtype, odd K (INT8's 8-column tail, INT4's padded group), 1 and 2 threads:
    each value times its scale in fp32, rounded once, as `quant_registry.dequantize` gives it."""
    threads = torch.get_num_threads()
    try:
        for n, k in ((67, 1000), (9, 300), (40, 129)):
            qt = weight(n, k, bits, seed=n)
            kp = qt.data.shape[1] * (2 if bits == 4 else 1)
            full = F.pad(dequantize(qt, torch.float32), (0, kp - k))
            for first, rows in ((0, n), (3, n - 5), (n - 1, 1)):
                for dtype in cpu_avx2.DTYPES:
                    for count in (1, 2):
                        torch.set_num_threads(count)
                        out = torch.full((rows, kp), float("nan"), dtype=dtype)
                        assert cpu_avx2.dequantize(qt.data, qt.scale, first, out) is out
                        assert torch.equal(out, full[first : first + rows].to(dtype)), (n, k, first, dtype, count)
    finally:
        torch.set_num_threads(threads)
    qt = weight(9, 300, bits)
    with pytest.raises(ValueError, match=r"dequantize: rows 5\.\.10 of data"):
        cpu_avx2.dequantize(qt.data, qt.scale, 5, torch.empty(5, qt.data.shape[1] * (2 if bits == 4 else 1)))


@needs_kernel
def test_bad_arguments_name_the_values():
    int4, int8, x = weight(8, 256, 4), weight(8, 256, 8), torch.randn(2, 256)
    with pytest.raises(ValueError, match=r"int4 kernel shapes: x \(2, 300\), data \(8, 128\), scale \(8, 2\)"):
        cpu_avx2.linear(torch.randn(2, 300), int4.data, int4.scale)
    with pytest.raises(
        ValueError, match=r"uint8 \(INT4\) or int8 data and fp32 scales; got torch.uint8, torch.bfloat16"
    ):
        cpu_avx2.linear(x, int4.data, int4.scale.bfloat16())
    with pytest.raises(ValueError, match=r"int8 kernel shapes: x \(2, 256\), data \(8, 256\), scale \(8, 2\)"):
        cpu_avx2.linear(x, int8.data, int4.scale)
    with pytest.raises(ValueError, match=r"invalid int4 kernel mode 'int16'; valid: exact, int8"):
        cpu_avx2.linear(x, int4.data, int4.scale, mode="int16")
    with pytest.raises(ValueError, match=r"x and bias must be one of .*; got torch.float64, None"):
        cpu_avx2.linear(x.double(), int8.data, int8.scale)
    with pytest.raises(ValueError, match=r"int8 kernel bias must be \[8\]; got \(9,\)"):
        cpu_avx2.linear(x, int8.data, int8.scale, torch.zeros(9))
    with pytest.raises(ValueError, match=r"out must be contiguous fp32/bf16/fp16 \(2, 8\); got torch.float32 \(8, 2\)"):
        cpu_avx2.linear(x, int4.data, int4.scale, out=torch.empty(8, 2))


def test_unavailable_reasons(monkeypatch):
    build = cpu_avx2._library.__wrapped__
    monkeypatch.setenv("QUANTPASS_CPU_KERNEL", "0")
    assert build()[1:] == (False, "QUANTPASS_CPU_KERNEL=0")
    monkeypatch.delenv("QUANTPASS_CPU_KERNEL")
    monkeypatch.setattr(cpu_avx2.platform, "machine", lambda: "aarch64")
    assert build()[2].startswith("built for x86-64 CPUs with AVX2; this is aarch64")
    monkeypatch.undo()
    monkeypatch.setattr(cpu_avx2.torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert build()[1:] == (False, "built for x86-64 CPUs with AVX2; this is x86_64 with DEFAULT")
    monkeypatch.undo()
    monkeypatch.setattr(cpu_avx2.torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert build()[1] is False and "AMX" in build()[2]
    monkeypatch.undo()
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert build()[1:] == (False, "building csrc/linear_avx2.c with /nonexistent/cc failed")
    monkeypatch.setattr(cpu_avx2, "_library", lambda: (None, False, "turned off by the test"))
    assert cpu_avx2.library() is None
    with pytest.raises(RuntimeError, match="CPU kernels can't run: turned off by the test"):
        cpu_avx2.linear(torch.zeros(1, 128), torch.zeros(1, 64, dtype=torch.uint8), torch.ones(1, 1))


@needs_kernel
def test_build_cache_is_reused(tmp_path, monkeypatch):
    """(on the small bandwidth probe: the kernels take seconds to compile)"""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    compiler = os.environ.get("CC") or "cc"
    first = cpu_avx2.build(compiler, PROBE)
    assert first.parent == tmp_path / "quantpass" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert cpu_avx2.build(compiler, PROBE) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary file left behind


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_bench_kernel_over_layers_in_one_call_matches_a_call_per_layer(bits):
    """bench/cpu_decode.py times the kernel alone as its layers in one C call (csrc/bench_probes.c's
    qp_linear_layers): each layer's output, written to its own poisoned buffer, is the one a call for
    that layer alone gives, for every mode the format has; also through a build of the source that
    bench/kernel_ab.py loads itself (how it times two versions side by side)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    try:
        import cpu_decode
        import kernel_ab
    finally:
        sys.path.pop(0)
    qts = [weight(40, 300, bits, seed) for seed in range(3)]
    x = torch.randn(3, 300).bfloat16()
    for kernel in (None, kernel_ab.load(str(cpu_avx2.SOURCE))):
        for mode in cpu_avx2.FORMAT_MODES[bits]:
            outs = [torch.full((3, 40), float("nan"), dtype=torch.bfloat16) for _ in qts]
            cpu_decode.kernel_alone(x, qts, outs, bits, cpu_avx2.MODES[mode], 2, kernel)()
            for qt, out in zip(qts, outs, strict=True):
                assert torch.equal(out, cpu_avx2.linear(x, qt.data, qt.scale, mode=mode)), (kernel, mode)
