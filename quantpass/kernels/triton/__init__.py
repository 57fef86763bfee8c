"""The `triton` backend: our Triton kernels for quantized linear and fused-MoE sites.

Files: `quant.py` (activation quantization), `gemm_kernel.py` (one GEMM kernel family, dense or
routed), `gemm.py` (its host side: plans, configs, launch), `scheme.py` (key pair -> kernel flags),
`moe_align.py` (token sorting), `moe.py` (fused MoE), `tuning.py` + `configs/*.json` (launch
configs), `elements.py` (shared element encodings).

Where it runs (`supports`): CUDA SM80+, with FP8 e4m3 data (FP8 and MXFP8 operands, NVFP4's
e4m3 scales) on SM89+ since Triton has no e4m3 type below; MX pairs use `tl.dot_scaled`, native on
SM100 and upcast to bf16 by Triton before the MMA below it. On CPU only under Triton's interpreter
(`TRITON_INTERPRET=1`), which the oracle never picks by itself: it is for tests. No shape rules:
weights arrive with K padded to their group (formats.py) and every load is masked, so any M, N, K.

This module imports no triton at import time (docs/design.md §5): kernels live in submodules loaded on
first use. On CUDA the graph ops are `torch.library.triton_op`s, so Inductor sees the kernels.
"""

from __future__ import annotations

import functools

import torch

from ...moe_problem import ACTIVATIONS, MoEProblem
from ...quant_registry.keys import QuantKey
from ...quant_registry.names import Kind
from ...quant_registry.qtensor import QTensor
from ...quant_registry.spec import KINDS
from .. import registry
from .scheme import Element, GemmMode, GemmScheme, activation_scheme, gemm_scheme

Tensor = torch.Tensor  # module level: the triton_op annotations below are resolved here
DEVICES = "cuda sm80+ (FP8 data sm89+; MX x MX native on sm100 in 128-row tiles, emulated otherwise); cpu under TRITON_INTERPRET=1 (tests)"


def supports(kind, capability, weight: QuantKey, activation: QuantKey | None, problem) -> tuple[bool, str]:
    if kind not in KINDS:
        return False, f"no Triton kernel for site kind {kind!r}"
    scheme = gemm_scheme(weight, activation)
    if isinstance(scheme, str):
        return False, scheme
    if activation is not None and isinstance(why := activation_scheme(activation), str):
        return False, why
    moe_activation = getattr(problem, "activation", None)
    if kind == Kind.MOE and moe_activation is not None and moe_activation not in ACTIVATIONS:
        return False, f"no fused epilogue for MoE activation {moe_activation!r}; valid: {', '.join(ACTIVATIONS)}"
    if "triton" not in capability.libs:
        return False, "triton is not installed"
    if capability.device == "cpu":
        if not capability.triton_interpret:
            return False, "needs CUDA, or TRITON_INTERPRET=1 on CPU"
        return True, "Triton interpreter on CPU (~5 ms per program per K step: for tests)"
    if capability.device != "cuda":
        return False, f"needs CUDA (or the interpreter on CPU), not {capability.device}"
    sm = capability.sm or 0
    if sm < 80:
        return False, f"needs SM80+ (bf16 tensor cores); this is sm{sm}"
    if _has_e4m3(scheme) and sm < 89:
        return False, f"FP8 e4m3 data needs SM89+ (Triton has no e4m3 type on sm{sm})"
    if scheme.mode == GemmMode.DOT_SCALED:
        return True, _dot_scaled_path(scheme, sm, getattr(problem, "m", None))
    return True, f"Triton {scheme.mode} GEMM ({scheme.name})"


# Where tl.dot_scaled runs natively (compile-only check with triton 3.6 and 3.9, tests/test_triton_aot.py):
# SM100's block-scaled MMA takes FP8/FP6/FP4 on both sides and 128-row tiles; anything else is
# decomposed by Triton into an upcast to bf16 and a bf16 MMA.
NATIVE_MX_MIN_SM = 100
NATIVE_MX_BLOCK_M = 128


