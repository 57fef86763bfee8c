"""quantpass's MXFP4 / NVFP4 CPU kernel (csrc/linear_fp4.c), built on first use like cpu_avx2's.

It reads the quantized weight as quantpass stores it (e2m1 codes two per byte, one scale byte per
block: MXFP4 e8m0 per 32, NVFP4 e4m3 per 16 under an fp32 per-tensor scale), so preparing copies
nothing and a call needs no dequantized weight: the `reference` backend, which ran these formats on
CPU before, decoded every weight into fp32 scratch per call and multiplied with MKL's fp32 GEMM
(~75 ms for a 4096x4096 MXFP4 weight at M=1; the scratch and MKL's buffers were most of what these
formats held beyond their quantized bytes: bench/README.md, "Memory").

Activations, per weight-activation pair (`MODES`):
- weight-only (MXFP4, NVFP4 W4A16): each block of the weight's block size quantized once per call
  to int8 with one fp32 scale (llama.cpp's Q8 idea), integer multiply-adds;
- NVFP4 W4A4: x quantized to NVFP4 in the kernel, the bytes `formats.quantize` gives for the
  dynamic key (the reference's activation quantization; tested), then exact integer products of the
  two sets of e2m1 codes. In C rather than torch: `quantize`'s full-size fp32 temporaries landed in
  the heap's holes on every call and stayed resident (bench/README.md, "Memory").
Where the CPU has AVX-512 VNNI, 512-bit tiles form the same integer sums (`tiles`, TILES; 1.35-1.65x
faster at M <= 16 on Zen 4). Above `MAX_M` rows the `reference` backend runs the call (dequantize +
matmul beats a kernel that re-reads its activations per weight row there).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from ..quant_registry.formats import AMAX_EPS, fp4_code_table
from ..quant_registry.keys import E8M0, kMxfp4Static, kNvfp4Dynamic, kNvfp4Static
from ..quant_registry.qtensor import QTensor
from . import cpu_avx2

SOURCE = cpu_avx2.CSRC / "linear_fp4.c"
# weight key -> the activation keys it runs with, and how the activations are taken (see the docstring)
MODES = {
    kMxfp4Static: {None: "int8 activations per 32"},
    kNvfp4Static: {None: "int8 activations per 16", kNvfp4Dynamic: "NVFP4 activations, exact integer products"},
}
# a MoE layer in one call (`moe_experts`): weight-only, and NVFP4 W4A4 with one per-tensor scale over each
# stage's routed rows, as the reference's loop quantizes them
MOE_ACTIVATIONS = (None, kNvfp4Dynamic)
MAX_M = 256  # the kernel 1.2-1.4x the reference at M=256 on a 4096x4096 weight, 2-2.6x at 128 (bench/README.md)
EXACT = False  # weight-only activations are quantized to int8 per block
P, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
ACTS = {None: 0, kNvfp4Dynamic: 1}  # csrc's INT8_BLOCKS, NVFP4
_ARGS = (P, I64, I32, I64, I64, I32, P, F32, P, P, P, I32, I64, I64, F32, P, I32, P, I64, I32, I32)  # qp_linear_fp4
_MOE_ARGS = (*cpu_avx2.MOE_LAYER_ARGS, P, P, I64, P, P, P, I64, P, I32, P, I32, P, F32)  # qp_moe_fp4's
SIGNATURES = {"qp_linear_fp4": _ARGS, "qp_moe_fp4": _MOE_ARGS, "qp_fp4_tiles": (ctypes.c_int,)}
_library = cpu_avx2.format_kernel(SOURCE, SIGNATURES, "FP4")
# the kernel's tiles (csrc's qp_fp4_tiles 0, 1): AVX2, or AVX-512 VNNI where the CPU has it (the same
# integer sums; measured faster on Zen 4: bench/README.md, "VNNI tiles for FP4")
TILES = ("avx2", "avx512-vnni")


def supports(weight, activation) -> tuple[bool, str]:
    modes = MODES.get(weight)
    if modes is None or activation not in modes:
        return False, f"no FP4 CPU kernel for weight {weight} with activation {activation}"
    ok, reason = available()
    if not ok:
        return False, f"quantpass's FP4 CPU kernel can't run: {reason}"
    return (
        True,
        f"e2m1 x {modes[activation]} on quantpass's FP4 kernel ({tiles()} tiles) for M <= {MAX_M}, reference above",
    )


def tiles(name: str | None = None) -> str:
    """The tiles the kernel uses (one of TILES); with `name`, switch to those first ("avx512-vnni" only on a
    CPU with AVX-512 VNNI). Their integer sums are the same; the order of their fp32 sums differs."""
    return cpu_avx2.format_tiles(_library, "qp_fp4_tiles", TILES, name, "FP4", "AVX-512 F, BW, VL or VNNI")


def available() -> tuple[bool, str]:
    """(ok, reason): whether this process can run the kernel; builds it on the first call."""
    return _library()[1:]


def linear(
    x: torch.Tensor, weight: QTensor, activation=None, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ dequantize(weight).T (+ bias) -> [M, N] in x.dtype (or into `out`, contiguous [M, N]
    fp32/bf16/fp16: tests pass one poisoned with NaN). weight: MXFP4 or NVFP4 `[N, K]` as
    `formats.quantize` makes it; activation: a key in `MODES[weight.key]`."""
    lib, ok, reason = _library()
    if not ok:
        raise RuntimeError(f"quantpass's FP4 CPU kernel can't run: {reason}")
    modes = MODES.get(weight.key)
    if modes is None or activation not in modes:
        raise ValueError(f"no FP4 CPU kernel for weight {weight.key} with activation {activation}")
    rows, kp = weight.data.shape[0], weight.data.shape[1] * 2
    block = weight.key.group_shape.col
    if x.dim() != 2 or x.shape[1] > kp or weight.data.dim() != 2 or tuple(weight.scale.shape) != (rows, kp // block):
        raise ValueError(f"FP4 kernel shapes: x {tuple(x.shape)}, {weight}")
    if x.dtype not in cpu_avx2.DTYPES:
        return linear(x.float(), weight, activation, None if bias is None else bias.float(), out).to(x.dtype)
    if bias is not None and bias.dtype not in cpu_avx2.DTYPES:
        bias = bias.float()
    out = cpu_avx2.output(out, x.shape[0], rows, x.dtype, "FP4")
    if x.stride(-1) != 1:
        x = x.contiguous()
    g = 0.5 if weight.scale2 is None else float(weight.scale2) / 2  # codes are e2m1 values x 2
    data, scale = weight.data.contiguous(), weight.scale.contiguous().view(torch.uint8)
    bias = None if bias is None else bias.contiguous()
    status = lib.qp_linear_fp4(
        x.data_ptr(), x.stride(0), cpu_avx2.DTYPES[x.dtype], x.shape[0], x.shape[1],
        ACTS[activation], fp4_code_table().data_ptr(), AMAX_EPS, data.data_ptr(), scale.data_ptr(), scale_table(weight.key.scale.dtype).data_ptr(), block, rows, kp, g,
        None if bias is None else bias.data_ptr(), 0 if bias is None else cpu_avx2.DTYPES[bias.dtype],
        out.data_ptr(), out.shape[-1], cpu_avx2.DTYPES[out.dtype], torch.get_num_threads(),
    )  # fmt: skip
    if status == -2:  # the checks above make this unreachable; said plainly if they ever drift apart
        raise ValueError(f"the FP4 kernel refused blocks of {block} over {kp} columns with activation {activation}")
    if status:
        raise cpu_avx2.scratch_error(status)
    return out


def graph_entry() -> tuple[tuple[int, int], dict[tuple[str, str], dict[str, int]]]:
    """What the C++ graph ops (csrc/linear_op.cpp) call for this kernel: qp_linear_fp4's and qp_moe_fp4's
    addresses ((0, 0) where it is not built) and, per (weight key, activation key) it runs, the call's
    constants by cpu_op.FORMAT_FIELDS (those `linear` and `moe_experts` derive from the key; the tensors'
    come with each call)."""
    lib, ok, _ = _library()
    rows = {
        (str(key), "" if activation is None else str(activation)): {
            "family": 4,
            "most": MAX_M,
            "srows": 1,
            "group": key.group_shape.col,
            "lut": scale_table(key.scale.dtype).data_ptr(),
            "act": ACTS[activation],
            "act_group": 0,
            "codes": fp4_code_table().data_ptr(),
            "input_scale": 0,
            "moe": int(activation in MOE_ACTIVATIONS),
        }
        for key, modes in MODES.items()
        for activation in modes
    }
    return cpu_avx2.addresses(lib if ok else None, "qp_linear_fp4", "qp_moe_fp4"), rows


def moe_experts(key, w13_data, w13_scale, w13_scale2, w2_data, w2_scale, w2_scale2, activation=None, input_scales=()):
    """(qp_moe_fp4, its arguments after the layer's, tensors they point into) for the stacked MXFP4 /
    NVFP4 experts of a MoE layer ([E, N, kp / 2] codes, [E, N, kp / block] scale bytes, NVFP4's per-tensor
    scale per expert, as `formats.quantize` makes them, contiguous) with an activation key in
    `MOE_ACTIVATIONS` that `MODES` pairs with the weight; None where the kernel can't run them as they are."""
    lib, ok, _ = _library()
    if not ok or activation not in MOE_ACTIVATIONS or activation not in MODES.get(key, ()):
        return None
    if not cpu_avx2.stacked(w13_data, w2_data):
        return None
    block, experts, args, keep = key.group_shape.col, w13_data.shape[0], [], []
    for data, scale, scale2 in ((w13_data, w13_scale, w13_scale2), (w2_data, w2_scale, w2_scale2)):
        kp = data.shape[2] * 2
        if tuple(scale.shape) != (*data.shape[:2], kp // block) or kp % block or not scale.is_contiguous():
            return None
        g = None
        if scale2 is not None:  # codes are e2m1 values x 2, as in `linear`
            if scale2.numel() != experts:
                return None
            g = (scale2.float().reshape(-1) / 2).contiguous()
            keep.append(g)
        args += [data.data_ptr(), scale.view(torch.uint8).data_ptr(), kp, None if g is None else g.data_ptr()]
    table = scale_table(key.scale.dtype).data_ptr()
    return lib.qp_moe_fp4, (*args, block, table, ACTS[activation], fp4_code_table().data_ptr(), AMAX_EPS), keep


@functools.cache
def scale_table(dtype: torch.dtype) -> torch.Tensor:
    """fp32 value of each scale byte: e8m0 (2^(b - 127), 255 is NaN) or e4m3."""
    if dtype == E8M0:
        table = torch.exp2(torch.arange(256, dtype=torch.float32) - 127)
        table[255] = float("nan")
        return table
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
