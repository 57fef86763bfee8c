"""Activation quantization kernels: per-tensor / per-token FP8, 1x128-group FP8, MXFP8, per-token INT8.

`quantize_activation(x, key)` returns the same QTensor, byte for byte, as the reference
`formats.quantize(x, key)` for the dynamic keys below (tests compare the bytes): data `[M, K]`
with K padded with zeros to the key's column group, scales `[M, groups]` (fp32, or e8m0 as
uint8), per-tensor `[1, 1]`. Same arithmetic in the same order: scale = amax / max with IEEE
division (`div_rn`: Triton's `/` is an approximate divide on CUDA), values divided by the scale,
clamped, rounded to nearest even. MX uses RCEIL on the raw amax, scale = 2^ceil(log2(amax / 448))
clamped to [-127, 127] (an all-zero group stores byte 0), read from the fp32 bits of amax / 448
(exact; `torch.log2` in fp32 can round 2^k * (1 + 2^-23) down to k, a case random data never hits).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ... import envs
from ...quant_registry.formats import AMAX_EPS, ELEMENTS, padded_cols, scale_shape
from ...quant_registry.keys import FP8, INT8, QuantKey
from ...quant_registry.qtensor import QTensor
from .elements import to_e4m3, to_int8
from .scheme import ScaleMode, activation_scheme

# A global a compiled kernel reads must be a constexpr (the interpreter doesn't check; found by
# tests/triton_aot.py): the same epsilon as formats.py.
AMAX_EPS_C = tl.constexpr(AMAX_EPS)

FP8_MAX = ELEMENTS[FP8].max
INT8_MAX = ELEMENTS[INT8].max


@triton.jit
def _quantize_kernel(
    x_ptr,  # [M, K] float, row stride stride_xm, unit column stride
    q_ptr,  # [M, K_padded] fp8 / int8
    scale_ptr,  # [M, groups] fp32 or uint8 (e8m0), unit column stride; unused for per-tensor
    tensor_scale_ptr,  # [1] fp32: the per-tensor scale, computed before the launch
    K,
    num_segments,  # rows ("tensor", "row") or rows * groups ("group", "mx")
    groups_per_row,
    stride_xm,
    stride_qm,
    stride_sm,
    ELEMENT: tl.constexpr,  # "fp8" | "int8"
    SCALE: tl.constexpr,  # "tensor" | "row" | "group" | "mx"
    BLOCK_S: tl.constexpr,  # segments per program
    BLOCK_C: tl.constexpr,  # columns per step: the group size ("group", "mx"), else a chunk of the row
    EXACT: tl.constexpr,  # round by hand (the interpreter's conversions are wrong; see elements.py)
):
    # A program quantizes a [BLOCK_S, BLOCK_C] tile of segments: one scale per segment, a segment
    # being a group of one row ("group", "mx") or a whole row ("row", looping over K; "tensor").
    segments = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    segment_mask = segments < num_segments
    rows = (segments // groups_per_row).to(tl.int64)
    first_col = (segments % groups_per_row) * BLOCK_C
    cols = tl.arange(0, BLOCK_C)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + first_col[:, None]
    q_ptrs = q_ptr + rows[:, None] * stride_qm + first_col[:, None]
    element_max: tl.constexpr = 448.0 if ELEMENT == "fp8" else 127.0
    if SCALE == "tensor" or SCALE == "row":
        if SCALE == "tensor":
            scale = tl.load(tensor_scale_ptr + rows * 0)
        else:  # first pass: each row's amax
            amax = tl.zeros([BLOCK_S], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_C):
                mask = segment_mask[:, None] & (k0 + cols[None, :] < K)
                x = tl.load(x_ptrs + k0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
            scale = tl.math.div_rn(tl.maximum(amax, AMAX_EPS_C), element_max)
            tl.store(scale_ptr + rows * stride_sm, scale, mask=segment_mask)
        for k0 in range(0, K, BLOCK_C):
            mask = segment_mask[:, None] & (k0 + cols[None, :] < K)
            x = tl.load(x_ptrs + k0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            q = _encode(tl.math.div_rn(x, scale[:, None]), ELEMENT, EXACT)
            tl.store(q_ptrs + k0 + cols[None, :], q, mask=mask)
    else:  # one group per segment
        x = tl.load(
            x_ptrs + cols[None, :], mask=segment_mask[:, None] & (first_col[:, None] + cols[None, :] < K), other=0.0
        )
        group_amax = tl.max(tl.abs(x.to(tl.float32)), axis=1)  # padding read as 0
        if SCALE == "mx":  # RCEIL from the raw amax: the exponent of amax / 448, + 1 unless a power of two
            bits = tl.math.div_rn(group_amax, element_max).to(tl.int32, bitcast=True)
            exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
            # amax / 448 below fp32's normals (an all-zero group): ceil(log2) clamped to -127, as formats.py;
            # 2^-126 for a subnormal ratio above 2^-127.
            exponent = tl.where(bits < 0x800000, tl.where(bits > 0x400000, -126, -127), exponent)
            stored = (exponent + 127).to(tl.uint8)
            scale_bits = tl.where(exponent == -127, 0x400000, (exponent + 127) << 23)  # 2^exponent, exactly
            scale = scale_bits.to(tl.float32, bitcast=True)
        else:
            scale = tl.math.div_rn(tl.maximum(group_amax, AMAX_EPS_C), element_max)
            stored = scale
        q = _encode(tl.math.div_rn(x.to(tl.float32), scale[:, None]), ELEMENT, EXACT)
        tl.store(q_ptrs + cols[None, :], q, mask=segment_mask[:, None])  # also writes the zero padding
        tl.store(scale_ptr + rows * stride_sm + segments % groups_per_row, stored, mask=segment_mask)


@triton.jit
def _encode(scaled, ELEMENT: tl.constexpr, EXACT: tl.constexpr):
    """Values already divided by their scale -> stored elements: clamp (saturate), round to nearest even."""
    if ELEMENT == "fp8":
        encoded = to_e4m3(tl.minimum(tl.maximum(scaled, -448.0), 448.0), EXACT)
    else:
        encoded = to_int8(tl.minimum(tl.maximum(scaled, -127.0), 127.0))
    return encoded


def quantize_activation(x: torch.Tensor, key: QuantKey) -> QTensor:
    """x [M, K] (bf16 / fp16 / fp32) -> QTensor with exactly `formats.quantize(x, key)`'s layout."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"quantize_activation wants a 2-D float tensor, got {tuple(x.shape)} {x.dtype}")
    interpret = envs.triton_interpret()
    element, scale_mode, padded, groups_per_row, block_c, tile = _plan(key, x.shape[1], interpret)
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    q = torch.empty((rows, padded), dtype=key.dtype, device=x.device)
    scale_dtype = torch.uint8 if scale_mode == ScaleMode.MX else torch.float32
    scale = torch.empty(
        (1, 1) if scale_mode == ScaleMode.TENSOR else (rows, groups_per_row), dtype=scale_dtype, device=x.device
    )
    tensor_scale = scale
    if scale_mode == ScaleMode.TENSOR:  # one global reduction first (torch: the same ops as formats.py)
        tensor_scale = x.abs().amax().float().clamp(min=AMAX_EPS).div(ELEMENTS[key.dtype].max).reshape(1, 1)
        scale = tensor_scale
    if rows == 0:
        return QTensor(q, scale, None, key, x.shape, x.dtype)
    segments = rows * groups_per_row  # "tensor" / "row": one segment per row
    block_s = min(max(tile // block_c, 1), 1 << (segments - 1).bit_length())  # pure-int triton.next_power_of_2
    wrap_triton(_quantize_kernel)[(-(-segments // block_s),)](
        x,
        q,
        scale,
        tensor_scale,
        cols,
        segments,
        groups_per_row,
        x.stride(0),
        q.stride(0),
        scale.stride(0),
        ELEMENT=str(element),  # constexprs: plain strings
        SCALE=str(scale_mode),
        BLOCK_S=block_s,
        BLOCK_C=block_c,
        EXACT=interpret,
    )
    return QTensor(q, scale, None, key, x.shape, x.dtype)


@functools.lru_cache(maxsize=1024)
def _plan(key: QuantKey, cols: int, interpret: bool) -> tuple[str, str, int, int, int, int]:
    """(element, scale mode, padded K, groups per row, BLOCK_C, elements per program) for a key and K:
    built once per (key, K), not per call (decode calls this per token)."""
    scheme = activation_scheme(key)
    if isinstance(scheme, str):
        raise ValueError(scheme)
    element, scale_mode, group = scheme
    # Tile size: the interpreter's cost is per program, so up to 64K elements there; on CUDA ~4K
    # elements per program (memory bound: enough bytes in flight per SM, enough programs per SM).
    tile = 65536 if interpret else 4096
    if scale_mode in (ScaleMode.TENSOR, ScaleMode.ROW):
        block_c, groups_per_row = min(triton.next_power_of_2(cols), tile), 1
    else:
        block_c, groups_per_row = group, scale_shape(key, (1, cols))[-1]
    return element, scale_mode, padded_cols(key, cols), groups_per_row, block_c, tile
