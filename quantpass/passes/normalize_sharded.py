"""Tensor-parallel graphs, rewritten into the local computations the site finders match (a pass
that runs before detection: `distributed.normalize`).

A sharded linear reaches quantpass spelled one of two ways (docs/distributed.md):

- local: `F.linear(x, W.to_local())` on the shard this rank holds (transformers' TP hooks at
  inference, MoE experts); `param_refs` binds the `to_local` node to its parameter: nothing to do.
- DTensor: `F.linear(x_dt, W_dt)` (torch's `parallelize_module`, transformers with grad on): DTensor
  computes on the shards behind the op. `localize_linears` spells it out: the activation brought to
  the placement the weight's shard needs, `F.linear` on local tensors, the result wrapped back into a
  DTensor with the placement the original had. The weight is never redistributed (never gathered).

`functional_all_reduce` turns Dynamo's spelling of an in-place `dist.all_reduce(x)`
(`x.copy_(wait_tensor(all_reduce(x)))`) into its functional form, so a region whose output is
all-reduced (tensor-parallel experts) doesn't look written into from outside.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..distributed import is_dtensor
from ..patterns.fx_match import LINEAR_TARGETS, op_name, value

# Ops whose result may share storage with their first operand (casts to the same dtype included).
MAY_ALIAS = {"to", "type", "float", "view", "view_as", "reshape", "contiguous", "flatten", "unsqueeze", "squeeze",
             "expand", "transpose", "permute", "t", "getitem", "narrow", "as_strided", "detach"}  # fmt: skip


def _placements(value) -> tuple:
    return tuple(value.placements)


def _local_input(x, placements: tuple):
    """The shard of activation `x` (a DTensor) a weight shard needs, as a plain tensor."""
    if tuple(x.placements) != placements:
        x = x.redistribute(x.device_mesh, placements)
    return x.to_local()


def _dtensor_output(local, like, placements: tuple, features: int, bias, target: tuple):
    """`local` (this rank's output) as the DTensor the original linear returned: global shape
    `like`'s leading dims x `features`, `bias` (replicated) added after a K-split's partial sums."""
    from torch._prims_common import make_contiguous_strides_for
    from torch.distributed.tensor import DTensor

    shape = (*like.shape[:-1], features)
    out = DTensor.from_local(
        local, like.device_mesh, placements, run_check=False, shape=shape, stride=make_contiguous_strides_for(shape)
    )
    if bias is not None:
        out = out + bias
    return out if tuple(out.placements) == target else out.redistribute(like.device_mesh, target)


def _arg(node: fx.Node, index: int, name: str):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _local_plan(x_value, weight_value, bias_value):
    """(activation placements, output placements, bias locally?) for a DTensor linear, or why not."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if not is_dtensor(x_value):
        return "its weight is a DTensor but its input is not"
    if weight_value.device_mesh.ndim != 1:
        return f"its weight lies on a {weight_value.device_mesh.ndim}-D device mesh; quantpass shards on 1-D meshes"
    (placement,) = weight_value.placements
    last = x_value.ndim - 1
    bias = None if bias_value is None else bias_value.placements[0]
    if type(placement) is Shard and placement.dim % 2 == 0:  # [N, K] rows: each rank computes N/w outputs
        if bias is not None and type(bias) is not Shard:
            return f"its weight is split on N but its bias is {bias}"
        return (Replicate(),), (Shard(last),), True
    if type(placement) is Shard:  # K split: each rank's partial sums, added up by the reduction
        if bias is not None and not bias.is_replicate():
            return f"its weight is split on K but its bias is {bias}"
        return (Shard(last),), (Partial(),), False
    return f"its weight's placement {placement} is not Shard(0) or Shard(1)"


def localize_linears(graph: fx.Graph, example_inputs) -> int:
    """Rewrite each `F.linear` whose weight is a DTensor parameter into a linear on local shards
    (see the module docstring); a linear that can't be gets `meta["quantpass_skip"]` saying why.
    Returns how many were rewritten."""
    placeholders = graph.find_nodes(op="placeholder")
    sharded = {n for n, v in zip(placeholders, example_inputs) if isinstance(v, torch.nn.Parameter) and is_dtensor(v)}
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in LINEAR_TARGETS:
            continue
        x, weight, bias = _arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 2, "bias")
        if weight not in sharded:
            continue
        bias_value = value(bias) if isinstance(bias, fx.Node) else None
        if bias is not None and not is_dtensor(bias_value):
            plan = "its weight is a DTensor but its bias is not"
        else:
            plan = _local_plan(value(x), value(weight), bias_value)
        if isinstance(plan, str):
            node.meta["quantpass_skip"] = f"sharded (DTensor) linear left alone: {plan}"
            continue
        try:
            _localize(graph, node, x, weight, bias, plan)
        except Exception as error:  # tracing the local form on fake values failed: leave it as it is
            node.meta["quantpass_skip"] = f"sharded (DTensor) linear left alone: {type(error).__name__}: {error}"
            continue
        count += 1
    return count


