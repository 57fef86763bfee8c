"""Element encodings shared by the Triton kernels: exact rounding to FP8 / INT8 / bf16, FP4 decoding.

Why round by hand: Triton's interpreter (`TRITON_INTERPRET=1`, our CPU test tier) converts
fp32 -> float8e4nv without carrying a mantissa round-up into the exponent (7.99 -> 4.0, measured
with triton 3.9) and fp32 -> bf16 by truncation. With `EXACT` the helpers first round in fp32
arithmetic to a value the target type holds exactly, so the conversion has nothing left to round
and the bytes equal torch's round-to-nearest-even. On CUDA the native conversions (`cvt.rn`) are
already exact and the launchers pass `EXACT=False`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def to_e4m3(v, EXACT: tl.constexpr):
    """fp32 already clamped to +-448 -> float8e4nv, round to nearest even."""
    if EXACT:
        negative = v.to(tl.int32, bitcast=True) < 0  # the sign bit, so -0.0 stays -0.0 as in torch
        magnitude = tl.abs(v)
        # e4m3 subnormals (< 2^-6) are multiples of 2^-9: at 1.5 * 2^14 fp32's ulp is 2^-9, so the add rounds there.
        subnormal = (magnitude + 24576.0) - 24576.0
        # Normals keep 3 of fp32's 23 mantissa bits: add half an ulp (ties to even) and clear 20 bits;
        # a carry moves into the exponent, which is what the interpreter's conversion gets wrong.
        bits = magnitude.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 == 0xFFF00000
        magnitude = tl.where(magnitude < 0.015625, subnormal, bits.to(tl.float32, bitcast=True))
        v = tl.where(negative, -magnitude, magnitude)
    return v.to(tl.float8e4nv)


@triton.jit
def to_int8(v):
    """fp32 already clamped to +-127 -> int8, round half to even like `torch.round`.

    Adding 1.5 * 2^23 leaves no fraction bits, so the add rounds to nearest even (|v| < 2^22);
    Triton's float -> int cast truncates and the interpreter has no `libdevice.rint`.
    """
    return ((v + 12582912.0) - 12582912.0).to(tl.int8)


@triton.jit
def to_output(acc, out_dtype: tl.constexpr, EXACT: tl.constexpr):
    """The fp32 epilogue value -> the output dtype (bf16 rounded to nearest even under EXACT)."""
    if EXACT and out_dtype == tl.bfloat16:
        bits = acc.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000
        acc = bits.to(tl.float32, bitcast=True)
    return acc.to(out_dtype)


@triton.jit
def e2m1_to_float(nibble):
    """FP4 e2m1 codes (uint8 in [0, 16)) -> fp32: sign bit 8, then 2 exponent bits and 1 mantissa bit."""
    magnitude = (nibble & 7).to(tl.int32)
    exponent = magnitude >> 1
    mantissa = magnitude & 1
    normal = (((exponent + 126) << 23) | (mantissa << 22)).to(tl.float32, bitcast=True)  # 2^(e-1) * 1.m
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.5, normal)  # subnormal: 0 or 0.5
    return tl.where((nibble & 8) != 0, -value, value)


@triton.jit
def unpack_nibbles(packed):
    """uint8 [BK // 2, BN] packed along dim 0, first element in the low nibble -> uint8 [BK, BN]."""
    pairs = tl.join(packed & 0xF, packed >> 4)  # [BK // 2, BN, 2]
    pairs = tl.permute(pairs, (0, 2, 1))  # [BK // 2, 2, BN]: row 2j is the low nibble, 2j + 1 the high
    return tl.reshape(pairs, (2 * packed.shape[0], packed.shape[1]))
