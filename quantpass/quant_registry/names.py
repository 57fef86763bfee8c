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


__all__ = ["Kind", "StrEnum"]
