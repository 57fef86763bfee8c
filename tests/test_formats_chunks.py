"""Big weights are quantized a few rows at a time (`formats._quantize_in_chunks`): byte-identical to
quantizing them whole for every weight key, odd shapes, experts, scales spanning every row
(per-tensor, NVFP4's second level), and with far smaller fp32 temporaries."""

from __future__ import annotations

import os
import subprocess
import sys

import fresh_process
import pytest
import torch

from quantpass.kernels import reference
from quantpass.quant_registry import formats, keys

WEIGHT_KEYS = {name: key for name, key in sorted(keys.KEYS.items()) if key.static}


def _weight(*shape):
    generator = torch.Generator().manual_seed(1)
    w = torch.randn(*shape, generator=generator) * torch.logspace(-2, 1, shape[-2]).unsqueeze(1)
    w[..., 3, :] = 0.0  # an all-zero row
    w[..., -1, :5] = torch.tensor([40.0, -40.0, 1e-30, -0.0, 6.0])  # the matrix's |x| max sits in the last step
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("name", sorted(WEIGHT_KEYS))
@pytest.mark.parametrize("shape", [(300, 200), (3, 259, 136)], ids=["odd-matrix", "experts"])
def test_chunked_is_byte_identical_to_whole(name, shape, monkeypatch):
    key, w = WEIGHT_KEYS[name], _weight(*shape)
    monkeypatch.setattr(formats, "QUANTIZE_CHUNK", 1 << 30)
    whole = formats.quantize(w, key)
    monkeypatch.setattr(formats, "QUANTIZE_CHUNK", 5000)  # ~25-40 rows a step: many steps, a partial last one
    assert formats._chunk_rows(w, key) > 0
    chunked = formats.quantize(w, key)
    assert chunked.shape == whole.shape and chunked.dtype == whole.dtype
    for a, b in zip(chunked.tensors(), whole.tensors()):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous()
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_dynamic_keys_and_small_weights_are_quantized_whole():
    assert formats._chunk_rows(torch.zeros(4096, 4096), keys.kFp8DynamicTokenSym) == 0
    assert formats._chunk_rows(torch.zeros(64, 4096), keys.kInt8StaticChannelSym) == 0
    assert formats._chunk_rows(torch.zeros(4096, 4096), keys.kFp8Static128BlockSym) % 128 == 0
    # off the CPU, chunks of 16M elements: a few launches per weight
    assert formats._chunk_rows(torch.zeros(4096, 4096, device="meta"), keys.kInt8StaticChannelSym) == 0
    assert formats._chunk_rows(torch.zeros(16384, 4096, device="meta"), keys.kInt8StaticChannelSym) == 4096


PEAK_SCRIPT = """
import sys, torch
from quantpass.quant_registry import formats, keys

def rss():  # resident set and its peak, bytes
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024

key = keys.KEYS[sys.argv[1]]
w = torch.randn(2816, 1024).to(torch.bfloat16)
formats.quantize(torch.randn(64, 64), key)  # imports, tables
start, _ = rss()
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
formats.quantize(w, key)
print(rss()[1] - start)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc to reset the peak RSS")
@pytest.mark.parametrize("name", ["kMxfp4Static", "kNvfp4Static", "kInt4StaticGroup128Sym", "kInt8StaticChannelSym"])
def test_temporaries_stay_near_a_chunk(name):
    """Fresh process, peak RSS while quantizing a 2816x1024 bf16 weight (5.5 MiB), output included.
    Measured 2026-12-01 under `fresh_process.MALLOC`, 5 runs each: 33-46 MiB whole, 5.3-7.2 MiB in steps."""
    out = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, name], env=fresh_process.env(), capture_output=True, text=True, check=True
    )
    peak = int(out.stdout.strip().splitlines()[-1])
    assert peak < 2.5 * 2816 * 1024 * 2, f"{name}: {peak / 2**20:.1f} MiB"


@pytest.mark.parametrize("name", sorted(keys.KEYS))
@pytest.mark.parametrize(
    "shape", [(300, 200), (2, 256, 128), (0, 64), (37,)], ids=["odd", "experts", "no-rows", "vector"]
)
def test_dequantize_in_place_matches_expanded_scales(name, shape):
    """`dequantize` scales whole groups in place through a view: the same products as multiplying
    by `expand_scale`'s weight-sized scales (what it did before), bit for bit."""
    key = keys.KEYS[name]
    if key.static and not shape[0]:
        pytest.skip("weights have rows")
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2)) * 3
    qt = formats.quantize(x, key)
    values = formats._decode(qt.data, key.dtype)
    rows, cols = values.shape[-2], x.shape[-1]
    expected = (values * formats.expand_scale(qt, rows, values.shape[-1]))[..., :cols].reshape(qt.shape)
    assert torch.equal(formats.dequantize(qt, torch.float32), expected)


@pytest.mark.parametrize("name", sorted(WEIGHT_KEYS))
@pytest.mark.parametrize("shape", [(300, 200), (257, 136)], ids=["odd", "odd-rows"])
def test_reference_matmul_dequantizes_a_few_rows_at_a_time(name, shape, monkeypatch):
    """The reference backend's product, its weight dequantized in row steps (a partial last one,
    steps that cut no row group), matches the whole dequantized weight's product to fp32 rounding
    (BLAS blocks an [M, N] product differently from its column slices: not bit for bit)."""
    key, w = WEIGHT_KEYS[name], _weight(*shape)
    qt = formats.quantize(w, key)
    x = torch.randn(5, shape[1], generator=torch.Generator().manual_seed(3))
    whole = x @ formats.dequantize(qt, torch.float32).t()
    steps, dequantize = [], reference.dequantize
    monkeypatch.setattr(reference, "DEQUANTIZE_CHUNK", 5000)
    monkeypatch.setattr(
        reference,
        "dequantize",
        lambda part, dtype, **scratch: steps.append(part.shape[-2]) or dequantize(part, dtype, **scratch),
    )
    chunked = reference._dequantized_matmul(x, qt)
    assert len(steps) > 2 and sum(steps) == shape[0], steps
    group_rows = key.group_shape.row
    assert group_rows == -1 or all(rows % group_rows == 0 for rows in steps[:-1]), steps
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5 * whole.abs().max().item())


def test_a_row_slice_that_splits_a_row_group_is_refused():
    qt = formats.quantize(_weight(256, 256), keys.kFp8Static128BlockSym)
    assert torch.equal(
        formats.dequantize(qt.rows(128, 999), torch.float32), formats.dequantize(qt, torch.float32)[128:]
    )
    with pytest.raises(ValueError, match="rows 64:256 split a group of 128 rows"):
        qt.rows(64, 256)
