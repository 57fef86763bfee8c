"""Reference numerics: `quantize(tensor, key) -> QTensor` and `dequantize(qtensor)` for every key.

One generic path serves every format; what differs is data in two small tables keyed by the key's
element dtype and scale dtype. The last two dims are the matrix (`[..., R, C]`, weights `[N, K]`,
activations `[M, K]`); leading dims (MoE experts) are batch, so per-tensor means per matrix.

Rules (docs/design.md §4): FP8 e4m3 scale = amax/448; MX scale e8m0 per 1x32 by RCEIL
(2^ceil(log2(amax/max_elem)), never clips); NVFP4 e4m3 per 1x16 times an fp32 global
amax/(448*6); INT8 symmetric ±127; INT4 symmetric ±7 per 128. Weights (static keys, computed
once) choose INT4 clip ratios and the MXFP4 exponent by least squared error
(`_lowest_error_scale`). Any R and C: groups that overhang are padded with zeros for the math, the
data keeps its true rows and a column count padded to the group, and `dequantize` crops. Big weights
are quantized a few rows at a time (`_chunk_rows`: bounded temporaries, same bytes); e2m1 rounding
on CPU is a lookup table built from torchao's conversion (`_fp4_tables`: same codes, one gather).
torchao's primitives where they give the same bytes at no cost: e2m1 codec and packing, NVFP4's
per-tensor scale; why MX and NVFP4 element scaling stay here: comments in `_quantize_grouped`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .keys import E8M0, FP4, FP8, INT4, INT8, PER_ROW, PER_TENSOR, QuantKey
from .qtensor import QTensor


@dataclass(frozen=True)
class Element:
    """An element type: its largest magnitude and its rounding error bound (for tests and docs).

    |x - dequantize(quantize(x))| <= rel * |x| + abs * scale  (+ any clipping above max * scale)
    """

    max: float
    rel: float
    abs: float
    packed: bool  # two per byte


ELEMENTS: dict[torch.dtype, Element] = {
    FP8: Element(448.0, 2**-4, 2**-10, False),  # 3 mantissa bits; subnormal step 2^-9
    FP4: Element(6.0, 2**-2, 2**-2, True),  # e2m1: {0, .5, 1, 1.5, 2, 3, 4, 6}
    INT8: Element(127.0, 0.0, 0.5, False),
    INT4: Element(7.0, 0.0, 0.5, True),  # -8 unused: symmetric
}
AMAX_EPS = 1e-12  # an all-zero group gets a tiny positive scale instead of a division by zero
E4M3_MIN_SCALE = 2**-6  # NVFP4 block scales are clamped to e4m3's smallest normal, as torchao does
INT4_CLIP_RATIOS = (1.0, 0.9, 0.8)  # clip candidates for INT4 weights (see _lowest_error_scale)
QUANTIZE_CHUNK = 1 << 18  # elements of a big weight quantized at once on CPU (see _chunk_rows)
QUANTIZE_CHUNK_GPU = 1 << 24  # on an accelerator: a few launches per weight, temporaries <= 64 MiB each
SEARCH_CHUNK = 1 << 18  # elements x candidates per step of the scale search: ~1 MiB of fp32 in flight


@functools.cache
def _fp4_codec():
    """torchao's e2m1 round-to-nearest-even conversion and low-nibble-first packing: the definition
    the lookup tables below reproduce (tests compare them), and what runs off the CPU and in traces.
    Imported only there: on CPU its import held ~4.4 MiB more for the process (bench/README.md, "Memory")."""
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked, unpack_uint4

    return f32_to_f4_unpacked, f4_unpacked_to_f32, unpack_uint4


# NVFP4's per-tensor scale is amax / (448 * 6) in fp32, as torchao's `per_tensor_amax_to_scale`
NVFP4_GLOBAL_DIVISOR = 448.0 * 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # by code
_E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # halfway between consecutive magnitudes


@functools.cache
def _fp4_tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(code per key, value per key, the two values per packed byte) for `_fp4_key`'s 8192 keys.

    torchao's conversion of an fp32 value depends only on its top 12 bits and on whether any of the
    low 20 bits is set: its round-to-nearest-even adds 2^21 - 1 plus the kept lowest bit to the bits
    and shifts by 22, with exponent/saturation branches decided by the top bits (NaN, Inf and fp32
    subnormals included). So one representative per key, converted as torchao converts it, is its
    result for every input with that key: one gather instead of ~25 full-size passes (4x faster on
    CPU). The representatives are rounded here, not by torchao: to nearest e2m1 magnitude, ties to the
    even code, saturating at 6 (Inf too); a NaN as torchao's bit arithmetic treats it, as 1.m with its
    sign and mantissa (tests/test_formats_fp4_codec.py checks every key against torchao)."""
    with torch._subclasses.fake_tensor.unset_fake_temporarily():  # real tables even if first used in a trace
        top = torch.arange(4096, dtype=torch.int32, device="cpu") << 20
        bits = torch.stack([top, top | 1], dim=1).flatten()
        bits = torch.where(bits.view(torch.float32).isnan(), bits & 0x807FFFFF | 0x3F800000, bits)
        representatives = bits.view(torch.float32)
        ties, magnitude = torch.tensor(_E2M1_TIES), representatives.abs()
        index = torch.searchsorted(ties, magnitude)  # ties below |x|: the code rounding down
        index += (magnitude == ties[index.clamp(max=len(ties) - 1)]) & (index % 2 == 1)  # a tie: the even code
        codes = (index | torch.signbit(representatives).to(torch.int64) << 3).to(torch.uint8)
        values = torch.tensor(E2M1_VALUES)
        pairs = torch.stack([values.repeat(16), values.repeat_interleave(16)], dim=1)  # byte b: (b & 15, b >> 4)
        return codes, values[codes.long()], pairs


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 4-bit codes [..., C] (C even) -> [..., C/2], two per byte, first in the low nibble (INT4's
    order and torchao's for FP4)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def fp4_code_table() -> torch.Tensor:
    """uint8 [8192]: the e2m1 code of every fp32 value by its `_fp4_key` (what `fp4_codes` gathers;
    the cpu backend's FP4 kernel rounds NVFP4 activations with it, so both give the same bytes)."""
    return _fp4_tables()[0]


def _fp4_key(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> int32 `(top 12 bits) * 2 + (low 20 bits != 0)`, a flat index into `_fp4_tables`."""
    bits = x.reshape(-1).view(torch.int32)
    sticky = (bits & 0xFFFFF).add_(0xFFFFF).bitwise_right_shift_(20)  # 1 when any low bit is set
    return (bits >> 20).bitwise_and_(0xFFF).bitwise_left_shift_(1).bitwise_or_(sticky)


def _lookup(x: torch.Tensor) -> bool:
    """The tables serve plain CPU tensors outside any trace. On other devices and while Dynamo or
    AOTAutograd traces (fake / functional tensors), torchao's op sequence runs as before, so compiled
    graphs keep their pointwise ops and no table is baked into them. (`is_compiling()` would also be
    true inside a backend, where quantpass quantizes the weights: the slow path, 9x the memory.)"""
    return x.device.type == "cpu" and type(x) is torch.Tensor and not torch.compiler.is_dynamo_compiling()


def fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 codes (uint8, sign in bit 3), bit for bit torchao's `f32_to_f4_unpacked`,
    saturating to +-6 (|x| >= 6, +-Inf)."""
    if not _lookup(x):
        return _fp4_codec()[0](x.contiguous())
    return _fp4_tables()[0].index_select(0, _fp4_key(x)).view(x.shape)


def fp4_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the e2m1 value each element rounds to (fp32), i.e. decode(fp4_codes(x))."""
    if not _lookup(x):
        f32_to_f4, f4_to_f32, _ = _fp4_codec()
        return f4_to_f32(f32_to_f4(x.contiguous()))
    return _fp4_tables()[1].index_select(0, _fp4_key(x)).view(x.shape)


def fp4_decode(packed: torch.Tensor, out: torch.Tensor | None = None, index: torch.Tensor | None = None):
    """uint8 [..., C/2] (two codes per byte, first in the low nibble) -> fp32 [..., C], written into
    `out` (contiguous fp32 of that shape) when given; `index`: int32 scratch of `packed.numel()`
    elements for the table lookup (else a new one)."""
    if not _lookup(packed):
        _, f4_to_f32, unpack = _fp4_codec()
        values = f4_to_f32(unpack(packed.contiguous()))
        return values if out is None else out.copy_(values)
    codes = packed.reshape(-1)
    index = codes.to(torch.int32) if index is None else index.copy_(codes)
    pairs = torch.index_select(_fp4_tables()[2], 0, index, out=None if out is None else out.view(-1, 2))
    return pairs.view(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Signed ints in [-8, 7] -> uint8, two per byte, offset by 8, first element in the low nibble."""
    return pack_nibbles((q.to(torch.int16) + 8).to(torch.uint8))


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: uint8 [..., C/2] -> int8 [..., C]."""
    low = (packed & 0xF).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=-1).flatten(-2)


def padded_cols(key: QuantKey, cols: int) -> int:
    """Columns the data holds: `cols` rounded up to the key's column group."""
    group = key.group_shape.col
    return cols if group <= 1 else math.ceil(cols / group) * group


def scale_shape(key: QuantKey, shape: torch.Size) -> tuple[int, ...]:
    rows, cols = shape[-2], shape[-1]
    group_rows, group_cols = key.group_shape.size(rows, cols)
    return (*shape[:-2], math.ceil(rows / group_rows), math.ceil(cols / group_cols))


def quantize(x: torch.Tensor, key: QuantKey, name: str = "tensor") -> QTensor:
    """Quantize `x` (any float dtype, >= 1-D) with `key`. Static keys check for NaN/Inf."""
    if not x.is_floating_point():
        raise ValueError(f"cannot quantize {name}: dtype {x.dtype} is not floating point")
    shape, dtype = x.shape, x.dtype
    if x.dim() == 1:
        x = x.unsqueeze(0)
    if x.shape[-2] == 0:  # a call with no tokens: one zero row's layout, cut to no rows
        one = quantize(x.new_zeros((*x.shape[:-2], 1, x.shape[-1])), key, name)
        scale = one.scale if key.group_shape.row == -1 else one.scale[..., :0, :]
        return QTensor(one.data[..., :0, :], scale, one.scale2, key, shape, dtype)
    if key.static and not bool(torch.isfinite(torch.stack([x.amax(), x.amin()]).float()).all()):
        # NaN propagates through amax/amin, +-Inf is one of them: two reductions, no full-size temporary
        raise ValueError(f"cannot quantize {name} with {key}: it contains NaN or Inf")
    element = ELEMENTS[key.dtype]
    step = _chunk_rows(x, key)
    if step:
        return _quantize_in_chunks(x, key, step, shape, dtype)
    if _whole_rows(key):
        return _quantize_whole_rows(x, key, element, shape, dtype)
    data, stored_scale, scale2 = _quantize_grouped(x, key)
    return QTensor(
        data=data,
        scale=stored_scale,
        scale2=None if scale2 is None else scale2.reshape(*x.shape[:-2], 1, 1),
        key=key,
        shape=shape,
        dtype=dtype,
    )


def _whole_rows(key: QuantKey) -> bool:
    return (
        key.group_shape in (PER_ROW, PER_TENSOR) and key.scale.dtype == torch.float32 and not ELEMENTS[key.dtype].packed
    )


def _chunk_rows(x: torch.Tensor, key: QuantKey) -> int:
    """Rows per step for a big weight (static key) quantized a few rows at a time, else 0. Whole,
    a 2816x1024 bf16 weight needed ~45 MiB of fp32 temporaries (8x its size); in steps of
    `QUANTIZE_CHUNK` elements they stay near 1 MiB each (and in cache: faster too). A scale spanning
    every row (per-tensor, NVFP4's second level) is computed first from the whole matrix."""
    rows, cols = x.shape[-2:]
    group_rows, chunk = key.group_shape.row, QUANTIZE_CHUNK if x.device.type == "cpu" else QUANTIZE_CHUNK_GPU
    if not key.static or rows * cols <= 2 * chunk or (group_rows == -1 and not _whole_rows(key)):
        return 0
    step = rows_per_step(cols, group_rows, chunk)
    return step if step < rows else 0


def rows_per_step(cols: int, group_rows: int, chunk: int) -> int:
    """How many rows of `cols` elements make about `chunk` elements, rounded to whole row groups
    (at least one row, or one group): the step of every row-chunked loop over a weight."""
    step = max(1, chunk // max(cols, 1))
    return max(group_rows, step // group_rows * group_rows) if group_rows > 1 else step


def _quantize_in_chunks(x: torch.Tensor, key: QuantKey, step: int, shape, dtype) -> QTensor:
    """`quantize(x, key)` bit for bit, `step` rows at a time (per matrix), into preallocated outputs."""
    if x.dim() > 2:  # experts: one matrix at a time
        parts = [_quantize_in_chunks(m, key, step, m.shape, dtype) for m in x.reshape(-1, *x.shape[-2:])]
        lead = x.shape[:-2]
        data, scale = (torch.stack(t).unflatten(0, lead) for t in zip(*((p.data, p.scale) for p in parts)))
        scale2 = None if key.scale2 is None else torch.stack([p.scale2 for p in parts]).unflatten(0, lead)
        return QTensor(data, scale, scale2, key, shape, dtype)
    element, rows = ELEMENTS[key.dtype], x.shape[0]
    whole, group_rows = _whole_rows(key), max(key.group_shape.row, 1)
    amax = None
    if key.group_shape.row == -1 or key.scale2 is not None:  # the matrix's |x| max, as a 1x1 fp32 tensor
        amax = torch.maximum(x.amax(), x.amin().neg()).float().clamp(min=AMAX_EPS).reshape(1, 1)
    data = scale = scale2 = None
    for start in range(0, rows, step):
        part = x[start : start + step]
        if whole:
            per_tensor = None if amax is None else amax / element.max
            qt = _quantize_whole_rows(part, key, element, part.shape, dtype, per_tensor)
            part_data, part_scale = qt.data, qt.scale
        else:
            part_data, part_scale, scale2 = _quantize_grouped(
                part, key, None if amax is None else amax.reshape(1, 1, 1, 1)
            )
        if data is None:
            data = part_data.new_empty((rows, part_data.shape[-1]))
            scale = (
                part_scale
                if amax is not None and whole
                else part_scale.new_empty((-(-rows // group_rows), part_scale.shape[-1]))
            )
        data[start : start + step] = part_data
        if not (amax is not None and whole):
            scale[start // group_rows : start // group_rows + part_scale.shape[0]] = part_scale
    return QTensor(data, scale, None if scale2 is None else scale2.reshape(1, 1), key, shape, dtype)


def _quantize_grouped(x: torch.Tensor, key: QuantKey, amax2: torch.Tensor | None = None):
    """The grouped formats' math: (data, stored scale, second-level scale or None). `amax2`: the
    whole matrix's clamped |x| max when `x` is a slice of it (NVFP4's second-level scale)."""
    element = ELEMENTS[key.dtype]
    groups = _grouped(x.float(), key)  # [..., R/gr, gr, C/gc, gc]
    extent = dict(dim=(-3, -1), keepdim=True)
    group_amax = torch.maximum(groups.amax(**extent), groups.amin(**extent).neg_())  # no |x| temporary
    amax = group_amax.clamp(min=AMAX_EPS)
    scale2 = None
    if key.scale.dtype == E8M0:
        # RCEIL from the raw amax: an all-zero block gets byte 0 (2^-127), as FlashInfer writes it.
        # Not torchao's to_mx(..., RCEIL) (tests/test_formats_torchao.py): same bytes except a block at
        # byte 0 with nonzero values (amax <= 2^-127 x element max), which torchao scales by 1 (zeros),
        # at 1.2-1.3x (MXFP8) / 2-2.5x (MXFP4) our thread CPU time, called on our chunks (2048x4096
        # bf16, 1 thread, two runs 2026-12-01).
        exponent = torch.ceil(torch.log2(group_amax / element.max)).clamp(-127, 127)
        if key.static and element.packed:  # fp4 weights: RCEIL's exponent or the one below, least error
            # (+0.3 dB Gaussian, +0.8 dB Student-t(4) 1024x4096 for MXFP4; MXFP8 gained 0.00: RCEIL)
            candidates = [torch.exp2(exponent), torch.exp2((exponent - 1).clamp(min=-127))]
            exponent = torch.log2(_lowest_error_scale(groups, candidates, key.dtype))
        scale, stored_scale = torch.exp2(exponent), (exponent + 127).to(torch.uint8)
    elif key.scale.dtype == FP8:  # NVFP4: e4m3 block scales under an fp32 per-matrix scale
        # Scales as torchao's nvfp4_quantize unless the matrix's |x| max is under AMAX_EPS (torchao
        # clamps nothing: an all-zero matrix gets 0 / 0 = NaN block scales). Its elements are x *
        # ((1 / scale2) / block) where we divide by block * scale2: one e2m1 step apart within an ulp
        # of a tie (41-402 of 262144), at 1.8-2x our thread CPU time on our chunks (as above).
        scale2 = (amax.amax(dim=(-4, -2), keepdim=True) if amax2 is None else amax2).float() / NVFP4_GLOBAL_DIVISOR
        stored_scale = (amax / element.max / scale2).clamp(E4M3_MIN_SCALE, 448.0).to(FP8)
        scale = stored_scale.float() * scale2
    elif key.dtype == INT4 and key.static:  # clip search: see INT4_CLIP_RATIOS
        candidates = [amax * ratio / element.max for ratio in INT4_CLIP_RATIOS]
        scale = stored_scale = _lowest_error_scale(groups, candidates, key.dtype)
    else:
        scale = stored_scale = amax / element.max
    data = _encode(groups / scale, key.dtype)
    data = data.flatten(-4, -3).flatten(-2, -1)[..., : x.shape[-2], :]  # drop padded rows
    return data.contiguous(), stored_scale.squeeze(-1).squeeze(-2).contiguous(), scale2


def _quantize_whole_rows(x, key: QuantKey, element: Element, shape, dtype, scale=None) -> QTensor:
    """Per-row / per-tensor FP8 and INT8: the same numbers as the grouped path in a handful of ops.
    Native W8A8 graphs trace this once per linear: the grouped path's reshapes and padding checks
    were 4.4 s of an 8.3 s Inductor compile of the dense preset (32 linears, measured 2026-11-29).
    `scale`: the whole matrix's per-tensor scale when `x` is a slice of it."""
    values = x.float()
    if scale is None:
        dims = (-1,) if key.group_shape == PER_ROW else (-2, -1)
        scale = values.abs().amax(dim=dims, keepdim=True).clamp(min=AMAX_EPS) / element.max
    return QTensor(_encode(values / scale, key.dtype).contiguous(), scale, None, key, shape, dtype)


def dequantize(qt: QTensor, dtype: torch.dtype | None = None, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor `qt` stands for, in `dtype` (default: the original dtype), true shape. Whole groups
    are scaled in place through a grouped view (the same products as with `expand_scale`, without
    two weight-sized fp32 scale tensors: the reference backend dequantizes every weight per call).
    `scratch`: `scratch_numel(qt)` fp32 elements (or more) to decode into instead of new tensors
    (the reference backend reuses one for every call); the result may then be a view of it."""
    values = _decode(qt.data, qt.key.dtype, scratch)  # fp32, in `scratch` or new
    rows, cols = values.shape[-2], qt.shape[-1]
    row_group, (_, group_cols) = qt.key.group_shape.row, qt.key.group_shape.size(rows, values.shape[-1])
    if values.shape[-1] % group_cols == 0 and (row_group == -1 or rows % row_group == 0):
        grouped = values.unflatten(-1, (-1, group_cols))  # [..., R, C/gc, gc] -> [..., R/gr, gr, C/gc, gc]
        grouped = grouped.unsqueeze(-4) if row_group == -1 else grouped.unflatten(-3, (-1, row_group))
        grouped.mul_(_scale_fp32(qt).unsqueeze(-1).unsqueeze(-3))
    else:
        values = values * expand_scale(qt, rows, values.shape[-1])
    return values[..., :cols].reshape(qt.shape).to(dtype or qt.dtype)


def concat_rows(parts: list[QTensor], name: str = "tensor") -> QTensor:
    """QTensors of one key joined along rows (`[..., R_i, C]` -> `[..., sum R_i, C]`), e.g. an MoE's
    separate gate and up projections into one w13. Scales stack as they are when every row group is
    whole; a per-tensor or second-level scale, or a row group that straddles two parts, can't be
    shared that way: those parts are quantized again together from their dequantized values."""
    key = parts[0].key
    group_rows = key.group_shape.row
    whole = key.scale2 is None and group_rows != -1 and all(p.shape[-2] % group_rows == 0 for p in parts[:-1])
    if not whole:
        joined = quantize(torch.cat([dequantize(p, torch.float32) for p in parts], dim=-2), key, name)
        return dataclasses.replace(joined, dtype=parts[0].dtype)
    shape = torch.Size((*parts[0].shape[:-2], sum(p.shape[-2] for p in parts), parts[0].shape[-1]))
    data = torch.cat([p.data for p in parts], dim=-2)
    return QTensor(data, torch.cat([p.scale for p in parts], dim=-2), None, key, shape, parts[0].dtype)


def expand_scale(qt: QTensor, rows: int, cols: int) -> torch.Tensor:
    """The fp32 scale of every element of a `[..., rows, cols]` operand (cols = padded cols)."""
    group_rows, group_cols = qt.key.group_shape.size(rows, cols)
    scale = _scale_fp32(qt).repeat_interleave(group_rows, dim=-2)[..., :rows, :]
    return scale.repeat_interleave(group_cols, dim=-1)[..., :cols]


def _scale_fp32(qt: QTensor) -> torch.Tensor:
    """The scale of each group, fp32 `[..., R/gr, C/gc]` (an e8m0 byte decoded, NVFP4's two levels multiplied)."""
    if qt.scale2 is not None:
        return qt.scale.float() * qt.scale2
    if qt.key.scale.dtype == E8M0:
        return torch.exp2(qt.scale.to(torch.int32) - 127.0)
    return qt.scale.float()


def _grouped(x: torch.Tensor, key: QuantKey) -> torch.Tensor:
    """Zero-pad `[..., R, C]` to whole groups and view it as `[..., R/gr, gr, C/gc, gc]`."""
    rows, cols = x.shape[-2:]
    group_rows, group_cols = key.group_shape.size(rows, cols)
    pad_rows, pad_cols = -rows % group_rows, -cols % group_cols
    if pad_rows or pad_cols:
        x = F.pad(x, (0, pad_cols, 0, pad_rows))
    return x.unflatten(-1, (-1, group_cols)).unflatten(-3, (-1, group_rows))


def _round(scaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values already divided by their scale -> the nearest element value (saturating), as fp32."""
    if dtype == FP4:  # saturates by itself: a clamp first changes no result
        return fp4_round(scaled.float())
    limit = ELEMENTS[dtype].max
    scaled = scaled.clamp(-limit, limit)
    if dtype == FP8:
        return scaled.to(FP8).float()
    return scaled.round_()  # clamp made a new tensor: round it in place


def _encode(scaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values already divided by their scale -> stored elements (packed for 4-bit)."""
    if dtype in (FP8, INT8):  # one saturating cast (integers round to nearest first)
        limit = ELEMENTS[dtype].max
        scaled = scaled.clamp(-limit, limit)
        return (scaled if dtype == FP8 else scaled.round()).to(dtype)
    if dtype == INT4:  # exact element values, then packed two per byte
        return _pack_grouped(_round(scaled, dtype), pack_int4)
    return _pack_grouped(fp4_codes(scaled.float()), pack_nibbles)  # the codes of the rounded values are the codes


def _pack_grouped(values: torch.Tensor, pack) -> torch.Tensor:
    # Pack along the flattened column dim so pairs never straddle a row; keep the group view.
    flat = values.flatten(-2, -1)
    return pack(flat.contiguous()).unflatten(-1, (values.shape[-2], -1))


def scratch_numel(qt: QTensor) -> int:
    """fp32 elements `dequantize(qt, scratch=...)` works in: the decoded values (padded columns
    included) and, for e2m1, the int32 lookup index of the packed bytes."""
    return qt.data.numel() * {FP4: 3, INT4: 2}.get(qt.key.dtype, 1)


def _decode(data: torch.Tensor, dtype: torch.dtype, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Stored elements -> their fp32 values (before scaling), new or in the first elements of `scratch`."""
    if scratch is not None:
        packed, flat = ELEMENTS[dtype].packed, scratch.reshape(-1)
        shape = (*data.shape[:-1], data.shape[-1] * (2 if packed else 1))
        values = flat[: math.prod(shape)].view(shape)
        if dtype == FP4:
            return fp4_decode(data, values, flat[values.numel() : values.numel() + data.numel()].view(torch.int32))
        return values.copy_(unpack_int4(data) if dtype == INT4 else data)  # exact: ints and fp8 fit in fp32
    if dtype == INT4:
        return unpack_int4(data).float()
    if dtype == FP4:
        return fp4_decode(data)
    return data.float()


def _lowest_error_scale(groups: torch.Tensor, candidates: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Per group, the candidate scale whose round trip has the least squared error (the first of
    equals). All candidates at once, a few group rows at a time, so the working set stays in cache,
    and the error measured in scaled units (times scale squared) so the round trip needs no
    multiply back: with the same 16 candidates as before, the same scales, and INT4 quantization of
    a 1024x4096 bf16 weight 5x faster overall with `INT4_CLIP_RATIOS` (bench/quantize_speed.py).

    Used for weights only (computed once). INT4: symmetric ±7 with scale amax/7 measures 0.5 dB
    below torchao's [-8, 7] grid on Gaussian 1x128 groups (18.6 vs 19.1 dB); clipping helps: 16
    ratios in [0.7, 1] give 19.50 dB (15.15 on Student-t(4)), the 3 of `INT4_CLIP_RATIOS` 19.39
    (15.09) at a fifth of the work, 1024x4096, measured 2026-12-01. MX: RCEIL never clips but for
    fp4 it loses to torchao's FLOOR (17.1 vs 17.6 dB on Student-t(4)); FLOOR's exponent is RCEIL's
    or one below, so choosing between those two per block is at least as good as either.
    """
    scales = torch.stack(candidates)  # [n, ..., R/gr, 1, C/gc, 1]
    best = torch.empty_like(candidates[0])
    row_groups = groups.shape[-4]
    step = max(1, SEARCH_CHUNK // max(1, groups[..., :1, :, :, :].numel() * len(candidates)))
    for start in range(0, row_groups, step):
        part, scale = groups[..., start : start + step, :, :, :], scales[..., start : start + step, :, :, :]
        scaled = part / scale
        error = _round(scaled, dtype).sub_(scaled).square_().sum(dim=(-3, -1), keepdim=True) * scale.square()
        chosen, least = scale[0], error[0]
        for i in range(1, len(candidates)):  # argmin over dim 0 by hand: a strided reduction, 3x slower
            better = error[i] < least  # strict: the first of equals wins, as argmin's
            chosen, least = torch.where(better, scale[i], chosen), torch.where(better, error[i], least)
        best[..., start : start + step, :, :, :] = chosen
    return best
