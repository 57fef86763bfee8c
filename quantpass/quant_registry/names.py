"""Closed sets of names as string enums: a member equals, hashes, prints and serialises (JSON, plan
rows) as its string, so code and configs that pass plain strings keep working."""

from __future__ import annotations

import enum

try:
    from enum import StrEnum
except ImportError:  # Python 3.10 (setup.cfg allows it): the same behaviour, spelled out

    class StrEnum(str, enum.Enum):
        def __str__(self) -> str:
            return str(self.value)


class Kind(StrEnum):
    """What a site is: a linear layer, or the experts of one MoE layer."""

    LINEAR = "linear"
    MOE = "moe"


class BackendName(StrEnum):
    """A kernel backend: the one list of their names. `kernels/registry.py` maps each to its module
    and checks at import that it maps exactly these; configs validate against them without
    importing any kernel module."""

    REFERENCE = "reference"
    NATIVE = "native"
    TRITON = "triton"
    CPU = "cpu"
    FLASHINFER = "flashinfer"


BACKEND_NAMES = ("auto", *sorted(BackendName))  # what a config's `backend` may say ("auto": the oracle picks)


__all__ = ["BACKEND_NAMES", "BackendName", "Kind", "StrEnum"]
