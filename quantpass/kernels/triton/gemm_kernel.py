"""One parametrised Triton GEMM kernel for every quantized pair, dense or routed (MoE experts); its
host side (operand checks, the per-weight plan, config choice, launch) is `gemm.py`.

C[M, N] = A[M, K] @ B[N, K]^T with A the activation (float, or FP8 / INT8 from `quant.py`) and B a
quantized weight in the layout `formats.quantize` produces (K padded to the key's group, 4-bit
elements packed two per byte along K, low nibble first). `scheme.GemmScheme` turns the key pair
into constexpr flags; Triton compiles one specialisation per flag set, so a flag costs nothing at
run time. Where each scale is applied:

- per-row / per-tensor scales (A's per-token, B's per-channel, NVFP4's global) in the epilogue;
- 1x128 activation groups and 128x128 weight blocks once per K step, on that step's partial
  product (BLOCK_K divides the groups so a step never straddles two);
- MX e8m0 scales by `tl.dot_scaled` itself (native on SM100, upcast by Triton below);
- weight-only K-group scales (INT4 per 128, NVFP4 per 16) on the dequantized tile before `tl.dot`.

Routed mode (fused MoE, docs/design.md §6): rows come from `moe_align`'s `sorted_ids` (pair ids
`token * top_k + slot`, padded per expert with the sentinel `num_pairs`), each BLOCK_M block reads
one expert's weights (`expert_ids`; -1 = the expert lives elsewhere: the block writes zeros), A's
row is `pair // TOP_K`, C's row is the pair. Row and expert offsets are int64: `pair * stride` and
`expert * stride_be` pass 2^31 at real sizes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .elements import e2m1_to_float, to_output, unpack_nibbles
from .scheme import FP8_PROMOTE_K as _FP8_PROMOTE_K

FP8_PROMOTE_K = tl.constexpr(_FP8_PROMOTE_K)  # a global a compiled kernel reads must be a constexpr


@triton.jit
def gemm_kernel(
    a_ptr,  # [M or T, K_A]: float, fp8 or int8
    a_scale_ptr,  # row: [M, 1] / [1, 1]; group, mx: [M, K / group]
    b_ptr,  # [E?, N, K] (4-bit: [E?, N, K / 2] uint8)
    b_scale_ptr,  # row: [E?, N or 1, 1]; block / group / mx: [E?, N / rows, K / cols]
    b_scale2_ptr,  # [E?, 1, 1] fp32 (NVFP4 global scale)
    bias_ptr,  # [E?, N]
    c_ptr,  # [M, N]
    sorted_ids_ptr,  # routed: [EM] int32 pair ids grouped by expert
    expert_ids_ptr,  # routed: [EM / BLOCK_M] int32 local expert per block, -1 = not local
    num_padded_ptr,  # routed: [1] int32 slots in use
    router_weights_ptr,  # routed: [M] (topk_weights flattened), multiplied in fp32 before the cast
    M,  # rows of C (routed: token-expert pairs; also the padding sentinel)
    N,  # columns of C (gated: half of B's rows)
    K,  # B's K in elements, padded to its group: the loop's extent
    K_A,  # columns A holds (a float A is not padded: loads past it read 0)
    EM,  # rows to walk: M (dense) or len(sorted_ids) (routed)
    stride_am,
    stride_ak,
    stride_asm,  # 0 for a per-tensor scale
    stride_ask,
    stride_be,
    stride_bn,
    stride_bk,  # along K, in bytes for packed 4-bit data
    stride_bse,
    stride_bsn,  # 0 for a per-tensor scale
    stride_bsk,
    stride_bs2e,
    stride_biase,
    stride_cm,
    stride_cn,
    stride_ck,  # split-K: C is a [SPLIT_K, M, N] fp32 workspace, one slice per K range (summed by the launcher)
    alpha,  # swigluoai
    limit,
    A_FORMAT: tl.constexpr,
    A_SCALE: tl.constexpr,
    B_FORMAT: tl.constexpr,
    B_SCALE: tl.constexpr,
    MODE: tl.constexpr,
    A_GROUP_K: tl.constexpr,
    B_GROUP_N: tl.constexpr,
    B_GROUP_K: tl.constexpr,
    HAS_SCALE2: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUTED: tl.constexpr,
    TOP_K: tl.constexpr,  # pairs per A row (routed)
    MUL_ROUTER_WEIGHT: tl.constexpr,
    ACTIVATION: tl.constexpr,  # "none", or the MoE gated activation fused into the epilogue (GEMM1)
    GATE_UP_LAYOUT: tl.constexpr,  # "concat": B = [gate; up]; "interleaved": gate rows even, up rows odd
    DOT_FORMAT: tl.constexpr,  # dot_scaled's A format ("e4m3", "bf16", "fp16"); dequant: "fp32" or A's type
    EXACT: tl.constexpr,  # interpreter: round the output cast by hand (elements.py)
    FP32_PRECISION: tl.constexpr,  # fp32 x fp32 dots (dequant of fp32 activations): "ieee" or "tf32", torch's setting
    SPLIT_K: tl.constexpr,  # programs along K (decode): grid axis 1; 1 = the whole K in one program
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped launch order: GROUP_M row blocks share each column block, so B tiles are reused from L2.
    OUT_N: tl.constexpr = BLOCK_N // 2 if ACTIVATION != "none" else BLOCK_N  # C columns per program
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(EM, BLOCK_M)
    num_pid_n = tl.cdiv(N, OUT_N)
    first_pid_m = (pid // (GROUP_M * num_pid_n)) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % (GROUP_M * num_pid_n)) % group_size_m
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size_m

    offs_out = pid_n * OUT_N + tl.arange(0, OUT_N)  # C's columns
    if ACTIVATION != "none":  # B rows of the tile: OUT_N gate rows, then the matching OUT_N up rows
        tile_col = tl.arange(0, BLOCK_N)
        out_col = pid_n * OUT_N + tile_col % OUT_N
        is_up = (tile_col >= OUT_N).to(tl.int32)
        offs_n = out_col + is_up * N if GATE_UP_LAYOUT == "concat" else 2 * out_col + is_up
        n_mask = out_col < N
    else:
        offs_n = offs_out
        n_mask = offs_out < N
    # int64 before any product with a stride: B's row offset n * K passes 2^31 at N * K >= 2^31 (an output
    # head of 262k x 8192), and so do the scale offsets of wide weights.
    offs_n = offs_n.to(tl.int64)
    if ROUTED:
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < M
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        c_ptrs = c_ptr + rows[:, None] * stride_cm + offs_out[None, :].to(tl.int64) * stride_cn
        c_mask = row_mask[:, None] & (offs_out[None, :] < N)
        if expert == -1:  # not a local expert: its pairs contribute zeros (expert parallelism)
            tl.store(c_ptrs, tl.zeros((BLOCK_M, OUT_N), dtype=c_ptr.dtype.element_ty), mask=c_mask)
            return
        a_rows = rows // TOP_K
    else:
        rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        expert = 0
        c_ptrs = c_ptr + rows[:, None] * stride_cm + offs_out[None, :].to(tl.int64) * stride_cn
        c_mask = row_mask[:, None] & (offs_out[None, :] < N)
        a_rows = rows
    a_ptrs = a_ptr + a_rows[:, None] * stride_am
    b_base = b_ptr + expert * stride_be
    b_scale_base = b_scale_ptr + expert * stride_bse

    # Split-K (decode): program pid_k walks its own whole BLOCK_K steps of K; its C is slice pid_k.
    pid_k = tl.program_id(1)
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    c_ptrs += pid_k.to(tl.int64) * stride_ck
    # FP8 accumulation policy (scheme.FP8_PROMOTE_K): partial sums move from the tensor cores' FP8
    # accumulator into the fp32 one at least every 128 K (sm90's default is never, over all of K).
    PROMOTE_K: tl.constexpr = FP8_PROMOTE_K if BLOCK_K > FP8_PROMOTE_K else BLOCK_K

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32 if A_FORMAT == "int8" else tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptrs + offs_k[None, :] * stride_ak, mask=row_mask[:, None] & (offs_k[None, :] < K_A), other=0.0)
        if B_FORMAT == "int4" or B_FORMAT == "e2m1":  # [BLOCK_K / 2, BLOCK_N] bytes
            offs_kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            b_mask = (offs_kb[:, None] < K // 2) & n_mask[None, :]
            b = tl.load(b_base + offs_kb[:, None] * stride_bk + offs_n[None, :] * stride_bn, mask=b_mask, other=0.0)
        else:  # [BLOCK_K, BLOCK_N]: B^T's tile, read from B's rows
            b_mask = (offs_k[:, None] < K) & n_mask[None, :]
            b = tl.load(b_base + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn, mask=b_mask, other=0.0)
        if MODE == "dot_scaled":
            offs_ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            ks_mask = offs_ks < K // 32
            b_scale_ptrs = b_scale_base + offs_n[:, None] * stride_bsn + offs_ks[None, :] * stride_bsk
            b_s = tl.load(b_scale_ptrs, mask=n_mask[:, None] & ks_mask[None, :], other=127)  # 127: 2^0
            a_s = None
            if A_SCALE == "mx":
                a_scale_ptrs = a_scale_ptr + a_rows[:, None] * stride_asm + offs_ks[None, :] * stride_ask
                a_s = tl.load(a_scale_ptrs, mask=row_mask[:, None] & ks_mask[None, :], other=127)
            acc = tl.dot_scaled(a, a_s, DOT_FORMAT, b, b_s, "e2m1" if B_FORMAT == "e2m1" else "e4m3", acc)
        elif MODE == "dot":
            if A_SCALE == "group" or B_SCALE == "block":  # this K step's scales, on its partial product
                # (a fresh accumulator per step: FP8 partial sums reach fp32 every BLOCK_K <= 128)
                step = tl.dot(a, b).to(tl.float32)
                if A_SCALE == "group":
                    a_s = tl.load(a_scale_ptr + a_rows * stride_asm + (k0 // A_GROUP_K) * stride_ask, mask=row_mask)
                    step = step * a_s[:, None]
                if B_SCALE == "block":
                    b_scale_ptrs = b_scale_base + (offs_n // B_GROUP_N) * stride_bsn + (k0 // B_GROUP_K) * stride_bsk
                    step = step * tl.load(b_scale_ptrs, mask=n_mask)[None, :]
                acc += step
            elif A_FORMAT == "fp8":
                acc = tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE_K)
            else:  # int8: int32 accumulation (Triton 3.6 wants out_dtype to say so; found by triton_aot.py)
                acc = tl.dot(a, b, acc, out_dtype=acc.dtype)
        else:  # dequant: decode B's tile to fp32, apply its K-group scales, then an ordinary dot
            if B_FORMAT == "int4":
                w = (unpack_nibbles(b).to(tl.int32) - 8).to(tl.float32)
            elif B_FORMAT == "e2m1":
                w = e2m1_to_float(unpack_nibbles(b))
            else:
                w = b.to(tl.float32)
            if B_SCALE == "group" or B_SCALE == "block":  # the step's [groups, BLOCK_N] scales, broadcast over K
                # (one scale per element was a [BLOCK_K, BLOCK_N] fp32 load: 3x the shared memory of the
                # INT4 tile itself, over 227 KiB in some configs; tests/triton_aot.py measures it)
                STEP_GROUPS: tl.constexpr = BLOCK_K // B_GROUP_K if BLOCK_K > B_GROUP_K else 1
                offs_g = k0 // B_GROUP_K + tl.arange(0, STEP_GROUPS)
                group_ptrs = (offs_n[None, :] // B_GROUP_N) * stride_bsn + offs_g[:, None] * stride_bsk
                g_mask = (offs_g[:, None] < tl.cdiv(K, B_GROUP_K)) & n_mask[None, :]
                scales = tl.load(b_scale_base + group_ptrs, mask=g_mask, other=0.0).to(tl.float32)
                w = tl.reshape(w, (STEP_GROUPS, BLOCK_K // STEP_GROUPS, BLOCK_N)) * scales[:, None, :]
                w = tl.reshape(w, (BLOCK_K, BLOCK_N))
            if DOT_FORMAT == "fp32":  # fp32 activations, or the interpreter (its bf16 dot is broken)
                acc = tl.dot(a.to(tl.float32), w, acc, input_precision=FP32_PRECISION)
            else:
                acc = tl.dot(a, w.to(a.dtype), acc)

    acc = acc.to(tl.float32)
    if A_SCALE == "row":
        acc = acc * tl.load(a_scale_ptr + a_rows * stride_asm, mask=row_mask, other=0.0)[:, None]
    if B_SCALE == "row":
        acc = acc * tl.load(b_scale_base + offs_n * stride_bsn, mask=n_mask, other=0.0)[None, :]
    if HAS_SCALE2:
        acc = acc * tl.load(b_scale2_ptr + expert * stride_bs2e)
    if HAS_BIAS:  # split-K: once, in slice 0
        bias = tl.load(bias_ptr + expert * stride_biase + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc = acc + bias[None, :] * (pid_k == 0).to(tl.float32)
    if MUL_ROUTER_WEIGHT:  # after the bias, as the reference does: y = (x @ w2^T + b2) * weight
        acc = acc * tl.load(router_weights_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    if ACTIVATION != "none":  # [BM, gate | up] -> act(gate) * up, in fp32 as the reference
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, OUT_N)), (0, 2, 1)))
        acc = _gated_activation(gate, up, ACTIVATION, alpha, limit)
    tl.store(c_ptrs, to_output(acc, c_ptr.dtype.element_ty, EXACT), mask=c_mask)


@triton.jit
def _gated_activation(gate, up, ACTIVATION: tl.constexpr, alpha, limit):
    """[BM, OUT_N] gate and up projections (fp32) -> the MoE activation, as `reference.gated_activation`."""
    if ACTIVATION == "silu":
        out = gate * tl.sigmoid(gate) * up
    elif ACTIVATION == "gelu":  # erf form, as F.gelu
        out = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476)) * up
    elif ACTIVATION == "gelu_tanh":  # 0.5 * (1 + tanh(u)) == sigmoid(2u), u = sqrt(2/pi) * (g + 0.044715 g^3)
        out = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)) * up
    elif ACTIVATION == "silu_clamped":  # DeepSeek-V4: silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        out = gate * tl.sigmoid(gate) * up
    else:  # swigluoai (GPT-OSS): clamped, (up + 1) * gate * sigmoid(alpha * gate)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        out = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    return out
