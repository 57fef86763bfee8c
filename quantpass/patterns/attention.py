"""Linear sites inside PyTorch's opaque attention ops, so their projections are quantized too.

On torch 2.13 Dynamo keeps `nn.MultiheadAttention` as one `F.multi_head_attention_forward` call
(grad mode or not: its fast path is blocked while Dynamo inlines the module), and in eval under
`torch.no_grad()` keeps `nn.TransformerEncoderLayer` as one `torch._transformer_encoder_layer_fwd`
call, FFN included; `torch._native_multi_head_attention` is the same kind of call when code makes it
itself. No linear pattern sees into them, so their weights were silently left alone.

Each projection weight of such a call becomes a `ProjectionSite`: an ordinary linear site (its own
plan row, FQN, config resolution, backend choice, verify on a sample through its own GEMM) whose
rewrite (`passes/lower_attention.py`) replaces the call, the first time, by its
`passes/attention_math.py` equivalent with every projection a dense slot, then turns its own slot
quantized. A projection left alone keeps its dense slot, so one layer can be ignored while the
others are quantized. A call the equivalent doesn't
cover (dropout in training mode, `static_k`/`static_v`) is left as it is, and each of its
projections gets a plan row saying why.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..problem import Problem
from .fx_match import value
from .linear import LinearSite, _module_fqn
from .site import ParamRef

DECOMPOSED = "rewritten as linears + scaled_dot_product_attention"


@dataclass(frozen=True)
class AttentionCall:
    """One opaque op: its arguments by name, its projections (slot, weight, bias), what it can't cover."""

    name: str
    arguments: Callable[[fx.Node], dict]
    projections: Callable[[dict], list[tuple[str, str, str | None]]]
    unsupported: Callable[[dict], str | None]


def _python_arguments(function) -> Callable[[fx.Node], dict]:
    signature = inspect.signature(function)

    def bind(node: fx.Node) -> dict:
        bound = signature.bind(*node.args, **node.kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    return bind


def _schema_arguments(op) -> Callable[[fx.Node], dict]:
    schema = op._schema.arguments

    def bind(node: fx.Node) -> dict:
        values = dict(zip((a.name for a in schema), node.args))
        values.update(node.kwargs)
        for a in schema:
            if a.name not in values:
                values[a.name] = a.default_value if a.has_default_value() else None
        return values

    return bind


def _mha_projections(a: dict) -> list[tuple[str, str, str | None]]:
    if a["use_separate_proj_weight"]:  # q/k/v biases are chunks of in_proj_bias: added by the helper
        qkv = [("q_proj", "q_proj_weight", None), ("k_proj", "k_proj_weight", None), ("v_proj", "v_proj_weight", None)]
        return [*qkv, ("out_proj", "out_proj_weight", "out_proj_bias")]
    return [("in_proj", "in_proj_weight", "in_proj_bias"), ("out_proj", "out_proj_weight", "out_proj_bias")]


def _mha_unsupported(a: dict) -> str | None:
    if a["training"] and (isinstance(a["dropout_p"], fx.Node) or a["dropout_p"] > 0):  # a node: dynamic
        return "dropout in training mode"
    if a["static_k"] is not None or a["static_v"] is not None:
        return "static_k/static_v"
    return None


_IN_OUT = [("in_proj", "qkv_weight", "qkv_bias"), ("out_proj", "proj_weight", "proj_bias")]
MHA = AttentionCall(
    "F.multi_head_attention_forward (nn.MultiheadAttention)",
    _python_arguments(F.multi_head_attention_forward),
    _mha_projections,
    _mha_unsupported,
)
NATIVE_MHA = AttentionCall(
    "torch._native_multi_head_attention",
    _schema_arguments(torch.ops.aten._native_multi_head_attention.default),
    lambda a: _IN_OUT,
    lambda a: None,
)
ENCODER_LAYER = AttentionCall(
    "torch._transformer_encoder_layer_fwd (nn.TransformerEncoderLayer's fast path)",
    _schema_arguments(torch.ops.aten._transformer_encoder_layer_fwd.default),
    lambda a: [*_IN_OUT, ("linear1", "ffn_weight_1", "ffn_bias_1"), ("linear2", "ffn_weight_2", "ffn_bias_2")],
    lambda a: "a nested-tensor input" if getattr(value(a["src"]), "is_nested", False) else None,
)
CALLS = {
    F.multi_head_attention_forward: MHA,
    torch._native_multi_head_attention: NATIVE_MHA,
    torch.ops.aten._native_multi_head_attention.default: NATIVE_MHA,
    torch._transformer_encoder_layer_fwd: ENCODER_LAYER,
    torch.ops.aten._transformer_encoder_layer_fwd.default: ENCODER_LAYER,
}


@dataclass
class ProjectionSite(LinearSite):
    """One projection of an opaque attention call (`node`); `slot` names it among the call's projections."""

    slot: str = ""
    call: AttentionCall | None = None

    @property
    def input_nodes(self) -> list[fx.Node]:
        return []  # the call's output is no projection's: verify runs the projection on a sample


def find_attention_sites(graph: fx.Graph, params: dict[fx.Node, ParamRef], claimed=frozenset()) -> list[LinearSite]:
    """A site per projection weight of every opaque attention call (`CALLS`)."""
    sites = []
    for node in graph.nodes:
        call = CALLS.get(node.target) if node.op == "call_function" and node not in claimed else None
        if call is None:
            continue
        arguments = call.arguments(node)
        unsupported = call.unsupported(arguments)
        for slot, weight_name, bias_name in call.projections(arguments):
            weight = arguments[weight_name]
            stored = value(weight)
            if stored is None or stored.dim() != 2:
                continue
            n, k = (int(d) for d in stored.shape)
            bias = arguments[bias_name] if bias_name else None
            ref = params.get(weight)
            if ref is None:
                fqn, refs = f"{_module_fqn(node, node.name)}.{slot}", []
                reason = "weight is not a parameter (computed in the graph or a buffer)"
            else:
                fqn, refs = ref.name.removesuffix(".weight"), [ref]
                reason = None if unsupported is None else f"inside {call.name} with {unsupported}: not decomposed"
            site = ProjectionSite(fqn, refs, Problem(n, k), reason, node=node, bias=bias, slot=slot, call=call)
            site.notes.append(f"inside {call.name}: {DECOMPOSED}")
            cross = call is not ENCODER_LAYER and not (arguments["query"] is arguments["key"] is arguments["value"])
            if slot == "in_proj" and cross:
                site.notes.append("not self-attention: the packed [3E, E] projection runs on each distinct input")
            sites.append(site)
    return sites
