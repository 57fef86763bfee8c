"""The `cpu` backend: weight-only CPU kernels for decode, dequantize + matmul above (and INT8 W8A8
through the same kernels on fake-quantized activations).

- On x86-64 AVX2 CPUs without AVX-512: quantpass's own kernels (cpu_avx2.py, csrc/linear_avx2.c),
  faster than aten's here (INT4 1.35-1.9x, INT8 1.1-1.7x). INT8 reads aten's layout below;
  INT4 has its own, marked by a scale of [N, K/128, 1] fp32.
- INT8 per-channel elsewhere: `torch._weight_int8pack_mm(x, int8 [N, K], scales [N])`.
- INT4 group-128 elsewhere (or `QUANTPASS_CPU_KERNEL=0`): `torch._weight_int4pack_mm_for_cpu(x,
  packed, 128, scale_and_zeros [K/128, N, 2])` on `torch._convert_weight_to_int4pack_for_cpu`'s
  layout; it computes (q - 8) * scale + zero, so our codes (value + 8) go in as they are, zero 0.

The kernels are fast at small M and scale badly with M, so `linear` switches on M at run time (this
is an opaque custom op, the branch costs nothing in a graph): up to `kernel_max_m(weight)` rows the
kernel, above that dequantize + one matmul. `fused_moe` is the reference's per-expert loop with
these kernels per expert (at decode, an expert sees a few rows: the kernels' best case).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from ..quant_registry.formats import dequantize, unpack_int4
from ..quant_registry.keys import kInt4StaticGroup128Sym, kInt8DynamicTokenSym, kInt8StaticChannelSym
from ..quant_registry.qtensor import QTensor
from . import cpu_avx2, reference
from .reference import fake_quantize

logger = logging.getLogger("quantpass")

DEVICES = "cpu"
KERNELS = {
    kInt8StaticChannelSym: ("_weight_int8pack_mm",),
    kInt4StaticGroup128Sym: ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu"),
}
# INT8 W8A8 runs the same kernels on per-token fake-quantized activations: identical math to an
# int8 x int8 GEMM with both scales in the epilogue, but torch._int_mm on this CPU took 1570 ms at
# M=128 (4096x4096, 1 thread, 2026-11-29) against 144 ms for the dequantize path.
ACTIVATIONS = {kInt8StaticChannelSym: (None, kInt8DynamicTokenSym)}
GROUP = 128  # INT4 scale group along K
# torch._weight_int8pack_mm (torch 2.13, AVX2) reads K in steps of 8: with K % 8 != 0 it segfaulted
# (M = 7, K = 292, 300, 308) or returned inf/NaN (M = 1, K = 300), measured 2026-11-29. Prepared
# INT8 weights carry zero columns up to a multiple of 8; x gets matching zero columns per call.
INT8_K_MULTIPLE = 8

# Largest M for which the aten kernel beats dequantize + matmul, per weight key. Measured 2026-11-29
# on this machine: AMD EPYC, AVX2 only (no AVX512-BF16/AMX), torch 2.13, 4096x4096, bf16 x, 1 thread
# (the 2 cores were shared with other jobs at load ~4: 2-thread timings stalled in thread barriers),
# median ms of 11 interleaved rounds (5 for M >= 128):
#   M                  1     2     4     8    16    32   128   192   256   384
#   bf16 F.linear    9.3  12.2  25.0  56.4  87.4 141.8
#   fp32 F.linear    7.7  10.1  22.7  22.4  20.7  28.0
#   INT8 kernel      3.9   3.8   5.7  10.9  23.6  27.2   106   172   349   677
#   INT8 deq+fp32   52.7  48.1  60.4  70.7  50.3  57.5   102   143   194   466
#   INT4 kernel      3.8   3.7   5.9  11.6  17.0  29.6   122   241   347   694
#   INT4 deq+fp32    141   122   126   149   123   108   149   243   301   565
# No crossover for M <= 32 here (the kernels win 2-20x); it sits near 128 (INT8) and 192 (INT4).
KERNEL_MAX_M = {kInt8StaticChannelSym: 128, kInt4StaticGroup128Sym: 192}
# quantpass's INT4 kernel (cpu_avx2.py) against aten's and dequantize + fp32 matmul, 4096x4096, bf16 x,
# median ms, 2026-11-29 22:02 UTC (quiet machine), `python bench/cpu_m_sweep.py --threads 1 2`. It
# beats aten's at every M and dequantize + matmul up to ~400 (1 thread) / ~500 (2 threads) rows:
#   M                         1      8     32    128    256    384    512
#   1 thread:  ours         1.21   4.76   19.3   77.4    155    239    327
#              aten         2.25   7.35   29.2    117    234    351    468
#              deq+fp32     67.6   78.9   89.7    132    187    244    307
#   2 threads: ours         0.62   2.38    9.5   38.5   79.9    121    174
#              deq+fp32     41.9   51.9   57.8   81.7    111    142    170
# quantpass's INT8 kernel, same measure (2026-11-29 23:20 UTC, `cpu_m_sweep.py --format int8`): 1.1-1.2x
# aten's at M=1 (memory-bound: 16 MB), 1.5-1.7x from M=8; dequantize + matmul wins from ~512 rows:
#   M                         1      8     32    128    256    384    512    768
#   1 thread:  ours         1.49   4.31   16.7   64.5    131    204    284    593
#              aten         1.82   6.75   28.4    108    219    320    434    662
#              deq+fp32     30.0   44.2   57.6    105    160    231    300    436
#   2 threads: ours         0.77   2.19   8.62   32.6   66.4    109    158    307
#              deq+fp32     19.3   31.5   39.0   65.0   99.0    135    166    258
AVX2_MAX_M = {kInt8StaticChannelSym: 384, kInt4StaticGroup128Sym: 384}

# The matmul above the threshold runs in x.dtype only where the CPU multiplies bf16/fp16 natively
# (AMX, AVX512-BF16); on AVX2 a bf16 GEMM is 5x slower than fp32 at M=32 (table above): upcast.
NATIVE_LOW_PRECISION_MATMUL = bool(
    getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    or getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
)


def supports(kind, capability, weight, activation, problem) -> tuple[bool, str]:
    if kind not in ("linear", "moe"):
        return False, f"no cpu kernel for site kind {kind!r}"
    if capability.device != "cpu":
        return False, f"aten's weight-only CPU kernels run on cpu, not {capability.device}"
    if activation not in ACTIVATIONS.get(weight, (None,)):
        return False, f"no CPU kernel for weight {weight} with activation {activation}"
    loop = "per-expert loop: " if kind == "moe" else ""
    fake = "" if activation is None else ", activations fake-quantized per token"
    ours, name = cpu_avx2.available()
    if ours and weight in AVX2_MAX_M:
        bits = "INT8" if weight == kInt8StaticChannelSym else "INT4"
        return True, f"{loop}{bits} on {name} for M <= {AVX2_MAX_M[weight]}, dequantize + matmul above{fake}"
    ops = KERNELS.get(weight)
    if ops is None:
        return False, f"no CPU kernel for weight {weight}; valid: {', '.join(sorted(map(str, KERNELS)))}"
    missing = [op for op in ops if not hasattr(torch, op)]
    if missing:
        return False, f"torch {torch.__version__} has no torch.{missing[0]}"
    rows = (problem.n,) if kind == "linear" else (2 * problem.n, problem.k)  # MoE: w13 [2I, H], w2 [H, I]
    odd = [n for n in rows if n % 16]
    if weight == kInt4StaticGroup128Sym and odd:
        return False, f"torch._convert_weight_to_int4pack_for_cpu needs N % 16 == 0; got N={odd[0]}"
    return True, f"{loop}torch.{ops[0]} for M <= {KERNEL_MAX_M[weight]}, dequantize + matmul above{fake}"


def kernel_max_m(weight: QTensor) -> int:
    """Largest M that runs the kernel for this prepared weight (above: dequantize + matmul)."""
    if _on_avx2_kernel(weight):
        return AVX2_MAX_M[weight.key]
    if weight.key == kInt4StaticGroup128Sym and _int4_layout() is None:
        return 1 << 62  # aten's INT4 layout can't be read back here: the kernel at every M
    return KERNEL_MAX_M[weight.key]


def prepare_weight(kind: str, weight: QTensor) -> QTensor:
    """The kernels' layout. INT8: data [N, K rounded up to 8] (zero columns), scale [N] in the
    weight's dtype (aten's kernel wants x.dtype). INT4 with quantpass's kernel: data [N, Kp/2] in
    `cpu_avx2.pack`'s order, scale [N, Kp/128, 1] fp32. INT4 on aten's: data [N, Kp/2] uint8 in the
    CPU packed layout, scale [Kp/128, N, 2] = (scale, 0) in the weight's dtype. Only one layout is
    kept: the large-M path unpacks it, so memory stays 0.5 byte per weight plus scales.
    """
    if _is_prepared(weight):
        return weight
    dtype = weight.dtype
    if weight.key == kInt8StaticChannelSym:
        data = F.pad(weight.data, (0, -weight.data.shape[-1] % INT8_K_MULTIPLE)).contiguous()
        return QTensor(data, weight.scale.reshape(-1).to(dtype), None, weight.key, weight.shape, dtype)
    if weight.key != kInt4StaticGroup128Sym:
        raise ValueError(f"cpu backend can't prepare {weight.key}; valid: {', '.join(sorted(map(str, KERNELS)))}")
    codes = (unpack_int4(weight.data).to(torch.int32) + 8).contiguous()  # [N, Kp] in [1, 15]
    if cpu_avx2.available()[0]:
        scale = weight.scale.to(torch.float32).unsqueeze(-1).contiguous()
        return QTensor(cpu_avx2.pack(codes.to(torch.uint8)), scale, None, weight.key, weight.shape, dtype)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
    scale = weight.scale.t().to(dtype)  # [Kp/128, N]
    scale_and_zeros = torch.stack([scale, torch.zeros_like(scale)], dim=-1).contiguous()
    return QTensor(packed, scale_and_zeros, None, weight.key, weight.shape, dtype)


def prepare_moe_weights(w13: QTensor, w2: QTensor, gate_up_layout: str) -> tuple[QTensor, QTensor]:
    """Each expert in `prepare_weight`'s layout, stacked: [E, ...] data and scales."""
    return _prepare_experts(w13), _prepare_experts(w2)


