"""The host side of the Triton GEMM (`gemm_kernel.py`): `quantized_matmul` checks the operands, builds
the call's plan (the `scheme.GemmScheme`, constexpr flags and strides: once per weight and call
options, cached), picks a config (autotuned once per shape on CUDA, `tuning.py`; given when routed)
and launches the kernel, dense or routed over `moe_align`'s blocks; a split-K launch's fp32 slices
are summed here.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.library import wrap_triton

from ... import envs
from ...moe_problem import ACTIVATIONS, GATE_UP_LAYOUTS
from ...quant_registry.qtensor import QTensor
from . import tuning
from .gemm_kernel import gemm_kernel
from .scheme import Element, GemmMode, GemmScheme, ScaleMode, constexpr_flags, gemm_scheme


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
            kernel = tuning.autotuned(gemm_kernel, *tune_key[:5])
            grid = lambda meta: (_cdiv(em, meta["BLOCK_M"]) * _cdiv(n, meta["BLOCK_N"] // gated), split)  # noqa: E731
            wrap_triton(kernel)[grid](*args, **flags)
            tuning.remember(tune_key, kernel)
            return c.sum(0).to(out_dtype) if split > 1 else c
    else:
        config = tuning.fit_block_k(dict(config or tuning.interpreter_config(rows, n)), plan.scheme)
        keep = tuning.META if interpret else (*tuning.META, *tuning.LAUNCH)  # the interpreter takes no launch options
        config = {key: config[key] for key in keep if key in config}
    grid = (_cdiv(em, config["BLOCK_M"]) * _cdiv(n, config["BLOCK_N"] // gated), split)
    wrap_triton(gemm_kernel)[grid](*args, **flags, **config)
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
