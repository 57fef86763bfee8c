"""The `native` backend (this module: torch ops): quantized linears as plain torch ops that Inductor
sees and fuses; its MoE is `torch_ops_moe.py`.

Nothing here is a custom op. Activation quantization is `formats.quantize` itself (pointwise ops and
row reductions, no `.item()`, no data-dependent branch; it traces under AOTAutograd with a dynamic M),
so Inductor fuses it into the producer of `x`, and a kernel here and the reference agree to rounding.
The GEMM is the torch op the device has for the pair:

- FP8 per-tensor / per-row W8A8: `torch._scaled_mm` (CPU; CUDA SM89+).
- INT8 W8A8: `torch._int_mm` (int32 accumulate) times both scales in the epilogue.
- FP8 1x128 x 128x128 blocks (CUDA SM90), MXFP8 and NVFP4 W4A4 (CUDA SM100+):
  `torch.nn.functional.scaled_mm` with explicit scale recipes.
- Weight-only: `formats.dequantize` into x.dtype + `F.linear`, on any device.

Torch's rules quoted below are from `aten/src/ATen/native/cuda/ScaledBlas.cpp` (`_scaled_mm_out_cuda`,
`_check_deepseek_support`, `_scaled_mxfp8_mxfp8`, `_scaled_nvfp4_nvfp4`), `cuda/Blas.cpp`
(`_int_mm_out_cuda`) and `torch/_meta_registrations.py` (`_check_scaled_mm_sizes_v2`), torch 2.13.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..quant_registry.formats import dequantize, padded_cols, quantize
from ..quant_registry.keys import (
    E8M0,
    QuantKey,
    kFp8Dynamic128Sym,
    kFp8DynamicTensorSym,
    kFp8DynamicTokenSym,
    kFp8Static128BlockSym,
    kFp8StaticChannelSym,
    kFp8StaticTensorSym,
    kInt4StaticGroup128Sym,
    kInt8DynamicTokenSym,
    kInt8StaticChannelSym,
    kMxfp4Static,
    kMxfp8Dynamic,
    kMxfp8Static,
    kNvfp4Dynamic,
    kNvfp4Static,
)
from ..quant_registry.names import Kind
from ..quant_registry.qtensor import QTensor
from . import registry
from .flashinfer_layout import swizzle_128x4
from .torch_ops_moe import fused_moe, supports_moe
from .triton.scheme import FP8_ACCUMULATION

__all__ = ["DEVICES", "fused_moe", "graph_linear_op", "linear", "linear_graph", "supports"]

# The backend contract's defaults (kernels/registry.py): the canonical layout, no graph-visible MoE op.
prepare_weight, prepare_moe_weights = registry.keep_layout, registry.keep_moe_layout
dequantize_prepared = registry.dequantize_canonical
graph_moe_op = registry.no_graph_op

DEVICES = (
    "weight-only: any device; FP8 per-tensor/per-row and INT8 W8A8: cpu, cuda (FP8 sm89+); "
    "FP8 128-block: cuda sm90; MXFP8, NVFP4 W4A4: cuda sm100+"
)

WEIGHT_ONLY = frozenset(
    {kFp8StaticChannelSym, kInt8StaticChannelSym, kInt4StaticGroup128Sym, kNvfp4Static, kMxfp4Static}
)


@dataclass(frozen=True)
class Gemm:
    """Where one quantized GEMM runs, by torch's rules: on CPU or not, which CUDA SMs, and the
    multiples N and the GEMM's K must be on CUDA. K is the data's K: padded to the weight's column
    group (128, 32, 16) where the format pads it, and counted in bytes for packed FP4 (torch's
    meta check wants the packed K % 16, so NVFP4 needs its padded K % 32)."""

    name: str
    cpu: bool
    min_sm: int
    max_sm: int | None = None
    n_multiple: int = 1
    k_multiple: int = 1
    needs_v2: bool = False  # `torch.nn.functional.scaled_mm` (scale recipes, lists of scales)


FP8_GEMM = Gemm("torch._scaled_mm", cpu=True, min_sm=89, n_multiple=16, k_multiple=16)
INT8_GEMM = Gemm("torch._int_mm", cpu=True, min_sm=75, n_multiple=8, k_multiple=8)  # int8 tensor cores: Turing+
FP8_BLOCK_GEMM = Gemm("F.scaled_mm BlockWise1x128 x BlockWise128x128", cpu=False, min_sm=90, max_sm=90, n_multiple=128, needs_v2=True)  # fmt: skip
MXFP8_GEMM = Gemm("F.scaled_mm BlockWise1x32 (e8m0, 128x4 swizzled)", cpu=False, min_sm=100, n_multiple=16, needs_v2=True)  # fmt: skip
NVFP4_GEMM = Gemm("F.scaled_mm BlockWise1x16 + TensorWise (e4m3, 128x4 swizzled)", cpu=False, min_sm=100, n_multiple=16, k_multiple=32, needs_v2=True)  # fmt: skip

# fmt: off
GEMMS: dict[tuple[QuantKey, QuantKey], Gemm] = {
    (kFp8StaticTensorSym,   kFp8DynamicTensorSym): FP8_GEMM,
    (kFp8StaticChannelSym,  kFp8DynamicTokenSym):  FP8_GEMM,
    (kInt8StaticChannelSym, kInt8DynamicTokenSym): INT8_GEMM,
    (kFp8Static128BlockSym, kFp8Dynamic128Sym):    FP8_BLOCK_GEMM,
    (kMxfp8Static,          kMxfp8Dynamic):        MXFP8_GEMM,
    (kNvfp4Static,          kNvfp4Dynamic):        NVFP4_GEMM,
}
# fmt: on

# Why a GEMM can't run where it can't, in torch's words where torch has them.
SM_RULES = {
    FP8_GEMM: "torch._scaled_mm needs CUDA compute capability 8.9 or 9.0+",
    INT8_GEMM: "torch._int_mm needs int8 tensor cores (sm75+)",
    FP8_BLOCK_GEMM: "torch: 'DeepSeek style (1x128, 128x128) scaling only supported in CUDA for SM90'",
    MXFP8_GEMM: "torch's MX GEMM (cuBLASLt block scaling) needs sm100+",
    NVFP4_GEMM: "torch's NVFP4 GEMM (cuBLASLt block scaling) needs sm100+",
}
CPU_REFUSAL = "torch._scaled_mm on CPU takes only per-tensor and per-row FP8 scales"

# FP8 accumulation: the policy every backend follows (triton/scheme.py says why). "precise" is
# `use_fast_accum=False`, torch's default, passed explicitly so the choice is visible and tested.
USE_FAST_ACCUM = FP8_ACCUMULATION == "fast"

# cuBLASLt's int8 GEMM refuses M <= 16 ("self.size(0) needs to be greater than 16", Blas.cpp).
INT_MM_MIN_ROWS = {"cuda": 17}


def supports(kind, capability, weight, activation, problem) -> tuple[bool, str]:
    if kind == Kind.MOE:
        return supports_moe(capability, weight, activation, problem)
    if activation is None:
        if weight in WEIGHT_ONLY:
            return True, "dequantize + F.linear (Inductor-visible)"
        return False, f"native has no weight-only kernel for {weight}"
    gemm = GEMMS.get((weight, activation))
    if gemm is None:
        return False, f"native has no kernel for {weight} with activation {activation}"
    if gemm.needs_v2 and not hasattr(F, "scaled_mm"):
        return False, f"{gemm.name} needs torch.nn.functional.scaled_mm (torch >= 2.10); torch is {torch.__version__}"
    if capability.device == "cpu":
        return (True, f"{gemm.name} on CPU") if gemm.cpu else (False, f"{CPU_REFUSAL}, not {gemm.name}")
    if capability.device != "cuda":
        return False, f"native W8A8/W4A4 GEMMs run on cpu and cuda; got device {capability.device!r}"
    sm = capability.sm or 0
    if sm < gemm.min_sm or (gemm.max_sm is not None and sm > gemm.max_sm):
        return False, f"{SM_RULES[gemm]}; this device is sm{sm}"
    k = padded_cols(weight, problem.k)
    if problem.n % gemm.n_multiple or k % gemm.k_multiple:
        rules = [
            f"{dim} % {multiple} == 0"
            for dim, multiple in (("N", gemm.n_multiple), ("K", gemm.k_multiple))
            if multiple > 1
        ]
        padded = "" if k == problem.k else f" (padded to {k})"
        return False, f"{gemm.name} on CUDA needs {' and '.join(rules)}; got N={problem.n}, K={problem.k}{padded}"
    return True, f"{gemm.name} on cuda sm{sm}"


def linear(x: torch.Tensor, weight: QTensor, activation: QuantKey | None, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias) -> [M, N] in x.dtype, as plain torch ops."""
    if activation is None:
        return F.linear(x, dequantize(weight, x.dtype), None if bias is None else bias.to(x.dtype))
    gemm = GEMMS.get((weight.key, activation))
    if gemm is None:
        raise ValueError(
            f"native has no kernel for weight {weight.key} with activation {activation}; "
            f"valid pairs: {sorted(f'{w}/{a}' for w, a in GEMMS)} or weight-only {sorted(map(str, WEIGHT_ONLY))}"
        )
    out = _GEMM_FUNCTIONS[gemm](x, weight, quantize(x, activation))  # bias stays out: see _fp8
    if bias is not None:
        out = out + bias
    return out.to(x.dtype)