def _prepare_experts(weight: QTensor) -> QTensor:
    if _is_prepared(weight[0]):
        return weight
    experts = [prepare_weight("moe", weight[e]) for e in range(weight.data.shape[0])]
    data, scale = torch.stack([p.data for p in experts]), torch.stack([p.scale for p in experts])
    return QTensor(data, scale, None, weight.key, weight.shape, weight.dtype)


def fused_moe(*args) -> torch.Tensor:
    """hidden [T, H] -> [T, H], arguments as `reference.fused_moe`: its loop, with `linear`'s
    kernels per expert (activation keys are fake-quantized by the loop, as the reference does)."""
    return reference.fused_moe(*args, expert_matmul=_expert_matmul)


def _expert_matmul(x: torch.Tensor, weight: QTensor) -> torch.Tensor:
    return linear(x, weight, None, None).float()


def linear(x: torch.Tensor, weight: QTensor, activation, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias) -> [M, N] in x.dtype. Unprepared weights are prepared per
    call (correct, slow): the graph path prepares once."""
    if activation not in ACTIVATIONS.get(weight.key, (None,)):
        raise ValueError(f"the cpu backend has no kernel for weight {weight.key} with activation {activation}")
    if activation is not None:
        x = fake_quantize(x, activation).to(x.dtype)
    weight = prepare_weight("linear", weight)
    if x.shape[0] <= kernel_max_m(weight):
        out = _kernel(x, weight)
    else:
        out = _dequantized_matmul(x, weight)
    if bias is not None:
        out = out + bias
    return out.to(x.dtype)


def _dequantized_matmul(x: torch.Tensor, weight: QTensor) -> torch.Tensor:
    dtype = x.dtype if NATIVE_LOW_PRECISION_MATMUL else torch.float32
    x = _padded(x, weight).to(dtype)
    if weight.key == kInt8StaticChannelSym:  # a per-channel scale commutes with the matmul: scale [M, N]
        return F.linear(x, weight.data.to(dtype)) * weight.scale.to(dtype)
    return F.linear(x, dequantize_int4(weight, dtype))


def dequantize_prepared(weight: QTensor, dtype: torch.dtype) -> torch.Tensor:
    """A weight in `prepare_weight`'s layout (MoE: stacked per expert) as dense [..., N, K]."""
    if weight.data.dim() == 3:
        return torch.stack([dequantize_prepared(weight[e], dtype) for e in range(weight.data.shape[0])])
    if not _is_prepared(weight):
        return dequantize(weight, dtype)
    if weight.key == kInt8StaticChannelSym:
        dense = weight.data.to(dtype) * weight.scale.to(dtype).unsqueeze(-1)
    else:
        dense = dequantize_int4(weight, dtype)
    return dense[..., : weight.shape[-1]]


