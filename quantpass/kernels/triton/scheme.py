"""What a (weight key, activation key) pair means to the GEMM kernel: its constexpr flags.

Everything here is derived from the two QuantKeys (STYLE rule 2): a new format is a new branch of
`gemm_scheme`, not a new kernel. No triton import: `supports` asks this without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...quant_registry.keys import E8M0, FP4, FP8, INT4, INT8, PER_ROW, PER_TENSOR, QuantKey

# FP8 accumulation: one policy for every FP8 format, followed by every backend. "precise": the tensor
# cores' FP8 partial sums are added into an fp32 accumulator at least every FP8_PROMOTE_K elements of K
# (Hopper's FP8 MMAs accumulate in a narrower format; DeepSeek-V3 and DeepGEMM promote every 128). It is
# torch._scaled_mm's default (`use_fast_accum=False`, which `native` passes), what the block-scaled
# kernels do by construction (a fresh product per 128-K step), and what Triton's sm90 default is not
# (it accumulates over all of K unless `max_num_imprecise_acc` says otherwise). SM100's MMAs accumulate
# in fp32 already. "fast" would be the alternative (vLLM's CUTLASS FP8 kernels): faster, less accurate
# at long K; the GPU tier measures the error at K = 8192 and 14336.
FP8_ACCUMULATION = "precise"
FP8_PROMOTE_K = 128


@dataclass(frozen=True)
class GemmScheme:
    """The constexpr flags of `_gemm_kernel` for one operand-format pair.

    a_format  "float" (the activation as given) | "fp8" | "int8"
    a_scale   "none" | "row" (per-token, or per-tensor through a zero stride) | "group" (1 x a_group_k) | "mx"
    b_format  "fp8" | "int8" | "int4" (uint8 packed, offset 8) | "e2m1" (uint8 packed)
    b_scale   "row" (per-channel, or per-tensor) | "block" (b_group, applied per K step) |
              "group" (b_group, applied to the dequantized tile) | "mx" (e8m0 per 1x32, `tl.dot_scaled`)
    mode      "dot" (fp8 x fp8 or int8 x int8 on the tensor cores) | "dot_scaled" (MX) |
              "dequant" (weight-only: the tile is decoded to the activation's float type, then `tl.dot`)
    """

    a_format: str
    a_scale: str
    b_format: str
    b_scale: str
    mode: str
    a_group_k: int = 0
    b_group: tuple[int, int] = (1, 1)
    has_scale2: bool = False  # NVFP4's fp32 per-matrix scale, applied in the epilogue

    @property
    def name(self) -> str:
        """Short dtype tag for config file names, e.g. "fp8_w8a8", "mxfp4_w4a16"."""
        weight = {"fp8": "fp8", "int8": "int8", "int4": "int4", "e2m1": "nvfp4" if self.has_scale2 else "mxfp4"}
        prefix = "mx" if self.b_scale == "mx" and self.b_format == "fp8" else ""
        bits = 4 if self.b_format in ("int4", "e2m1") else 8
        activation_bits = 16 if self.a_format == "float" else 8
        return f"{prefix}{weight[self.b_format]}_w{bits}a{activation_bits}"


def _weight_format(key: QuantKey) -> tuple[str, str, tuple[int, int], bool] | str:
    group = key.group_shape
    per_row = group in (PER_TENSOR, PER_ROW)
    if key.dtype in (FP8, INT8) and key.scale.dtype != E8M0 and per_row:
        return ("fp8" if key.dtype == FP8 else "int8", "row", (1, 1), False)
    if key.dtype == FP8 and key.scale.dtype == E8M0 and (group.row, group.col) == (1, 32):
        return ("fp8", "mx", (1, 32), False)
    if key.dtype == FP8 and group.row > 1 and _power_of_2(group.row) and _power_of_2(group.col):
        return ("fp8", "block", (group.row, group.col), False)
    if key.dtype == FP4 and key.scale.dtype == E8M0 and (group.row, group.col) == (1, 32):
        return ("e2m1", "mx", (1, 32), False)
    if key.dtype == FP4 and key.scale.dtype == FP8 and group.row == 1 and _power_of_2(group.col):
        return ("e2m1", "group", (1, group.col), key.scale2 is not None)  # NVFP4
    if key.dtype == INT4 and group.row == 1 and _power_of_2(group.col):
        return ("int4", "group", (1, group.col), False)
    return f"no Triton GEMM for weight {key}"


def _activation_format(key: QuantKey | None) -> tuple[str, str, int] | str:
    if key is None:
        return ("float", "none", 0)
    scheme = activation_scheme(key)
    if isinstance(scheme, str):
        return scheme
    element, scale, group = scheme
    return (element, "row" if scale == "tensor" else scale, group)  # per-tensor: a row scale of stride 0


def gemm_scheme(weight: QuantKey, activation: QuantKey | None) -> GemmScheme | str:
    """The kernel flags for the pair, or a sentence saying why the kernel family can't run it."""
    w = _weight_format(weight)
    a = _activation_format(activation)
    if isinstance(w, str) or isinstance(a, str):
        return w if isinstance(w, str) else a
    b_format, b_scale, b_group, has_scale2 = w
    a_format, a_scale, a_group_k = a
    scheme = dict(a_format=a_format, a_scale=a_scale, b_format=b_format, b_scale=b_scale, b_group=b_group)
    scheme.update(a_group_k=a_group_k, has_scale2=has_scale2)
    if b_scale == "mx" or a_scale == "mx":
        if b_scale != "mx" or a_scale not in ("none", "mx"):
            return f"MX weights pair with unquantized or MX activations only ({weight} x {activation})"
        return GemmScheme(mode="dot_scaled", **scheme)
    if a_format == "float":
        return GemmScheme(mode="dequant", **scheme)
    if a_format != b_format:
        return f"activation {activation} and weight {weight} have different element types"
    if a_format == "int8" and (a_scale, b_scale) != ("row", "row"):
        return "INT8 x INT8 needs per-token activations and per-channel weights (int32 accumulation)"
    if b_scale == "group":
        return f"weight {weight} has K-group scales; only block scales combine with FP8 activations"
    return GemmScheme(mode="dot", **scheme)


def _power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def activation_scheme(key: QuantKey) -> tuple[str, str, int] | str:
    """(ELEMENT, SCALE, GROUP) for a dynamic activation key, or why there is no kernel for it."""
    if key.static:
        return f"{key} is a static (weight) key; activations are quantized with dynamic keys"
    if key.dtype not in (FP8, INT8) or key.scale2 is not None:
        return f"no Triton activation quantization for {key} (FP8 and INT8 elements only)"
    element = "fp8" if key.dtype == FP8 else "int8"
    group = key.group_shape
    if group == PER_TENSOR:
        return (element, "tensor", 0)
    if group == PER_ROW:
        return (element, "row", 0)
    if group.row == 1 and group.col > 1 and _power_of_2(group.col):
        if key.scale.dtype == E8M0:
            return (element, "mx", group.col) if element == "fp8" else f"no INT8 MX scheme ({key})"
        return (element, "group", group.col)
    return f"no Triton activation quantization for group shape {group} ({key})"
