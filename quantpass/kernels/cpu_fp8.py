"""quantpass's FP8 CPU kernel (csrc/linear_fp8.c), built on first use like cpu_avx2's.

It reads every FP8 weight quantpass stores as it is stored (e4m3 bytes and the format's scale grid:
per tensor, per channel, per 128x128 block, MXFP8's e8m0 per 32), so preparing copies nothing and a
call needs no dequantized weight. The `reference` backend, which ran FP8 on CPU before (torch's
`_scaled_mm` emulates FP8 on CPU at the same speed), decoded every weight into fp32 scratch per call
and multiplied with MKL's fp32 GEMM.

Activations are multiplied in fp32: weight-only as given, W8A8 as the activation key quantizes them
(what the reference multiplies: the kernel quantizes per-token, per-1x128, per-tensor, static and
MXFP8 activations itself, bit for bit as `reference.fake_quantize` does), so the two backends differ
only in the order of fp32 sums. Where the CPU has AVX-512 BF16, bf16 activations and FP8-quantized
ones (their codes, the scales applied to each weight group's sum; MXFP8's power-of-two scales folded
into the bf16 weights and activations) multiply on bf16 tiles instead (`tiles`, TILES; on Zen 4
1.3-1.6x faster at M = 1, 1.5-2.1x at M = 4 and 16, MXFP8 as fast as per-channel FP8): exact products
again (W8A8: of the codes), other fp32 roundings. Above `MAX_M` rows the `reference` backend runs the
call (one fp32 GEMM on the dequantized weight is faster there). `moe_experts` hands a MoE layer's
experts to the kernel's one-call MoE entry (kernels/cpu.py, `_moe_on_our_kernels`); `graph_entry`
gives the C++ graph op what it needs to call the kernel itself."""

from __future__ import annotations

import ctypes

import torch

from ..quant_registry import keys as k
from ..quant_registry.formats import AMAX_EPS
from ..quant_registry.keys import E8M0
from ..quant_registry.qtensor import QTensor
from . import cpu_avx2
from .cpu_fp4 import scale_table
from .reference import fake_quantize

SOURCE = cpu_avx2.CSRC / "linear_fp8.c"
# weight key -> the activation keys it runs with (the oracle's FP8 pairs; None: weight-only)
MODES = {
    k.kFp8StaticTensorSym: (None, k.kFp8DynamicTensorSym, k.kFp8StaticTensorSym),
    k.kFp8StaticChannelSym: (None, k.kFp8DynamicTokenSym),
    k.kFp8Static128BlockSym: (None, k.kFp8Dynamic128Sym),
    k.kMxfp8Static: (None, k.kMxfp8Dynamic),
}
MAX_M = 128  # >= the reference up to 128 on both sets of tiles (bench/README.md, "FP8 on CPU"), not at 256
EXACT = True  # activations go in as fp32, as given
P, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# activation keys the kernel quantizes itself: (csrc's PER_TOKEN, PER_TENSOR, STATIC or MX; columns per
# scale, 0: the row). MXFP8's went through `fake_quantize` in torch until 2026-12-02 (+0.25 ms per call
# at M=1 on a 4096x4096 weight on Zen 4, +1.1 ms on a loaded Ice Lake).
PER_TOKEN, PER_TENSOR, STATIC, MX = 1, 2, 3, 4
ACTS = {
    k.kFp8DynamicTokenSym: (PER_TOKEN, 0),
    k.kFp8Dynamic128Sym: (PER_TOKEN, k.kFp8Dynamic128Sym.group_shape.col),
    k.kFp8DynamicTensorSym: (PER_TENSOR, 0),
    k.kFp8StaticTensorSym: (STATIC, 0),
    k.kMxfp8Dynamic: (MX, k.kMxfp8Dynamic.group_shape.col),
}
# the activation keys a MoE layer runs with in one call (`moe_experts`): all, each expert GEMM's rows
# quantized as the reference's loop quantizes all routed rows (row by row, each expert's static scale,
# or one per-tensor dynamic scale over all of them, taken before the GEMMs)
MOE_ACTIVATIONS = (None, *ACTS)
_ARGS = (P, I64, I32, I64, I64, P, I64, I64, P, P, I64, I64, I64, I32, I64, F32, F32, P, I32, P, I64, I32, I32)  # fmt: skip
# qp_moe_fp8's: the layer's, then each GEMM's weights (data, scales, kp, srows, sld), group, lut, how
# the rows are quantized (act, act_group), the static scales of w13's and w2's GEMMs, eps
_MOE_ARGS = (*cpu_avx2.MOE_LAYER_ARGS, P, P, I64, I64, I64, P, P, I64, I64, I64, I64, P, I32, I64, P, P, F32)  # fmt: skip
SIGNATURES = {"qp_linear_fp8": _ARGS, "qp_moe_fp8": _MOE_ARGS, "qp_fp8_tiles": (I32,)}
_library = cpu_avx2.format_kernel(SOURCE, SIGNATURES, "FP8")
# the kernel's tiles (csrc's qp_fp8_tiles 0, 1): fp32 activations on AVX2, or bf16 ones on AVX-512 BF16,
# which a call takes where the CPU has it and every activation value is a bf16 value
TILES = ("avx2", "avx512-bf16")


