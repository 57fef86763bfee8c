"""The `cpu` backend: weight-only CPU kernels for decode, dequantize + matmul above (and INT8 W8A8
through the same kernels on fake-quantized activations); MXFP4 and NVFP4 (weight-only and W4A4) on
quantpass's FP4 kernel (cpu_fp4.py) and every FP8 format on its FP8 kernel (cpu_fp8.py), the
`reference` backend above their largest M (`FORMAT_KERNELS`).

- On x86-64 CPUs with AVX2 (AVX-512 ones too: faster than aten's there as well, measured) and no
  AMX: quantpass's own kernels (cpu_avx2.py, csrc/linear_avx2.c). They read the quantized weight as
  quantpass stores it: preparing copies nothing. They multiply on integer activations
  (`ACTIVATION_MODES`) up to `LINEAR_MAX_M` rows, above that dequantize + matmul.
- Elsewhere (or `QUANTPASS_CPU_KERNEL=0`, or no C compiler), aten's: INT8 per-channel
  `torch._weight_int8pack_mm(x, int8 [N, K], scales [N])`; INT4 group-128
  `torch._weight_int4pack_mm_for_cpu(x, packed, 128, scale_and_zeros [K/128, N, 2])` on
  `torch._convert_weight_to_int4pack_for_cpu`'s layout (it computes (q - 8) * scale + zero, so our
  codes, value + 8, go in as they are, zero 0); up to `KERNEL_MAX_M` rows, dequantize + matmul above.

Every weight has one prepared copy: ours is the quantized weight itself; aten's replaces it, and the
large-M path dequantizes per call. `fused_moe` runs a MoE layer (weight-only, INT8/FP8/MXFP8 W8A8,
NVFP4 W4A4) in one C call (`_moe_on_our_kernels`, `cpu_avx2.moe_layer` with each kernel library's
`moe_experts`) and anything else as `_per_expert_loop`. Compiled graphs call the graph ops of
cpu_graph.py (`graph_linear_op`, `graph_moe_op`), which go straight to our kernels when they can and
through `linear` / the MoE paths here otherwise.
aten's INT4 layout is read back in cpu_aten_int4.py. Measurements: bench/README.md ("CPU decode at the
bandwidth limit", "MoE at decode", "Results: CPU").
"""

from __future__ import annotations

import threading
from dataclasses import replace

import torch
import torch.nn.functional as F

from ..moe_problem import GateUpLayout, MoEProblem
from ..quant_registry.formats import dequantize, unpack_int4
from ..quant_registry.keys import KEYS, kInt4StaticGroup128Sym, kInt8DynamicTokenSym, kInt8StaticChannelSym
from ..quant_registry.names import Kind
from ..quant_registry.qtensor import QTensor
from ..quant_registry.spec import KINDS
from . import cpu_avx2, cpu_fp4, cpu_fp8, reference
from .cpu_aten_int4 import int4_layout as _int4_layout
from .cpu_aten_int4 import unpack_int4_cpu
from .reference import fake_quantize

DEVICES = "cpu"
KERNELS = {
    kInt8StaticChannelSym: ("_weight_int8pack_mm",),
    kInt4StaticGroup128Sym: ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu"),
}
BITS = {kInt8StaticChannelSym: 8, kInt4StaticGroup128Sym: 4}
# weight key -> the module of quantpass's kernel for its format family, each with the same interface:
# MODES (weight key -> activation keys), MAX_M (the reference above), EXACT (whether activations it is
# given are multiplied as they are: then MoE experts may take the loop's fake-quantized ones),
# MOE_ACTIVATIONS (the activation keys a MoE layer runs with in one call), supports(weight, activation),
# linear(x, weight, activation, bias), moe_experts(...) (a MoE layer's entry and arguments). They read
# the quantized weight as it is (contiguous): nothing to prepare.
FORMAT_KERNELS = {key: module for module in (cpu_fp4, cpu_fp8) for key in module.MODES}
_FORMAT_KERNELS_BY_NAME = {str(key): (key, module) for key, module in FORMAT_KERNELS.items()}
# INT8 W8A8 runs the same kernels on per-token fake-quantized activations: identical math to an
# int8 x int8 GEMM with both scales in the epilogue, ~10x faster here than torch._int_mm
# (bench/README.md, "Measurements behind choices in the code").
ACTIVATIONS = {kInt8StaticChannelSym: (None, kInt8DynamicTokenSym)}
GROUP = 128  # INT4 scale group along K
# torch._weight_int8pack_mm (torch 2.13, AVX2) reads K in steps of 8: with K % 8 != 0 it segfaulted
# (M = 7, K = 292, 300, 308) or returned inf/NaN (M = 1, K = 300), measured 2026-11-29. aten-prepared
# INT8 weights carry zero columns up to a multiple of 8; x gets matching zero columns per call.
INT8_K_MULTIPLE = 8

