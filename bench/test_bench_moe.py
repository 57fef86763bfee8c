"""Fused MoE kernels by provider, grouped by shape: bf16 `grouped_mm` experts vs each backend per format.

    make bench
    pytest bench/test_bench_moe.py --benchmark-only --bench-suite gpu-quick

The experts of one layer, routing done: hidden [T, H] with top-k ids/weights -> [T, H], SiLU-gated,
w13 [E, 2I, H] ([gate; up]) and w2 [E, H, I]. The bf16 baseline is transformers 5.x's `grouped_mm`
experts path (sort by expert, two grouped GEMMs, weighted sum): what quantpass replaces in a model.
Backends are called as the `quantpass::fused_moe` op calls them, with weights prepared once.
"""

from __future__ import annotations

import functools

import suites
import torch
import torch.nn.functional as F
from providers import BASELINE, DTYPE, clone, device, measure, skip_unless_runnable, spec_of
from providers import weight_copies as copies_for

import quantpass as qp
from quantpass.kernels import ops
from quantpass.kernels.oracle import Problem, backend_module
from quantpass.moe_problem import GatedActivation, MoEProblem

GROUPED_MM = getattr(F, "grouped_mm", None) or torch._grouped_mm  # F.grouped_mm: torch >= 2.10
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # fused_moe's GPT-OSS arguments; unused by SiLU


@functools.cache
def experts(num_experts: int, hidden: int, intermediate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2I, H], w2 [E, H, I]) in bf16."""
    torch.manual_seed(num_experts * 7919 + hidden + intermediate)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, device=device()) * 0.02
    w2 = torch.randn(num_experts, hidden, intermediate, device=device()) * 0.02
    return w13.to(DTYPE), w2.to(DTYPE)


@functools.cache
def routed_tokens(tokens: int, num_experts: int, topk: int, hidden: int):
    """(hidden [T, H], topk_weights [T, k] fp32 renormalised, topk_ids [T, k]) from a random router."""
    torch.manual_seed(tokens * 31 + num_experts)
    x = torch.randn(tokens, hidden, device=device()).to(DTYPE)
    weights, ids = torch.randn(tokens, num_experts, device=device()).softmax(-1).topk(topk, dim=-1)
    return x, weights / weights.sum(-1, keepdim=True), ids


@functools.cache
def quantized(format_name: str, num_experts: int, hidden: int, intermediate: int) -> tuple[qp.QTensor, qp.QTensor]:
    key = spec_of(format_name).weight
    return tuple(qp.quantize(w, key) for w in experts(num_experts, hidden, intermediate))


def grouped_mm_experts(x, topk_weights, topk_ids, w13, w2) -> torch.Tensor:
    """transformers' `grouped_mm_experts_forward` (integrations/moe.py) for SiLU-gated experts."""
    tokens, topk = topk_ids.shape
    num_experts = w13.shape[0]
    expert_ids, order = torch.sort(topk_ids.reshape(-1))
    counts = torch.histc(expert_ids.float(), bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    gate, up = GROUPED_MM(x[order // topk], w13.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)  # [T*k, I]
    out = GROUPED_MM(F.silu(gate) * up, w2.transpose(-2, -1), offs=offsets)  # [T*k, H], expert order
    out = out * topk_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    unsorted = torch.empty_like(out).index_copy_(0, order, out)
    return unsorted.view(tokens, topk, -1).sum(dim=1)


@functools.cache
def expected(shape: suites.MoEShape) -> torch.Tensor:
    """The unquantized experts in fp32, one expert at a time: what SQNR is measured against."""
    x, topk_weights, topk_ids = routed_tokens(shape.tokens, shape.experts, shape.topk, shape.hidden)
    w13, w2 = experts(shape.experts, shape.hidden, shape.intermediate)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in topk_ids.unique().tolist():
        tokens, slots = torch.nonzero(topk_ids == expert, as_tuple=True)
        gate, up = (x[tokens].float() @ w13[expert].float().t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[expert].float().t()
        out.index_add_(0, tokens, y * topk_weights[tokens, slots].unsqueeze(-1))
    return out


def test_moe(benchmark, record, moe_case):
    shape, format_name, provider = moe_case
    row = dict(kind="moe", tag=shape.tag, m=shape.tokens, n=shape.intermediate, k=shape.hidden)
    row.update(experts=shape.experts, topk=shape.topk)
    x, topk_weights, topk_ids = routed_tokens(shape.tokens, shape.experts, shape.topk, shape.hidden)
    touched = topk_ids.unique().numel() / shape.experts  # weight bytes count the experts a call reads
    if provider == BASELINE:
        w13, w2 = experts(shape.experts, shape.hidden, shape.intermediate)
        weight_bytes = (w13.numel() + w2.numel()) * w13.element_size()

        def call_for(w13, w2):
            return lambda: grouped_mm_experts(x, topk_weights, topk_ids, w13, w2)
    else:
        problem = Problem(
            n=shape.intermediate,
            k=shape.hidden,
            m=shape.tokens,
            experts=shape.experts,
            topk=shape.topk,
            activation="silu",
        )
        skip_unless_runnable(record, provider, format_name, problem, group=shape.group, **row)
        w13, w2 = quantized(format_name, shape.experts, shape.hidden, shape.intermediate)
        weight_bytes = w13.nbytes + w2.nbytes
        w13, w2 = ops.prepare_moe_weights(provider, w13, w2, "concat")
        kernel, activation_key = backend_module(provider).fused_moe, spec_of(format_name).activation
        gated = GatedActivation("silu", "concat", SWIGLU_ALPHA, SWIGLU_LIMIT)

        def call_for(w13, w2):
            return lambda: kernel(MoEProblem(x, topk_weights, topk_ids, w13, w2, gated, activation_key))

    copies = copies_for(int(weight_bytes * touched), shape.tokens)
    calls = [call_for(w13, w2)] + [call_for(clone(w13), clone(w2)) for _ in range(copies - 1)]
    measure(
        benchmark,
        record,
        calls,
        group=shape.group,
        flops=6 * shape.tokens * shape.topk * shape.hidden * shape.intermediate,
        weight_bytes=int(weight_bytes * touched),
        reference=expected(shape),
        format=format_name,
        provider=provider,
        **row,
    )
