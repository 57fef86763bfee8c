"""The e2m1 (FP4) lookup-table codec in formats.py against torchao's bit-twiddling conversion it
replaced: identical codes, values and decoded bytes on every top-16-bit pattern and the edge values
(signed zeros, fp32 subnormals, exact ties and their neighbours, saturation, Inf, NaN), and whole
MXFP4/NVFP4 quantizations byte-identical to the old codec's; and the CPU path never importing torchao."""

from __future__ import annotations

import math
import subprocess
import sys

import fresh_process
import pytest
import torch

from quantpass.quant_registry import formats, keys
from quantpass.quant_registry.formats import _fp4_codec, fp4_codes, fp4_decode, fp4_round

TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]  # midpoints between e2m1 values: round half to even


def _floats(bits: list[int]) -> torch.Tensor:
    return (
        torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int64)
        .to(torch.int32)
        .view(torch.float32)
    )


def _edge_values() -> torch.Tensor:
    near = [math.nextafter(t, d) for t in [*TIES, 0.5, 1.0, 2.0, 4.0, 6.0] for d in (0.0, math.inf)]
    values = torch.tensor([0.0, 1e-45, 1e-40, 2**-126, 2**-127, *TIES, 0.5, 1, 1.5, 2, 3, 4, 6, 6.5, 8, 1e30, math.inf])
    values = torch.cat([values, torch.tensor(near, dtype=torch.float64).float()])  # fp32 neighbours may round back
    signed = torch.cat([values, -values])
    nans = _floats([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFBFFFFF, 0x7FA00000])
    return torch.cat([signed, nans])


def _every_top16() -> torch.Tensor:
    top = torch.arange(1 << 16, dtype=torch.int64) << 16
    lows = [0, 1, 0x8000, 0xFFFF, 0x0F0F]
    bits = torch.cat([top | low for low in lows] + [top | torch.randint(0, 1 << 16, top.shape)])
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("inputs", [_edge_values, _every_top16], ids=["edges", "every-top16"])
def test_codes_and_values_match_torchao(inputs):
    f32_to_f4, f4_to_f32, _ = _fp4_codec()
    x = inputs()
    codes = f32_to_f4(x.contiguous())
    assert torch.equal(fp4_codes(x), codes)
    rounded = fp4_round(x)
    assert torch.equal(rounded.view(torch.int32), f4_to_f32(codes).view(torch.int32))  # -0.0 stays -0.0
    clamped = f4_to_f32(f32_to_f4(x.clamp(-6, 6)))  # the old `_round` clamped first
    assert torch.equal(rounded.view(torch.int32), clamped.view(torch.int32))
    assert torch.equal(fp4_codes(rounded), codes)  # encoding the rounded values: the same codes


def test_codec_keeps_shapes_and_reads_strided_inputs():
    f32_to_f4, _, _ = _fp4_codec()
    x = torch.randn(3, 40, 18).mul(4).transpose(1, 2)  # not contiguous
    assert fp4_codes(x).shape == x.shape
    assert torch.equal(fp4_codes(x), f32_to_f4(x.contiguous()))
    assert fp4_round(x[:0]).shape == (0, 18, 40)


def test_decode_matches_torchao_for_every_byte():
    _, f4_to_f32, unpack = _fp4_codec()
    data = torch.arange(256, dtype=torch.uint8).reshape(2, 4, 32)
    decoded = fp4_decode(data)
    assert decoded.shape == (2, 4, 64)
    assert torch.equal(decoded.view(torch.int32), f4_to_f32(unpack(data)).view(torch.int32))


def _torchao_codes(x):
    return _fp4_codec()[0](x.float().contiguous())


def _torchao_round(x):
    f32_to_f4, f4_to_f32, _ = _fp4_codec()
    return f4_to_f32(f32_to_f4(x.float().clamp(-6, 6).contiguous()))


def _torchao_decode(data):
    _, f4_to_f32, unpack = _fp4_codec()
    return f4_to_f32(unpack(data.contiguous()))


@pytest.mark.parametrize("key", [keys.kMxfp4Static, keys.kNvfp4Static, keys.kMxfp4Dynamic, keys.kNvfp4Dynamic], ids=str)
def test_quantize_is_byte_identical_to_the_old_codec(key, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(67, 200, generator=generator) * torch.logspace(-3, 2, 67).unsqueeze(1)
    x[0, :9] = torch.tensor([0.0, -0.0, 6.0, -6.0, 0.25, 0.75, 2.5, 5.0, 1e-40])
    x[1] = 0.0  # an all-zero row
    x = torch.cat([x, torch.distributions.StudentT(4.0).sample((33, 200))]).to(torch.bfloat16)
    new = formats.quantize(x, key)
    dense = formats.dequantize(new, torch.float32)
    monkeypatch.setattr(formats, "fp4_codes", _torchao_codes)
    monkeypatch.setattr(formats, "fp4_round", _torchao_round)
    monkeypatch.setattr(formats, "fp4_decode", _torchao_decode)
    old = formats.quantize(x, key)
    for a, b in zip(new.tensors(), old.tensors()):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(dense, formats.dequantize(old, torch.float32))


def test_traced_code_keeps_torchao_ops_and_the_same_results():
    """Under torch.compile the codec is torchao's op sequence (no table baked into graphs), with the
    same results as the tables."""
    x = torch.cat([_edge_values(), torch.randn(1000) * 3])
    packed = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    graphs = []

    def backend(gm, example_inputs):  # where quantpass quantizes weights: real tensors take the tables
        graphs.append((gm, formats._lookup(torch.zeros(2)), formats._lookup(torch.zeros(2, device="meta"))))
        return gm

    compiled = torch.compile(lambda x, p: (fp4_codes(x), fp4_round(x), fp4_decode(p)), backend=backend, fullgraph=True)
    for got, want in zip(compiled(x, packed), (fp4_codes(x), fp4_round(x), fp4_decode(packed))):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    graph, real_in_backend, meta_in_backend = graphs[0]
    assert "index_select" not in graph.code and "rshift" in graph.code
    assert real_in_backend and not meta_in_backend


def test_fp4_on_cpu_runs_without_importing_torchao():
    """Quantizing, dequantizing and multiplying FP4 on CPU use quantpass's own tables: torchao's
    mx_formats import held ~4.4 MiB more for the process (bench/README.md, "Memory")."""
    code = (
        "import sys, torch, quantpass as qp\n"
        "from quantpass.kernels import cpu\n"
        "w = torch.randn(64, 96)\n"
        "for fmt in ('nvfp4', 'mxfp4'):\n"
        "    spec = qp.QuantSpec.from_name(fmt)\n"
        "    qt = qp.quantize(w, spec.weight)\n"
        "    qp.dequantize(qt)\n"
        "    cpu.linear(torch.randn(3, 96), qt, spec.activation, None)\n"
        "print(sorted(m for m in sys.modules if m.startswith('torchao.prototype')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=fresh_process.env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
