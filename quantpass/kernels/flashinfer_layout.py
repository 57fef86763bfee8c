"""The weight, scale and routing layouts FlashInfer's MXFP8 kernels read, as pure torch.

No flashinfer import: every function here runs (and is tested) on CPU. Sources of each layout:

- 128x4 scale swizzle: torchao's `to_blocked` (prototype/mx_formats/utils.py), which is TRT-LLM/
  FlashInfer's `get_sf_out_offset_128x4` (csrc/nv_internal/tensorrt_llm/kernels/quantization.cuh) and
  vLLM's `swizzle_mxfp8_scale` byte for byte (tests/test_flashinfer.py checks both). Rows pad to 128,
  scale columns to 4, padding bytes are 0.
- MoE gemm1 rows: FlashInfer's SwiGLU reads `[up; gate]` (silu on the second half: flashinfer
  trace/templates/moe.py), interleaved by `reorder_rows_for_gated_act_gemm` (row 2j = up_j,
  2j+1 = gate_j), then `shuffle_matrix_a` / `shuffle_matrix_sf_a` with epilogue_tile_m = 128
  (flashinfer fused_moe/core.py, utils.py; vLLM `_shuffle_mxfp8_moe_weights`).
- Routed MoE ids: `(expert_id << 16) | bf16(weight).bits` per (token, slot), int32 (flashinfer
  tests/moe `pack_topk_for_routed_moe`).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from ..moe_problem import GATE_UP_LAYOUTS, GateUpLayout
from ..quant_registry.formats import quantize
from ..quant_registry.keys import kMxfp8Dynamic

SCALE_BLOCK = 32  # MX: one e8m0 scale per 32 elements along K
SWIZZLE_ROWS, SWIZZLE_COLS = 128, 4  # one 512-byte tile of the 128x4 scale layout
EPILOGUE_TILE_M = 128  # TRT-LLM MXFP8 MoE (flashinfer tests: "128 for MxFp8, 64 for DeepSeekFp8")


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def swizzled_scale_len(rows: int, scale_cols: int) -> int:
    """Bytes of one swizzled scale matrix (FlashInfer `_mxfp8_swizzled_scale_len`)."""
    return round_up(rows, SWIZZLE_ROWS) * round_up(scale_cols, SWIZZLE_COLS)


@functools.cache
def _blocked_layout():
    """torchao's `to_blocked` / `from_blocked` (imported on first use: torchao takes seconds to import)."""
    from torchao.prototype.mx_formats.utils import from_blocked, to_blocked

    return to_blocked, from_blocked


def swizzle_128x4(scale: torch.Tensor) -> torch.Tensor:
    """`[..., R, C]` one-byte scales -> `[..., swizzled_scale_len(R, C)]`: torchao's `to_blocked` per
    matrix (byte (r, c) to (r//128, c//4, r%32, (r%128)//32, c%4) of the zero-padded tiles). Padded
    here first (torchao's own padding allocates with torch.zeros, which fake CUDA tensors refuse on a
    CPU-only torch): then the matrices' rows stack into whole tiles and take one call."""
    to_blocked, _ = _blocked_layout()
    *batch, rows, cols = scale.shape
    padded = F.pad(scale, (0, -cols % SWIZZLE_COLS, 0, -rows % SWIZZLE_ROWS))  # zero fill
    stacked = padded.reshape(-1, padded.shape[-1]).contiguous()  # to_blocked views its input
    return to_blocked(stacked).reshape(*batch, swizzled_scale_len(rows, cols))


