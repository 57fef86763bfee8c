"""Token sorting for the fused MoE (`moe_align`): group token-expert pairs by expert, block-padded.

Plain torch ops, no host synchronisation (sizes are upper bounds known from the shapes, so it
also traces inside a `triton_op`): a scatter-add histogram, a stable argsort, a cumsum, a
searchsorted. A pair is `token * top_k + slot`. Each expert's pairs fill whole BLOCK_M blocks, the
tail padded with the sentinel `num_pairs`, so every GEMM block reads one expert's weights. Pairs
routed to experts that are not local (expert map -1) are gathered into blocks of their own with
expert id -1: the GEMM writes zeros for them, so the combine over top-k needs no mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Routing:
    sorted_ids: torch.Tensor  # [slots] int32: pair ids grouped by expert, each expert padded to block_m
    expert_ids: torch.Tensor  # [slots / block_m] int32: the local expert of each block, -1 = not local
    num_padded: torch.Tensor  # [1] int32: slots in use; blocks past it exit at once
    num_pairs: int  # tokens * top_k: rows of the GEMM outputs, and the padding sentinel
    block_m: int


def local_expert_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """[T, k] global expert ids -> local indices, -1 for experts that live on another rank."""
    if expert_map is None:
        return topk_ids
    return expert_map.to(topk_ids.device)[topk_ids.long()]


def moe_align(local_ids: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """Sort pairs by local expert ([T, k] ids in [-1, num_experts)), padding each expert to block_m."""
    device = local_ids.device
    flat = local_ids.reshape(-1).long()
    num_pairs = flat.numel()
    bucket = torch.where(flat < 0, num_experts, flat)  # non-local pairs: an extra last bucket
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))  # bincount without its host sync
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(bucket, stable=True)  # pair ids, grouped by bucket, in token order
    sorted_bucket = bucket[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_bucket]
    # Every non-empty bucket wastes under block_m slots, and at most min(pairs, buckets) are non-empty.
    slots = -(-(num_pairs + min(num_pairs, num_experts + 1) * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((slots,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[(padded_end - padded)[sorted_bucket] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, slots, block_m, device=device)
    block_bucket = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids = torch.where(block_bucket >= num_experts, -1, block_bucket).to(torch.int32)
    return Routing(sorted_ids, expert_ids, padded_end[-1:].to(torch.int32), num_pairs, block_m)


def decode_routing(local_ids: torch.Tensor, block_m: int) -> Routing:
    """The decode shortcut: one pair per block, no sort. When tokens * top_k is small against the
    number of experts, pairs rarely share an expert, so sorting would save no blocks but costs a
    few kernel launches; each block holds one pair and block_m - 1 sentinels."""
    flat = local_ids.reshape(-1)
    num_pairs = flat.numel()
    sorted_ids = torch.full((num_pairs, block_m), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[:, 0] = torch.arange(num_pairs, dtype=torch.int32, device=flat.device)
    num_padded = torch.full((1,), num_pairs * block_m, dtype=torch.int32, device=flat.device)
    return Routing(sorted_ids.reshape(-1), flat.to(torch.int32), num_padded, num_pairs, block_m)
