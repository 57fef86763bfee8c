"""What a (weight key, activation key) pair means to the GEMM kernel: its constexpr flags.

Everything here is derived from the two QuantKeys (STYLE rule 2): a new format is a new branch of
`gemm_scheme`, not a new kernel. No triton import: `supports` asks this without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...quant_registry.keys import E8M0, FP4, FP8, INT4, INT8, PER_ROW, PER_TENSOR, QuantKey
from ...quant_registry.names import StrEnum

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


class Element(StrEnum):
    """An operand's data as the kernel reads it."""

    FLOAT = "float"  # the activation as given (bf16 / fp16 / fp32)
    FP8 = "fp8"
    INT8 = "int8"
    INT4 = "int4"  # uint8 packed, offset 8
    E2M1 = "e2m1"  # FP4, uint8 packed


class ScaleMode(StrEnum):
    """How an operand's scales are laid out and applied."""

    NONE = "none"
    TENSOR = "tensor"  # activation quantization only; the GEMM reads it as a row scale of stride 0
    ROW = "row"  # per-token / per-channel
    GROUP = "group"  # 1 x group along K (activations); weights: applied to the dequantized tile
    BLOCK = "block"  # weight blocks, applied per K step
    MX = "mx"  # e8m0 per 1x32, `tl.dot_scaled`


class GemmMode(StrEnum):
    DOT = "dot"  # fp8 x fp8 or int8 x int8 on the tensor cores
    DOT_SCALED = "dot_scaled"  # MX
    DEQUANT = "dequant"  # weight-only: the tile is decoded to the activation's float type, then `tl.dot`


def constexpr_flags(**flags) -> dict:
    """Kernel constexprs with the enums above as plain strings (what the `@triton.jit` bodies compare)."""
    return {name: str(v) if isinstance(v, StrEnum) else v for name, v in flags.items()}


@dataclass(frozen=True)
class GemmScheme:
    """The constexpr flags of `gemm_kernel.gemm_kernel` for one operand-format pair.

    a_format  FLOAT | FP8 | INT8
    a_scale   NONE | ROW (per-token, or per-tensor through a zero stride) | GROUP (1 x a_group_k) | MX
    b_format  FP8 | INT8 | INT4 | E2M1
    b_scale   ROW (per-channel, or per-tensor) | BLOCK (b_group) | GROUP (b_group) | MX
    """

    a_format: Element
    a_scale: ScaleMode
    b_format: Element
    b_scale: ScaleMode
    mode: GemmMode
    a_group_k: int = 0
    b_group: tuple[int, int] = (1, 1)
    has_scale2: bool = False  # NVFP4's fp32 per-matrix scale, applied in the epilogue

    @property
    def name(self) -> str:
        """Short dtype tag for config file names, e.g. "fp8_w8a8", "mxfp4_w4a16"."""
        element = {Element.E2M1: "nvfp4" if self.has_scale2 else "mxfp4"}.get(self.b_format, str(self.b_format))
        prefix = "mx" if self.b_scale == ScaleMode.MX and self.b_format == Element.FP8 else ""
        bits = 4 if self.b_format in (Element.INT4, Element.E2M1) else 8
        activation_bits = 16 if self.a_format == Element.FLOAT else 8
        return f"{prefix}{element}_w{bits}a{activation_bits}"


def _weight_format(key: QuantKey) -> tuple[Element, ScaleMode, tuple[int, int], bool] | str:
    group = key.group_shape
    per_row = group in (PER_TENSOR, PER_ROW)
    if key.dtype in (FP8, INT8) and key.scale.dtype != E8M0 and per_row:
        return (Element.FP8 if key.dtype == FP8 else Element.INT8, ScaleMode.ROW, (1, 1), False)
    if key.dtype == FP8 and key.scale.dtype == E8M0 and (group.row, group.col) == (1, 32):
        return (Element.FP8, ScaleMode.MX, (1, 32), False)
    if key.dtype == FP8 and group.row > 1 and _power_of_2(group.row) and _power_of_2(group.col):
        return (Element.FP8, ScaleMode.BLOCK, (group.row, group.col), False)
    if key.dtype == FP4 and key.scale.dtype == E8M0 and (group.row, group.col) == (1, 32):
        return (Element.E2M1, ScaleMode.MX, (1, 32), False)
    if key.dtype == FP4 and key.scale.dtype == FP8 and group.row == 1 and _power_of_2(group.col):
        return (Element.E2M1, ScaleMode.GROUP, (1, group.col), key.scale2 is not None)  # NVFP4
    if key.dtype == INT4 and group.row == 1 and _power_of_2(group.col):
        return (Element.INT4, ScaleMode.GROUP, (1, group.col), False)
    return f"no Triton GEMM for weight {key}"


def _activation_format(key: QuantKey | None) -> tuple[Element, ScaleMode, int] | str:
    if key is None:
        return (Element.FLOAT, ScaleMode.NONE, 0)
    scheme = activation_scheme(key)
    if isinstance(scheme, str):
        return scheme
    element, scale, group = scheme
    return (element, ScaleMode.ROW if scale == ScaleMode.TENSOR else scale, group)  # per-tensor: stride-0 rows


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
    if b_scale == ScaleMode.MX or a_scale == ScaleMode.MX:
        if b_scale != ScaleMode.MX or a_scale not in (ScaleMode.NONE, ScaleMode.MX):
            return f"MX weights pair with unquantized or MX activations only ({weight} x {activation})"
        return GemmScheme(mode=GemmMode.DOT_SCALED, **scheme)
    if a_format == Element.FLOAT:
        return GemmScheme(mode=GemmMode.DEQUANT, **scheme)
    if a_format != b_format:
        return f"activation {activation} and weight {weight} have different element types"
    if a_format == Element.INT8 and (a_scale, b_scale) != (ScaleMode.ROW, ScaleMode.ROW):
        return "INT8 x INT8 needs per-token activations and per-channel weights (int32 accumulation)"
    if b_scale == ScaleMode.GROUP:
        return f"weight {weight} has K-group scales; only block scales combine with FP8 activations"
    return GemmScheme(mode=GemmMode.DOT, **scheme)


def _power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def activation_scheme(key: QuantKey) -> tuple[Element, ScaleMode, int] | str:
    """(ELEMENT, SCALE, GROUP) for a dynamic activation key, or why there is no kernel for it."""
    if key.static:
        return f"{key} is a static (weight) key; activations are quantized with dynamic keys"
    if key.dtype not in (FP8, INT8) or key.scale2 is not None:
        return f"no Triton activation quantization for {key} (FP8 and INT8 elements only)"
    element = Element.FP8 if key.dtype == FP8 else Element.INT8
    group = key.group_shape
    if group == PER_TENSOR:
        return (element, ScaleMode.TENSOR, 0)
    if group == PER_ROW:
        return (element, ScaleMode.ROW, 0)
    if group.row == 1 and group.col > 1 and _power_of_2(group.col):
        if key.scale.dtype == E8M0:
            return (element, ScaleMode.MX, group.col) if element == Element.FP8 else f"no INT8 MX scheme ({key})"
        return (element, ScaleMode.GROUP, group.col)
    return f"no Triton activation quantization for group shape {group} ({key})"