def dequantize_int4(weight: QTensor, dtype: torch.dtype) -> torch.Tensor:
    """A prepared INT4 weight as [N, Kp] in `dtype`: int8 arithmetic until one multiply by the scale."""
    if _is_avx2_int4(weight):
        codes, scale = cpu_avx2.unpack(weight.data), weight.scale[..., 0].to(dtype)
    else:
        codes = unpack_int4_cpu(weight.data, weight.shape[0], weight.data.shape[-1] * 2)
        scale = weight.scale[..., 0].t().to(dtype)  # [N, Kp/128]
    values = codes.view(torch.int8) - 8
    return (values.unflatten(-1, (-1, GROUP)) * scale.unsqueeze(-1)).flatten(-2)


def _kernel(x: torch.Tensor, weight: QTensor) -> torch.Tensor:
    if not _on_avx2_kernel(weight):
        return _aten_kernel(x, weight)
    scale = weight.scale[..., 0] if _is_avx2_int4(weight) else weight.scale.to(torch.float32)
    return cpu_avx2.linear(_padded(x, weight), weight.data, scale)


def _aten_kernel(x: torch.Tensor, weight: QTensor) -> torch.Tensor:
    # fp32 activations go in as bf16: the kernels' fp32 paths are 10-80x slower (4096x4096, 1 thread,
    # 2026-11-29: INT8 M=1 15.1 -> 1.6 ms, INT4 M=1 77 -> 2.2 ms, INT4 M=16 1237 -> 14.7 ms) and the
    # rounding costs nothing visible: 51 dB against the exact product of the same quantized weight,
    # where INT8/INT4 weights themselves sit at ~40/~19 dB against the original.
    x = _padded(x, weight).to(torch.bfloat16 if x.dtype == torch.float32 else x.dtype)
    scale = weight.scale.to(x.dtype)  # a no-op when the model runs in the weight's dtype
    if weight.key == kInt8StaticChannelSym:
        return torch._weight_int8pack_mm(x, weight.data, scale)
    return torch._weight_int4pack_mm_for_cpu(x, weight.data, GROUP, scale)


