"""Triton activation quantization: the same bytes as the reference `formats.quantize` for every dynamic key.

CPU tier: Triton's interpreter (conftest sets TRITON_INTERPRET=1 without CUDA). GPU tier: the same
checks at 4096 x 4096 on CUDA.
"""

import pytest
import torch
from _triton_support import device, on_interpreter, poison_empty

from quantpass.quant_registry import formats, keys
from quantpass.quant_registry.keys import FP8

DYNAMIC_KEYS = [
    "kFp8DynamicTensorSym",
    "kFp8DynamicTokenSym",
    "kFp8Dynamic128Sym",
    "kMxfp8Dynamic",
    "kInt8DynamicTokenSym",
]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    poison_empty(monkeypatch)


def quantize_activation(x, key):
    from quantpass.kernels.triton.quant import quantize_activation

    return quantize_activation(x, key)


def assert_same_bytes(x, key):
    got, want = quantize_activation(x, key), formats.quantize(x, key)
    assert (got.data.shape, got.data.dtype) == (want.data.shape, want.data.dtype)
    assert (got.scale.shape, got.scale.dtype) == (want.scale.shape, want.scale.dtype)
    assert (got.key, got.shape, got.dtype) == (want.key, want.shape, want.dtype)
    mismatched = (got.data.view(torch.uint8) != want.data.view(torch.uint8)).sum().item()
    assert mismatched == 0, f"{mismatched} of {got.data.numel()} elements differ"
    assert torch.equal(got.scale.view(torch.uint8), want.scale.view(torch.uint8))


def activations(rows, cols, dtype, dev="cpu"):
    """Rows of very different ranges, one all-zero row (the amax epsilon), one outlier."""
    x = torch.randn(rows, cols, device=dev) * torch.logspace(-3, 3, rows, device=dev)[:, None]
    x[rows // 2] = 0
    x[-1, cols // 3] = 1e4
    return x.to(dtype)


@on_interpreter
@pytest.mark.parametrize("name", DYNAMIC_KEYS)
@pytest.mark.parametrize(("rows", "cols"), [(1, 100), (7, 160), (33, 300)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_same_bytes_as_reference(name, rows, cols, dtype):
    """K = 100 / 160 / 300 fit neither 128 nor (for 100, 300) 32: the padding must be written as zeros."""
    assert_same_bytes(activations(rows, cols, dtype), keys.KEYS[name])


@on_interpreter
def test_fp8_rounding_ties_and_carries():
    """Scale exactly 1 (amax 448): every tie between e4m3 neighbours rounds to even, round-ups carry
    into the exponent (7.99 -> 8, the case Triton's interpreter gets wrong), signs and zeros kept."""
    codes = torch.arange(0, 126, dtype=torch.uint8).view(FP8).float()  # 0 .. 448, increasing
    ties = (codes[:-1] + codes[1:]) / 2
    values = torch.cat([ties, ties + 2**-12, ties - 2**-12, codes, torch.tensor([448.0, -0.0, 2**-10, 3 * 2**-11])])
    x = torch.cat([values, -values]).reshape(1, -1)
    for name in ("kFp8DynamicTensorSym", "kFp8DynamicTokenSym"):
        assert_same_bytes(x, keys.KEYS[name])


@on_interpreter
def test_int8_round_half_to_even():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5, -126.5, 3.49, -3.51]])
    assert_same_bytes(x, keys.kInt8DynamicTokenSym)


@on_interpreter
def test_mx_scale_is_rceil_at_powers_of_two():
    """amax / 448 exactly a power of two keeps its exponent; a hair above it takes the next one."""
    x = torch.zeros(6, 64)
    x[0, 0] = 448.0 * 2**-4  # ratio 2^-4: exponent -4
    x[1, 0] = 448.0 * 2**-4 * (1 + 2**-7)  # just above: -3
    x[2, 5:37] = torch.linspace(-3, 3, 32)
    x[3, 33] = 448.0
    x[4, 7], x[5, 7] = 4e-36, 1e-39  # amax / 448 below fp32's normals: exponents -126 and -127
    assert_same_bytes(x, keys.kMxfp8Dynamic)  # all-zero groups store byte 0 (2^-127)
    scale = quantize_activation(x, keys.kMxfp8Dynamic).scale
    assert scale[:, 0].tolist()[:2] == [127 - 4, 127 - 3] and scale[4:, 0].tolist() == [1, 0]


@on_interpreter
def test_strided_rows_and_empty_input():
    wide = torch.randn(9, 256, dtype=torch.bfloat16)
    assert_same_bytes(wide[:, :160], keys.kFp8Dynamic128Sym)  # row stride 256, not 160
    empty = quantize_activation(torch.empty(0, 64), keys.kFp8DynamicTokenSym)
    assert empty.data.shape == (0, 64) and empty.scale.shape == (0, 1)


@pytest.mark.parametrize(
    "key", [keys.kFp8StaticChannelSym, keys.kNvfp4Dynamic, keys.kMxfp4Dynamic], ids=["static", "nvfp4", "mxfp4"]
)
def test_unsupported_keys_are_refused_by_name(key):
    with pytest.raises(ValueError, match=str(key)):
        quantize_activation(torch.randn(2, 64), key)


@pytest.mark.gpu
@pytest.mark.parametrize("name", DYNAMIC_KEYS)
def test_same_bytes_as_reference_on_cuda(name):
    """Real size on the GPU: the native conversions (cvt.rn) and div_rn must give torch's bytes."""
    assert_same_bytes(activations(4096, 4096, torch.bfloat16, device()), keys.KEYS[name])
    assert_same_bytes(activations(33, 4000, torch.bfloat16, device()), keys.KEYS[name])
