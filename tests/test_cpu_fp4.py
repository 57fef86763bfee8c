"""quantpass's MXFP4 / NVFP4 CPU kernel (kernels/cpu_fp4.py, csrc/linear_fp4.c) against references
on odd shapes, outputs poisoned with NaN before the call: W4A4 against the reference backend (the same
quantized activations: fp32 rounding apart); weight-only against an independent float64 computation of
what it defines (x quantized to int8 per block, then exact products), and against the reference's exact
activations with the accuracy it states; every tail (K not a multiple of 64 codes, N not a multiple of
the tiles' rows, M across the activation-row tiles); NaN rows; argument errors; each on both sets of
tiles (AVX2; AVX-512 VNNI where the CPU has it). Threads, routing and compiled models:
tests/test_cpu_format_kernels.py."""

import pytest
import torch
from kernel_tiles import on_tiles

from quantpass.kernels import cpu_fp4, reference
from quantpass.metrics import sqnr
from quantpass.quant_registry import formats, keys

pytestmark = pytest.mark.skipif(not cpu_fp4.available()[0], reason=f"FP4 CPU kernel: {cpu_fp4.available()[1]}")

WEIGHT_ONLY = [keys.kMxfp4Static, keys.kNvfp4Static]
# (M, N, K): K with a partial last chunk of 64 codes (48, 80, 1040, 96, 160), an odd number of full
# chunks (64, 192: the VNNI tiles take chunks in pairs), N not a multiple of 4 or 16
SHAPES = [(1, 37, 48), (2, 16, 80), (3, 33, 1040), (4, 20, 96), (5, 7, 64), (6, 24, 192), (9, 64, 4096), (17, 3, 160)]


@pytest.fixture(autouse=True, params=cpu_fp4.TILES)
def tiles(request):
    """Every test on each set of tiles (skipped where the CPU lacks it)."""
    with on_tiles(cpu_fp4.tiles, request.param):
        yield request.param


