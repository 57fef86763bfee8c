"""quantpass's FP8 CPU kernel (kernels/cpu_fp8.py, csrc/linear_fp8.c) against references on odd
shapes, outputs poisoned with NaN before the call: weight-only against a float64 product of x and
the dequantized weight, for every FP8 weight layout (per tensor, per channel, 128x128 blocks, MXFP8)
and every tail (K not a multiple of 16 bytes, N not a multiple of the tiles' rows, M across the
activation-row tiles); W8A8 against the reference backend (the same quantized activations); every
e4m3 byte decoded as torch decodes it; NaN and inf; argument errors; each on both sets of tiles (fp32
on AVX2; bf16 on AVX-512 BF16, where the CPU has it), and which set a call takes. Threads, routing
and compiled models: tests/test_cpu_format_kernels.py."""

from dataclasses import replace

import pytest
import torch
from kernel_tiles import on_tiles

from quantpass.kernels import cpu_fp8, reference
from quantpass.metrics import sqnr
from quantpass.quant_registry import formats, keys
from quantpass.quant_registry.qtensor import QTensor

pytestmark = pytest.mark.skipif(not cpu_fp8.available()[0], reason=f"FP8 CPU kernel: {cpu_fp8.available()[1]}")


@pytest.fixture(autouse=True, params=cpu_fp8.TILES)
def tiles(request):
    """Every test on each set of tiles (skipped where the CPU lacks it)."""
    with on_tiles(cpu_fp8.tiles, request.param):
        yield request.param


WEIGHTS = list(cpu_fp8.MODES)
PAIRS = [(w, a) for w, acts in cpu_fp8.MODES.items() for a in acts if a is not None]
# (M, N, K): K with a partial last 16 bytes (the per-row formats: 260, 130, 7), spanning scale groups
# (1040: 9 blocks of 128, 33 MX blocks), N not a multiple of 4, 8 or 128; M across the 4-row tiles
SHAPES = [(1, 37, 48), (2, 16, 260), (3, 33, 1040), (4, 20, 96), (5, 7, 130), (9, 300, 512), (17, 3, 7)]


