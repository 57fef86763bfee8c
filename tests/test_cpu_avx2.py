"""quantpass's INT4 and INT8 CPU kernels (csrc/linear_avx2.c): layout, numerics against a float64
product of the same quantized weight on odd shapes (every tile and tail path, outputs poisoned with
NaN), threads, the build cache, and each reason they can't run."""

import os

import pytest
import torch

from quantpass.kernels import cpu_avx2
from quantpass.metrics import sqnr
from quantpass.quant_registry import quantize
from quantpass.quant_registry.formats import unpack_int4
from quantpass.quant_registry.keys import kInt4StaticGroup128Sym, kInt8StaticChannelSym

needs_kernel = pytest.mark.skipif(not cpu_avx2.available()[0], reason=f"kernel can't run: {cpu_avx2.available()[1]}")
# fp32 accumulation of exact products (codes are small integers, scales fp32) against float64:
# >= 122.8 dB (INT4) measured on these shapes (2026-11-29); bf16 rounding alone would be ~50 dB.
FLOOR_DB = 110


def operands(m, n, k, seed=0, bits=4):
    """x zero-padded to Kp (as the cpu backend passes it), the kernel's bytes and scales, and the
    float64 reference product of the same quantized weight."""
    gen = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    if bits == 8:  # K padded to 8 with zero columns, as cpu.prepare_weight does
        qt = quantize(w, kInt8StaticChannelSym)
        data = torch.nn.functional.pad(qt.data, (0, -k % 8)).contiguous()
        x_padded = torch.nn.functional.pad(x, (0, data.shape[-1] - k))
        expected = x.double() @ (qt.data.double() * qt.scale.double()).T
        return x_padded, data, qt.scale.reshape(-1).float().contiguous(), expected
    qt = quantize(w, kInt4StaticGroup128Sym)
    kp = qt.data.shape[-1] * 2
    values = unpack_int4(qt.data).double().unflatten(-1, (-1, 128)) * qt.scale.double().unsqueeze(-1)
    x_padded = torch.nn.functional.pad(x, (0, kp - k))
    data = cpu_avx2.pack((unpack_int4(qt.data).to(torch.int16) + 8).to(torch.uint8))
    return x_padded, data, qt.scale.float().contiguous(), x_padded.double() @ values.flatten(-2).T


def test_pack_layout_and_round_trip():
    codes = torch.randint(0, 16, (3, 256), dtype=torch.uint8)
    packed = cpu_avx2.pack(codes)
    assert packed.shape == (3, 128) and packed.dtype == torch.uint8
    # byte 8c + i = code(16c + i) | code(16c + 8 + i) << 4
    assert packed[1, 8 * 5 + 3] == codes[1, 16 * 5 + 3] | (codes[1, 16 * 5 + 8 + 3] << 4)
    assert torch.equal(cpu_avx2.unpack(packed), codes)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [100, 300, 1000])
def test_kernel_matches_float64_on_odd_shapes(k, bits):
    """M covers the 1-row tile and 2/3/4-row tiles with tails; N every remainder mod 4 (and mod 2)."""
    for m in (1, 2, 3, 4, 5, 7, 33):
        for n in (1, 2, 3, 5, 6, 7, 67):
            x, data, scale, expected = operands(m, n, k, seed=m * 100 + n, bits=bits)
            out = torch.full((m, n), float("nan"))
            got = cpu_avx2.linear(x, data, scale, out=out)
            assert got is out and not got.isnan().any(), (m, n, k)
            assert sqnr(expected, got.double()) >= FLOOR_DB, (m, n, k)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_bf16_input_and_threads(bits):
    """bf16 x is read as fp32; each output is one thread's sum in a fixed order: 1 and 2 threads agree bit for bit."""
    x, data, scale, _ = operands(9, 130, 512, bits=bits)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_avx2.linear(x.bfloat16(), data, scale)
        torch.set_num_threads(2)
        two = cpu_avx2.linear(x.bfloat16(), data, scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(one, cpu_avx2.linear(x.bfloat16().float(), data, scale))


@needs_kernel
def test_bad_arguments_name_the_values():
    x, data, scale, _ = operands(2, 8, 256)
    with pytest.raises(ValueError, match=r"int4 kernel shapes: x \(2, 200\), data \(8, 128\), scale \(8, 2\)"):
        cpu_avx2.linear(x[:, :200], data, scale)
    with pytest.raises(
        ValueError, match=r"uint8 \(INT4\) or int8 data and fp32 scales; got torch.uint8, torch.bfloat16"
    ):
        cpu_avx2.linear(x, data, scale.bfloat16())
    with pytest.raises(ValueError, match=r"int8 kernel shapes: x \(2, 256\), data \(8, 256\), scale \(8, 2\)"):
        cpu_avx2.linear(x, torch.zeros(8, 256, dtype=torch.int8), scale)
    with pytest.raises(ValueError, match=r"out must be contiguous fp32 \(2, 8\); got torch.float32 \(8, 2\)"):
        cpu_avx2.linear(x, data, scale, out=torch.empty(8, 2))


def test_unavailable_reasons(monkeypatch):
    build = cpu_avx2._library.__wrapped__
    monkeypatch.setenv("QUANTPASS_CPU_KERNEL", "0")
    assert build()[1:] == (False, "QUANTPASS_CPU_KERNEL=0")
    monkeypatch.delenv("QUANTPASS_CPU_KERNEL")
    monkeypatch.setattr(cpu_avx2.platform, "machine", lambda: "aarch64")
    assert build()[2].startswith("built for x86-64 AVX2 machines without AVX-512; this is aarch64")
    monkeypatch.undo()
    for capability in ("DEFAULT", "AVX512"):
        monkeypatch.setattr(cpu_avx2.torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert build()[1] is False and build()[2].endswith(f"with {capability}")
    monkeypatch.undo()
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert build()[1:] == (False, "building csrc/linear_avx2.c with /nonexistent/cc failed")
    monkeypatch.setattr(cpu_avx2, "_library", lambda: (None, False, "turned off by the test"))
    with pytest.raises(RuntimeError, match="CPU kernels can't run: turned off by the test"):
        cpu_avx2.linear(torch.zeros(1, 128), torch.zeros(1, 64, dtype=torch.uint8), torch.ones(1, 1))


@needs_kernel
def test_build_cache_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    compiler = os.environ.get("CC") or "cc"
    first = cpu_avx2._build(compiler)
    assert first.parent == tmp_path / "quantpass" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert cpu_avx2._build(compiler) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary file left behind
