"""Reading `torch._convert_weight_to_int4pack_for_cpu`'s layout back, for the cpu backend: only where
aten's INT4 kernel runs (quantpass's can't), for the dequantize path above its largest M; torch has no
public unpack for it.

The layout is the one aten's `weight_to_int4pack_kernel` (aten/src/ATen/native/cpu/int4mm_kernel.cpp,
behind torch._convert_weight_to_int4pack_for_cpu) documents and writes: rows go in blocks of BLOCK_N =
4 x Vectorized<float>::size() of the CPU capability aten dispatches to (64 on AVX512, 32 on AVX2 and on
x86's unvectorized DEFAULT); block i is a [K, rows_i / 2] byte matrix. A full block on AVX512 / AVX2
puts row q in byte q's low nibble and row BLOCK_N/2 + q in its high nibble ("halves"); a short last
block, every block of the DEFAULT kernel and of an MSVC build (its vectorized branches are
`!defined(_MSC_VER)`) pair rows 2j, 2j + 1 ("pairs"). Elsewhere BLOCK_N follows that machine's vector
width, not checked here: INT4 stays on aten's kernel at every M. tests/test_kernels_native_cpu.py
checks every entry against aten's op (ATEN_CPU_CAPABILITY selects each), so a torch that changes the
layout fails there instead of being misread.
"""

from __future__ import annotations

import logging
import platform
import sys

import torch

logger = logging.getLogger("quantpass")

INT4_LAYOUTS = {"AVX512": (64, "halves"), "AVX2": (32, "halves"), "DEFAULT": (32, "pairs")}  # x86-64


def unpack_int4_cpu(packed: torch.Tensor, rows: int, cols: int, layout: tuple[int, str] | None = None) -> torch.Tensor:
    """CPU-packed int4 [N, K/2] -> codes [N, K] uint8 (value + 8), in our row order."""
    block, full_block = layout or int4_layout()
    flat = packed.reshape(-1)
    full_rows = rows // block * block
    parts = []
    if full_rows:
        body = flat[: full_rows * cols // 2].view(full_rows // block, cols, block // 2)
        parts.append(_unpack_blocks(body, full_block))
    if rows > full_rows:
        tail = flat[full_rows * cols // 2 :].view(1, cols, (rows - full_rows) // 2)
        parts.append(_unpack_blocks(tail, "pairs"))
    return torch.cat(parts)


def _unpack_blocks(blocks: torch.Tensor, order: str) -> torch.Tensor:
    """[blocks, K, rows/2] bytes -> [blocks * rows, K] codes (cat/stack write the row order)."""
    low, high = (blocks & 0xF).transpose(1, 2), (blocks >> 4).transpose(1, 2)  # [blocks, rows/2, K]
    if order == "halves":
        codes = torch.cat([low, high], dim=1)  # row q, then row rows/2 + q
    else:
        codes = torch.stack([low, high], dim=2)  # rows 2j, 2j + 1
    return codes.reshape(-1, blocks.shape[1])


def _documented_int4_layout() -> tuple[int, str] | None:
    """The (BLOCK_N, full-block order) aten packs with in this process (`INT4_LAYOUTS`), or None
    where it is not known here (then INT4 stays on torch._weight_int4pack_mm_for_cpu at every M)."""
    capability = torch.backends.cpu.get_cpu_capability()
    layout = INT4_LAYOUTS.get(capability) if platform.machine().lower() in ("x86_64", "amd64") else None
    if layout is None:
        logger.info(
            "torch's int4 CPU packing on %s (%s) is not one quantpass reads back (known: x86-64 %s): INT4 "
            "uses torch._weight_int4pack_mm_for_cpu at every M",
            platform.machine(),
            capability,
            ", ".join(INT4_LAYOUTS),
        )
        return None
    return (layout[0], "pairs") if sys.platform == "win32" else layout


_INT4_LAYOUT = _documented_int4_layout()  # once, at import: Dynamo traces callers but not platform/uname


def int4_layout() -> tuple[int, str] | None:
    """(BLOCK_N, full-block order) aten packs with here, or None where quantpass does not read it back."""
    return _INT4_LAYOUT
