"""Projections of opaque attention calls lowered: the call becomes its `attention_math` equivalent
(the first time one of its projections is rewritten, every projection a dense slot), and each
quantized projection turns its own slot into the `quantpass::linear` call a linear site would make.
`patterns/attention.py` says which calls and projections there are."""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx

from ..patterns.attention import ENCODER_LAYER, MHA, NATIVE_MHA, AttentionCall, ProjectionSite
from . import attention_math as am
from .lower_linear import LinearLowering


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


# call -> (its attention_math equivalent, (the call's arguments, dense slots) -> the equivalent's kwargs)
DECOMPOSITIONS: dict[AttentionCall, tuple[Callable, Callable[[dict, dict], dict]]] = {
    MHA: (am.multi_head_attention, _mha_kwargs),
    NATIVE_MHA: (am.native_multi_head_attention, _native_kwargs),
    ENCODER_LAYER: (am.transformer_encoder_layer, _encoder_kwargs),
}
HELPERS = {helper for helper, _ in DECOMPOSITIONS.values()}


def _dense_slots(call: AttentionCall, arguments: dict) -> dict:
    return {slot: ("dense", arguments[w], arguments[b] if b else None) for slot, w, b in call.projections(arguments)}


def _decompose(graph: fx.Graph, node: fx.Node, call: AttentionCall) -> fx.Node:
    """Replace the opaque call by its `attention_math` helper with every projection dense."""
    arguments = call.arguments(node)
    helper, helper_kwargs = DECOMPOSITIONS[call]
    with graph.inserting_before(node):
        new = graph.call_function(helper, (), helper_kwargs(arguments, _dense_slots(call, arguments)))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


class ProjectionLowering(LinearLowering):
    """Verify runs a projection as a linear site (its own GEMM on a sample); only the rewrite differs."""

    def rewrite(self, site: ProjectionSite, graph, weights, spec, backend, device_type, differentiable=False):
        node = site.node if site.node.target in HELPERS else _decompose(graph, site.node, site.call)
        op_args = self.op_args(site, None, weights[0], site.bias, spec, backend)[1:]
        node.update_kwarg(site.slot, ("quantized", backend, device_type, differentiable, op_args))
        return node