# How our kernels take activations, and the measured accuracy against fp32 activations behind the
# choice (bench/cpu_decode.py --parts accuracy; speed and accuracy tables in bench/README.md). "exact" (fp32
# activations) is the other mode: 1.2-2.5x slower here at every M, and aten's AVX-512 kernels beat it
# from M=16, while these lose nothing measurable.
ACTIVATION_MODES = {
    kInt8StaticChannelSym: ("int16", "exact integer products, 81-92 dB against fp32 activations"),
    kInt4StaticGroup128Sym: ("int8", "33-44 dB against fp32 activations, under INT4's own ~19 dB"),
}
# Largest M for our kernels (a MoE layer's tokens in one call, and rows per expert GEMM); largest M of a
# linear on them, then dequantize + matmul (`_large_m_matmul`); and the same for aten's kernels. From
# bench/cpu_m_sweep.py, tables in bench/README.md. A linear's: where the CPU multiplies bf16 natively, measured
# on a Zen 5 with the chunked dequantize ("The matmul above the kernels' largest M"); elsewhere as measured
# on an Ice Lake before it, when dequantizing cost 3-10x more (not re-measured there: the switch may be late).
OURS_MAX_M = {kInt8StaticChannelSym: 384, kInt4StaticGroup128Sym: 384}
KERNEL_MAX_M = {kInt8StaticChannelSym: 128, kInt4StaticGroup128Sym: 192}

# `_large_m_matmul` dequantizes this many bytes of a weight at a time, into a buffer kept per thread
CHUNK_BYTES = 8 << 20
_CHUNKS = threading.local()
# The matmul above the threshold runs in x.dtype only where the CPU multiplies bf16/fp16 natively
# (AMX, AVX512-BF16); on AVX2 a bf16 GEMM is 5x slower than fp32 at M=32 (bench/README.md): upcast.
NATIVE_LOW_PRECISION_MATMUL = bool(
    getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    or getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
)
LINEAR_MAX_M = (
    {kInt8StaticChannelSym: 48, kInt4StaticGroup128Sym: 128} if NATIVE_LOW_PRECISION_MATMUL else dict(OURS_MAX_M)
)


def supports(kind, capability, weight, activation, problem) -> tuple[bool, str]:
    if kind not in KINDS:
        return False, f"no cpu kernel for site kind {kind!r}"
    if capability.device != "cpu":
        return False, f"aten's weight-only CPU kernels run on cpu, not {capability.device}"
    family = FORMAT_KERNELS.get(weight)
    if family is not None:
        if kind != Kind.MOE:
            return family.supports(weight, activation)
        if activation in family.MOE_ACTIVATIONS:  # `_moe_on_our_kernels`, up to the kernel's largest M
            ok, reason = family.supports(weight, activation)
            loop = "the reference's loop" if _requantizes(family, activation) else "per-expert loop"
            return ok, f"one C call per layer for T <= {family.MAX_M} ({loop} above): {reason}"
        if _requantizes(family, activation):
            return False, f"the per-expert loop runs {weight} weight-only; {activation} activations go to the reference"
        ok, reason = family.supports(weight, None)  # the loop quantizes the activations, as the reference's
        return ok, f"per-expert loop: {activation} activations by the loop, {reason}"
    if activation not in ACTIVATIONS.get(weight, (None,)):
        return False, f"no CPU kernel for weight {weight} with activation {activation}"
    loop = "per-expert loop: " if kind == Kind.MOE else ""
    fake = "" if activation is None else ", activations fake-quantized per token"
    ours, name = cpu_avx2.available()
    if ours and weight in ACTIVATION_MODES:
        bits, (mode, accuracy) = BITS[weight], ACTIVATION_MODES[weight]
        most = LINEAR_MAX_M[weight]
        if kind == Kind.MOE:  # `_moe_on_our_kernels`, up to the kernels' largest M
            most = OURS_MAX_M[weight]
            loop = f"one C call per layer for T <= {most} (per-expert loop above): "
        return True, (
            f"{loop}INT{bits} on {name} with {mode} activations ({accuracy}) for M <= {most}, "
            f"dequantize + matmul above{fake}"
        )
    ops_ = KERNELS.get(weight)
    if ops_ is None:
        return False, f"no CPU kernel for weight {weight}; valid: {', '.join(sorted(map(str, KERNELS)))}"
    missing = [op for op in ops_ if not hasattr(torch, op)]
    if missing:
        return False, f"torch {torch.__version__} has no torch.{missing[0]}"
    rows = (problem.n,) if kind == Kind.LINEAR else (2 * problem.n, problem.k)  # MoE: w13 [2I, H], w2 [H, I]
    odd = [n for n in rows if n % 16]
    if weight == kInt4StaticGroup128Sym and odd:
        return False, f"torch._convert_weight_to_int4pack_for_cpu needs N % 16 == 0; got N={odd[0]}"
    return True, f"{loop}torch.{ops_[0]} for M <= {KERNEL_MAX_M[weight]}, dequantize + matmul above{fake}"