def supports(weight, activation) -> tuple[bool, str]:
    if activation not in MODES.get(weight, ()):
        return False, f"no FP8 CPU kernel for weight {weight} with activation {activation}"
    ok, reason = available()
    if not ok:
        return False, f"quantpass's FP8 CPU kernel can't run: {reason}"
    acts = "fp32 activations" if activation is None else f"{activation} activations (as the reference quantizes them)"
    return True, f"e4m3 x {acts} on quantpass's FP8 kernel ({tiles()} tiles) for M <= {MAX_M}, reference above"


def available() -> tuple[bool, str]:
    """(ok, reason): whether this process can run the kernel; builds it on the first call."""
    return _library()[1:]


def linear(
    x: torch.Tensor, weight: QTensor, activation=None, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ dequantize(weight).T (+ bias) -> [M, N] in x.dtype (or into `out`, contiguous [M, N]
    fp32/bf16/fp16: tests pass one poisoned with NaN). weight: an FP8 `[N, K]` as `formats.quantize`
    makes it (or a checkpoint loads it); activation: a key in `MODES[weight.key]`."""
    lib, ok, reason = _library()
    if not ok:
        raise RuntimeError(f"quantpass's FP8 CPU kernel can't run: {reason}")
    if activation not in MODES.get(weight.key, ()):
        raise ValueError(f"no FP8 CPU kernel for weight {weight.key} with activation {activation}")
    if x.dim() != 2 or weight.data.dim() != 2 or x.shape[1] > weight.data.shape[1]:
        raise ValueError(f"FP8 kernel shapes: x {tuple(x.shape)}, {weight}")
    if x.dtype not in cpu_avx2.DTYPES:  # through fp32
        return linear(x.float(), weight, activation, None if bias is None else bias.float(), out).to(x.dtype)
    rows, kp = weight.data.shape
    srows, group, sld = _scale_grid(weight)
    out = cpu_avx2.output(out, x.shape[0], rows, x.dtype, "FP8")
    (act, act_group), act_scale = ACTS.get(activation, (0, 0)), 0.0
    if activation == k.kFp8StaticTensorSym:
        act_scale = _static_scale(weight, activation)
    if bias is not None and bias.dtype not in cpu_avx2.DTYPES:
        bias = bias.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    data, (scale, lut) = weight.data.contiguous(), _scales(weight.key, weight.scale.contiguous())
    bias = None if bias is None else bias.contiguous()
    status = lib.qp_linear_fp8(
        x.data_ptr(), x.stride(0), cpu_avx2.DTYPES[x.dtype], x.shape[0], x.shape[1],
        data.data_ptr(), rows, kp, scale.data_ptr(), lut, srows, sld, group, act, act_group, act_scale, AMAX_EPS,
        None if bias is None else bias.data_ptr(), 0 if bias is None else cpu_avx2.DTYPES[bias.dtype],
        out.data_ptr(), out.shape[-1], cpu_avx2.DTYPES[out.dtype], torch.get_num_threads(),
    )  # fmt: skip
    if status == -2:  # _scale_grid makes this unreachable; said plainly if they ever drift apart
        raise ValueError(f"the FP8 kernel refused scale groups of {group} columns for {weight}")
    if status:
        raise cpu_avx2.scratch_error(status)
    return out


def graph_entry() -> tuple[tuple[int, int], dict[tuple[str, str], dict[str, int]]]:
    """What the C++ graph ops (csrc/linear_op.cpp) call for this kernel: qp_linear_fp8's and qp_moe_fp8's
    addresses ((0, 0) where it is not built) and, per (weight key, activation key) it runs, the call's
    constants by cpu_op.FORMAT_FIELDS (those `linear` and `moe_experts` derive from the key; the tensors'
    come with each call)."""
    lib, ok, _ = _library()
    rows = {}
    for key, activations in MODES.items():
        lut = _lut(key) or 0
        for activation in activations:
            act, act_group = ACTS.get(activation, (0, 0))
            rows[str(key), "" if activation is None else str(activation)] = {
                "family": 8,
                "most": MAX_M,
                "srows": key.group_shape.row,  # -1: all of them
                "group": _columns_per_scale(key),
                "lut": lut,
                "act": act,
                "act_group": act_group,
                "codes": 0,
                "input_scale": int(act == STATIC),
                "moe": int(activation in MOE_ACTIVATIONS),
            }
    return cpu_avx2.addresses(lib if ok else None, "qp_linear_fp8", "qp_moe_fp8"), rows


def tiles(name: str | None = None) -> str:
    """The tiles the kernel uses where a call's activations allow (one of TILES); with `name`, switch to
    those first ("avx512-bf16" only on a CPU with AVX-512 BF16). Both multiply exactly; the bf16 ones
    scale W8A8's sums rather than its activations, and their fp32 sums run in another order."""
    lacks = "AVX-512 F, BW, VL or BF16, or the C compiler that built the kernel lacks them"
    return cpu_avx2.format_tiles(_library, "qp_fp8_tiles", TILES, name, "FP8", lacks)


def moe_experts(key, w13_data, w13_scale, w13_scale2, w2_data, w2_scale, w2_scale2, activation=None, input_scales=()):
    """(qp_moe_fp8, its arguments after the layer's, tensors they point into) for the stacked FP8 experts
    of a MoE layer ([E, N, kp] e4m3, scales as `formats.quantize` makes them, contiguous) with an
    activation key in `MOE_ACTIVATIONS` (a static one: `input_scales`, w13's and w2's calibrated scales,
    `[]` or `[E]`); None where the kernel can't run them as they are (the per-expert loop runs them)."""
    lib, ok, _ = _library()
    if not ok or key not in MODES or activation not in MOE_ACTIVATIONS or activation not in MODES[key]:
        return None
    if not cpu_avx2.stacked(w13_data, w13_scale, w2_data, w2_scale):
        return None
    xq, xq_group = ACTS.get(activation, (0, 0))
    experts, args, keep = w13_data.shape[0], [], []
    for data, scale in ((w13_data, w13_scale), (w2_data, w2_scale)):
        srows, group, sld = _grid(key, data.shape[1:], scale.shape[1:], f"{key} experts {tuple(data.shape)}")
        scale, lut = _scales(key, scale)
        args += [data.data_ptr(), scale.data_ptr(), data.shape[2], srows, sld]
        keep.append(scale)
    static = [None, None]
    if xq == STATIC:  # each expert's scale, as the loop gives each expert GEMM its own
        if len(input_scales) != 2 or any(s is None or s.numel() not in (1, experts) for s in input_scales):
            return None
        static = [s.float().reshape(-1).expand(experts).contiguous() for s in input_scales]
        keep += static
    pointers = [None if s is None else s.data_ptr() for s in static]
    return lib.qp_moe_fp8, (*args, group, lut, xq, xq_group, *pointers, AMAX_EPS), keep


def _scales(key, scale: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """The scales as the kernel reads them: MXFP8's bytes with their table of values, else fp32."""
    lut = _lut(key)
    return (scale.float() if lut is None else scale.view(torch.uint8)), lut


def _columns_per_scale(key) -> int:
    """Weight columns per scale of the key's grid, 0 for one scale over the whole row."""
    return 0 if key.group_shape.col == -1 else key.group_shape.col


def _lut(key) -> int | None:
    """The address of the fp32 values of the key's scale bytes (MXFP8's e8m0), None for fp32 scales."""
    return scale_table(E8M0).data_ptr() if key.scale.dtype == E8M0 else None


def _static_scale(weight: QTensor, activation) -> float:
    """A checkpoint's calibrated per-tensor activation scale, as fake_quantize would use it (one value)."""
    if weight.input_scale is None:
        fake_quantize(torch.zeros(1, 1), activation, None)  # raises the reference's error naming the key
    if weight.input_scale.numel() != 1:
        raise ValueError(
            f"activation {activation} takes one input scale per weight; got {tuple(weight.input_scale.shape)}"
        )
    return float(weight.input_scale)


def _scale_grid(weight: QTensor) -> tuple[int, int, int]:
    """(weight rows per scale row, columns per scale (0: the whole row), scales per scale row) from the
    key's group shape and the scale tensor, checked against the data."""
    return _grid(weight.key, weight.data.shape, weight.scale.shape, weight)


def _grid(key, data_shape, scale_shape, what) -> tuple[int, int, int]:
    """`_scale_grid` of data [rows, kp] and its scales; `what` names them in the error."""
    rows, kp = data_shape
    row_group = key.group_shape.row
    srows = rows if row_group == -1 else row_group  # -1: the whole dimension
    group = _columns_per_scale(key)
    want = (-(-rows // srows), 1 if group == 0 else -(-kp // group))
    if tuple(scale_shape) != want or (group and (group % 16 or kp % group)):
        raise ValueError(f"FP8 kernel scales: want {want} for {what}, got {tuple(scale_shape)}")
    return max(srows, 1), group, want[1]
