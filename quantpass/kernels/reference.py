"""The `reference` backend: dequantize and compute in fp32 with plain torch, on any device.

It is the numerical ground truth for tests, `verify` and benchmarks: activations go through the
same quantize -> dequantize round trip a real kernel's activation quantization would apply, so a
kernel and the reference should agree to rounding, not merely to the format's accuracy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..moe_problem import ACTIVATIONS, GATE_UP_LAYOUTS, MoEProblem, gated_activation  # noqa: F401 (the reference's math)
from ..quant_registry.formats import (
    E4M3_MIN_SCALE,
    ELEMENTS,
    _round,
    decoded_numel,
    dequantize,
    quantize,
    rows_per_step,
)
from ..quant_registry.keys import FP4, FP8, QuantKey, kFp8StaticTensorSym, kNvfp4CalibratedGlobal, needs_input_scale
from ..quant_registry.qtensor import QTensor
from . import registry

DEVICES = "any"  # and the only backend with static (calibrated) activation scales

# The backend contract's defaults (kernels/registry.py): the canonical layout, no graph-visible op.
prepare_weight, prepare_moe_weights = registry.keep_layout, registry.keep_moe_layout
dequantize_prepared = registry.dequantize_canonical
graph_linear_op = graph_moe_op = registry.no_graph_op


def supports(kind, capability, weight, activation, problem) -> tuple[bool, str]:
    return True, "dequantize + fp32 matmul (the ground truth; slow)"


def fake_quantize(x: torch.Tensor, key: QuantKey | None, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x as a kernel sees it after activation quantization, in fp32. A static key
    (`needs_input_scale`) uses the layer's calibrated `input_scale` instead of computing one."""
    if key is None:
        return x.float()
    if not needs_input_scale(key):
        return dequantize(quantize(x, key), torch.float32)
    if input_scale is None:
        raise ValueError(
            f"activation {key} needs the layer's calibrated input scale (a pre-quantized checkpoint's "
            "input_scale) and this weight has none; use a dynamic activation key"
        )
    return STATIC_FAKE_QUANTIZE[key](x.float(), input_scale.float().to(x.device))


def _fp8_static_per_tensor(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    limit = ELEMENTS[FP8].max
    return (x / scale).clamp(-limit, limit).to(FP8).float() * scale


def _nvfp4_calibrated_global(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 with per-call e4m3 scales per 1x16 block under the static fp32 global scale."""
    cols = x.shape[-1]
    blocks = F.pad(x, (0, -cols % 16)).unflatten(-1, (-1, 16))
    block_scale = blocks.abs().amax(dim=-1, keepdim=True) / ELEMENTS[FP4].max / global_scale
    scale = block_scale.clamp(E4M3_MIN_SCALE, ELEMENTS[FP8].max).to(FP8).float() * global_scale
    return (_round(blocks / scale, FP4) * scale).flatten(-2)[..., :cols]


STATIC_FAKE_QUANTIZE = {kFp8StaticTensorSym: _fp8_static_per_tensor, kNvfp4CalibratedGlobal: _nvfp4_calibrated_global}


def linear(x: torch.Tensor, weight: QTensor, activation: QuantKey | None, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias) -> [M, N] in x.dtype."""
    out = _dequantized_matmul(fake_quantize(x, activation, weight.input_scale), weight)
    if bias is not None:
        out.add_(bias.float())  # in place: the product is this call's own fp32 tensor
    return out.to(x.dtype)


DEQUANTIZE_CHUNK = 1 << 18  # weight elements dequantized at once: 1 MiB of fp32 in flight


def _dequantized_matmul(x: torch.Tensor, weight: QTensor) -> torch.Tensor:
    """fp32 x [M, K] @ weight [N, K].T -> fp32 [M, N], the weight dequantized a few rows at a time:
    a whole fp32 copy per call (11 MiB for a 2816x1024 weight) was freed memory glibc kept, and the
    process held 1.3-1.8x the quantized weights' size (bench/README.md, "Memory"). Every step decodes
    into one scratch and multiplies straight into its columns of the output (`out=`): a new fp32
    step and product per step left glibc holding ~9 MiB of freed temporaries per process."""
    rows, cols = weight.shape[-2:]
    step = rows_per_step(cols, weight.key.group_shape.row, DEQUANTIZE_CHUNK)
    if x.dim() != 2 or weight.data.dim() != 2:
        return x @ dequantize(weight, torch.float32).t()
    out = torch.empty(x.shape[0], rows, dtype=torch.float32, device=x.device)
    scratch = torch.empty(decoded_numel(weight.rows(0, step)), dtype=torch.float32, device=x.device)
    for start in range(0, rows, step):
        part = weight.rows(start, start + step)
        torch.mm(x, dequantize(part, torch.float32, out=scratch).t(), out=out[:, start : start + part.shape[-2]])
    return out


def fused_moe(problem: MoEProblem, *, expert_matmul=_dequantized_matmul) -> torch.Tensor:
    """`problem`'s hidden [T, H] -> [T, H]: a loop over the local experts, dequantized weights.

    Each GEMM's input is quantized once over all routed rows (as fused kernels do), so a
    per-tensor activation key gets one scale per GEMM, not one per expert; a static key
    (a checkpoint's calibrated `input_scale`, `[]` or `[E]`) uses each expert's own. `expert_matmul(x fp32
    [R, K], one expert's QTensor [N, K]) -> fp32 [R, N]` replaces dequantize + matmul (the cpu
    backend runs its kernels in this loop).
    """
    hidden, activation_key, on_input = problem.hidden, problem.activation_key, problem.apply_router_weight_on_input
    local_ids = problem.topk_ids if problem.expert_map is None else problem.expert_map[problem.topk_ids]
    tokens, slots = torch.nonzero(local_ids >= 0, as_tuple=True)  # routed (token, slot) pairs
    experts = local_ids[tokens, slots]
    router = problem.topk_weights[tokens, slots].float().unsqueeze(-1)
    x = hidden[tokens].float()
    if on_input:
        x = x * router
    matmul, quantize_rows = expert_matmul, lambda rows: fake_quantize(rows.to(hidden.dtype), activation_key)
    if needs_input_scale(activation_key):  # each expert's rows with its own static scale

        def matmul(rows, weight):
            return expert_matmul(fake_quantize(rows.to(hidden.dtype), activation_key, weight.input_scale), weight)

        quantize_rows = torch.Tensor.float
    h = _per_expert(quantize_rows(x), experts, problem.w13, problem.b13, matmul)
    a = quantize_rows(problem.gated(h))
    y = _per_expert(a, experts, problem.w2, problem.b2, matmul)
    if not on_input:
        y = y * router
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    return out.index_add_(0, tokens, y).to(hidden.dtype)


def _per_expert(x: torch.Tensor, experts: torch.Tensor, weight: QTensor, bias: torch.Tensor | None, matmul):
    """Row r of x [R, K] times its expert's weight [E, N, K] (+ bias [E, N]) -> [R, N] fp32."""
    out = torch.empty(x.shape[0], weight.shape[-2], dtype=torch.float32, device=x.device)
    for expert in experts.unique().tolist():
        rows = experts == expert
        out[rows] = matmul(x[rows], weight[expert])
        if bias is not None:
            out[rows] += bias[expert].float()
    return out