def graph_linear_op(device_type: str):
    """On every device, `linear_graph`: plain torch ops AOTAutograd traces (Inductor fuses the
    activation quantization into the graph around it)."""
    return linear_graph


def linear_graph(x, w_data, w_scale, w_scale2, bias, weight_key, activation_key, backend, out_features):
    """`quantpass::linear`'s arguments as plain torch ops (`graph_linear_op`).
    `backend` is always "native" here; it is in the signature so every backend takes one argument list."""
    from .ops import key_from_arg, weight_view  # ops imports the oracle, which imports this module

    weight = weight_view(w_data, w_scale, w_scale2, weight_key, out_features, x.shape[-1], x.dtype)
    out = linear(x.reshape(-1, x.shape[-1]), weight, key_from_arg(activation_key), bias)
    return out.reshape(*x.shape[:-1], out_features)


def _fp8(x: torch.Tensor, weight: QTensor, xq: QTensor) -> torch.Tensor:
    """Per-tensor or per-row FP8. Bias is added after the GEMM in every path: CUDA's `_scaled_mm`
    takes only a bf16/fp16 bias and none with fp32 output, and Inductor fuses the add anyway."""
    scale_a, scale_b = xq.scale, weight.scale.reshape(1, -1)  # [M or 1, 1], [1, N or 1]
    if x.device.type == "cpu":  # scalar scales are ~800x slower on CPU (docs/design.md §7): go row-wise
        scale_a = scale_a.expand(x.shape[0], 1).contiguous()
        scale_b = scale_b.expand(1, weight.shape[0]).contiguous()
    return torch._scaled_mm(
        xq.data, weight.data.t(), scale_a, scale_b, out_dtype=x.dtype, use_fast_accum=USE_FAST_ACCUM
    )


