"""The gated activation of an experts region is identified by its structure: every spelling of a
supported activation is recognised, and anything else is refused however it behaves on typical
inputs (`clamp(max=50)` and `where(|x| > 30, 0, x)` are silu's twins below 30; `nan_to_num` is the
identity on finite values). Each case is a tiny function captured by Dynamo: its graph is the
activation, from its inputs (the up projection outputs) to its output.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from quantpass.patterns.moe_activation import MatchedActivation, NotAnActivation, identify_activation

I = 16  # noqa: E741  intermediate size: fused gate/up inputs are [8, 2I]


def halves(h):
    return h.chunk(2, dim=-1)


def swigluoai(h, up_limit=7.0):
    """GPT-OSS's `_apply_gate`, as transformers writes it."""
    gate, up = h[..., ::2], h[..., 1::2]
    gate = gate.clamp(min=None, max=7.0)
    up = up.clamp(min=-up_limit, max=up_limit)
    glu = gate * torch.sigmoid(gate * 1.702)
    return (up + 1) * glu


def silu_clamped(h, gate_limit=10.0):
    """DeepSeek-V4's `_apply_gate`, as transformers writes it."""
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=gate_limit)
    up = up.clamp(min=-10.0, max=10.0)
    return F.silu(gate) * up


def gelu_new(x):  # transformers' NewGELUActivation
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def silu_cast(h):
    gate, up = h[:, ::2].float(), h[:, 1::2]
    return (F.silu(gate) * up).to(h.dtype)


def silu_written_out(h):
    gate, up = h.split(I, dim=-1)
    return gate * torch.sigmoid(gate) * up


def scaled_in_place(h):
    gate, up = halves(h)
    activated = F.silu(gate)
    activated.mul_(2)  # 2 * silu: the in-place write is outside what the output is computed from
    return activated * up


SILU = MatchedActivation("silu", "concat")
RECOGNISED = {
    "silu": (lambda h: F.silu(halves(h)[0]) * halves(h)[1], SILU),
    "silu written out, split": (silu_written_out, SILU),
    "silu, slices, reordered": (lambda h: h[..., I:] * (torch.sigmoid(h[..., :I]) * h[..., :I]), SILU),
    "silu interleaved, casts": (silu_cast, MatchedActivation("silu", "interleaved")),
    "gelu": (lambda h: F.gelu(halves(h)[0]) * halves(h)[1], MatchedActivation("gelu", "concat")),
    "gelu tanh": (
        lambda h: F.gelu(halves(h)[0], approximate="tanh") * halves(h)[1],
        MatchedActivation("gelu_tanh", "concat"),
    ),
    "gelu_new formula": (lambda h: gelu_new(halves(h)[0]) * halves(h)[1], MatchedActivation("gelu_tanh", "concat")),
    "swigluoai": (swigluoai, MatchedActivation("swigluoai", "interleaved", 1.702, 7.0)),
    "silu clamped": (silu_clamped, MatchedActivation("silu_clamped", "concat", limit=10.0)),
}
REFUSED = {
    "clamp(max=50)": (lambda h: F.silu(halves(h)[0].clamp(max=50)) * halves(h)[1], "computes mul(clamp("),
    "where": (lambda h: F.silu(torch.where(halves(h)[0].abs() > 30, 0, halves(h)[0])) * halves(h)[1], "abs(...)"),
    "nan_to_num": (lambda h: F.silu(torch.nan_to_num(halves(h)[0])) * halves(h)[1], "nan_to_num(...) is not an op"),
    "relu": (lambda h: F.relu(halves(h)[0]) * halves(h)[1], "relu(...) is not an op"),
    "gate times itself": (lambda h: F.silu(halves(h)[0]) * halves(h)[0], "which is none of"),
    "swigluoai, another up limit": (lambda h: swigluoai(h, up_limit=5.0), "which is none of"),
    "silu clamped, another gate limit": (lambda h: silu_clamped(h, gate_limit=5.0), "which is none of"),
    "silu, only the up half clamped": (lambda h: F.silu(halves(h)[0]) * halves(h)[1].clamp(-5, 5), "which is none of"),
    "int cast": (lambda h: F.silu(halves(h)[0].int().float()) * halves(h)[1], "int(...) is not an op"),
    "written in place": (scaled_in_place, "written in place"),
}


def identify(fn, *widths):
    """identify_activation on the Dynamo graph of `fn`: its arguments are the inputs, the nodes are
    those its output is computed from."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*(torch.randn(8, w) for w in widths))
    (gm,) = graphs
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}  # in order of first use
    arguments = [p.name for p in inspect.signature(fn).parameters.values() if p.default is inspect.Parameter.empty]
    inputs = [placeholders[f"l_{name}_"] for name in arguments]  # in argument order
    output = gm.graph.output_node().args[0][0]
    nodes, stack = set(), [output]
    while stack:
        node = stack.pop()
        if node not in nodes and node not in inputs:
            nodes.add(node)
            stack.extend(node.all_input_nodes)
    return identify_activation([n for n in gm.graph.nodes if n in nodes], inputs, output)


@pytest.mark.parametrize("name", RECOGNISED)
def test_spellings_of_supported_activations_are_recognised(name):
    fn, expected = RECOGNISED[name]
    assert identify(fn, 2 * I) == expected


@pytest.mark.parametrize("name", REFUSED)
def test_anything_else_is_refused(name):
    fn, why = REFUSED[name]
    with pytest.raises(NotAnActivation) as error:
        identify(fn, 2 * I)
    assert why in str(error.value), str(error.value)


@pytest.mark.parametrize(("fn", "gate_input"), [(lambda g, u: F.silu(g) * u, 0), (lambda u, g: u * F.silu(g), 1)])
def test_separate_gate_and_up_projections(fn, gate_input):
    assert identify(fn, I, I) == MatchedActivation("silu", "concat", gate_input=gate_input)