def operands(key, M, N, K, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = formats.quantize(torch.randn(N, K, generator=gen).to(dtype), key)
    x = torch.randn(M, K, generator=gen).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    return x, weight, bias


def poisoned(M, N, dtype=torch.float32):
    return torch.full((M, N), float("nan"), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("key", WEIGHTS, ids=str)
def test_weight_only_is_the_exact_product(key, shape, dtype):
    x, weight, bias = operands(key, *shape, dtype=dtype)
    out = cpu_fp8.linear(x, weight, None, bias, out=poisoned(shape[0], shape[1]))
    dense = formats.dequantize(weight, torch.float64)
    want = x.double() @ dense.t() + bias.double()
    assert not out.isnan().any()
    assert sqnr(want, out.double()) >= 110  # fp32 sums of exact fp32 products (measured 130-144 dB)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-{p[1]}")
def test_w8a8_matches_the_reference(pair, shape):
    weight_key, activation = pair
    x, weight, bias = operands(weight_key, *shape, seed=1)
    if keys.needs_input_scale(activation):  # a checkpoint's calibrated scale
        weight = replace(weight, input_scale=x.float().abs().amax() / 448 * 0.9)
    out = cpu_fp8.linear(x, weight, activation, bias, out=poisoned(shape[0], shape[1]))
    want = reference.linear(x.float(), weight, activation, bias.float())
    assert not out.isnan().any()
    assert sqnr(want, out) >= 110  # the same quantized activations: only the fp32 sums' order differs


def identity_weight(weight_key, k: int) -> QTensor:
    """e4m3 1.0 on the diagonal of [k, k] (padded as the key pads), every scale 1 (MXFP8's: byte 127), a
    static input scale of 1: the kernel's output is its quantized activations."""
    kp, groups = formats.padded_cols(weight_key, k), weight_key.group_shape
    shape = (1 if groups.row == -1 else -(-k // groups.row), 1 if groups.col == -1 else kp // groups.col)
    scale = torch.full(shape, 127, dtype=torch.uint8) if weight_key.scale.dtype == keys.E8M0 else torch.ones(shape)
    weight = QTensor(torch.eye(k, kp).to(torch.float8_e4m3fn), scale, None, weight_key, (k, k), torch.float32)
    weight.input_scale = torch.tensor(1.0)
    return weight


def test_mxfp8_block_scales_next_to_powers_of_two_are_torchs():
    """MXFP8 activations, quantized in the kernel: blocks of 32 whose max / 448 lies on or a few ulps
    above or below a power of two (where ceil(log2) depends on how log2 rounds: the kernel takes the
    double log2 rounded to fp32, which equals torch's there), an all-zero block (exponent -127), a
    subnormal one, one near fp32's largest, NaN and inf: bit for bit what the reference quantizes."""
    gen, blocks = torch.Generator().manual_seed(4), []
    for e in (-120, -30, -9, -1, 0, 1, 7, 30, 100):
        for ulps in (-2, -1, 0, 1, 2, 3):
            top = torch.tensor(2.0**e, dtype=torch.float32).view(torch.int32) + ulps
            block = torch.rand(32, generator=gen) * 2.0**e * 448
            block[ulps % 32] = top.view(torch.float32) * 448  # the block's max (rounded once in fp32)
            blocks.append(block)
    blocks += [torch.zeros(32), torch.full((32,), 1e-41), torch.full((32,), 3e38), torch.randn(32, generator=gen)]
    x = torch.stack(blocks).reshape(-1, 2 * 32)  # 2 blocks per row
    weight = identity_weight(keys.kMxfp8Static, x.shape[1])
    want = reference.fake_quantize(x, keys.kMxfp8Dynamic, None)
    assert torch.equal(cpu_fp8.linear(x, weight, keys.kMxfp8Dynamic, out=poisoned(*x.shape)), want)
    x[1, 40], x[3, 5] = float("nan"), float("inf")  # that row NaN (the identity's zeros times it), as the reference
    got, want = cpu_fp8.linear(x, weight, keys.kMxfp8Dynamic), reference.linear(x, weight, keys.kMxfp8Dynamic, None)
    assert got[1].isnan().all() and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("activation", list(cpu_fp8.ACTS), ids=str)
def test_activations_quantized_in_the_kernel_are_the_references_bit_for_bit(activation):
    """Each activation the kernel quantized shows up alone against an identity weight (e4m3 1.0, scales
    1), so any value other than fake_quantize's is visible: e4m3 midpoints that round to even (normal
    and subnormal), values under half the smallest subnormal, the clamp at 448, NaN and inf rows. Row
    maxima of 448 make each dynamic scale exactly 1; the static scale is 1."""
    ties = [1.0625, 1.1875, 2.125, 3 * 2**-10, 5 * 2**-10, 2**-10, 2**-11, 440.0, 432.0, 0.0, 1e-30]
    ties = torch.tensor(ties + [-t for t in ties])
    rows = [
        torch.cat([torch.tensor([448.0]), ties, torch.linspace(-3, 3, 41)]),
        torch.cat([torch.tensor([-448.0]), ties / 2, torch.randn(41, generator=torch.Generator().manual_seed(2))]),
        torch.cat([torch.tensor([448.0, 500.0, -1e4]), ties[2:], torch.randn(41) * 100]),  # over 448: the clamp
    ]
    small = torch.randn(3, 100, generator=torch.Generator().manual_seed(3)) / 1000  # 1x128: a second group
    x = torch.cat([torch.stack(rows), small], dim=1)
    k = x.shape[1]
    weight_key = next(w for w, acts in cpu_fp8.MODES.items() if activation in acts)
    weight = identity_weight(weight_key, k)
    want = reference.fake_quantize(x, activation, weight.input_scale)
    assert torch.equal(cpu_fp8.linear(x, weight, activation, out=poisoned(3, k)), want)
    for bad in (float("nan"), float("inf")):  # as the reference: that row (per token) or every row (per tensor)
        x_bad = x.clone()
        x_bad[1, 7] = bad
        want = reference.linear(x_bad, weight, activation, None)  # a NaN times the weight's zeros: NaN rows
        got = cpu_fp8.linear(x_bad, weight, activation)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_e4m3_byte_reads_as_torch_decodes_it(out_dtype):
    """A per-tensor weight holding each finite e4m3 byte once (subnormals, zeros, both signs), scale 1,
    against one-hot activations: every output is one decoded byte, exactly."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # 254 finite bytes
    data = codes.view(torch.float8_e4m3fn).reshape(1, -1).repeat(3, 1)  # [3, 254]: K = 254, a partial step
    weight = QTensor(data, torch.ones(1, 1), None, keys.kFp8StaticTensorSym, data.shape, torch.float32)
    out = cpu_fp8.linear(torch.eye(254), weight, out=poisoned(254, 3, out_dtype))
    assert torch.equal(out[:, 0], codes.view(torch.float8_e4m3fn).float().to(out_dtype))


def test_every_e4m3_byte_times_each_mxfp8_scale_reads_exactly():
    """Each finite e4m3 byte against one-hot activations, under e8m0 scales at and past the edges of what the
    bf16 tiles fold into the weights (bytes 10 .. 246): rows 0-3 (one 4-row tile) fold, rows 4-7 (the next)
    hold a byte outside and run unfolded. Every output is one byte times its scale, exactly (or inf past fp32's
    range, and zero for a zero byte: a scale of 2^120 or more once gave NaN there on the fp32 tiles)."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F] + [0, 0], dtype=torch.uint8)  # 8 MX blocks
    data = codes.view(torch.float8_e4m3fn).reshape(1, -1).repeat(8, 1)
    exponents = torch.tensor([127, 10, 246, 100, 9, 247, 0, 254], dtype=torch.uint8)
    scale = exponents[:, None].repeat(1, 8)
    scale[4:, 1:] = 127  # one byte outside the range takes its tile off the fold
    weight = QTensor(data, scale, None, keys.kMxfp8Static, data.shape, torch.float32)
    out = cpu_fp8.linear(torch.eye(256), weight, out=poisoned(256, 8))
    value = codes.view(torch.float8_e4m3fn).float()[:, None]
    want = value * torch.exp2(scale.float().repeat_interleave(32, dim=1).t() - 127)  # inf past fp32's range
    assert torch.equal(out, want)


def test_nan_and_inf_activations_stay_in_their_rows_as_in_the_reference():
    x, weight, _ = operands(keys.kFp8StaticChannelSym, 3, 16, 128)
    x[1, 5], x[2, 70] = float("nan"), float("inf")
    out, want = cpu_fp8.linear(x, weight), reference.linear(x, weight, None, None)
    assert out[1].isnan().all() and not out[2].isfinite().any() and out[0].isfinite().all()
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.isinf(), want.isinf())


def test_a_nan_scale_gives_nan_in_its_rows_only():
    _, weight, _ = operands(keys.kMxfp8Static, 2, 16, 96)
    scale = weight.scale.clone()
    scale[3, 1] = 255  # e8m0's NaN
    out = cpu_fp8.linear(torch.randn(2, 96), replace(weight, scale=scale))
    assert out[:, 3].isnan().all() and not out[:, [0, 1, 2, 4]].isnan().any()


def test_bad_arguments_name_what_is_wrong():
    x, weight, _ = operands(keys.kFp8StaticChannelSym, 2, 16, 64)
    with pytest.raises(
        ValueError, match="no FP8 CPU kernel for weight kFp8StaticChannelSym with activation kMxfp8Dynamic"
    ):
        cpu_fp8.linear(x, weight, keys.kMxfp8Dynamic)
    with pytest.raises(ValueError, match="FP8 kernel shapes"):
        cpu_fp8.linear(torch.randn(2, 96), weight)
    with pytest.raises(ValueError, match="FP8 kernel scales: want"):
        cpu_fp8.linear(x, replace(weight, scale=weight.scale[:8]))
    with pytest.raises(ValueError, match="out must be contiguous"):
        cpu_fp8.linear(x, weight, out=torch.empty(2, 15))


def test_which_tiles_a_call_takes(tiles):
    """The bf16 tiles run a call whose activations are all bf16 values that dpbf16ps reads as they are
    (bf16 activations as given; FP8-quantized ones as codes with their scales, unless a code times its
    scale overflows; MXFP8's as codes times their scales, unless one is not a normal bf16 value); any
    other call runs on the fp32 tiles, bit for bit as with those chosen."""
    if tiles != "avx512-bf16":
        pytest.skip("about the bf16 tiles")
    x, weight, _ = operands(keys.kFp8Static128BlockSym, 3, 40, 1024, dtype=torch.float32)
    subnormal = x.bfloat16().float()
    subnormal[1, 3] = 2.0**-130  # a bf16 value, but subnormal: dpbf16ps would read it as zero
    mx_inf = x.clone()
    mx_inf[2, 9] = float("inf")  # MXFP8's block scale 2^127: 448 x 2^127 overflows
    mx_tiny = x.clone()
    mx_tiny[1] *= 2.0**-130  # MXFP8's codes times their scales (2^-127 at the least): not normal bf16 values
    mx_weight = formats.quantize(torch.randn(40, 1024), keys.kMxfp8Static)
    fp32_tiles = [(x, weight, None), (subnormal, weight, None), (mx_inf, mx_weight, keys.kMxfp8Dynamic),
                  (mx_tiny, mx_weight, keys.kMxfp8Dynamic)]  # fmt: skip
    bf16_tiles = [(x.bfloat16(), weight, None), (x, weight, keys.kFp8Dynamic128Sym),
                  (x.bfloat16(), mx_weight, None), (x, mx_weight, keys.kMxfp8Dynamic)]  # fmt: skip
    for i, case in enumerate(fp32_tiles + bf16_tiles):
        got = cpu_fp8.linear(*case, out=poisoned(3, 40))  # fp32 out: the sums as they are
        with on_tiles(cpu_fp8.tiles, "avx2"):
            want = cpu_fp8.linear(*case, out=poisoned(3, 40))
        assert torch.equal(got.isnan(), want.isnan())
        # the same products; on the bf16 tiles summed in another order (so some outputs differ)
        assert torch.equal(got.nan_to_num(), want.nan_to_num()) == (i < len(fp32_tiles))
        assert sqnr(want.nan_to_num().double(), got.nan_to_num().double()) >= 120


def test_bad_tiles_are_named():
    with pytest.raises(ValueError, match=r"invalid FP8 tiles 'avx512'; valid: avx2, avx512-bf16"):
        cpu_fp8.tiles("avx512")
