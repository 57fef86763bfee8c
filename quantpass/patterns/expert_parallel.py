"""Expert parallelism: each rank holds E/world experts; its fused MoE op runs them with an `expert_map`.

transformers' expert-parallel experts (`DistributedConfig(ep_size=...)`, its `AllReduceEP` at
inference: every rank of the group holds the same batch) reach the graph as the single-device
experts on this rank's local weights, behind a prologue that turns global expert ids into local
ones and parks the other ranks' routes on a sentinel id (E_l) with router weight 0:

    local = torch.where(ids // E_l != rank, E_l, ids % E_l);  weights = weights.masked_fill(ids // E_l != rank, 0)

and, inside the experts, masks for the sentinel rows (`ids_g >= E_l`: `masked_fill`, `clamp_`). The
outputs are then summed over ranks by an all-reduce. This module matches the prologue (`prologue`)
and the masks (`sentinel_edits`); the pass `passes/normalize_expert_parallel.py` then parks those
routes on the last local expert instead (still with weight 0: same output), which makes every
sentinel mask provably empty: the masks go and the experts are the single-device form the MoE finder
proves. `ExpertParallelMoESite` then runs that site from the *global* ids with an `expert_map`
(global id -> local index, -1 elsewhere: docs/distributed.md), so other ranks' routes cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.fx as fx

from .fx_match import op_name
from .moe import MoESite
from .moe_interpreter import ids_root

EP_META = "quantpass_expert_parallel"  # on the normalized `where`: its LocalExperts
SENTINEL_META = "quantpass_sentinel"  # on each sentinel mask `sentinel_edits` found
MASK_VIEWS = {"unsqueeze", "expand", "view", "reshape", "expand_as"}


@dataclass(frozen=True)
class LocalExperts:
    local: int  # E_l experts on this rank
    rank: int  # this rank's index in the expert group: it holds experts [rank * E_l, (rank + 1) * E_l)


def global_ids(where: fx.Node) -> fx.Node:
    """The [T, k] global expert ids a (normalized) prologue reads: `ids` of its `ids % E_l`."""
    return where.args[2].args[0]


def prologue(where: fx.Node) -> LocalExperts | None:
    """`torch.where(ids // E_l != r, E_l, ids % E_l)` -> (E_l, r), else None."""
    if len(where.args) != 3 or where.kwargs:
        return None
    condition, sentinel, local = where.args
    if not isinstance(sentinel, int) or op_name(local) != "mod" or local.args[1] != sentinel:
        return None
    ids = local.args[0]
    if op_name(condition) != "ne" or not isinstance(condition.args[1], int):
        return None
    quotient = condition.args[0]
    if op_name(quotient) != "floordiv" or quotient.args[0] is not ids or quotient.args[1] != sentinel:
        return None
    return LocalExperts(sentinel, condition.args[1])


def _from_normalized(node, where: fx.Node) -> bool:
    return ids_root(node) is where


def sentinel_edits(graph: fx.Graph, where: fx.Node, local: int) -> list[tuple[fx.Node, fx.Node | None]] | None:
    """(node to remove, what its readers read instead or None) for every masked fill and clamp of
    the sentinel rows fed by `where`, in graph order (the masks themselves get `SENTINEL_META`);
    None when a mask reaches something else."""
    edits = []
    for node in graph.nodes:
        name = op_name(node)
        if name in ("ge", "__ge__"):
            data, bound = node.args[:2]
            if not (isinstance(bound, int) and bound >= local and _from_normalized(data, where)):
                continue
            masks, stack = [], [node]
            while stack:
                mask = stack.pop()
                masks.append(mask)
                for user in mask.users:
                    if op_name(user) in MASK_VIEWS and user.args[0] is mask:
                        stack.append(user)
                    elif op_name(user) in ("masked_fill", "masked_fill_") and user.args[1] is mask:
                        edits.append((user, None if op_name(user) == "masked_fill_" else user.args[0]))
                    else:
                        return None
            for mask in masks:
                mask.meta[SENTINEL_META] = True
        elif name in ("clamp", "clamp_") and _from_normalized(node.args[0], where):
            bounds = dict(zip(("min", "max"), node.args[1:])) | dict(node.kwargs)
            low, high = bounds.get("min"), bounds.get("max")
            if (low is None or low <= 0) and (high is None or high >= local - 1):
                edits.append((node, None if name == "clamp_" else node.args[0]))
    if any(op_name(node) in ("masked_fill_", "clamp_") and node.users for node, _ in edits):
        return None
    order = {node: i for i, node in enumerate(graph.nodes)}
    return sorted(edits, key=lambda edit: order[edit[0]])


def expert_map(experts: int, first: int, local: int, device) -> torch.Tensor:
    """[experts] int32: global expert id -> its index among this rank's `local` experts (which
    start at global id `first`), -1 for the experts other ranks hold."""
    ids = torch.arange(experts, dtype=torch.int32, device=device) - first
    return torch.where((ids >= 0) & (ids < local), ids, -1)


@dataclass
class ExpertParallelMoESite(MoESite):
    """An MoE site on this rank's experts, called with global ids and an `expert_map`.

    `topk_ids` are the global ids; `local_ids` the normalized local ones the proven region
    (`original`, used by verify's sample path) reads."""

    local_ids: fx.Node | None = None
    global_experts: int = 0
    first_expert: int = 0

    @classmethod
    def from_site(cls, site: MoESite, global_experts: int, first_expert: int) -> ExpertParallelMoESite:
        # `dataclasses.replace` keeps the class: this builds the subclass from the site's field values
        moved = {f.name: getattr(site, f.name) for f in fields(site)}
        moved.update(topk_ids=global_ids(site.topk_ids), local_ids=site.topk_ids)
        return cls(**moved, global_experts=global_experts, first_expert=first_expert)

    def describe(self, rank: int, world: int) -> str:
        last = self.first_expert + self.problem.experts
        return (
            f"expert parallel: rank {rank}/{world} runs experts [{self.first_expert}, {last}) of "
            f"{self.global_experts} (expert_map: global id -> local)"
        )

    def expert_map(self, device) -> torch.Tensor:
        return expert_map(self.global_experts, self.first_expert, self.problem.experts, device)