def kernel_max_m(weight: QTensor) -> int:
    """Largest M that runs a kernel for this prepared weight (above: dequantize + matmul)."""
    if weight.key in FORMAT_KERNELS:
        return FORMAT_KERNELS[weight.key].MAX_M
    if _on_our_kernel(weight):
        return LINEAR_MAX_M[weight.key]
    if weight.key == kInt4StaticGroup128Sym and _int4_layout() is None:
        return 1 << 62  # aten's INT4 layout can't be read back here: the kernel at every M
    return KERNEL_MAX_M[weight.key]


def prepare_weight(kind: str, weight: QTensor) -> QTensor:
    """The kernels' layout. Ours: the quantized weight itself (data [N, K] int8 or [N, Kp/2] uint8,
    scale fp32 [N, 1] or [N, Kp/128]), made contiguous. aten's, where ours can't run: INT8 data [N, K
    rounded up to 8] (zero columns), scale [N] in the weight's dtype; INT4 data [N, Kp/2] uint8 in
    the CPU packed layout, scale [Kp/128, N, 2] = (scale, 0) in the weight's dtype. One copy either
    way: the large-M path dequantizes per call.
    """
    if weight.key in FORMAT_KERNELS:
        return weight.contiguous()
    if weight.key not in KERNELS:
        raise ValueError(f"cpu backend can't prepare {weight.key}; valid: {', '.join(sorted(map(str, KERNELS)))}")
    if _is_aten_layout(weight):
        return weight
    if cpu_avx2.available()[0]:
        return _contiguous(weight)
    dtype = weight.dtype
    if weight.key == kInt8StaticChannelSym:
        data = F.pad(weight.data, (0, -weight.data.shape[-1] % INT8_K_MULTIPLE)).contiguous()
        return QTensor(data, weight.scale.reshape(-1).to(dtype), None, weight.key, weight.shape, dtype)
    codes = (unpack_int4(weight.data).to(torch.int32) + 8).contiguous()  # [N, Kp] in [1, 15]
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
    scale = weight.scale.t().to(dtype)  # [Kp/128, N]
    scale_and_zeros = torch.stack([scale, torch.zeros_like(scale)], dim=-1).contiguous()
    return QTensor(packed, scale_and_zeros, None, weight.key, weight.shape, dtype)


def prepare_moe_weights(w13: QTensor, w2: QTensor, gate_up_layout: GateUpLayout) -> tuple[QTensor, QTensor]:
    """Each expert in `prepare_weight`'s layout, stacked: [E, ...] data and scales."""
    return _prepare_experts(w13), _prepare_experts(w2)


def _prepare_experts(weight: QTensor) -> QTensor:
    if weight.key in FORMAT_KERNELS:
        return weight.contiguous()
    if _is_aten_layout(weight[0]):
        return weight
    if cpu_avx2.available()[0]:
        return _contiguous(weight)
    experts = [prepare_weight(Kind.MOE, weight[e]) for e in range(weight.data.shape[0])]
    data, scale = torch.stack([p.data for p in experts]), torch.stack([p.scale for p in experts])
    return QTensor(data, scale, None, weight.key, weight.shape, weight.dtype)


