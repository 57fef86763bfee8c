"""What the pattern matchers find: sites (their nodes, parameters and sizes), and parameter names.

A `Site` is one layer found in a Dynamo graph (a linear, or the experts of an MoE layer): what was
matched, nothing about what is done with it. Its subclasses add the facts of their kind (the nodes
the computation reads and writes, the gated activation of an MoE...). How a site of each kind is
quantized, rewritten into quantpass ops and verified lives in `passes/` (`passes/lower.py` maps a
site's class to its `SiteLowering`): detection imports neither kernels nor the oracle.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.fx as fx

from ..distributed import is_dtensor, local_tensor
from ..problem import Problem
from ..quant_registry.names import Kind


@dataclass
class ParamRef:
    """A parameter placeholder of the Dynamo graph.

    `index` is its position among the graph's placeholders (= in example_inputs and in the
    runtime call's args); `name` its FQN, e.g. `model.layers.0.mlp.experts.gate_up_proj`.
    `transposed` says it is stored `[..., K, N]` and must be transposed to the `[..., N, K]`
    layout quantization expects; `shape`, that it is viewed as this matrix first (a 3-D weight an
    einsum uses as a linear: `patterns/einsum_linear.py`).
    """

    node: fx.Node
    index: int
    name: str
    transposed: bool = False
    shape: tuple[int, int] | None = None

    def matrix(self, value: torch.Tensor) -> torch.Tensor:
        """The parameter's value in `[..., N, K]` layout (a DTensor's: the shard this rank holds)."""
        value = local_tensor(value)
        value = value if self.shape is None else value.reshape(self.shape)
        return value.transpose(-2, -1) if self.transposed else value


@dataclass
class Site:
    """One matched layer: `kind` (a `Kind`: linear or moe), its FQN, the parameters it quantizes, its sizes.

    `config_kind` is the config kind whose spec applies (the `kind` itself unless a matcher says
    otherwise: an unproven MoE's per-expert linears take the "moe" spec); `default_ignore` says why
    the defaults leave the site alone (an output head, a tied embedding, an MoE router)."""

    kind: ClassVar[Kind]
    fqn: str
    params: list[ParamRef]
    problem: Problem
    skip_reason: str | None = None  # found, but left alone: why (shown in the plan)
    notes: list[str] = field(default_factory=list)  # extra plan notes (e.g. "bias fused")
    config_kind: Kind | str = ""  # "" = `kind`
    default_ignore: str | None = None

    def __post_init__(self) -> None:
        self.config_kind = self.config_kind or self.kind

    @property
    def output_node(self) -> fx.Node:
        """The node whose value the site's rewrite replaces (its users then read the quantized op)."""
        raise NotImplementedError

    @property
    def input_nodes(self) -> list[fx.Node]:
        """The activations the site's computation reads (verify feeds the rewritten op their real values)."""
        raise NotImplementedError

    def remap(self, replaced: dict[fx.Node, fx.Node]) -> None:
        """Point this site's node fields at the nodes that replaced them: an earlier site's rewrite
        may have erased a node this site reads (`nn.Sequential(Linear, Linear)`: the second
        linear's input is the first one's output)."""
        for name, value in vars(self).items():
            if isinstance(value, fx.Node) and value in replaced:
                setattr(self, name, replaced[value])


_CONTAINERS = ("_modules", "_parameters", "_buffers")


def source_fqn(node: fx.Node) -> str | None:
    """The FQN of a parameter placeholder, read from the structure of Dynamo's source, e.g.

    `L['self']._modules['model']._modules['layers']._modules['0']._parameters['weight']` -> `model.layers.0.weight`.
    The path starts at the root module (the outermost `NNModuleSource`: `L['self']`, `L['args'][0]`,
    `G['m']` are dropped). Every spelling Dynamo uses to step into a module names the same part:
    `._modules['x']`, `.__dict__['_modules']['x']` (a module whose attributes the forward assigned,
    e.g. Swin's stages), `.__dict__['x']`, `.x`, `object.__getattribute__(m, 'x')`, `[0]`.
    """
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:  # Dynamo drops `grapharg` once the backend returns: decode the node's name
        return _name_fqn(str(node.target))
    return _path_fqn(source)


def _path_fqn(source) -> str | None:
    """`source`'s path below its root module, or None (no module in the chain, or a step that is no
    attribute or item access)."""
    from torch._dynamo import source as ds

    chain = []
    while source is not None:
        chain.append(source)
        source = getattr(source, "base", None)
    chain.reverse()
    root = next((i for i, s in enumerate(chain) if isinstance(s, ds.NNModuleSource)), None)
    if root is None:
        return None
    parts: list[str] = []
    for step in chain[root + 1 :]:
        if isinstance(step, ds.NNModuleSource):
            continue
        if isinstance(step, (ds.AttrSource, ds.GenericAttrSource)):
            parts.append(step.member)
        elif isinstance(step, (ds.DictGetItemSource, ds.DictSubclassGetItemSource, ds.GetItemSource)):
            if isinstance(step.index, ds.Source) or getattr(step, "index_is_slice", False):
                return None
            parts.append(str(step.index))
        else:
            return None
    # `__dict__['x']` is `.x`; `._modules['x']` (also reached as `__dict__['_modules']['x']`) is `.x`
    parts = [p for i, p in enumerate(parts) if not (p == "__dict__" and i + 1 < len(parts))]
    parts = [p for i, p in enumerate(parts) if not (p in _CONTAINERS and i + 1 < len(parts))]
    return ".".join(parts) or None


def _name_fqn(name: str) -> str | None:
    """`L_self_modules_model_modules_layers_modules_0_dict_modules_fc_parameters_weight_` -> `model.layers.0.fc.weight`."""
    match = re.search(r"_(?:dict_)?(?:modules|parameters|buffers)_(.+?)_?$", name)
    if match is None:
        return None
    return re.sub(r"_(?:dict_)?(?:modules|parameters|buffers)_", ".", match.group(1))


def param_refs(graph: fx.Graph, example_inputs) -> dict[fx.Node, ParamRef]:
    """Every placeholder bound to an `nn.Parameter`, by node; for a DTensor parameter, also each
    `param.to_local()` node (sharded models compute on the local shard: docs/distributed.md)."""
    refs = {}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for index, node in enumerate(placeholders):
        if index < len(example_inputs) and isinstance(example_inputs[index], torch.nn.Parameter):
            refs[node] = ParamRef(node, index, source_fqn(node) or node.name)
            if is_dtensor(example_inputs[index]):
                for user in node.users:
                    if user.op == "call_method" and user.target == "to_local" and len(user.args) == 1:
                        refs[user] = ParamRef(user, index, refs[node].name)
    return refs
