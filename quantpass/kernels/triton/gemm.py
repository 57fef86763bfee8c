"""One parametrised GEMM kernel for every quantized pair, dense or routed (MoE experts).

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

import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ... import envs
from ...moe_problem import ACTIVATIONS, GATE_UP_LAYOUTS
from ...quant_registry.qtensor import QTensor
from . import tuning
from .elements import e2m1_to_float, to_output, unpack_nibbles
from .scheme import FP8_PROMOTE_K as _FP8_PROMOTE_K
from .scheme import Element, GemmMode, GemmScheme, ScaleMode, constexpr_flags, gemm_scheme

FP8_PROMOTE_K = tl.constexpr(_FP8_PROMOTE_K)  # a global a compiled kernel reads must be a constexpr


@triton.jit
def _gemm_kernel(
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
    else:  # swigluoai (GPT-OSS): clamped, (up + 1) * gate * sigmoid(alpha * gate)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        out = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    return out


def quantized_matmul(
    a: torch.Tensor | QTensor,
    weight: QTensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    routing=None,
    router_weights: torch.Tensor | None = None,
    activation: str | None = None,
    gate_up_layout: str = "concat",
    alpha: float = 1.702,
    limit: float = 7.0,
    config: dict | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """a [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in `out_dtype` (default: a's float dtype).

    `a` is a float tensor (weight-only and MX x BF16 pairs) or the QTensor `quantize_activation`
    returns. Routed (fused MoE): `weight` is [E, N, K], `bias` [E, N], `routing` a
    `moe_align.Routing` over pairs `token * top_k + slot`; a has one row per token (or per pair) and
    the result has one row per pair, scaled by `router_weights` [pairs] when given. `activation`
    (MoE GEMM1) fuses the gated activation into the epilogue: the weight's N rows are gate and up
    projections in `gate_up_layout` and the result has N / 2 columns. `config`
    (BLOCK_M/N/K, GROUP_M, num_warps, num_stages) is required when routed (BLOCK_M = the routing's).
    `split_k` (dense only) splits K over that many programs, summed in fp32 after the kernel;
    default `tuning.split_k` (decode shapes on CUDA).
    """
    a_data, a_scale, a_key = (a.data, a.scale, a.key) if isinstance(a, QTensor) else (a, None, None)
    routed = routing is not None
    out_dtype = out_dtype or (a.dtype if isinstance(a, QTensor) else a_data.dtype)
    top_k = int(routing.num_pairs // max(a_data.shape[0], 1)) if routed else 1  # a constexpr: a plain int
    plan = _plan(weight, a_key, a_data, out_dtype, bias, routed, top_k, router_weights is not None, activation, gate_up_layout)  # fmt: skip
    n, k = plan.n, plan.k
    a_cols = a.shape[-1] if isinstance(a, QTensor) else a_data.shape[-1]
    if a_data.dim() != 2:
        raise ValueError(f"the GEMM wants a 2-D A, got {tuple(a_data.shape)}")
    if a_cols != k:
        raise ValueError(f"A has K={a_cols} but the weight {tuple(weight.shape)} has K={k}")
    if a_data.device != weight.data.device:
        raise ValueError(f"A is on {a_data.device}, the weight on {weight.data.device}")
    if plan.a_to_bf16:
        a_data = a_data.to(torch.bfloat16)  # dot_scaled takes bf16/fp16 beside MX operands
    if bias is not None and tuple(bias.shape) != plan.bias_shape:
        raise ValueError(f"bias of shape {tuple(bias.shape)}, expected {plan.bias_shape}")
    rows = routing.num_pairs if routed else a_data.shape[0]
    interpret = plan.flags["EXACT"]
    if routed:
        if config is None or config["BLOCK_M"] != routing.block_m:
            raise ValueError("a routed GEMM needs a config whose BLOCK_M is the routing's block_m")
        if rows % max(a_data.shape[0], 1):
            raise ValueError(f"{rows} pairs is not a multiple of A's {a_data.shape[0]} rows")
        em, index, split = routing.sorted_ids.numel(), (routing.sorted_ids, routing.expert_ids, routing.num_padded), 1
    else:
        em, split = rows, split_k
        if split is None:  # the heuristic is for CUDA; the interpreter splits only when asked (tests)
            split = 1 if interpret or activation else tuning.split_k(rows, n, plan.data_k, a_data.device)
    if split > 1 and (routed or activation):
        raise ValueError("split-K is for dense GEMMs without a fused activation")
    if split > 1:  # fp32 partial products, one slice per K range, summed below
        c = torch.empty((split, rows, n), dtype=torch.float32, device=a_data.device)
    else:
        c = torch.empty((rows, n), dtype=out_dtype, device=a_data.device)
    if rows == 0 or n == 0:
        return c.sum(0).to(out_dtype) if split > 1 else c
    if not routed:
        index = (c, c, c)  # unused pointers (never read when not ROUTED)
    if router_weights is not None:
        router_weights = router_weights.reshape(-1)
        if router_weights.numel() != rows:
            raise ValueError(f"{router_weights.numel()} router weights for {rows} token-expert pairs")
        router_weights = router_weights.contiguous()
    if bias is not None and bias.stride(-1) != 1:
        bias = bias.contiguous()
    a_strides = (a_data.stride(0), a_data.stride(1), *_scale_strides(a_scale)[1:]) if a_scale is not None else (a_data.stride(0), a_data.stride(1), 0, 0)  # fmt: skip
    args = (
        a_data,
        a_scale if a_scale is not None else a_data,
        weight.data,
        weight.scale,
        weight.scale2 if weight.scale2 is not None else weight.scale,
        bias if bias is not None else c,
        c,
        *index,
        router_weights if router_weights is not None else c,
        rows,
        n,
        plan.data_k,
        a_data.shape[1],
        em,
        *a_strides,
        *plan.weight_strides,
        bias.stride(0) if routed and bias is not None else 0,
        c.stride(-2),
        c.stride(-1),
        c.stride(0) if split > 1 else 0,
        float(alpha),
        float(limit),
    )
    flags = {**plan.flags, "SPLIT_K": split}
    gated = 1 if activation is None else 2  # gated: a program's BLOCK_N B rows make BLOCK_N / 2 outputs
    if config is None and not interpret:  # dense on CUDA: autotuned once per shape, then launched directly
        tune_key = (plan.scheme, n, plan.data_k, tuning.m_bucket(rows), split, a_data.dtype, c.dtype)
        config = tuning.TUNED.get(tune_key)
        if config is None:
            kernel = tuning.autotuned(_gemm_kernel, *tune_key[:5])
            grid = lambda meta: (_cdiv(em, meta["BLOCK_M"]) * _cdiv(n, meta["BLOCK_N"] // gated), split)  # noqa: E731
            wrap_triton(kernel)[grid](*args, **flags)
            tuning.remember(tune_key, kernel)
            return c.sum(0).to(out_dtype) if split > 1 else c
    else:
        config = tuning.fit_block_k(dict(config or tuning.interpreter_config(rows, n)), plan.scheme)
        keep = tuning.META if interpret else (*tuning.META, *tuning.LAUNCH)  # the interpreter takes no launch options
        config = {key: config[key] for key in keep if key in config}
    grid = (_cdiv(em, config["BLOCK_M"]) * _cdiv(n, config["BLOCK_N"] // gated), split)
    wrap_triton(_gemm_kernel)[grid](*args, **flags, **config)
    return c.sum(0).to(out_dtype) if split > 1 else c


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv unwraps constexprs: ~10x the cost, per launch


@dataclass(frozen=True)
class _Plan:
    """What a call needs that depends on the weight and the call's options but not on its rows."""

    scheme: GemmScheme
    n: int  # C's columns (gated: half the weight's rows)
    k: int  # logical K (A's columns)
    data_k: int  # K in elements of the stored data (padded to the group)
    weight_strides: tuple[int, ...]  # B's (e, n, k), its scale's (e, n, k), scale2's e
    bias_shape: tuple[int, ...]
    flags: dict  # every constexpr but SPLIT_K and the launch config
    a_to_bf16: bool


# Per weight (its data tensor, by identity and weakly: a freed weight frees its plans), per call
# options: the plan. Decode on a GPU is a ~10 us kernel; rebuilding the scheme, flags and strides
# on every call cost ~60 us of Python (measured on this repo's CPU with the launch stubbed out).
_PLANS: dict[int, tuple[weakref.ref, dict]] = {}


def _plans_of(tensor: torch.Tensor) -> dict:
    entry = _PLANS.get(id(tensor))
    if entry is None or entry[0]() is not tensor:
        key = id(tensor)
        entry = _PLANS[key] = (weakref.ref(tensor, lambda _, key=key: _PLANS.pop(key, None)), {})
    return entry[1]


def _plan(weight, a_key, a_data, out_dtype, bias, routed, top_k, router, activation, gate_up_layout) -> _Plan:
    interpret = envs.triton_interpret()
    options = (weight.key, a_key, weight.scale.shape, weight.scale.stride(), weight.scale2 is None, a_data.dtype,
               out_dtype, None if bias is None else bias.dtype, routed, top_k, router, activation, gate_up_layout,
               interpret, torch.get_float32_matmul_precision())  # fmt: skip
    plans = _plans_of(weight.data)
    plan = plans.get(options)
    if plan is None:
        if len(plans) > 64:  # options vary without bound only if misused; never grow forever
            plans.clear()
        plan = plans[options] = _make_plan(weight, a_key, a_data, out_dtype, bias, routed, top_k, router, activation, gate_up_layout, interpret)  # fmt: skip
    return plan


def _make_plan(weight, a_key, a_data, out_dtype, bias, routed, top_k, router, activation, gate_up_layout, interpret) -> _Plan:  # fmt: skip
    scheme = gemm_scheme(weight.key, a_key)
    if isinstance(scheme, str):
        raise ValueError(scheme)
    batch = 1 if routed else 0
    if weight.data.dim() != 2 + batch:
        raise ValueError(
            f"{'routed' if routed else 'dense'} GEMM wants a {2 + batch}-D weight, got {tuple(weight.shape)}"
        )
    n, k = weight.shape[-2], weight.shape[-1]
    weight_rows = n
    if activation is not None:
        if activation not in ACTIVATIONS or gate_up_layout not in GATE_UP_LAYOUTS:
            raise ValueError(
                f"invalid gated activation {activation!r} / layout {gate_up_layout!r}; valid: "
                f"{', '.join(ACTIVATIONS)} / {', '.join(GATE_UP_LAYOUTS)}"
            )
        if n % 2:
            raise ValueError(f"a gated GEMM needs an even number of weight rows (gate and up), got {n}")
        n //= 2
    _check_operands(scheme, a_data, weight, bias)
    dot_scaled_fp32 = scheme.mode == GemmMode.DOT_SCALED and a_data.dtype == torch.float32
    weight_strides = (
        weight.data.stride(0) if routed else 0,
        weight.data.stride(-2),
        weight.data.stride(-1),
        *_scale_strides(weight.scale, batch),
        weight.scale2.stride(0) if routed and weight.scale2 is not None else 0,
    )
    flags = constexpr_flags(
        A_FORMAT=scheme.a_format,
        A_SCALE=scheme.a_scale,
        B_FORMAT=scheme.b_format,
        B_SCALE=scheme.b_scale,
        MODE=scheme.mode,
        A_GROUP_K=max(scheme.a_group_k, 1),
        B_GROUP_N=scheme.b_group[0],
        B_GROUP_K=scheme.b_group[1],
        HAS_SCALE2=scheme.has_scale2,
        HAS_BIAS=bias is not None,
        ROUTED=routed,
        TOP_K=top_k,
        MUL_ROUTER_WEIGHT=router,
        ACTIVATION=activation or "none",
        GATE_UP_LAYOUT=gate_up_layout,
        DOT_FORMAT=_dot_format(scheme, torch.bfloat16 if dot_scaled_fp32 else a_data.dtype, interpret),
        EXACT=interpret,
        FP32_PRECISION=fp32_precision(interpret),
    )
    data_k = weight.data.shape[-1] * (2 if scheme.b_format in (Element.INT4, Element.E2M1) else 1)
    bias_shape = (weight.data.shape[0], weight_rows) if routed else (weight_rows,)
    return _Plan(scheme, n, k, data_k, weight_strides, bias_shape, flags, dot_scaled_fp32)


def fp32_precision(interpret: bool) -> str:
    """How fp32 x fp32 dots run: as torch runs fp32 matmuls. "highest" (torch's default) is IEEE fp32;
    "high" / "medium" allow TF32 (`torch.set_float32_matmul_precision`). Triton's own default is TF32."""
    return "ieee" if interpret or torch.get_float32_matmul_precision() == "highest" else "tf32"


# What each scheme's operands must hold (formats.py's layout); a mismatch is a caller's bug.
_DATA_DTYPES = {
    "fp8": (torch.float8_e4m3fn,),
    "int8": (torch.int8,),
    "int4": (torch.uint8,),
    "e2m1": (torch.uint8,),
    "float": (torch.bfloat16, torch.float16, torch.float32),
}


def _check_operands(scheme, a_data, weight, bias) -> None:
    """Dtypes and devices against the scheme (shapes are checked per call)."""
    if a_data.dtype not in _DATA_DTYPES[scheme.a_format]:
        raise ValueError(f"A is {a_data.dtype}; {scheme.a_format} activations are {_DATA_DTYPES[scheme.a_format]}")
    if weight.data.dtype not in _DATA_DTYPES[scheme.b_format]:
        raise ValueError(f"weight data is {weight.data.dtype}, {weight.key} stores {_DATA_DTYPES[scheme.b_format]}")
    devices = {t.device for t in (a_data, weight.data, weight.scale, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"GEMM operands on several devices: {sorted(map(str, devices))}")


def _dot_format(scheme: GemmScheme, a_dtype: torch.dtype, interpret: bool) -> str:
    if scheme.mode == GemmMode.DOT_SCALED:
        return "e4m3" if scheme.a_scale == ScaleMode.MX else {torch.float16: "fp16"}.get(a_dtype, "bf16")
    if scheme.mode == GemmMode.DEQUANT and (interpret or a_dtype == torch.float32):
        return "fp32"
    return "native"


def _scale_strides(scale: torch.Tensor, batch: int = 0) -> tuple[int, int, int]:
    """(batch, row, col) strides of a scale tensor, 0 along an extent of 1 (per-tensor broadcasts)."""
    if scale.dim() != 2 + batch:
        raise ValueError(f"scale of shape {tuple(scale.shape)} should have {2 + batch} dims")
    strides = tuple(0 if size == 1 else stride for size, stride in zip(scale.shape, scale.stride()))
    return strides if batch else (0, *strides)
