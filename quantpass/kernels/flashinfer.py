"""The `flashinfer` backend: MXFP8 x MXFP8 dense GEMM and fused MoE on Blackwell (SM100/SM103).

- linear: `flashinfer.mm_mxfp8` (CUTLASS backend), weight `[N, K]` e4m3 passed as the column-major
  view `weight.t()`, both scales 1-D in the 128x4 swizzled layout; activations quantized by
  `flashinfer.mxfp8_quantize` (RCEIL, the same bytes as `flashinfer_layout.quantize_activation`).
- moe: TRT-LLM `trtllm_fp8_block_scale_routed_moe` with `Fp8QuantizationType.MxFp8` (routing stays
  in our graph; ids and weights arrive packed), weights prepared once by `prepare_moe_weights`.

FlashInfer's own `register_custom_op` is a no-op (flashinfer/utils.py) and its fakes have the wrong
dtypes, so each call is wrapped in our own `torch.library.custom_op` with an exact fake, and
`flashinfer` is imported only inside the op bodies. Assumes FlashInfer >= 0.6 (the routed MoE entry
point with `fp8_quantization_type`); version facts are cited where used.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..moe_problem import GateUpLayout, MoEActivation, MoEProblem
from ..quant_registry.keys import QuantKey, kMxfp8Dynamic, kMxfp8Static
from ..quant_registry.names import Kind
from ..quant_registry.qtensor import QTensor
from ..quant_registry.spec import KINDS
from . import registry
from .flashinfer_layout import (
    SCALE_BLOCK,
    local_topk_ids,
    pack_routing,
    prepare_moe_tensor,
    round_up,
    shuffle_index,
    swizzle_128x4,
    w13_row_index,
)

Tensor = torch.Tensor

DEVICES = "CUDA SM100/SM103 (B200, GB200, B300) with flashinfer installed"
# SM100 family only: the TRT-LLM MoE cubins are sm100f-only (vLLM `is_device_capability_family(100)`);
# SM110/SM12x run mm_mxfp8 with other constraints (SM12x: N % 32) that nothing here has exercised.
SUPPORTED_SM = (100, 103)
MIN_DIM = 128  # mm_mxfp8: "output may contain NaN/Inf" below N, K = 128 (gemm_base.py problem-size check)
OUT_ROW_ALIGN = 8  # bf16 output rows 16-byte aligned for the TMA epilogue (conservative; not measured)
M_PAD = 128  # rows per MMA tile; inputs padded to it as vLLM's Mxfp8LinearOp does for FlashInfer 0.6
# mm_mxfp8 computes a whole 128-row tile per CTA, so M <= 16 does >= 8x redundant MMA work; DESIGN §5
# prefers Triton there. A guess to be replaced by a B200 measurement (bench/), used only when M is known.
DECODE_MAX_M = 16
MOE_ALIGN = 128  # I and H: w2 scales [H, I/32] need (I/32) % 4 and rows % 128 (shuffle_matrix_sf_a, no padding)
MOE_MAX_TOPK = 8  # TRT-LLM routing kernel (no groups, Renormalize): "only supports top_k<=8"
MOE_MAX_EXPERTS = 512  # routing kernel: experts <= 512 threads (vLLM's assert); experts % 4 == 0 (TORCH_CHECK)
RENORMALIZE = 1  # RoutingMethodType.Renormalize; ignored by the routed entry point (ids are given)
MAJOR_K = 0  # WeightLayout.MajorK, the only layout MxFp8 accepts (trtllm_fused_moe_kernel_launcher.cu)


def supports(kind: str, capability, weight: QuantKey, activation: QuantKey | None, problem) -> tuple[bool, str]:
    if kind not in KINDS:
        return False, f"invalid kind {kind!r}; valid: {', '.join(KINDS)}"
    if (weight, activation) != (kMxfp8Static, kMxfp8Dynamic):
        return False, f"runs only weight {kMxfp8Static} with activation {kMxfp8Dynamic}, got {weight}/{activation}"
    if capability.device != "cuda":
        return False, f"needs a CUDA GPU of the SM100 family (B200/GB200/B300), got device {capability.device!r}"
    if capability.sm not in SUPPORTED_SM:
        return False, f"needs SM100 or SM103 (B200/GB200/B300), got sm{capability.sm}"
    if "flashinfer" not in capability.libs:
        return False, "flashinfer is not installed (pip install flashinfer-python)"
    return _supports_linear_shape(problem) if kind == Kind.LINEAR else _supports_moe_shape(problem)


def _supports_linear_shape(problem) -> tuple[bool, str]:
    n, k, m = problem.n, problem.k, problem.m
    if n < MIN_DIM or k < MIN_DIM:
        return False, f"mm_mxfp8 needs N, K >= {MIN_DIM} (smaller gives NaN/Inf), got N={n}, K={k}"
    if k % SCALE_BLOCK:
        return False, f"mm_mxfp8 needs K % {SCALE_BLOCK} == 0 (whole MX blocks), got K={k}"
    if n % OUT_ROW_ALIGN:
        return False, f"mm_mxfp8 output rows must be 16-byte aligned (N % {OUT_ROW_ALIGN} == 0), got N={n}"
    if m is not None and m <= DECODE_MAX_M:
        return False, f"M={m} is decode-sized: mm_mxfp8 computes 128-row tiles; Triton/native suit M <= {DECODE_MAX_M}"
    return True, "FlashInfer mm_mxfp8 (CUTLASS), 128x4-swizzled scales"


def _supports_moe_shape(problem) -> tuple[bool, str]:
    intermediate, hidden, experts, topk = problem.n, problem.k, problem.experts, problem.topk
    if intermediate % MOE_ALIGN or hidden % MOE_ALIGN:
        return False, (
            f"TRT-LLM MXFP8 MoE needs intermediate and hidden sizes % {MOE_ALIGN} == 0, "
            f"got I={intermediate}, H={hidden}"
        )
    if experts and (experts % 4 or experts > MOE_MAX_EXPERTS):
        return False, f"TRT-LLM MoE routing needs experts % 4 == 0 and <= {MOE_MAX_EXPERTS}, got {experts}"
    if topk > MOE_MAX_TOPK:
        return False, f"TRT-LLM MoE routing takes top_k <= {MOE_MAX_TOPK}, got {topk}"
    if problem.activation not in (None, MoEActivation.SILU):
        return False, f"the TRT-LLM MXFP8 MoE computes SwiGLU (silu) only, not {str(problem.activation)!r}"
    if problem.has_bias:
        return False, "the TRT-LLM MXFP8 MoE takes no expert biases"
    return True, "FlashInfer TRT-LLM MXFP8 fused MoE (SwiGLU, no biases)"


def _check_mxfp8(weight: QTensor, what: str) -> None:
    if weight.key != kMxfp8Static:
        raise ValueError(f"flashinfer {what} takes weight key {kMxfp8Static}, got {weight.key}")


def prepare_weight(kind: str, weight: QTensor) -> QTensor:
    """A linear weight `[N, K]`: data unchanged, scales `[N, K/32]` -> 1-D 128x4 swizzled."""
    if kind != Kind.LINEAR:
        raise ValueError(f"flashinfer prepare_weight is for kind 'linear', got {kind!r} (MoE: prepare_moe_weights)")
    _check_mxfp8(weight, "linear")
    if weight.data.dim() != 2:
        raise ValueError(f"flashinfer linear weight must be 2-D [N, K], got data shape {tuple(weight.data.shape)}")
    return dataclasses.replace(weight, data=weight.data.contiguous(), scale=swizzle_128x4(weight.scale))


def prepare_moe_weights(w13: QTensor, w2: QTensor, gate_up_layout: GateUpLayout) -> tuple[QTensor, QTensor]:
    """w13 `[E, 2I, H]` ([gate; up] or interleaved) and w2 `[E, H, I]` -> TRT-LLM's MajorK shuffled
    layout: gemm1 rows [up; gate] interleaved then shuffled, gemm2 rows shuffled, every scale
    matrix permuted the same way and 128x4-interleaved in place (shapes unchanged)."""
    _check_mxfp8(w13, "MoE w13")
    _check_mxfp8(w2, "MoE w2")
    data13, scale13 = prepare_moe_tensor(w13.data, w13.scale, w13_row_index(w13.data.shape[-2], gate_up_layout))
    data2, scale2 = prepare_moe_tensor(w2.data, w2.scale, shuffle_index(w2.data.shape[-2]))
    return dataclasses.replace(w13, data=data13, scale=scale13), dataclasses.replace(w2, data=data2, scale=scale2)


def dequantize_prepared(weight: QTensor, dtype: torch.dtype) -> Tensor:
    """Not implemented: the swizzled / shuffled layouts are not read back (no grad mode, no restore)."""
    raise NotImplementedError("backend 'flashinfer' can't turn its weight layout back into a dense tensor")


graph_linear_op = graph_moe_op = registry.no_graph_op  # the generic quantpass ops call it


def _half_precision(x: Tensor) -> torch.dtype:
    """FlashInfer's quantizer takes fp16/bf16 input; anything else runs in bf16."""
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def linear(x: Tensor, weight: QTensor, activation: QuantKey | None, bias: Tensor | None) -> Tensor:
    """x `[M, K]` @ prepared MXFP8 weight `[N, K]`.T (+ bias) -> `[M, N]` in x.dtype."""
    if activation != kMxfp8Dynamic:
        raise ValueError(f"flashinfer linear quantizes activations with {kMxfp8Dynamic}, got {activation}")
    out = torch.ops.quantpass.flashinfer_mm_mxfp8(x.to(_half_precision(x)), weight.data, weight.scale)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(x.dtype)