def _dot_scaled_path(scheme: GemmScheme, sm: int, m: int | None) -> str:
    """The oracle's reason for an MX pair; "emulated: ..." where Triton upcasts (oracle.EMULATED)."""
    if sm < NATIVE_MX_MIN_SM:
        return f"emulated: tl.dot_scaled on sm{sm} upcasts the MX operands to bf16 (native MX MMAs need SM100)"
    if scheme.a_format == Element.FLOAT:
        return f"emulated: MX weights x float activations on sm{sm}: the weight is upcast to bf16 (SM100's MX MMAs take FP8/FP6/FP4 operands only)"  # fmt: skip
    if m is not None and m < NATIVE_MX_BLOCK_M:
        return f"emulated: M={m} on sm{sm}: native MX MMAs need {NATIVE_MX_BLOCK_M}-row tiles, smaller ones are upcast to bf16"
    return f"Triton tl.dot_scaled GEMM ({scheme.name}): native MX MMA on sm{sm} in {NATIVE_MX_BLOCK_M}-row tiles (decode tiles upcast to bf16)"


def _has_e4m3(scheme: GemmScheme) -> bool:
    return Element.FP8 in (scheme.a_format, scheme.b_format) or scheme.has_scale2  # NVFP4: e4m3 scales


# The backend contract's defaults (kernels/registry.py): the kernels read the canonical layout.
prepare_weight, prepare_moe_weights = registry.keep_layout, registry.keep_moe_layout
dequantize_prepared = registry.dequantize_canonical


def linear(x2d: torch.Tensor, weight: QTensor, activation_key: QuantKey | None, bias: torch.Tensor | None):
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N] in x.dtype: quantize the activation, then the GEMM."""
    from .gemm import quantized_matmul
    from .quant import quantize_activation

    a = x2d if activation_key is None else quantize_activation(x2d, activation_key)
    return quantized_matmul(a, weight, bias, x2d.dtype)


def fused_moe(problem: MoEProblem, **options):
    """`problem.hidden` [T, H] -> [T, H] through the experts; `options` as `moe.fused_moe`'s."""
    from . import moe

    return moe.fused_moe(problem, **options)


def graph_linear_op(device_type: str):
    """On CUDA, a `triton_op` with `quantpass::linear`'s arguments (Inductor sees its kernels)."""
    return _graph_ops()[0] if device_type == "cuda" else None


def graph_moe_op(device_type: str):
    """On CUDA, a `triton_op` with `quantpass::fused_moe`'s arguments; elsewhere None (the generic
    custom op then calls `fused_moe`: triton_op can't be compiled on CPU, docs/design.md §7)."""
    return _graph_ops()[1] if device_type == "cuda" else None


@functools.cache
def _graph_ops():
    """Register `quantpass::triton_linear` / `quantpass::triton_fused_moe` once, with the arguments of
    `quantpass::linear` / `quantpass::fused_moe` (triton_op infers its schema from the annotations, so
    they are spelled out; a test checks the schemas match). Their bodies run the eager launchers:
    every kernel launch goes through `wrap_triton`."""
    from torch.library import triton_op

    from .. import ops

    @triton_op("quantpass::triton_linear", mutates_args=())
    def triton_linear(
        x: Tensor,
        w_data: Tensor,
        w_scale: Tensor,
        w_scale2: Tensor | None,
        bias: Tensor | None,
        weight_key: str,
        activation_key: str,
        backend: str,
        out_features: int,
        input_scale: Tensor | None = None,
    ) -> Tensor:
        args = (w_data, w_scale, w_scale2, bias, weight_key, activation_key, out_features, input_scale)
        return ops.run_linear(linear, x, *args)

    @triton_op("quantpass::triton_fused_moe", mutates_args=())
    def triton_fused_moe(
        hidden: Tensor,
        topk_weights: Tensor,
        topk_ids: Tensor,
        w13_data: Tensor,
        w13_scale: Tensor,
        w13_scale2: Tensor | None,
        w2_data: Tensor,
        w2_scale: Tensor,
        w2_scale2: Tensor | None,
        b13: Tensor | None,
        b2: Tensor | None,
        expert_map: Tensor | None,
        weight_key: str,
        activation_key: str,
        backend: str,
        activation: str,
        gate_up_layout: str,
        apply_router_weight_on_input: bool,
        intermediate_size: int,
        alpha: float,
        limit: float,
        w13_input_scale: Tensor | None = None,
        w2_input_scale: Tensor | None = None,
    ) -> Tensor:
        return ops.run_fused_moe(fused_moe, hidden, topk_weights, topk_ids, w13_data, w13_scale, w13_scale2, w2_data,
                                 w2_scale, w2_scale2, b13, b2, expert_map, weight_key, activation_key, backend,
                                 activation, gate_up_layout, apply_router_weight_on_input, intermediate_size, alpha,
                                 limit, w13_input_scale, w2_input_scale)  # fmt: skip

    return torch.ops.quantpass.triton_linear.default, torch.ops.quantpass.triton_fused_moe.default