def _int8(x: torch.Tensor, weight: QTensor, xq: QTensor) -> torch.Tensor:
    """int8 x int8 -> int32, then x's per-token and the weight's per-channel scale in fp32.

    Small M on CUDA: zero rows pad the activation to 17 (`torch.sym_max` keeps a dynamic M symbolic:
    no guard, no recompile; Inductor writes the pad in the kernel that quantizes x); the rows are
    sliced off the int32 result. Zero rows cost GEMM work, never a wrong value.
    """
    rows = x.shape[0]
    data = xq.data
    min_rows = INT_MM_MIN_ROWS.get(x.device.type, 0)
    if min_rows:
        data = F.pad(data, (0, 0, 0, torch.sym_max(min_rows - rows, 0)))
    accumulated = torch._int_mm(data, weight.data.t()).narrow(0, 0, rows)  # [M, N] int32: |sum| <= 127^2 K
    return accumulated.float() * xq.scale * weight.scale.reshape(1, -1)


def _fp8_block(x: torch.Tensor, weight: QTensor, xq: QTensor) -> torch.Tensor:
    """1x128 activations x 128x128 weight blocks (CUDA SM90). K is padded to 128 in both operands.

    Layouts torch checks: scale_a [M, K/128] outer-dim-major (strides (1, M)); scale_b
    [round_up(K/128, 4), N/128] with strides (1, round_up(K/128, 4)), i.e. our [N/128, K/128] weight
    scale with its rows padded to 16 bytes, transposed.
    """
    # clone, not .contiguous(): for M = 1 the transposed [K/128, 1] view already counts as
    # contiguous and would keep strides (K/128, 1) - torch wants (1, 1).
    scale_a = xq.scale.t().clone(memory_format=torch.contiguous_format).t()
    scale_b = F.pad(weight.scale, (0, -weight.scale.shape[-1] % 4)).t()
    recipe = F.ScalingType
    return F.scaled_mm(
        xq.data, weight.data.t(), scale_a, recipe.BlockWise1x128, scale_b, recipe.BlockWise128x128,
        output_dtype=x.dtype, use_fast_accum=USE_FAST_ACCUM,
    )  # fmt: skip