def _localize(graph, node, x, weight, bias, plan) -> None:
    x_placements, out_placements, local_bias = plan
    x_value, weight_value = value(x), value(weight)
    fake_mode = getattr(weight_value.to_local(), "fake_mode", None)  # Dynamo's, which made these values
    with fake_mode or contextlib.nullcontext():
        values = [_local_input(x_value, x_placements), weight_value.to_local()]
        if bias is not None and local_bias:
            values.append(value(bias).to_local())
        out_value = F.linear(*values)
    with graph.inserting_before(node):
        inputs = [
            graph.call_function(_local_input, (x, x_placements)),
            graph.call_method("to_local", (weight,)),
            *([graph.call_method("to_local", (bias,))] if bias is not None and local_bias else []),
        ]
        local = graph.call_function(F.linear, tuple(inputs))
        late_bias = bias if bias is not None and not local_bias else None
        features = int(weight_value.shape[0])
        out = graph.call_function(
            _dtensor_output, (local, x, out_placements, features, late_bias, _placements(value(node)))
        )
    for new, val in zip([*inputs, local], [*values, out_value]):
        new.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "example_value")})
        new.meta["val"] = new.meta["example_value"] = val
    out.meta.update(node.meta)
    node.replace_all_uses_with(out)
    graph.erase_node(node)


# ----------------------------------------------------------------------------- in-place collectives


def _is_collective(node) -> bool:
    return isinstance(node, fx.Node) and str(node.target).startswith("_c10d_functional.")


def functional_all_reduce(graph: fx.Graph) -> int:
    """`x.copy_(wait_tensor(c(x, ...)))` with `c` a functional collective writing back into `x`:
    readers of `x` after the copy read the collective's result instead, and the copy goes. Only
    where nothing can read `x`'s storage through another name after the copy. Returns the count."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    count = 0
    for copy in list(graph.find_nodes(op="call_method", target="copy_")):
        target, source = copy.args[0], copy.args[1] if len(copy.args) > 1 else None
        if copy.users or copy.kwargs or not _waits_on_collective_of(source, target):
            continue
        if not _only_name_after(target, copy, order):
            continue
        for user in [u for u in target.users if order[u] > order[copy]]:
            user.replace_input_with(target, source)
        graph.erase_node(copy)
        count += 1
    return count


def _waits_on_collective_of(source, target) -> bool:
    return (
        isinstance(source, fx.Node)
        and str(source.target).startswith("_c10d_functional.wait_tensor")
        and _is_collective(source.args[0])
        and source.args[0].args[0] is target
    )


def _only_name_after(target: fx.Node, copy: fx.Node, order) -> bool:
    """Whether, after `copy`, `target`'s storage is read only as `target` itself: it is no
    placeholder, no view of it taken before is read after, and nothing it may alias is."""
    if target.op != "call_function" and target.op != "call_method":
        return False
    for user in target.users:
        if user is copy or order[user] > order[copy] or _is_collective(user):
            continue
        if op_name(user) in MAY_ALIAS and any(order[u] > order[copy] for u in user.users):
            return False
    node = target
    while op_name(node) in MAY_ALIAS and isinstance(node.args[0], fx.Node):
        base = node.args[0]
        if base.op == "placeholder" or any(order[u] > order[copy] for u in base.users if u is not node):
            return False
        node = base
    return True