def operands(key, M, N, K, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    K = formats.padded_cols(key, K)
    weight = formats.quantize(torch.randn(N, K, generator=gen).to(dtype), key)
    x = torch.randn(M, K, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    return x, weight, bias


def poisoned(M, N, dtype):
    return torch.full((M, N), float("nan"), dtype=dtype)


def int8_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """What the kernel multiplies for weight-only formats: x per block of `block` columns as int8,
    q = round_half_even(x * (127 / max|x|)) and d = max|x| / 127 in fp32 as the kernel forms them (an x
    at exactly half a step rounds by that product), returned as q * d in float64."""
    blocks = x.float().unflatten(-1, (-1, block))
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0)  # `127 / amax` is 127 * (1 / amax) in torch
    return (torch.round(blocks * inv).double() * (amax / 127).double()).flatten(-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("key", WEIGHT_ONLY, ids=str)
def test_weight_only_is_int8_activations_times_the_weight(key, shape, dtype):
    x, weight, bias = operands(key, *shape, dtype=dtype)
    out = cpu_fp4.linear(x, weight, None, bias, out=poisoned(shape[0], shape[1], torch.float32))
    want = int8_activations(x, key.group_shape.col) @ formats.dequantize(weight, torch.float64).t() + bias.double()
    assert not out.isnan().any()
    assert sqnr(want, out.double()) >= 100  # fp32 sums of exact integer block products
    # against the reference's exact activations: the accuracy cpu_fp4.MODES states (measured 44-47 dB)
    assert sqnr(reference.linear(x, weight, None, bias).float(), out) >= 38


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_nvfp4_activations_match_the_reference(shape, dtype):
    x, weight, bias = operands(keys.kNvfp4Static, *shape, dtype=dtype, seed=1)
    out = cpu_fp4.linear(x, weight, keys.kNvfp4Dynamic, bias, out=poisoned(shape[0], shape[1], torch.float32))
    want = reference.linear(x.float(), weight, keys.kNvfp4Dynamic, bias.float())
    assert not out.isnan().any()
    assert sqnr(want, out) >= 100  # the same quantized activations: only the fp32 sums' order differs


def test_nvfp4_activations_are_quantized_as_formats_quantize_does():
    """Each activation the kernel quantized shows up alone against a one-hot weight, so any code or
    scale other than formats.quantize's (a tie rounded the other way) is a whole step off: e2m1
    midpoints, block scales halfway between two e4m3 values (x's per-tensor scale is exactly 1: its
    max is 448 * 6), blocks under AMAX_EPS, zeros, and bf16 noise."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -2.5, -3.5, -5.0, 0.0, 1.0])
    scale_ties = [torch.cat([torch.tensor([6 * s]), ties[:15] * s]) for s in (1.0625, 1.1875, 9.5)]  # e4m3 ties
    rows = [
        torch.cat([ties, ties * 2, ties * 8, *scale_ties]),
        torch.cat([ties / 4, torch.full((16,), 1e-13), torch.zeros(47), torch.tensor([2688.0]), -ties]),
        torch.randn(96, generator=torch.Generator().manual_seed(3)).bfloat16().float() * 40,
    ]
    x = torch.stack(rows)
    weight = formats.quantize(torch.eye(96), keys.kNvfp4Static)
    out = cpu_fp4.linear(x, weight, keys.kNvfp4Dynamic, out=poisoned(3, 96, torch.float32))
    torch.testing.assert_close(out, reference.linear(x, weight, keys.kNvfp4Dynamic, None), rtol=1e-6, atol=0)


def test_nvfp4_activations_with_a_nan_are_nan_everywhere_as_the_reference():
    x, weight, _ = operands(keys.kNvfp4Static, 3, 16, 64)
    x[1, 7] = float("nan")
    assert reference.linear(x, weight, keys.kNvfp4Dynamic, None).isnan().all()
    assert cpu_fp4.linear(x, weight, keys.kNvfp4Dynamic).isnan().all()


@pytest.mark.parametrize("key", WEIGHT_ONLY, ids=str)
def test_a_row_with_nan_or_inf_is_nan_and_the_others_are_not(key):
    x, weight, _ = operands(key, 3, 16, 128)
    x[1, 5], x[2, 70] = float("nan"), float("inf")
    out = cpu_fp4.linear(x, weight)
    assert out[1:].isnan().all() and not out[0].isnan().any()


def test_bad_arguments_name_what_is_wrong():
    x, weight, _ = operands(keys.kMxfp4Static, 2, 16, 64)
    with pytest.raises(ValueError, match="no FP4 CPU kernel for weight kMxfp4Static with activation kNvfp4Dynamic"):
        cpu_fp4.linear(x, weight, keys.kNvfp4Dynamic)
    with pytest.raises(ValueError, match="FP4 kernel shapes"):
        cpu_fp4.linear(torch.randn(2, 96), weight)
    with pytest.raises(ValueError, match="out must be contiguous"):
        cpu_fp4.linear(x, weight, out=torch.empty(2, 15))


def test_tile_sets_agree_and_bad_names_are_named():
    """Both sets form the same integer sums per lane; only their fp32 sums (8 vs 16 lanes) round
    differently."""
    with pytest.raises(ValueError, match=r"invalid FP4 tiles 'avx512'; valid: avx2, avx512-vnni"):
        cpu_fp4.tiles("avx512")
    for key in WEIGHT_ONLY:
        x, weight, bias = operands(key, 3, 40, 1040)
        outs = []
        for name in cpu_fp4.TILES:
            with on_tiles(cpu_fp4.tiles, name):
                outs.append(cpu_fp4.linear(x, weight, None, bias, out=poisoned(3, 40, torch.float32)))
        assert sqnr(outs[0].double(), outs[1].double()) >= 120  # fp32 rounding only
