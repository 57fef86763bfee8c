"""Reference numerics: layouts, error bounds (hypothesis), packing, SQNR floors, torchao parity."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantpass.metrics import sqnr
from quantpass.quant_registry import QTensor, dequantize, keys, quantize
from quantpass.quant_registry.formats import (
    ELEMENTS,
    _fp4_codec,
    expand_scale,
    pack_int4,
    pack_nibbles,
    padded_cols,
    unpack_int4,
)

ALL_KEYS = sorted(keys.KEYS.items())
WEIGHT_KEYS = {name: key for name, key in ALL_KEYS if key.static}

# SQNR floors on Gaussian weights (issue #2), per weight key.
FLOORS_DB = {
    "kFp8StaticTensorSym": 30,
    "kFp8StaticChannelSym": 30,
    "kFp8Static128BlockSym": 30,
    "kMxfp8Static": 30,
    "kInt8StaticChannelSym": 38,
    "kMxfp4Static": 17,
    "kNvfp4Static": 19.5,
    "kInt4StaticGroup128Sym": 17,
}


def student_t(shape):
    return torch.distributions.StudentT(4.0).sample(shape)


def test_every_weight_key_has_a_floor():
    assert set(FLOORS_DB) == set(WEIGHT_KEYS)


@pytest.mark.parametrize("name", sorted(FLOORS_DB))
def test_sqnr_floor_on_gaussian_weights(name):
    w = torch.randn(256, 1024, dtype=torch.bfloat16)
    measured = sqnr(w.float(), dequantize(quantize(w, keys.KEYS[name])).float())
    assert measured >= FLOORS_DB[name], f"{name}: {measured:.2f} dB"


@pytest.mark.parametrize(
    ("name", "data_shape", "data_dtype", "scale_shape", "scale_dtype"),
    [
        ("kFp8StaticTensorSym", (96, 300), torch.float8_e4m3fn, (1, 1), torch.float32),
        ("kFp8StaticChannelSym", (96, 300), torch.float8_e4m3fn, (96, 1), torch.float32),
        ("kFp8Static128BlockSym", (96, 384), torch.float8_e4m3fn, (1, 3), torch.float32),
        ("kFp8Dynamic128Sym", (96, 384), torch.float8_e4m3fn, (96, 3), torch.float32),
        ("kMxfp8Static", (96, 320), torch.float8_e4m3fn, (96, 10), torch.uint8),
        ("kMxfp4Static", (96, 160), torch.uint8, (96, 10), torch.uint8),
        ("kNvfp4Static", (96, 152), torch.uint8, (96, 19), torch.float8_e4m3fn),
        ("kInt8StaticChannelSym", (96, 300), torch.int8, (96, 1), torch.float32),
        ("kInt4StaticGroup128Sym", (96, 192), torch.uint8, (96, 3), torch.float32),
    ],
)
def test_layout_of_odd_shapes(name, data_shape, data_dtype, scale_shape, scale_dtype):
    """N=96 and K=300 fit no group: columns pad to whole groups, rows stay, dequantize crops."""
    w = torch.randn(96, 300)
    qt = quantize(w, keys.KEYS[name])
    assert (tuple(qt.data.shape), qt.data.dtype) == (data_shape, data_dtype)
    assert (tuple(qt.scale.shape), qt.scale.dtype) == (scale_shape, scale_dtype)
    assert padded_cols(qt.key, 300) % 300 == 0 or qt.key.group_shape.col > 1
    out = dequantize(qt)
    assert out.shape == w.shape and out.dtype == w.dtype
    assert sqnr(w, out) > 15


def test_nvfp4_global_scale_and_batched_experts():
    w = torch.randn(4, 64, 96)  # [E, N, K]: one global scale per expert matrix
    w[2] *= 100
    qt = quantize(w, keys.kNvfp4Static)
    assert qt.scale2.shape == (4, 1, 1)
    assert torch.allclose(qt.scale2.flatten(), w.abs().amax(dim=(1, 2)) / (448 * 6))
    for expert in range(4):  # each expert's matrix keeps its own accuracy despite expert 2's range
        alone = dequantize(quantize(w[expert], keys.kNvfp4Static))
        assert torch.equal(dequantize(qt)[expert], alone)


@pytest.mark.parametrize("name", [n for n, _ in ALL_KEYS])
def test_degenerate_shapes_and_values(name):
    key = keys.KEYS[name]
    for w in (torch.zeros(3, 5), torch.randn(7), torch.randn(1, 1), torch.full((2, 40), 1e-30)):
        out = dequantize(quantize(w, key))
        assert out.shape == w.shape and torch.isfinite(out).all(), (name, w.shape)
    assert torch.equal(dequantize(quantize(torch.zeros(3, 5), key)), torch.zeros(3, 5))


def test_nan_in_a_weight_raises_naming_the_tensor():
    w = torch.randn(8, 32)
    w[3, 4] = float("nan")
    with pytest.raises(ValueError, match="cannot quantize layers.0.q_proj.weight with kMxfp8Static: it contains NaN"):
        quantize(w, keys.kMxfp8Static, name="layers.0.q_proj.weight")
    w[3, 4] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(w, keys.kInt8StaticChannelSym)
    with pytest.raises(ValueError, match="dtype torch.int64 is not floating point"):
        quantize(torch.arange(4), keys.kInt8StaticChannelSym)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from([n for n, _ in ALL_KEYS]),
    rows=st.integers(1, 40),
    cols=st.integers(1, 300),
    magnitude=st.sampled_from([1e-4, 1.0, 3e3]),
    seed=st.integers(0, 2**16),
    heavy=st.booleans(),
)
def test_error_bound_property(name, rows, cols, magnitude, seed, heavy):
    """|x - q(x)| <= rel*|x| + abs*scale (+ clipping above max*scale, only where a search clips)."""
    key = keys.KEYS[name]
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator) * magnitude
    if heavy:
        x[torch.rand(rows, cols, generator=generator) < 0.01] *= 50
    qt = quantize(x, key)
    element = ELEMENTS[key.dtype]
    scale = expand_scale(qt, rows, padded_cols(key, cols))[:, :cols]
    error = (dequantize(qt) - x).abs()
    clipped = (x.abs() - element.max * scale).clamp(min=0)
    bound = element.rel * x.abs() + element.abs * scale + clipped + 1e-6 * x.abs() + 1e-30
    assert (error <= bound).all(), f"{name}: worst excess {(error - bound).max():.3g}"
    searched = key.static and (key.dtype == torch.int4 or key.scale.dtype == torch.float8_e8m0fnu)
    if not searched and key.scale.dtype != torch.float8_e4m3fn:
        # only weight scale searches (INT4 clip, MX exponent) and NVFP4's rounded e4m3 scales clip
        assert (clipped <= 1e-6 * x.abs()).all()


@settings(max_examples=25, deadline=None)
@given(shape=st.tuples(st.integers(1, 5), st.integers(1, 20).map(lambda n: 2 * n)), seed=st.integers(0, 2**16))
def test_packing_round_trips(shape, seed):
    generator = torch.Generator().manual_seed(seed)
    ints = torch.randint(-8, 8, shape, generator=generator, dtype=torch.int8)
    packed = pack_int4(ints)
    assert packed.shape == (shape[0], shape[1] // 2) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), ints)
    assert torch.equal(packed[..., 0] & 0xF, (ints[..., 0] + 8).to(torch.uint8))  # first element in the low nibble
    codes = torch.randint(0, 16, shape, generator=generator, dtype=torch.uint8)
    _, _, unpack = _fp4_codec()
    assert torch.equal(unpack(pack_nibbles(codes)), codes)  # FP4's packing, read back by torchao


def test_fp4_code_values():
    _, f4_to_f32, _ = _fp4_codec()
    values = f4_to_f32(torch.arange(16, dtype=torch.uint8)).tolist()
    assert values[:8] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert values[9:] == [-0.5, -1, -1.5, -2, -3, -4, -6]


def test_mx_activation_scales_are_rceil():
    """Dynamic (activation) MX scales follow RCEIL exactly: FlashInfer's quantizer gives these bytes."""
    x = torch.randn(16, 256) * torch.logspace(-3, 3, 16).unsqueeze(1)
    for key, elem_max in ((keys.kMxfp8Dynamic, 448.0), (keys.kMxfp4Dynamic, 6.0)):
        qt = quantize(x, key)
        amax = x.unflatten(-1, (-1, 32)).abs().amax(-1)
        expected = (torch.ceil(torch.log2(amax / elem_max)) + 127).to(torch.uint8)
        assert torch.equal(qt.scale, expected)


