"""Sharded models (torch.distributed): every rank quantizes and runs the shards it holds.

The design is docs/distributed.md. In short: a DTensor parameter is quantized as `param.to_local()`
(a view of this rank's shard: no full weight is ever gathered or allocated), and the graph is first
normalized so that each sharded layer computes on local tensors (`passes/normalize_sharded.py`,
`passes/normalize_expert_parallel.py`); the site finders, kernels and weight cache then work unchanged.
Scale groups are those of the shard: per-channel and per-tensor scales are per shard (no
collective at compile time, and at least as accurate as one scale for the whole tensor); a group
of fixed size must not straddle a shard boundary (`check_shards` raises at compile time).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .quant_registry.spec import SHORTHANDS


def is_dtensor(value) -> bool:
    """Whether `value` is a DTensor, without importing torch.distributed.tensor when it isn't."""
    if not isinstance(value, torch.Tensor) or type(value) in (torch.Tensor, torch.nn.Parameter):
        return False
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def local_tensor(value):
    """The shard this rank holds of a DTensor (a view, no copy), else `value` itself."""
    if not is_dtensor(value):
        return value
    with torch.no_grad():
        return value.to_local()


def like_param(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (values of this rank's shard) as a tensor like `param`: a DTensor for a DTensor."""
    if not is_dtensor(param):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


# ----------------------------------------------------------------------------- graph


def _has_collectives(graph: fx.Graph) -> bool:
    return any(str(n.target).startswith("_c10d_functional.") for n in graph.nodes if n.op == "call_function")


def normalize(gm: fx.GraphModule, example_inputs) -> fx.GraphModule:
    """A copy of Dynamo's graph with its sharded layers spelled on local tensors, or `gm` itself
    when it has none (a single-device graph costs one scan)."""
    if not any(is_dtensor(v) for v in example_inputs) and not _has_collectives(gm.graph):
        return gm
    from .passes.fx_utils import copy_graph_module
    from .passes.normalize_expert_parallel import normalize_expert_parallel
    from .passes.normalize_sharded import functional_all_reduce, localize_linears

    new = copy_graph_module(gm)
    localize_linears(new.graph, example_inputs)
    functional_all_reduce(new.graph)
    normalize_expert_parallel(new.graph)
    new.graph.lint()
    new.recompile()
    return new


def adapt_sites(sites: list, example_inputs) -> list:
    """Sites of a sharded graph as the pass must see them: a weight still used as a DTensor (not
    through `to_local`) is left alone with the reason, expert-parallel MoE sites get their map."""
    from .patterns.expert_parallel import EP_META, ExpertParallelMoESite
    from .patterns.moe import MoESite

    adapted = []
    for site in sites:
        if site.skip_reason is None and any(is_dtensor(_meta_value(ref.node)) for ref in site.params):
            site.skip_reason = _localize_skip(site) or (
                "its weight is a DTensor used as one (not through to_local): quantpass quantizes local shards"
            )
        if isinstance(site, MoESite) and site.skip_reason is None and EP_META in site.topk_ids.meta:
            found = _expert_range(site, example_inputs)
            if found is not None:
                site = ExpertParallelMoESite.from_site(site, *found)
        adapted.append(site)
    return adapted


def _localize_skip(site) -> str | None:
    """Why `localize_linears` left this site's sharded linear alone (it says so on the linear's
    node), or None; only linear sites have such a node."""
    from .patterns.linear import LinearSite

    if isinstance(site, LinearSite) and site.node is not None:
        return site.node.meta.get("quantpass_skip")
    return None


def _meta_value(node):
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def _expert_range(site, example_inputs) -> tuple[int, int] | None:
    """(global experts, first local expert's global id) of an expert-parallel site whose weights are
    DTensors split on the experts dim, consistent with the prologue's constants; else None."""
    experts = site.topk_ids.meta["quantpass_expert_parallel"]
    weight = example_inputs[site.params[0].index]
    if not is_dtensor(weight):
        return None
    local_shape, offset = _local_shape_and_offset(weight)
    if local_shape[0] != experts.local or offset[0] != experts.rank * experts.local:
        return None
    return int(weight.shape[0]), int(offset[0])


def _local_shape_and_offset(value) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)


# ----------------------------------------------------------------------------- plan notes and checks


def rank_and_world(value) -> tuple[int, int]:
    mesh = value.device_mesh
    return (mesh.get_local_rank() if mesh.ndim == 1 else mesh.get_rank()), mesh.size()


def check_shards(site, values, spec) -> list[str]:
    """Plan notes for a site's DTensor weights (`rank r/w, local [N, K] of [N, K] (K split)`);
    raises ValueError when a shard boundary would cut one of the weight format's scale groups."""
    from .patterns.expert_parallel import ExpertParallelMoESite

    sharded = [(ref, value) for ref, value in zip(site.params, values) if is_dtensor(value)]
    if not sharded:
        return []
    rank, world = rank_and_world(sharded[0][1])
    parts, splits = [], set()
    for ref, value in sharded:
        axes = _check_param(site.fqn, ref, value, spec, rank, world)
        splits |= set(axes)
        local, total = (_dims(_matrix_shape(ref, shape)) for shape in (local_tensor(value).shape, value.shape))
        name = ref.name.rsplit(".", 1)[-1] + " " if len(site.params) > 1 else ""
        parts.append(f"{name}local {local} of {total}")
    split = " and ".join(f"{axis} split" for axis in ("experts", "N", "K") if axis in splits) or "replicated"
    note = f"rank {rank}/{world}, {', '.join(parts)} ({split})"
    row, col = spec.weight.group_shape.row, spec.weight.group_shape.col
    whole = [axis for axis, extent in (("N", row), ("K", col)) if extent == -1 and axis in splits]
    if whole or spec.weight.scale2 is not None:
        note += "; scales computed per shard"
    notes = [note]
    if isinstance(site, ExpertParallelMoESite):
        notes.append(site.describe(rank, world))
    return notes


def _dims(shape) -> str:
    return f"[{', '.join(map(str, shape))}]"


def _matrix_shape(ref, shape) -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    return (*shape[:-2], shape[-1], shape[-2]) if ref.transposed else shape


def _check_param(fqn: str, ref, value, spec, rank: int, world: int) -> list[str]:
    """The axes (`experts`, `N`, `K`) this parameter is split on; raises ValueError where a scale
    group of a fixed size (of the weight, or of the activation along K) would straddle a shard
    boundary, naming the formats whose groups fit this shard."""
    ndim = value.ndim
    _, offset = _local_shape_and_offset(value)
    axes = []
    for placement in value.placements:
        strided = type(placement).__name__ == "_StridedShard"
        if not placement.is_shard() and not strided:
            continue
        dim = placement.dim % ndim
        matrix_dim = dim if not ref.transposed or dim < ndim - 2 else (2 * ndim - 3) - dim
        axis = {ndim - 2: "N", ndim - 1: "K"}.get(matrix_dim, "experts")
        axes.append(axis)
        local, total = int(local_tensor(value).shape[dim]), int(value.shape[dim])
        runs = _strided_runs(fqn, value, placement, rank, world) if strided else [(int(offset[dim]), local)]
        cut = [g for g in _groups(spec.weight, spec.activation, axis) if _cuts(g, runs, total)]
        if cut:
            fits = [n for n, pair in SHORTHANDS.items() if not any(_cuts(g, runs, total) for g in _groups(*pair, axis))]
            raise ValueError(
                f"layer {fqn!r}: rank {rank}/{world} holds local {axis}={local} of {total}, which cuts "
                f"{spec.name()}'s scale groups of {cut[0]} along {axis} at a shard boundary; valid formats for "
                f"this shard: {', '.join(fits)} (or a parallel size that splits {axis} into multiples of {cut[0]})"
            )
    return axes


def _strided_runs(fqn: str, value, placement, rank: int, world: int) -> list[tuple[int, int]]:
    """(start, length) of the runs of a `_StridedShard` this rank holds: the dim is cut into
    `split_factor` pieces (a packed gate/up projection: 2), and each piece is sharded like `Shard`."""
    if value.device_mesh.ndim != 1:
        raise ValueError(f"layer {fqn!r}: its weight is {placement!r} on a {value.device_mesh.ndim}-D mesh; "
                         "quantpass shards strided weights on 1-D meshes")  # fmt: skip
    total, pieces = int(value.shape[placement.dim]), placement.split_factor
    piece = total // pieces
    chunk = -(-piece // world)  # torch.chunk's: the last ranks may hold less
    start = min(rank * chunk, piece)
    return [(k * piece + start, min(chunk, piece - start)) for k in range(pieces)]


def _groups(weight, activation, axis: str) -> list[int]:
    """The fixed group sizes along `axis` of a weight key and (along K, which the activation
    shares) its activation key; -1 (the whole extent: the shard's) is left out."""
    if axis == "N":
        sizes = [weight.group_shape.row]
    elif axis == "K":
        sizes = [weight.group_shape.col, *([activation.group_shape.col] if activation is not None else [])]
    else:
        sizes = []
    return [size for size in sizes if size != -1]


def _cuts(group: int, runs: list[tuple[int, int]], total: int) -> bool:
    """Whether a shard (its runs `(start, length)` of `total`) cuts a group of `group`: a group
    may end short only at the tensor's end (the padded last group)."""
    return any(start % group != 0 or ((start + n) % group != 0 and start + n != total) for start, n in runs)
