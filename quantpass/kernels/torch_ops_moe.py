"""The `native` backend's MoE: the experts as plain torch ops around `torch._grouped_mm`, Inductor-visible.

Weights are dequantized to bf16 (`torch._grouped_mm` takes only bf16 under compile and on CPU; it
wants int32 offsets and leaves rows past the last offset uninitialised), token rows are sorted by
expert with `sort` + `histc`/`cumsum` offsets (no data-dependent shapes, so it traces with a dynamic
token count), then two grouped GEMMs around the gated activation of the reference, the router
weight applied in fp32, and the top-k sum. Activation quantization, when the spec has one, is the
reference's round trip, so this path and `reference` agree to bf16 rounding.

Where it wins: not on this repo's CPU (AMD EPYC, AVX2, no AVX-512/AMX): 1.2-6x slower than the
reference's per-expert loop (bench/README.md, "Measurements behind choices in the code"). It
dequantizes every expert on every call (the loop only the experts hit: a loss at decode), and bf16
GEMMs run ~6x slower than fp32 ones on a CPU without AMX (CPU `_grouped_mm` is exactly as fast as a
per-expert `F.linear` loop in either dtype). So `supports_moe` refuses CPU. On CUDA (sm80+) bf16 `_grouped_mm` is a tensor-core kernel: expected near the bf16 MoE
at prefill and ~2.5x its weight traffic at decode (int8 read + bf16 write + bf16 read) - unmeasured
here (no GPU); it is a compile-friendly fallback there, the Triton fused MoE the fast path.
"""

from __future__ import annotations

import torch

from ..moe_problem import ACTIVATIONS, MoEProblem
from ..quant_registry.formats import dequantize, quantize
from ..quant_registry.keys import QuantKey
from ..quant_registry.qtensor import QTensor

ROW_ALIGNMENT = 8  # torch._grouped_mm: every row stride 16-byte aligned -> bf16 dims % 8
MIN_SM = 80  # torch._grouped_mm on CUDA: sm80+ (torch >= 2.9)


CPU_REFUSAL = (
    "native MoE measured slower than the reference loop on CPU at T=1..256 (all experts dequantized "
    "per call; bf16 GEMMs ~6x slower than fp32 without AMX)"
)


def supports_moe(capability, weight: QuantKey, activation: QuantKey | None, problem) -> tuple[bool, str]:
    """Whether this path runs the MoE problem on the device, and why (not)."""
    if capability.device == "cpu":
        return False, CPU_REFUSAL
    if capability.device == "cuda" and (capability.sm or 0) < MIN_SM:
        return False, f"torch._grouped_mm needs CUDA sm{MIN_SM}+; this device is sm{capability.sm}"
    if capability.device != "cuda":
        return False, f"native MoE runs on cuda; got device {capability.device!r}"
    if problem.k % ROW_ALIGNMENT or problem.n % ROW_ALIGNMENT:
        return False, f"torch._grouped_mm needs H and I % {ROW_ALIGNMENT} == 0 (bf16 rows 16-byte aligned); got H={problem.k}, I={problem.n}"  # fmt: skip
    if problem.activation is not None and problem.activation not in ACTIVATIONS:
        return False, f"no gated activation {problem.activation!r}; valid: {', '.join(ACTIVATIONS)}"
    return True, "dequantize to bf16 + torch._grouped_mm (Inductor-visible; all experts dequantized per call)"


def fused_moe(problem: MoEProblem) -> torch.Tensor:
    """hidden [T, H], routing [T, k] -> [T, H]; the contract of `registry.Backend.fused_moe`."""
    hidden, topk_weights, topk_ids = problem.hidden, problem.topk_weights, problem.topk_ids
    w13, w2, activation_key, expert_map = problem.w13, problem.w2, problem.activation_key, problem.expert_map
    on_input = problem.apply_router_weight_on_input
    tokens, topk = topk_ids.shape
    experts = w13.shape[0]
    ids = topk_ids.reshape(-1)  # [S = T*k], token-major
    if expert_map is not None:  # global -> local id; experts living elsewhere sort past the last group
        local = expert_map[ids]
        ids = torch.where(local < 0, experts, local)
    sorted_ids, perm = ids.sort()
    counts = torch.histc(sorted_ids.float(), bins=experts, min=0, max=experts - 1)  # sentinel E not counted
    offsets = counts.cumsum(0).to(torch.int32)  # [E] row ends, int32 as torch._grouped_mm wants
    valid = (sorted_ids < experts).unsqueeze(-1)  # rows past offsets[-1] are never written
    experts_of_rows = sorted_ids.clamp(max=experts - 1)
    router = topk_weights.reshape(-1)[perm].float().unsqueeze(-1)  # [S, 1]
    rows = hidden[perm // topk].float()  # [S, H]
    if on_input:
        rows = rows * router
    w13_t = dequantize_bf16(w13).transpose(-2, -1)  # [E, H, 2I] view
    h = torch._grouped_mm(_activation_input(rows, hidden.dtype, activation_key), w13_t, offs=offsets).float()
    if problem.b13 is not None:
        h = h + problem.b13[experts_of_rows].float()
    a = problem.gated(h)  # [S, I] fp32
    w2_t = dequantize_bf16(w2).transpose(-2, -1)  # [E, I, H] view
    y = torch._grouped_mm(_activation_input(a, hidden.dtype, activation_key), w2_t, offs=offsets).float()
    if problem.b2 is not None:
        y = y + problem.b2[experts_of_rows].float()
    y = torch.where(valid, y, 0.0)
    if not on_input:
        y = y * router
    unsorted = torch.empty_like(y).index_copy(0, perm, y)  # back to token-major rows
    return unsorted.view(tokens, topk, -1).sum(dim=1).to(hidden.dtype)


def dequantize_bf16(weight: QTensor) -> torch.Tensor:
    """All experts' weights in bf16. Per-row scales (INT8/FP8 channel) broadcast instead of being
    expanded to the weight's size as `formats.dequantize` does: 3x faster on CPU (80 vs 234 ms for
    [8, 2048, 2048] INT8), equal to it up to the bf16 rounding of the scale."""
    unpacked = weight.data.dtype not in (torch.uint8,) and weight.data.shape[-1] == weight.shape[-1]
    if unpacked and weight.scale2 is None and weight.scale.shape[-1] == 1 and weight.scale.is_floating_point():
        return weight.data.to(torch.bfloat16) * weight.scale.to(torch.bfloat16)
    return dequantize(weight, torch.bfloat16)


def _activation_input(x: torch.Tensor, dtype: torch.dtype, key: QuantKey | None) -> torch.Tensor:
    """Rows as the GEMM sees them: in the model's dtype, through the activation quantizer, in bf16."""
    x = x.to(dtype)
    if key is not None:
        return dequantize(quantize(x, key), torch.bfloat16)
    return x.to(torch.bfloat16)