def test_mx_matches_torchao_rceil_bytes_for_activations():
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    x = torch.randn(32, 256)
    scale, data = to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    ours = quantize(x, keys.kMxfp8Dynamic)
    assert torch.equal(ours.scale, scale.view(torch.uint8))
    assert torch.equal(ours.data.view(torch.uint8), data.view(torch.uint8))


# -- parity with torchao on the same tensors ----------------------------------------------------


def _torchao_round_trips():
    """torchao quantize->dequantize for every format it also implements, by our weight key name."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
    from torchao.quantization.quant_primitives import (
        MappingType,
        _choose_scale_float8,
        _dequantize_affine_float8,
        _quantize_affine_float8,
        choose_qparams_affine,
        dequantize_affine,
        quantize_affine,
    )

    def fp8(block):
        def run(w):
            size = [w.shape[0] if b == -1 else b for b in block[:1]] + [w.shape[1] if block[1] == -1 else block[1]]
            scale = _choose_scale_float8(w, size)
            return _dequantize_affine_float8(_quantize_affine_float8(w, scale), scale)

        return run

    def mx(elem):
        def run(w):
            best = -math.inf, None
            for mode in ScaleCalculationMode:  # torchao's best mode on this tensor
                scale, data = to_mx(w, elem, 32, mode)
                values = f4_unpacked_to_f32(unpack_uint4(data)) if elem == torch.float4_e2m1fn_x2 else data.float()
                out = values * torch.exp2(scale.view(torch.uint8).float() - 127).repeat_interleave(32, -1)
                best = max(best, (sqnr(w, out), out), key=lambda t: t[0])
            return best[1]

        return run

    def nvfp4(w):
        global_scale = per_tensor_amax_to_scale(w.abs().amax())
        scale, data = nvfp4_quantize(w, 16, global_scale)
        return f4_unpacked_to_f32(unpack_uint4(data)) * (scale.float() * global_scale).repeat_interleave(16, -1)

    def affine(bits, group):
        def run(w):
            qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
            block = (1, w.shape[1] if group == -1 else group)
            scale, zero = choose_qparams_affine(w, MappingType.SYMMETRIC, block, torch.int8, qmin, qmax)
            q = quantize_affine(w, block, scale, zero, torch.int8, qmin, qmax)
            return dequantize_affine(q, block, scale, zero, torch.int8, qmin, qmax)

        return run

    return {
        "kFp8StaticTensorSym": fp8((-1, -1)),
        "kFp8StaticChannelSym": fp8((1, -1)),
        "kFp8Static128BlockSym": fp8((128, 128)),
        "kMxfp8Static": mx(torch.float8_e4m3fn),
        "kMxfp4Static": mx(torch.float4_e2m1fn_x2),
        "kNvfp4Static": nvfp4,
        "kInt8StaticChannelSym": affine(8, -1),
        "kInt4StaticGroup128Sym": affine(4, 128),
    }


@pytest.mark.parametrize("distribution", ["gaussian", "student_t4"])
def test_sqnr_within_a_tenth_of_a_db_of_torchao_or_better(distribution):
    w = torch.randn(128, 1024) if distribution == "gaussian" else student_t((128, 1024))
    report = {}
    for name, round_trip in _torchao_round_trips().items():
        ours = sqnr(w, dequantize(quantize(w, keys.KEYS[name])))
        theirs = sqnr(w, round_trip(w))
        report[name] = (round(ours, 2), round(theirs, 2))
    worse = {n: r for n, r in report.items() if r[0] < r[1] - 0.1}
    assert not worse, f"ours vs torchao (dB): {report}"


def test_qtensor_nbytes_and_repr():
    qt = quantize(torch.randn(64, 256, dtype=torch.bfloat16), keys.kInt4StaticGroup128Sym)
    assert isinstance(qt, QTensor)
    assert qt.nbytes == 64 * 128 + 64 * 2 * 4
    assert "kInt4StaticGroup128Sym" in repr(qt) and "(64, 256)" in repr(qt)
