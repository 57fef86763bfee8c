"""`MoEProblem` / `GatedActivation` (the backends' MoE argument) and the names as string enums; the
`quantpass::fused_moe` op's flat arguments packed into one, forward and backward."""

import json
from dataclasses import replace

import pytest
import torch

from quantpass.kernels import ops, reference
from quantpass.metrics import sqnr
from quantpass.moe_problem import ACTIVATIONS, GATE_UP_LAYOUTS, GatedActivation, GateUpLayout, MoEActivation, MoEProblem
from quantpass.quant_registry import KINDS, formats, keys
from quantpass.quant_registry.names import Kind


def test_names_are_their_strings():
    assert ACTIVATIONS == ("silu", "gelu", "gelu_tanh", "swigluoai", "silu_clamped")
    assert GATE_UP_LAYOUTS == ("concat", "interleaved")
    assert KINDS == ("linear", "moe") and Kind.MOE == "moe" and f"{Kind.LINEAR}" == "linear"
    assert json.dumps({Kind.MOE: [MoEActivation.SILU, GateUpLayout.INTERLEAVED]}) == '{"moe": ["silu", "interleaved"]}'
    assert {"moe": 1}[Kind.MOE] == 1 and str(MoEActivation.GELU_TANH) == "gelu_tanh"


def test_gated_activation_names_bad_values():
    with pytest.raises(ValueError, match="invalid MoE activation 'relu'; valid: silu, gelu, gelu_tanh, swigluoai"):
        GatedActivation("relu", "concat")
    with pytest.raises(ValueError, match="invalid gate_up_layout 'stacked'; valid: concat, interleaved"):
        GatedActivation("silu", "stacked")


def test_gated_activation_math():
    """[gate; up] and the interleaved layout of the same rows give the same result; swigluoai clamps."""
    gate, up = torch.randn(3, 8) * 4, torch.randn(3, 8) * 4
    concat, interleaved = torch.cat([gate, up], -1), torch.stack([gate, up], -1).flatten(-2)
    for activation in ACTIVATIONS:
        a = GatedActivation(activation, "concat", 1.702, 7.0)(concat)
        assert torch.equal(a, GatedActivation(activation, "interleaved", 1.702, 7.0)(interleaved))
    silu = GatedActivation("silu", "concat")(concat)
    assert torch.allclose(silu, torch.nn.functional.silu(gate) * up)
    clamped = GatedActivation("swigluoai", "concat", 1.0, 0.5)(concat)
    g = gate.clamp(max=0.5)
    assert torch.allclose(clamped, (up.clamp(-0.5, 0.5) + 1) * g * torch.sigmoid(g))
    clamped = GatedActivation("silu_clamped", "concat", limit=0.5)(concat)
    assert torch.allclose(clamped, torch.nn.functional.silu(g) * up.clamp(-0.5, 0.5))


def _op_args(tokens=5, experts=4, top_k=2, hidden=64, inter=32, activation="swigluoai", layout="interleaved"):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(1, tokens, hidden, generator=gen, requires_grad=True)
    topk_weights, topk_ids = torch.randn(tokens, experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
    topk_weights = topk_weights.detach().requires_grad_(True)
    key = keys.kInt8StaticChannelSym
    w13 = formats.quantize(torch.randn(experts, 2 * inter, hidden, generator=gen) / 8, key)
    w2 = formats.quantize(torch.randn(experts, hidden, inter, generator=gen) / 6, key)
    b13, b2 = torch.randn(experts, 2 * inter, generator=gen) / 4, torch.randn(experts, hidden, generator=gen) / 4
    expert_map = torch.tensor([0, -1, 1, 2, 3])[:experts]  # expert 1 lives elsewhere
    w13, w2, b13, b2 = (t[[0, 2, 3]] for t in (w13, w2, b13, b2))
    weights = (w13.data, w13.scale, None, w2.data, w2.scale, None, b13, b2, expert_map)
    tail = (str(key), str(keys.kInt8DynamicTokenSym), "reference", activation, layout, True, inter, 1.702, 7.0)
    return (x, topk_weights, topk_ids, *weights, *tail), (w13, w2)


def test_op_arguments_become_one_problem():
    args, (w13, _) = _op_args()
    problem = ops.moe_problem(args[0].reshape(-1, 64), *args[1:])
    assert problem.gated == GatedActivation("swigluoai", "interleaved", 1.702, 7.0)
    assert problem.activation_key == keys.kInt8DynamicTokenSym and problem.apply_router_weight_on_input
    assert torch.equal(problem.w13.data, w13.data) and problem.w2.shape == (3, 64, 32) and problem.b13 is args[9]
    out = torch.ops.quantpass.fused_moe(*args)
    assert out.shape == args[0].shape and torch.equal(out.reshape(5, 64), reference.fused_moe(problem))


def test_op_backward_is_the_dense_experts_gradient():
    """dX and d(router weights) from the op: autograd through the reference loop on dequantized
    weights, activation quantization passed straight through."""
    args, _ = _op_args()
    out = torch.ops.quantpass.fused_moe(*args)
    grads = torch.autograd.grad(out.square().sum(), args[:2])
    x, topk_weights = (t.detach().requires_grad_(True) for t in args[:2])
    problem = ops.moe_problem(x.reshape(-1, 64), topk_weights, *args[2:])
    dense = {name: formats.dequantize(getattr(problem, name), torch.float32) for name in ("w13", "w2")}
    want_out = reference.fused_moe(replace(problem, activation_key=None, **dense), expert_matmul=lambda r, w: r @ w.t())
    want = torch.autograd.grad(want_out, (x, topk_weights), 2 * out.detach().reshape(want_out.shape))
    for got, expected in zip(grads, want):
        assert got.shape == expected.shape and sqnr(expected, got) > 60


def test_problem_is_frozen_and_not_compared_by_tensors():
    args, (w13, w2) = _op_args()
    problem = MoEProblem(args[0][0], args[1], args[2], w13, w2, GatedActivation("silu", "concat"))
    with pytest.raises(AttributeError):
        problem.hidden = None
    assert problem != replace(problem) and problem == problem  # identity: no tensor comparison to a bool
