"""Environment for a test that measures a fresh Python process's resident memory (RSS and its peak)."""

from __future__ import annotations

import os
import sys

# glibc serves every allocation over 128 KiB by mmap and returns freed memory at once, so RSS follows
# what is live. With its default dynamic threshold a freed temporary could stay resident and the same
# run read 5.7-14.7 MiB (a CI failure at 14.7).
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def env() -> dict[str, str]:
    """This process's environment, its import path and the allocator settings above."""
    return {**os.environ, **MALLOC, "PYTHONPATH": os.pathsep.join(sys.path)}