def unswizzle_128x4(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `swizzle_128x4` (torchao's `from_blocked`): `[..., L]` -> `[..., rows, cols]`."""
    _, from_blocked = _blocked_layout()
    *batch, _ = swizzled.shape
    padded_rows, padded_cols = round_up(rows, SWIZZLE_ROWS), round_up(cols, SWIZZLE_COLS)
    matrices = math.prod(batch)
    padded = from_blocked(swizzled.contiguous().reshape(-1), matrices * padded_rows, padded_cols)
    return padded.reshape(*batch, padded_rows, padded_cols)[..., :rows, :cols]


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[M, K]` (K % 32 == 0) -> (e4m3 `[M, K]`, swizzled e8m0 scales), the bytes FlashInfer's
    `mxfp8_quantize(x, is_sf_swizzled_layout=True)` writes: same RCEIL rule as `formats.quantize`;
    an all-zero block gets scale byte 0 as in FlashInfer's kernel (formats' eps clamp gives 79)."""
    qt = quantize(x, kMxfp8Dynamic)
    all_zero = (qt.data.float() == 0).reshape(*qt.scale.shape, SCALE_BLOCK).all(dim=-1)
    scale = torch.where(all_zero, torch.zeros_like(qt.scale), qt.scale)
    return qt.data, swizzle_128x4(scale)


# --- MoE weight preparation: row permutations, composed once, applied to data and scales ---


def gate_up_to_up_gate_index(rows: int, gate_up_layout: str) -> torch.Tensor:
    """Rows of our w13 `[2I, H]` in FlashInfer's `[up; gate]` order: out[r] = w13[index[r]]."""
    half = torch.arange(rows // 2)
    if gate_up_layout == GateUpLayout.CONCAT:  # [gate; up] -> [up; gate] (vLLM `swap_w13_to_w31`)
        return torch.cat([half + rows // 2, half])
    if gate_up_layout == GateUpLayout.INTERLEAVED:  # gate on even rows, up on odd rows (GPT-OSS)
        return torch.cat([2 * half + 1, 2 * half])
    raise ValueError(f"invalid gate_up_layout {gate_up_layout!r}; valid: {', '.join(GATE_UP_LAYOUTS)}")


def gated_act_index(rows: int) -> torch.Tensor:
    """`reorder_rows_for_gated_act_gemm`: [r0..r(N/2-1) | rN/2..] -> [r0, rN/2, r1, rN/2+1, ...]."""
    p = torch.arange(rows)
    return torch.where(p % 2 == 0, p // 2, rows // 2 + p // 2)


def shuffle_index(rows: int, epilogue_tile_m: int = EPILOGUE_TILE_M) -> torch.Tensor:
    """`get_shuffle_matrix_a_row_indices`: within each block of 32 rows (16 when the epilogue tile
    is not a multiple of 128), new row 4q+g (2q+g) takes old row q + 8g (the srcToDstBlk maps)."""
    block = 32 if epilogue_tile_m % 128 == 0 else 16
    if rows % block:
        raise ValueError(f"shuffle needs rows % {block} == 0, got rows={rows}")
    p = torch.arange(rows)
    q = p % block
    return (p // block) * block + (q % 8) * (block // 8) + q // 8


def w13_row_index(rows: int, gate_up_layout: str) -> torch.Tensor:
    """All gemm1 row moves in one index: swap to [up; gate], interleave, shuffle."""
    return gate_up_to_up_gate_index(rows, gate_up_layout)[gated_act_index(rows)][shuffle_index(rows)]


def prepare_moe_tensor(
    data: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """data `[E, R, K]`, scale `[E, R, K/32]` -> rows permuted; scales also 128x4-interleaved per
    expert in place (`shuffle_matrix_sf_a` = row shuffle + `block_scale_interleave`, no padding:
    R % 128 == 0 and (K/32) % 4 == 0 are required). Shapes are unchanged."""
    num_rows, scale_cols = scale.shape[-2:]
    if num_rows % SWIZZLE_ROWS or scale_cols % SWIZZLE_COLS:
        raise ValueError(
            f"MoE scale [{num_rows}, {scale_cols}] per expert must have rows % 128 == 0 and cols % 4 == 0 "
            "(FlashInfer's shuffle_matrix_sf_a does not pad): rows and K must be multiples of 128"
        )
    rows = rows.to(data.device)
    permuted_scale = scale[:, rows].contiguous()
    return data[:, rows].contiguous(), swizzle_128x4(permuted_scale).reshape(scale.shape)


def restore_moe_tensor(
    data: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `prepare_moe_tensor` (for tests and debugging)."""
    inverse = torch.argsort(rows).to(data.device)
    experts, num_rows, scale_cols = scale.shape
    linear_scale = unswizzle_128x4(scale.reshape(experts, -1), num_rows, scale_cols)
    return data[:, inverse].contiguous(), linear_scale[:, inverse].contiguous()


# --- routing ---


def pack_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """`[T, k]` ids and weights -> int32 `(id << 16) | bf16 bits` (the low half masked so a
    negative weight's sign extension can't corrupt the id)."""
    bits = topk_weights.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return (topk_ids.to(torch.int32) << 16) | bits


def local_topk_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor, local_experts: int) -> torch.Tensor:
    """Global expert ids -> local ids through `expert_map` (-1 = not local); non-local slots get id
    `local_experts`, outside the kernel's local range [0, local_experts), so it skips them."""
    local = expert_map.to(topk_ids.device)[topk_ids.long()]
    return torch.where(local < 0, torch.full_like(local, local_experts), local)