@torch.library.custom_op("quantpass::flashinfer_mm_mxfp8", mutates_args=())
def mm_mxfp8(x: Tensor, weight: Tensor, weight_scale: Tensor) -> Tensor:
    """x `[M, K]` fp16/bf16, weight `[N, K]` e4m3, weight_scale 1-D 128x4 -> `[M, N]` in x.dtype."""
    rows, out_features = x.shape[0], weight.shape[0]
    if rows == 0:
        return x.new_empty((0, out_features))
    import flashinfer

    padded = x.contiguous() if rows % M_PAD == 0 else F.pad(x, (0, 0, 0, -rows % M_PAD))
    x_data, x_scale = flashinfer.mxfp8_quantize(padded, True)  # is_sf_swizzled_layout: 128x4
    # backend named: "auto" may pick the trtllm GEMM, which wants shuffled weights and 8x4 scales.
    out = flashinfer.mm_mxfp8(x_data, weight.t(), x_scale, weight_scale, out_dtype=x.dtype, backend="cutlass")
    return out[:rows]


@mm_mxfp8.register_fake
def _(x, weight, weight_scale):
    return x.new_empty((x.shape[0], weight.shape[0]))


def fused_moe(problem: MoEProblem) -> Tensor:
    """hidden `[T, H]`, routing `[T, k]`, prepared w13/w2 -> `[T, H]` (`registry.Backend.fused_moe`).

    The gate/up layout was applied by `prepare_moe_weights`; `alpha`/`limit` belong to `swigluoai`,
    which this kernel does not run.
    """
    activation, activation_key = problem.gated.activation, problem.activation_key
    if activation != MoEActivation.SILU:
        raise ValueError(f"flashinfer MXFP8 MoE runs activation 'silu' (SwiGLU) only, got {str(activation)!r}")
    if problem.b13 is not None or problem.b2 is not None:
        raise ValueError("flashinfer MXFP8 MoE has no expert biases; use backend 'triton' or 'reference'")
    if activation_key != kMxfp8Dynamic:
        raise ValueError(f"flashinfer MXFP8 MoE quantizes activations with {kMxfp8Dynamic}, got {activation_key}")
    hidden, topk_weights, topk_ids = problem.hidden, problem.topk_weights, problem.topk_ids
    w13, w2, expert_map = problem.w13, problem.w2, problem.expert_map
    local_experts = w13.data.shape[0]
    num_experts = local_experts
    if expert_map is not None:  # non-local experts -> an id the kernel treats as another rank's
        topk_ids = local_topk_ids(topk_ids, expert_map, local_experts)
        num_experts = round_up(local_experts + 1, 4)
    if problem.apply_router_weight_on_input:  # the kernel weights outputs; for top-1 that is the same
        if topk_ids.shape[1] != 1:
            raise ValueError(f"apply_router_weight_on_input needs top_k == 1 on flashinfer, got {topk_ids.shape[1]}")
        hidden = (hidden.float() * topk_weights.float()).to(hidden.dtype)
        topk_weights = torch.ones_like(topk_weights)
    out = torch.ops.quantpass.flashinfer_mxfp8_moe(
        hidden.to(torch.bfloat16).contiguous(),
        pack_routing(topk_ids, topk_weights),
        w13.data,
        w13.scale,
        w2.data,
        w2.scale,
        num_experts,
    )
    return out.to(hidden.dtype)