def _mxfp8(x: torch.Tensor, weight: QTensor, xq: QTensor) -> torch.Tensor:
    """MXFP8 x MXFP8 (CUDA SM100+): e8m0 scales per 1x32 in the 128x4 swizzled layout (M, N padded
    to 128 there, K-blocks to 4). The weight's swizzle is redone per call (N x K/32 bytes)."""
    swizzle = F.SwizzleType.SWIZZLE_32_4_4
    return F.scaled_mm(
        xq.data,
        weight.data.t(),
        _swizzled(xq.scale, E8M0),
        F.ScalingType.BlockWise1x32,
        _swizzled(weight.scale, E8M0),
        F.ScalingType.BlockWise1x32,
        swizzle_a=swizzle,
        swizzle_b=swizzle,
        output_dtype=x.dtype,
        use_fast_accum=USE_FAST_ACCUM,
    )


def _nvfp4(x: torch.Tensor, weight: QTensor, xq: QTensor) -> torch.Tensor:
    """NVFP4 x NVFP4 (CUDA SM100+): two-level scales, [e4m3 per 1x16 (swizzled), fp32 per tensor];
    torch multiplies the two global scales into the GEMM's alpha. Packed data: 2 x e2m1 per byte,
    first element in the low nibble, as torch's float4_e2m1fn_x2."""
    fp4 = torch.float4_e2m1fn_x2
    recipes = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
    swizzles = [F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE]
    return F.scaled_mm(
        xq.data.view(fp4),
        weight.data.view(fp4).t(),
        [_swizzled(xq.scale, xq.scale.dtype), xq.scale2],
        recipes,
        [_swizzled(weight.scale, weight.scale.dtype), weight.scale2],
        recipes,
        swizzle_a=swizzles,
        swizzle_b=swizzles,
        output_dtype=x.dtype,
    )


def _swizzled(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[R, C] one-byte scales -> the flat 128x4 tiled layout cuBLASLt reads, viewed as `dtype`."""
    return swizzle_128x4(scale.view(torch.uint8)).view(dtype)


_GEMM_FUNCTIONS = {FP8_GEMM: _fp8, INT8_GEMM: _int8, FP8_BLOCK_GEMM: _fp8_block, MXFP8_GEMM: _mxfp8, NVFP4_GEMM: _nvfp4}
