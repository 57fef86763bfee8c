"""Linear sites inside PyTorch's opaque attention ops, so their projections are quantized too.

On torch 2.13 Dynamo keeps `nn.MultiheadAttention` as one `F.multi_head_attention_forward` call
(grad mode or not: its fast path is blocked while Dynamo inlines the module), and in eval under
`torch.no_grad()` keeps `nn.TransformerEncoderLayer` as one `torch._transformer_encoder_layer_fwd`
call, FFN included; `torch._native_multi_head_attention` is the same kind of call when code makes it
itself. No linear pattern sees into them, so their weights were silently left alone.

Each projection weight of such a call becomes a `ProjectionSite`: an ordinary linear site (its own
plan row, FQN, config resolution, backend choice, verify on a sample through its own GEMM) whose
rewrite replaces the call, the first time, by its `attention_math` equivalent with every
projection a dense slot, then turns its own slot quantized. A projection left alone keeps its dense
slot, so one layer can be ignored while the others are quantized. A call the equivalent doesn't
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

from ..kernels.oracle import Problem
from . import attention_math as math_
from .linear import LinearSite, _module_fqn
from .site import ParamRef

DECOMPOSED = "rewritten as linears + scaled_dot_product_attention"


@dataclass(frozen=True)
class _Call:
    """One opaque op: its arguments by name, its projections (slot, weight, bias) and the helper call."""

    name: str
    arguments: Callable[[fx.Node], dict]
    projections: Callable[[dict], list[tuple[str, str, str | None]]]
    unsupported: Callable[[dict], str | None]
    helper: Callable
    helper_kwargs: Callable[[dict, dict], dict]  # (arguments, dense slots) -> the helper's kwargs


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


def _mha_kwargs(a: dict, slots: dict) -> dict:
    keep = ("query", "key", "value", "num_heads", "bias_k", "bias_v", "add_zero_attn", "key_padding_mask")
    keep += ("need_weights", "attn_mask", "average_attn_weights", "is_causal", "dropout_p")
    kwargs = {name: a[name] for name in keep}
    kwargs["in_bias"] = a["in_proj_bias"] if a["use_separate_proj_weight"] else None
    return {**kwargs, **slots}


def _native_kwargs(a: dict, slots: dict) -> dict:
    names = ("query", "key", "value", "mask", "need_weights", "average_attn_weights", "mask_type")
    return {"num_heads": a["num_head"], **{n: a[n] for n in names}, **slots}


def _encoder_kwargs(a: dict, slots: dict) -> dict:
    names = ("src", "num_heads", "use_gelu", "norm_first", "eps", "mask", "mask_type")
    norms = {f"norm{i}": (a[f"norm_weight_{i}"], a[f"norm_bias_{i}"]) for i in (1, 2)}
    return {**{n: a[n] for n in names}, **norms, **slots}


_IN_OUT = [("in_proj", "qkv_weight", "qkv_bias"), ("out_proj", "proj_weight", "proj_bias")]
_MHA = _Call(
    "F.multi_head_attention_forward (nn.MultiheadAttention)",
    _python_arguments(F.multi_head_attention_forward),
    _mha_projections,
    _mha_unsupported,
    math_.multi_head_attention,
    _mha_kwargs,
)
_NATIVE = _Call(
    "torch._native_multi_head_attention",
    _schema_arguments(torch.ops.aten._native_multi_head_attention.default),
    lambda a: _IN_OUT,
    lambda a: None,
    math_.native_multi_head_attention,
    _native_kwargs,
)
_ENCODER = _Call(
    "torch._transformer_encoder_layer_fwd (nn.TransformerEncoderLayer's fast path)",
    _schema_arguments(torch.ops.aten._transformer_encoder_layer_fwd.default),
    lambda a: [*_IN_OUT, ("linear1", "ffn_weight_1", "ffn_bias_1"), ("linear2", "ffn_weight_2", "ffn_bias_2")],
    lambda a: "a nested-tensor input" if getattr(_value(a["src"]), "is_nested", False) else None,
    math_.transformer_encoder_layer,
    _encoder_kwargs,
)
CALLS = {
    F.multi_head_attention_forward: _MHA,
    torch._native_multi_head_attention: _NATIVE,
    torch.ops.aten._native_multi_head_attention.default: _NATIVE,
    torch._transformer_encoder_layer_fwd: _ENCODER,
    torch.ops.aten._transformer_encoder_layer_fwd.default: _ENCODER,
}
HELPERS = {call.helper: call for call in CALLS.values()}


def _value(node):
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


@dataclass
class ProjectionSite(LinearSite):
    """One projection of an opaque attention call (`node`); `slot` names it in the helper's kwargs."""

    slot: str = ""
    call: _Call | None = None

    @property
    def input_nodes(self) -> list[fx.Node]:
        return []  # the call's output is no projection's: verify runs the projection on a sample

    def rewrite(self, graph, weights, spec, backend, device_type, differentiable=False):
        node = self.node if self.node.target in HELPERS else _decompose(graph, self.node, self.call)
        op_args = self._op_args(None, weights[0], self.bias, spec, backend)[1:]
        node.update_kwarg(self.slot, ("quantized", backend, device_type, differentiable, op_args))
        return node


def _dense_slots(call: _Call, arguments: dict) -> dict:
    return {slot: ("dense", arguments[w], arguments[b] if b else None) for slot, w, b in call.projections(arguments)}


def _decompose(graph: fx.Graph, node: fx.Node, call: _Call) -> fx.Node:
    """Replace the opaque call by its `attention_math` helper with every projection dense."""
    arguments = call.arguments(node)
    with graph.inserting_before(node):
        new = graph.call_function(call.helper, (), call.helper_kwargs(arguments, _dense_slots(call, arguments)))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


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
            value = _value(weight)
            if value is None or value.dim() != 2:
                continue
            n, k = (int(d) for d in value.shape)
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
            cross = call is not _ENCODER and not (arguments["query"] is arguments["key"] is arguments["value"])
            if slot == "in_proj" and cross:
                site.notes.append("not self-attention: the packed [3E, E] projection runs on each distinct input")
            sites.append(site)
    return sites
