"""Parameter names from Dynamo's sources (issue #11, the zoo's `dict-source-names`).

A module whose forward assigns its own attributes (Swin's stages: `self.window_size = ...`) is then
reached through `.__dict__['_modules']['x']`; the old name regex turned that into `0.__dict__.x`, so
plan rows, `targets` and `ignore` missed every layer of Swin's second stage. These tests compile real
models and read the sources Dynamo hands the backend, for every spelling that reaches a module.
"""

import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import quantpass as qp
from quantpass.patterns.site import _name_fqn, source_fqn


class Block(nn.Module):
    """Sets an attribute in forward (as Swin's `set_shift_and_window_size` does), then calls its layers."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.inner = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        self.size = 0

    def forward(self, x):
        self.size = x.shape[-1]
        return self.inner(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.heads = nn.ModuleDict({"a": nn.Linear(16, 16)})
        self.proj = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        x = self.blocks[1].fc(x)  # an index into a ModuleList
        for head in self.heads.values():
            x = head(x)
        x = self._modules["proj"](x)  # the container spelled out
        return F.linear(x, self.__dict__["_parameters"]["w"])


class Holders(nn.Module):
    """Layers kept outside the module tree (a list, a dict, a plain object): named by the attribute path."""

    def __init__(self):
        super().__init__()
        self.listed = [nn.Linear(16, 16)]
        self.table = {"k": nn.Linear(16, 16)}
        self.ns = types.SimpleNamespace(lin=nn.Linear(16, 16))

    def forward(self, x):
        return self.ns.lin(self.table["k"](self.listed[0](x)))


def _names(fn, *args) -> list[tuple[str, str | None, str | None]]:
    """(Dynamo's source, source_fqn, the node-name fallback) of each parameter placeholder."""
    seen = []

    def backend(gm, example_inputs):
        for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
            if isinstance(value, nn.Parameter):
                seen.append((node.meta["grapharg"].source.name, source_fqn(node), _name_fqn(node.name)))
        return gm

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=backend)(*args)
    torch._dynamo.reset()
    return seen


GLOBAL_NET = Net().eval()


def _call_global(x):
    return GLOBAL_NET(x)


def _call_varargs(*args):
    return args[0](args[1])


@pytest.mark.parametrize(
    "call",
    [
        lambda m, x: _names(m, x),  # L['self']
        lambda m, x: _names(_call_varargs, m, x),  # L['args'][0]
        lambda m, x: _names(_call_global, x),  # G['GLOBAL_NET']
    ],
    ids=["method", "varargs", "global"],
)
def test_every_module_spelling_names_the_parameter(call):
    model = GLOBAL_NET
    seen = call(model, torch.randn(3, 16))
    sources = " ".join(source for source, _, _ in seen)
    assert ".__dict__['_modules']['fc']" in sources  # the Swin spelling is really exercised
    assert ".__dict__['_parameters']['w']" in sources or "._parameters['w']" in sources
    expected = {name for name, _ in model.named_parameters()}
    assert {fqn for _, fqn, _ in seen} == expected
    assert {fallback for _, _, fallback in seen} == expected  # decoded from the node names alone


def test_layers_outside_the_module_tree_are_named_by_their_attribute_path():
    seen = _names(Holders().eval(), torch.randn(3, 16))
    assert {fqn for _, fqn, _ in seen} == {
        f"{path}.{p}" for path in ("listed.0", "table.k", "ns.lin") for p in ("weight", "bias")
    }


def test_plan_rows_and_patterns_reach_a_mutated_module():
    """End to end: each linear of the mutated blocks has its own plan row and `ignore` matches it."""
    model, x = Net().eval(), torch.randn(3, 16)
    backend = qp.backend(linear="int8_weight_only", lowering="aot_eager", ignore=["blocks.1.inner.*"])
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend)(x)
    torch._dynamo.reset()
    rows = {row.fqn: row for row in backend.plan.rows}
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)} | {"w"}
    assert set(rows) == linears
    assert not rows["blocks.1.inner.0"].quantized and "ignore" in rows["blocks.1.inner.0"].reason
    assert all(rows[name].quantized for name in linears - {"blocks.1.inner.0"})
