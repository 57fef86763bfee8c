"""Running a CPU kernel test on one of a kernel's tile sets (kernels/cpu_avx2.py `int4_tiles`,
kernels/cpu_fp4.py and kernels/cpu_fp8.py `tiles`), skipped where this CPU lacks them."""

from __future__ import annotations

import contextlib

import pytest


@contextlib.contextmanager
def on_tiles(switch, name: str | None):
    """The kernel on tile set `name` for the block (`switch`: the kernel module's tile function; None:
    leave them as they are); skips the test where the CPU lacks those tiles, restores them after."""
    if name is None:
        yield
        return
    before = switch()
    try:
        switch(name)
    except ValueError as error:
        pytest.skip(str(error))
    try:
        yield
    finally:
        switch(before)
