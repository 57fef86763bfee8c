"""The native backend's MoE, `torch_ops_moe.fused_moe` (dequantize to bf16 + torch._grouped_mm), against the
reference loop."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from quantpass.kernels import reference
from quantpass.kernels import torch_ops_moe as native_moe
from quantpass.kernels.oracle import Capability, Problem
from quantpass.metrics import sqnr
from quantpass.moe_problem import GatedActivation, MoEProblem
from quantpass.quant_registry.formats import quantize
from quantpass.quant_registry.spec import QuantSpec

E, K, H, I = 4, 2, 64, 32  # noqa: E741
SILU = GatedActivation("silu", "concat")


def moe_inputs(tokens: int, dtype, biases: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, H, generator=g).to(dtype)
    topk_ids = torch.rand(tokens, E, generator=g).argsort(dim=-1)[:, :K]
    topk_weights = torch.rand(tokens, K, generator=g).softmax(dim=-1)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1
    b13, b2 = (torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)) if biases else (None, None)
    return hidden, topk_weights, topk_ids, w13, w2, b13, b2


# (spec, activation, layout, router on input, biases, expert map): the forms quantpass::fused_moe carries.
CASES = [
    ("int8_weight_only", "silu", "concat", False, False, False),
    ("int8_per_channel", "gelu_tanh", "concat", True, False, False),
    ("fp8_per_channel", "swigluoai", "interleaved", False, True, False),
    ("int4_weight_only", "silu", "concat", False, False, True),
]


@pytest.mark.parametrize("tokens", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] + "-" + c[1] for c in CASES])
def test_native_moe_matches_reference(case, dtype, tokens):
    name, activation, layout, on_input, biases, local = case
    spec = QuantSpec.from_name(name)
    hidden, topk_weights, topk_ids, w13, w2, b13, b2 = moe_inputs(tokens, dtype, biases)
    expert_map = torch.tensor([0, -1, 1, 2]) if local else None  # expert 1 lives elsewhere
    experts = slice(None) if expert_map is None else [0, 2, 3]
    w13_q, w2_q = quantize(w13[experts], spec.weight), quantize(w2[experts], spec.weight)
    gated = GatedActivation(activation, layout, 1.702, 7.0)
    problem = MoEProblem(hidden, topk_weights, topk_ids, w13_q, w2_q, gated, spec.activation, b13, b2, expert_map)
    problem = replace(problem, apply_router_weight_on_input=on_input)
    expected = reference.fused_moe(problem)
    result = native_moe.fused_moe(problem)
    assert result.shape == expected.shape and result.dtype == dtype
    # bf16 weights and GEMM inputs vs the reference's fp32: ~40 dB; a wrong row order or layout < 5 dB
    assert sqnr(expected, result) > 30.0


def test_native_moe_supports():
    problem = Problem(n=32, k=64, experts=4, topk=2, activation="silu")
    weight = QuantSpec.from_name("int8_weight_only").weight
    assert native_moe.supports_moe(Capability("cuda", 90), weight, None, problem)[0]
    ok, why = native_moe.supports_moe(Capability("cpu"), weight, None, problem)
    assert not ok and "slower than the reference" in why  # measured: see torch_ops_moe's docstring
    ok, why = native_moe.supports_moe(Capability("cuda", 75), weight, None, problem)
    assert not ok and "sm80" in why
    ok, why = native_moe.supports_moe(Capability("cuda", 90), weight, None, Problem(n=30, k=64, experts=4, topk=2))
    assert not ok and "I=30" in why


def test_native_moe_traces_with_dynamic_tokens():
    """Plain torch ops with no data-dependent shapes: one graph for any token count, no graph break."""
    spec = QuantSpec.from_name("int8_weight_only")
    _, _, _, w13, w2, _, _ = moe_inputs(4, torch.bfloat16, False)
    w13_q, w2_q = quantize(w13, spec.weight), quantize(w2, spec.weight)

    def experts(hidden, topk_weights, topk_ids):
        return native_moe.fused_moe(MoEProblem(hidden, topk_weights, topk_ids, w13_q, w2_q, SILU))

    graphs = []
    compiled = torch.compile(
        experts, backend=lambda gm, _: graphs.append(gm) or gm.forward, dynamic=True, fullgraph=True
    )
    for tokens in (3, 9):
        hidden, topk_weights, topk_ids, *_ = moe_inputs(tokens, torch.bfloat16, False)
        torch.testing.assert_close(compiled(hidden, topk_weights, topk_ids), experts(hidden, topk_weights, topk_ids))
    assert len(graphs) == 1