def fused_moe(problem: MoEProblem) -> torch.Tensor:
    """hidden [T, H] -> [T, H]: on our kernels in one C call where `_moe_on_our_kernels` runs the layer
    (`moe_in_one_call`: weight-only, FP8/MXFP8 W8A8, INT8 W8A8, NVFP4 W4A4, up to the kernel's largest
    M); anything else `_per_expert_loop` (activation keys are fake-quantized by the loop, as the
    reference does)."""
    w13, w2, hidden = problem.w13, problem.w2, problem.hidden
    if w13.key == w2.key:
        gated, activation_key = problem.gated, problem.activation_key
        out = _moe_on_our_kernels(
            hidden, problem.topk_weights, problem.topk_ids, w13.data, w13.scale, w13.scale2, w2.data, w2.scale,
            w2.scale2, problem.b13, problem.b2, problem.expert_map, str(w13.key), gated.activation,
            gated.gate_up_layout, problem.apply_router_weight_on_input, gated.alpha, gated.limit,
            "" if activation_key is None else str(activation_key), (w13.input_scale, w2.input_scale),
        )  # fmt: skip
        if out is not None:
            return out
    return _per_expert_loop(problem)


def _per_expert_loop(problem: MoEProblem) -> torch.Tensor:
    """The loop where the layer is not one C call: `linear`'s kernels per expert, or the reference's own
    dequantize + matmul where those would quantize the loop's quantized activations again."""
    family = FORMAT_KERNELS.get(problem.w13.key)
    if family is not None and _requantizes(family, problem.activation_key):
        return reference.fused_moe(problem)
    return reference.fused_moe(problem, expert_matmul=_expert_matmul)


def _requantizes(family, activation) -> bool:
    """Whether the family's weight-only kernel would quantize a loop's quantized activations again (FP4's)."""
    return activation is not None and not family.EXACT


def _moe_on_our_kernels(
    hidden, topk_weights, topk_ids, w13_data, w13_scale, w13_scale2, w2_data, w2_scale, w2_scale2, b13, b2,
    expert_map, weight_key, activation, gate_up_layout, on_input, alpha, limit, activation_key="", input_scales=(),
) -> torch.Tensor | None:  # fmt: skip
    """A MoE layer in one C call (hidden [T, H] -> [T, H]): csrc/moe_layer.h's steps of the loop with
    each expert's rows through its weights once, on the kernel every expert GEMM of the loop would run
    (INT8/INT4 weight-only and INT8 W8A8: qp_moe; FP8 weight-only or with the activation keys in
    `cpu_fp8.MOE_ACTIVATIONS`: qp_moe_fp8; MXFP4, NVFP4 weight-only and W4A4: qp_moe_fp4), where the
    kernel reads the weights as they are, T <= its largest M and the dtypes are ones it reads; else
    None. At decode the loop's Python and torch calls per expert cost as much as the kernels
    (bench/README.md, "MoE at decode"). The loop's result up to the gated activation's exp, erf or tanh,
    which may round differently from torch's in the last bit. `activation_key`: its string ("" for
    none); a static one's scales in `input_scales` (w13's, w2's)."""
    found = _moe_experts(
        weight_key, w13_data, w13_scale, w13_scale2, w2_data, w2_scale, w2_scale2, activation_key, input_scales
    )
    if found is None:
        return None
    entry, weights, _held, most = found  # `weights` points into `_held`'s tensors: held through the call
    return cpu_avx2.moe_layer(
        entry, weights, most, w13_data.shape[0], w13_data.shape[1] // 2, hidden, topk_weights, topk_ids, b13, b2,
        expert_map, activation, gate_up_layout, on_input, alpha, limit,
    )  # fmt: skip


def _moe_experts(weight_key, w13_data, w13_scale, w13_scale2, w2_data, w2_scale, w2_scale2, activation_key, scales):
    """(the MoE entry for this format, its arguments after the layer's, tensors the arguments point into,
    the most rows per GEMM): the kernel library's `moe_experts` where it runs these stacked experts as
    they are, else None."""
    family = _FORMAT_KERNELS_BY_NAME.get(weight_key)
    if family is not None:
        (key, module), activation = family, KEYS.get(activation_key) if activation_key else None
        if activation_key and activation is None:
            return None
        found = module.moe_experts(
            key, w13_data, w13_scale, w13_scale2, w2_data, w2_scale, w2_scale2, activation, scales
        )
        return None if found is None else (*found, module.MAX_M)
    fast = _FAST.get(weight_key)
    found = None if fast is None else cpu_avx2.moe_experts(fast, activation_key, w13_data, w13_scale, w2_data, w2_scale)
    return None if found is None else (*found, fast[2])