def _padded(x: torch.Tensor, weight: QTensor) -> torch.Tensor:
    """x with zero columns up to the prepared data's K (INT4: 128s, INT8: 8s): they meet the padding."""
    cols = weight.data.shape[-1] * (2 if weight.key == kInt4StaticGroup128Sym else 1)
    return x if cols == x.shape[-1] else F.pad(x, (0, cols - x.shape[-1]))


def _is_prepared(weight: QTensor) -> bool:
    return weight.scale.dim() == (1 if weight.key == kInt8StaticChannelSym else 3)


def _is_avx2_int4(weight: QTensor) -> bool:
    return weight.key == kInt4StaticGroup128Sym and weight.scale.dim() == 3 and weight.scale.shape[-1] == 1


def _on_avx2_kernel(weight: QTensor) -> bool:
    """Whether this prepared weight runs on quantpass's kernels: INT4 by its layout (fixed when
    prepared), INT8 (aten's layout, read by both) whenever they are available."""
    return _is_avx2_int4(weight) or (weight.key == kInt8StaticChannelSym and cpu_avx2.available()[0])


# --- Reading `_convert_weight_to_int4pack_for_cpu`'s layout back (aten/src/ATen/native/cpu/
# int4mm_kernel.cpp, weight_to_int4pack_kernel). Rows go in blocks of BLOCK_N = 4 x the float vector
# width (64 with AVX512, 32 with AVX2); block i is a [K, rows_i / 2] byte matrix. A full block on
# AVX512/AVX2 puts row q in byte q's low nibble and row rows/2 + q in its high nibble ("halves"); a
# short last block (and every block without AVX) pairs rows 2j, 2j + 1 ("pairs"). Verified here
# (AVX2): N=64 -> bytes[k*16 + j] = w[j, k] | w[16 + j, k] << 4 per 32-row block, and a 16-row tail
# as pairs. Which layout this process's torch uses is found once by packing a probe.
LAYOUTS = ((64, "halves"), (32, "halves"), (16, "pairs"), (32, "pairs"), (64, "pairs"))


