"""formats.py's MX and NVFP4 numerics against torchao's primitives for the same formats (`to_mx` with
RCEIL, `nvfp4_quantize`), byte for byte on odd shapes, zero rows, tiny and huge values: where they
agree, and exactly where and why they differ (the reasons formats.py keeps its own math, see its
`_quantize_grouped`). A torchao that changes either side fails here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quantpass.quant_registry import formats, keys, quantize

mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
nvfp4_tensor = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402

MX = {
    keys.kMxfp8Static: torch.float8_e4m3fn,
    keys.kMxfp8Dynamic: torch.float8_e4m3fn,
    keys.kMxfp4Dynamic: torch.float4_e2m1fn_x2,  # kMxfp4Static adds the exponent search on top
}


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    zero_row = torch.randn(5, 64, generator=g)
    zero_row[1] = 0.0
    mixed = torch.randn(4, 96, generator=g)
    mixed[0, :32] *= 1e-30  # one block far below the others
    mixed[2, 32:64] *= 1e30
    return {
        "bf16-7x300": torch.randn(7, 300, generator=g).bfloat16(),
        "130x96": torch.randn(130, 96, generator=g),
        "student-t": torch.distributions.StudentT(4.0).sample((64, 257)),
        "zero-row": zero_row,
        "mixed": mixed,
        "huge": torch.randn(3, 64, generator=g) * 1e38,
        "amax-at-powers-of-two": torch.full((2, 64), 448.0 * 4) * torch.tensor([[1.0], [0.5]]),
        "experts": torch.randn(2, 9, 80, generator=g),
    }


def _padded(x: torch.Tensor, group: int) -> torch.Tensor:
    return F.pad(x.float(), (0, -x.shape[-1] % group)).contiguous()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("key", MX, ids=str)
@pytest.mark.parametrize("name", sorted(_inputs()))
def test_mx_rceil_is_torchaos_to_mx(key, name):
    """Scales and elements byte-identical to `to_mx(..., RCEIL)` (columns zero-padded to the block)."""
    x = _inputs()[name]
    ours = quantize(x, key)
    scale, data = mx_tensor.to_mx(_padded(x, 32), MX[key], 32, ScaleCalculationMode.RCEIL)
    assert torch.equal(_bytes(ours.scale), _bytes(scale))
    assert torch.equal(_bytes(ours.data), _bytes(data))


@pytest.mark.parametrize("key", MX, ids=str)
def test_mx_blocks_at_the_smallest_scale_differ_from_to_mx(key):
    """The one difference: a block whose RCEIL exponent clamps to -127 (scale byte 0, amax at most
    2^-127 times the element max) is divided by 2^-127 here, by 1 in torchao's `_to_mx_rceil` (its
    reciprocal for byte 0 is 1.0). Same scale byte; torchao's elements are all zero, ours are not."""
    x = torch.linspace(-1, 1, 64).reshape(2, 32) * 2.0**-128 * (448 if MX[key] == torch.float8_e4m3fn else 6)
    ours = quantize(x, key)
    scale, data = mx_tensor.to_mx(x.contiguous(), MX[key], 32, ScaleCalculationMode.RCEIL)
    assert torch.equal(_bytes(ours.scale), _bytes(scale)) and not _bytes(scale).any()  # byte 0
    torchaos = formats._decode(data if key.dtype == keys.FP8 else _bytes(data), key.dtype)
    assert not torchaos.any()
    error = (formats.dequantize(ours, torch.float32) - x) * 2.0**127  # in units of the scale: no underflow
    assert error.norm() < 0.25 * (x * 2.0**127).norm(), "ours keeps these blocks' values"


def test_nvfp4_second_level_and_block_scales_are_torchaos():
    """NVFP4: the per-matrix scale is `per_tensor_amax_to_scale`, the e4m3 block scales and the e2m1
    codec are torchao's; the elements differ only in how the product of the two scales divides x:
    torchao multiplies by (1 / scale2) / block (its MSLK kernel's rounding), formats.py divides by
    block * scale2. torchao's bytes come back exactly when formats' encoder gets torchao's product."""
    for name, x in _inputs().items():
        if x.dim() > 2:
            continue
        for key in (keys.kNvfp4Static, keys.kNvfp4Dynamic):
            ours = quantize(x, key)
            values = _padded(x, 16)
            scale2 = nvfp4_tensor.per_tensor_amax_to_scale(values.abs().amax())
            block_scale, data = nvfp4_tensor.nvfp4_quantize(values, 16, scale2)
            assert torch.equal(ours.scale2.reshape(()), scale2), name
            assert torch.equal(_bytes(ours.scale), _bytes(block_scale)), name
            blocks = values.unflatten(-1, (-1, 16))
            torchaos_product = blocks * ((1.0 / scale2) / block_scale.float()).unsqueeze(-1)
            encoded = formats._encode(torchaos_product.clamp(-6, 6).flatten(-2), keys.FP4)
            assert torch.equal(encoded, _bytes(data)), name


def test_nvfp4_elements_differ_from_torchao_in_rare_roundings():
    """How often the two orders of the scale product round an element differently: only where x / scale
    lands within an ulp of a rounding tie (3.5 vs 3.4999998), so one e2m1 step apart; measured 41,
    191, 402 of 262144 Gaussian bf16 elements for seeds 0, 1, 2 (2026-12-01)."""
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0)).bfloat16()
    ours = quantize(x, keys.kNvfp4Static)
    _, data = nvfp4_tensor.nvfp4_quantize(x.float(), 16, nvfp4_tensor.per_tensor_amax_to_scale(x.float().abs().amax()))
    a, b = formats._decode(ours.data, keys.FP4), formats._decode(_bytes(data), keys.FP4)
    differ = a != b
    assert 0 < differ.sum() < 2e-3 * a.numel()
    steps = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    index = torch.bucketize(a.abs(), steps), torch.bucketize(b.abs(), steps)
    assert ((index[0] - index[1]).abs()[differ] <= 1).all() and (a.sign() * b.sign() >= 0).all()


def test_nvfp4_all_zero_matrix_stays_finite():
    """An all-zero matrix: torchao's per-matrix scale is 0 and its block scales 0 / 0 (NaN); formats
    clamps every amax to AMAX_EPS first, so scales stay finite and the matrix decodes to zeros."""
    x = torch.zeros(4, 32)
    block_scale, _ = nvfp4_tensor.nvfp4_quantize(x, 16, nvfp4_tensor.per_tensor_amax_to_scale(x.abs().amax()))
    assert block_scale.float().isnan().all()
    ours = quantize(x, keys.kNvfp4Static)
    assert ours.scale.float().isfinite().all() and ours.scale2.isfinite().all()
    assert not formats.dequantize(ours).any()