def moe_in_one_call(weight, activation) -> bool:
    """Whether a MoE layer with this pair runs in one C call here (`_moe_on_our_kernels`, up to the
    kernel's largest M): weight-only on every kernel, the activation keys in a format kernel's
    `MOE_ACTIVATIONS` (FP8 W8A8, NVFP4 W4A4), INT8 W8A8."""
    family = FORMAT_KERNELS.get(weight)
    if family is not None:
        return activation in family.MOE_ACTIVATIONS and family.available()[0]
    return weight in ACTIVATION_MODES and activation in ACTIVATIONS.get(weight, (None,)) and cpu_avx2.available()[0]


def _expert_matmul(x: torch.Tensor, weight: QTensor) -> torch.Tensor:
    return linear(x, weight, None, None).float()


def linear(x: torch.Tensor, weight: QTensor, activation, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias) -> [M, N] in x.dtype. Unprepared weights are prepared per
    call (correct; a copy per call where aten's layout is needed): the graph path prepares once.
    FP4 and FP8 formats: their kernel up to its largest M, the reference's dequantize + matmul above."""
    family = FORMAT_KERNELS.get(weight.key)
    if family is not None:
        if x.shape[0] > family.MAX_M:
            return reference.linear(x, weight, activation, bias)
        return family.linear(x, weight, activation, bias)  # it reads any layout prepare() would pass
    if activation not in ACTIVATIONS.get(weight.key, (None,)):
        raise ValueError(f"the cpu backend has no kernel for weight {weight.key} with activation {activation}")
    if activation is not None:
        x = fake_quantize(x, activation).to(x.dtype)
    weight = prepare_weight(Kind.LINEAR, weight)
    if x.shape[0] > kernel_max_m(weight):
        out = _large_m_matmul(x, weight)
    elif _on_our_kernel(weight):
        return _our_kernel(x, weight, bias)
    else:
        out = _aten_kernel(x, weight)
    if bias is not None:
        out = out + bias
    return out.to(x.dtype)


def _our_kernel(x: torch.Tensor, weight: QTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Our kernel with the bias added in it, in x.dtype (other dtypes go through fp32)."""
    if x.dtype not in cpu_avx2.DTYPES:
        return _our_kernel(x.float(), weight, None if bias is None else bias.float()).to(x.dtype)
    if bias is not None and bias.dtype not in cpu_avx2.DTYPES:
        bias = bias.float()
    mode = ACTIVATION_MODES[weight.key][0]
    return cpu_avx2.linear(x, weight.data, weight.scale, bias, mode=mode)


def _contiguous(weight: QTensor) -> QTensor:
    """Our kernels' layout: the quantized weight, contiguous, fp32 scales (no copy when it is so)."""
    weight = weight.contiguous()
    return weight if weight.scale.dtype == torch.float32 else replace(weight, scale=weight.scale.float())


def _large_m_matmul(x: torch.Tensor, weight: QTensor) -> torch.Tensor:
    """Above the kernels' largest M: a matmul on the dequantized weight. On our kernels' layout, the weight
    is dequantized CHUNK_BYTES at a time into a buffer kept per thread (csrc's qp_dequantize), each chunk
    multiplied into its columns of the output: a fresh full-size dequantized weight paid its page faults on
    every call (16 ms of a 4096x4096 INT8 weight's 17.5 ms, 2 ms once touched: bench/README.md, "The matmul
    above the kernels' largest M"). aten's layout: the whole weight, INT8's scale after the matmul."""
    dtype = x.dtype if NATIVE_LOW_PRECISION_MATMUL else torch.float32
    x = _padded(x, weight).to(dtype)
    if _on_our_kernel(weight):
        n, kp = weight.data.shape[0], x.shape[-1]
        rows = max(1, CHUNK_BYTES // (kp * dtype.itemsize))
        out = x.new_empty(x.shape[0], n)
        for first in range(0, n, rows):
            count = min(rows, n - first)
            chunk = cpu_avx2.dequantize(
                weight.data, weight.scale, first, _chunk_buffer(count * kp, dtype).view(count, kp)
            )
            torch.mm(x, chunk.t(), out=out[:, first : first + count])
        return out
    if weight.key == kInt8StaticChannelSym:  # a per-channel scale commutes with the matmul: scale [M, N]
        return F.linear(x, weight.data.to(dtype)) * weight.scale.reshape(-1).to(dtype)
    return F.linear(x, dequantize_int4(weight, dtype))


def _chunk_buffer(elements: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's buffer for `_large_m_matmul`'s dequantized chunks, grown to `elements` of `dtype` (at
    most CHUNK_BYTES, or one row where a row is larger)."""
    buffer = getattr(_CHUNKS, "buffer", None)
    if buffer is None or buffer.dtype != dtype or buffer.numel() < elements:
        buffer = _CHUNKS.buffer = torch.empty(elements, dtype=dtype)
    return buffer[:elements]


def dequantize_prepared(weight: QTensor, dtype: torch.dtype) -> torch.Tensor:
    """A weight in `prepare_weight`'s layout (MoE: stacked per expert) as dense [..., N, K]."""
    if weight.data.dim() == 3:
        return torch.stack([dequantize_prepared(weight[e], dtype) for e in range(weight.data.shape[0])])
    if not _is_aten_layout(weight):  # ours is the quantized weight itself
        return dequantize(weight, dtype)
    if weight.key == kInt8StaticChannelSym:
        dense = weight.data.to(dtype) * weight.scale.to(dtype).unsqueeze(-1)
    else:
        dense = dequantize_int4(weight, dtype)
    return dense[..., : weight.shape[-1]]


def dequantize_int4(weight: QTensor, dtype: torch.dtype) -> torch.Tensor:
    """A prepared INT4 weight as [N, Kp] in `dtype`: int8 arithmetic until one multiply by the scale."""
    if _is_aten_layout(weight):
        codes = unpack_int4_cpu(weight.data, weight.shape[0], weight.data.shape[-1] * 2)
        values, scale = codes.view(torch.int8) - 8, weight.scale[..., 0].t().to(dtype)  # [N, Kp/128]
    else:
        values, scale = unpack_int4(weight.data), weight.scale.to(dtype)
    return (values.unflatten(-1, (-1, GROUP)) * scale.unsqueeze(-1)).flatten(-2)


def _aten_kernel(x: torch.Tensor, weight: QTensor) -> torch.Tensor:
    # fp32 activations go in as bf16: the kernels' fp32 paths are 10-80x slower (bench/README.md,
    # "Measurements behind choices in the code") and the rounding costs nothing visible: 51 dB against
    # the exact product of the same quantized weight, where INT8/INT4 weights sit at ~40/~19 dB.
    x = _padded(x, weight).to(torch.bfloat16 if x.dtype == torch.float32 else x.dtype)
    scale = weight.scale.to(x.dtype)  # a no-op when the model runs in the weight's dtype
    if weight.key == kInt8StaticChannelSym:
        return torch._weight_int8pack_mm(x, weight.data, scale)
    return torch._weight_int4pack_mm_for_cpu(x, weight.data, GROUP, scale)


def _padded(x: torch.Tensor, weight: QTensor) -> torch.Tensor:
    """x with zero columns up to the prepared data's K (INT4: 128s, aten's INT8: 8s): they meet the padding."""
    cols = weight.data.shape[-1] * (2 if weight.key == kInt4StaticGroup128Sym else 1)
    return x if cols == x.shape[-1] else F.pad(x, (0, cols - x.shape[-1]))


def _is_aten_layout(weight: QTensor) -> bool:
    """aten's scales are [N] (INT8) or [Kp/128, N, 2] (INT4); quantpass's are 2-D."""
    return weight.scale.dim() != 2


def _on_our_kernel(weight: QTensor) -> bool:
    """Whether this prepared weight runs on quantpass's kernels: by its layout, fixed when prepared."""
    return not _is_aten_layout(weight) and cpu_avx2.available()[0]


# weight key -> (bits, activation mode, most rows, the activation key a MoE layer quantizes per token in
# qp_moe or "", most rows of a linear): our kernels' table, for `_moe_experts` and the graph ops (cpu_graph.py,
# and in C++)
_FAST = {
    str(key): (
        BITS[key],
        cpu_avx2.MODES[ACTIVATION_MODES[key][0]],
        OURS_MAX_M[key],
        next((str(a) for a in ACTIVATIONS.get(key, ()) if a is not None), ""),
        LINEAR_MAX_M[key],
    )
    for key in ACTIVATION_MODES
}


# The graph ops (cpu_graph.py) call back into `linear` and the MoE paths above.
from .cpu_graph import graph_linear_op, graph_moe_op, graph_tables  # noqa: E402, F401
