"""Fused MoE on the routed GEMM (docs/design.md §6): the experts of one layer, routing already done.

    hidden [T, H] --quantize--> routed GEMM1 (w13 [E, 2I, H], + b13, gated activation in the
      epilogue) --> [T*k, I] --quantize--> routed GEMM2 (w2 [E, H, I], + b2, x router weight)
      --> [T*k, H] --sum over top-k--> [T, H]

The gated activation (silu / gelu / gelu_tanh / swigluoai / silu_clamped; gate and up "concat" or "interleaved")
runs on GEMM1's fp32 accumulators: each program loads the gate rows and the matching up rows of
w13, so the [T*k, 2I] projections are never written (half the bytes; and the activation sees fp32,
as in the reference, before the one cast to the hidden dtype).

Rows of the intermediates are token-expert pairs `token * top_k + slot`; `moe_align` groups them by
expert into BLOCK_M blocks (or, at decode, one pair per block). The router weight multiplies GEMM2's
fp32 accumulator before the cast (or the input, with `apply_router_weight_on_input`). Non-local
experts (expert map -1) give zero rows. Per-tensor activation scales are global over all tokens
(one scale for GEMM1's input, one for GEMM2's), where the reference quantizes per expert: results
differ at the FP8 noise level, not by rounding (the tests say so).
"""

from __future__ import annotations

import dataclasses

import torch

from ... import envs
from ...moe_problem import MoEProblem
from . import tuning
from .gemm import quantized_matmul
from .moe_align import decode_routing, local_expert_ids, moe_align
from .quant import quantize_activation
from .scheme import gemm_scheme


def fused_moe(problem: MoEProblem, *, config: dict | None = None, decode: bool | None = None) -> torch.Tensor:
    """hidden [T, H], topk_weights/ids [T, k] -> [T, H] (`registry.Backend.fused_moe`).

    `config` overrides the launch config (else `tuning.moe_config`, or the interpreter's); `decode`
    forces (True) or forbids (False) the one-pair-per-block shortcut (default: `decode_shortcut`).
    """
    hidden, topk_weights, topk_ids = problem.hidden, problem.topk_weights, problem.topk_ids
    w13, w2, activation_key = problem.w13, problem.w2, problem.activation_key
    scheme = gemm_scheme(w13.key, activation_key)
    if isinstance(scheme, str):
        raise ValueError(scheme)
    if w13.data.dim() != 3 or w2.data.dim() != 3 or hidden.dim() != 2 or topk_ids.shape != topk_weights.shape:
        raise ValueError(
            f"fused_moe wants hidden [T, H], top-k [T, k], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(hidden.shape)}, "
            f"{tuple(topk_ids.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    num_experts, intermediate = w13.data.shape[0], w2.shape[-1]
    if tuple(w13.shape[1:]) != (2 * intermediate, hidden_size) or w2.shape[-2] != hidden_size:
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} don't match hidden size {hidden_size}")
    num_pairs = tokens * top_k
    if decode is None:
        decode = decode_shortcut(tokens, top_k, num_experts)
    if config is None and envs.triton_interpret():
        config = tuning.interpreter_config(16, 2 * intermediate)
    elif config is None:
        config = tuning.moe_config(tokens, num_experts, top_k, intermediate, scheme)
    if decode:  # one pair per block: the smallest block tl.dot takes wastes the least
        config = dict(config, BLOCK_M=16)
    local_ids = local_expert_ids(topk_ids, problem.expert_map)
    if decode:
        routing = decode_routing(local_ids, config["BLOCK_M"])
    else:
        routing = moe_align(local_ids, num_experts, config["BLOCK_M"])

    x = hidden
    if problem.apply_router_weight_on_input:  # one A row per pair, already weighted (Llama-4 style)
        x = hidden.float()[:, None, :] * topk_weights.float()[:, :, None]
        x = x.to(hidden.dtype).reshape(num_pairs, hidden_size)
    a1 = quantize_activation(x, activation_key) if activation_key is not None else x
    gated = dataclasses.asdict(problem.gated)  # the GEMM's epilogue flags: activation, gate_up_layout, alpha, limit
    act = quantized_matmul(a1, w13, problem.b13, hidden.dtype, routing=routing, config=config, **gated)  # [pairs, I]
    a2 = quantize_activation(act, activation_key) if activation_key is not None else act
    router = None if problem.apply_router_weight_on_input else topk_weights
    y = quantized_matmul(a2, w2, problem.b2, hidden.dtype, routing=routing, router_weights=router, config=config)
    return y.view(tokens, top_k, hidden_size).sum(dim=1, dtype=torch.float32).to(hidden.dtype)


def decode_shortcut(tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether one pair per block (no sort) beats sorting: each block reads its expert's weights, so
    pairs that share an expert read it again. Taken while that costs at most one expert's weights more
    than sorting, in expectation under uniform routing (a token's top-k experts are distinct):
    pairs - E * (1 - (1 - k / E)^T) <= 1. E=64, top-8: T <= 2 (T=8 would read ~1.5x the weights);
    E=8, top-2: T <= 2."""
    pairs = tokens * top_k
    if pairs > num_experts or num_experts <= 0:
        return False
    distinct = num_experts * (1 - (1 - top_k / num_experts) ** tokens)
    return pairs - distinct <= 1 + 1e-9
