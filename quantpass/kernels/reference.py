"""The `reference` backend: dequantize and compute in fp32 with plain torch, on any device.

It is the numerical ground truth for tests, `verify` and benchmarks: activations go through the
same quantize -> dequantize round trip a real kernel's activation quantization would apply, so a
kernel and the reference should agree to rounding, not merely to the format's accuracy.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from ..moe_problem import ACTIVATIONS, GATE_UP_LAYOUTS, MoEProblem, gated_activation  # noqa: F401 (the reference's math)
from ..quant_registry.formats import (
    AMAX_EPS,
    E4M3_MIN_SCALE,
    ELEMENTS,
    _round,
    _whole_rows,
    dequantize,
    quantize,
    rows_per_step,
    scratch_numel,
)
from ..quant_registry.keys import (
    FP4,
    FP8,
    PER_ROW,
    QuantKey,
    kFp8StaticTensorSym,
    kNvfp4CalibratedGlobal,
    needs_input_scale,
)
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
    arena = _Arena(x)
    if _in_place(x, activation):
        quantized = _fake_quantize_rows(x, activation, arena.take(x.numel()))
    else:
        quantized = fake_quantize(x, activation, weight.input_scale)
    # the fp32 product in the workspace unless it is the result itself (x.dtype fp32) or autograd records the bias add
    fresh = x.dtype == torch.float32 or x.dim() != 2 or (bias is not None and _records_grad(bias))
    out = None if fresh else arena.take(x.shape[0] * weight.shape[-2])
    out = _dequantized_matmul(quantized, weight, arena, out)
    if bias is not None:
        out.add_(bias.float())
    return out.to(x.dtype)


def _records_grad(x: torch.Tensor) -> bool:
    """Autograd records ops on x: no workspace, no in-place round trip, no `out=` product (it has
    no derivative, and a product saves its operands for the backward: a reused scratch would change them)."""
    return x.requires_grad and torch.is_grad_enabled()


def _in_place(x: torch.Tensor, key: QuantKey | None) -> bool:
    """`_fake_quantize_rows` serves x: no key (bf16/fp16 x), or a dynamic per-token / per-tensor FP8 or INT8 key."""
    if _records_grad(x):
        return False
    if key is None:
        return x.dtype != torch.float32
    return x.dim() == 2 and x.shape[0] > 0 and not key.static and _whole_rows(key)


def _fake_quantize_rows(x: torch.Tensor, key: QuantKey | None, buffer: torch.Tensor) -> torch.Tensor:
    """`fake_quantize(x, key)` bit for bit in `buffer` (x.numel() fp32 elements), in place: the same
    divisions, clamp, cast and products as quantize + dequantize without their [M, K] temporaries."""
    values = buffer.view(x.shape).copy_(x)
    if key is None:
        return values
    limit, dims = ELEMENTS[key.dtype].max, (-1,) if key.group_shape == PER_ROW else (-2, -1)
    amax = torch.maximum(values.amax(dim=dims, keepdim=True), values.amin(dim=dims, keepdim=True).neg_())
    scale = amax.clamp_(min=AMAX_EPS) / limit  # |x|'s max without an |x| temporary
    values.div_(scale).clamp_(-limit, limit)
    if key.dtype == FP8:
        values.copy_(values.to(FP8))
    else:  # INT8: the rounded values are the stored integers (+ 0: an int8 zero has no sign)
        values.round_().add_(0.0)
    return values.mul_(scale)


DEQUANTIZE_CHUNK = 1 << 18  # weight elements dequantized at once: 1 MiB of fp32 in flight
WORKSPACE = 1 << 20  # fp32 elements (4 MiB) each CPU thread keeps for the temporaries of its calls
_THREAD = threading.local()


class _Arena:
    """One call's fp32 temporaries carved out of its thread's workspace, one after another.

    Allocated and freed on every call, they landed each time somewhere else in the holes that
    released weights leave in glibc's heap, and every page they touched stayed resident: 5-7 MiB
    more RSS per process than live (bench/README.md, "Memory"). The workspace is allocated once per
    thread and only its touched pages are resident. Off the CPU, inside a trace, under autograd, or
    when a request does not fit what is left, `take` returns a new tensor instead."""

    def __init__(self, x: torch.Tensor):
        self.device, self.free = x.device, None
        if (
            x.device.type == "cpu"
            and type(x) is torch.Tensor
            and not (torch.compiler.is_compiling() or _records_grad(x))
        ):
            if getattr(_THREAD, "workspace", None) is None:
                _THREAD.workspace = torch.empty(WORKSPACE, dtype=torch.float32)
            self.free = _THREAD.workspace

    def take(self, numel: int) -> torch.Tensor:
        """`numel` fp32 elements, flat, uninitialised, valid until the call returns."""
        if self.free is None or numel > self.free.numel():
            return torch.empty(numel, dtype=torch.float32, device=self.device)
        taken, self.free = self.free[:numel], self.free[numel:]
        return taken


def _dequantized_matmul(
    x: torch.Tensor, weight: QTensor, arena: _Arena | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 x [M, K] @ weight [N, K].T -> fp32 [M, N], the weight dequantized a few rows at a time:
    a whole fp32 copy per call (11 MiB for a 2816x1024 weight) was freed memory glibc kept, and the
    process held 1.3-1.8x the quantized weights' size (bench/README.md, "Memory"). Every step decodes
    into one scratch from `arena` (else this call's own) and multiplies straight into its columns of
    the output (`out=`; `out`: M * N fp32 elements to use for it, else a new tensor)."""
    rows, cols = weight.shape[-2:]
    step = rows_per_step(cols, weight.key.group_shape.row, DEQUANTIZE_CHUNK)
    if x.dim() != 2 or weight.data.dim() != 2:
        return x @ dequantize(weight, torch.float32).t()
    arena = _Arena(x) if arena is None else arena
    out = torch.empty(x.shape[0], rows, dtype=torch.float32, device=x.device) if out is None else out
    out = out.view(x.shape[0], rows)
    grad = _records_grad(x)
    scratch = None if grad else arena.take(scratch_numel(weight.rows(0, step)))
    for start in range(0, rows, step):
        part = weight.rows(start, start + step)
        w, columns = dequantize(part, torch.float32, scratch=scratch), slice(start, start + part.shape[-2])
        if grad:
            out[:, columns] = x @ w.t()
        else:
            torch.mm(x, w.t(), out=out[:, columns])
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