def unpack_int4_cpu(packed: torch.Tensor, rows: int, cols: int, layout: tuple[int, str] | None = None) -> torch.Tensor:
    """CPU-packed int4 [N, K/2] -> codes [N, K] uint8 (value + 8), in our row order."""
    block, full_block = layout or _int4_layout()
    flat = packed.reshape(-1)
    full_rows = rows // block * block
    parts = []
    if full_rows:
        body = flat[: full_rows * cols // 2].view(full_rows // block, cols, block // 2)
        parts.append(_unpack_blocks(body, full_block))
    if rows > full_rows:
        tail = flat[full_rows * cols // 2 :].view(1, cols, (rows - full_rows) // 2)
        parts.append(_unpack_blocks(tail, "pairs"))
    return torch.cat(parts)


def _unpack_blocks(blocks: torch.Tensor, order: str) -> torch.Tensor:
    """[blocks, K, rows/2] bytes -> [blocks * rows, K] codes (cat/stack write the row order)."""
    low, high = (blocks & 0xF).transpose(1, 2), (blocks >> 4).transpose(1, 2)  # [blocks, rows/2, K]
    if order == "halves":
        codes = torch.cat([low, high], dim=1)  # row q, then row rows/2 + q
    else:
        codes = torch.stack([low, high], dim=2)  # rows 2j, 2j + 1
    return codes.reshape(-1, blocks.shape[1])


@functools.cache
def _int4_layout() -> tuple[int, str] | None:
    """The (BLOCK_N, full-block order) this torch packs with: the first of LAYOUTS that reads a
    random probe (112 = 64 + 48 = 3 x 32 + 16 rows: full blocks and a short one) back exactly;
    None if none does (then INT4 stays on the aten kernel at every M)."""
    codes = torch.randint(0, 16, (112, 256), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
    for layout in LAYOUTS:
        if torch.equal(unpack_int4_cpu(packed, 112, 256, layout).to(torch.int32), codes):
            return layout
    logger.info(
        "torch %s packs int4 for CPU in a layout quantpass can't read back (tried %s): INT4 uses "
        "torch._weight_int4pack_mm_for_cpu at every M",
        torch.__version__,
        LAYOUTS,
    )
    return None