@torch.library.custom_op("quantpass::flashinfer_mxfp8_moe", mutates_args=())
def mxfp8_moe(
    hidden: Tensor,
    packed_routing: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    num_experts: int,
) -> Tensor:
    """hidden `[T, H]` bf16, packed_routing int32 `[T, k]` (`pack_routing`), prepared local experts
    w13 `[E, 2I, H]`, w2 `[E, H, I]` (ids >= E are not local) -> `[T, H]` bf16."""
    tokens = hidden.shape[0]
    if tokens == 0:
        return hidden.new_empty(hidden.shape, dtype=torch.bfloat16)
    import flashinfer
    from flashinfer import fused_moe as moe

    if not hasattr(moe, "trtllm_fp8_block_scale_routed_moe") or not hasattr(moe, "Fp8QuantizationType"):
        raise RuntimeError(
            f"flashinfer {getattr(flashinfer, '__version__', '?')} lacks trtllm_fp8_block_scale_routed_moe with "
            "Fp8QuantizationType.MxFp8; the flashinfer MoE backend needs FlashInfer >= 0.6"
        )
    x_data, x_scale = flashinfer.mxfp8_quantize(hidden, False)  # linear [T, H/32] scales for MxFp8 MoE
    out = moe.trtllm_fp8_block_scale_routed_moe(
        topk_ids=packed_routing,
        routing_bias=None,
        hidden_states=x_data,
        hidden_states_scale=x_scale.view(torch.uint8).reshape(tokens, -1),
        gemm1_weights=w13,
        gemm1_weights_scale=w13_scale,
        gemm2_weights=w2,
        gemm2_weights_scale=w2_scale,
        num_experts=num_experts,
        top_k=packed_routing.shape[1],
        n_group=None,
        topk_group=None,
        intermediate_size=w2.shape[-1],
        local_expert_offset=0,
        local_num_experts=w13.shape[0],
        routed_scaling_factor=None,
        routing_method_type=RENORMALIZE,
        use_shuffled_weight=True,
        weight_layout=MAJOR_K,
        do_finalize=True,
        fp8_quantization_type=moe.Fp8QuantizationType.MxFp8,
    )
    return out[0] if isinstance(out, (list, tuple)) else out


@mxfp8_moe.register_fake
def _(hidden, packed_routing, w13, w13_scale, w2, w2_scale, num_experts):
    return hidden.new_empty(hidden.shape, dtype=torch.bfloat16)
