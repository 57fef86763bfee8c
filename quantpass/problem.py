"""What a matched site asks of a kernel: its sizes and the facts a backend's capability reads.

Pure data, shared by detection (`patterns/` builds one per site) and the oracle (`kernels/oracle.py`
hands it to each backend's `supports`); it lives here so detection doesn't import kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .moe_problem import MoEActivation


@dataclass(frozen=True)
class Problem:
    """The sizes a kernel's capability can depend on. `m` is None when the token count is dynamic.

    linear: n = out features, k = in features. moe: n = intermediate size, k = hidden size.
    """

    n: int
    k: int
    m: int | None = None
    experts: int = 0
    topk: int = 0
    activation: MoEActivation | str | None = None  # moe: the gated activation (moe_problem.ACTIVATIONS)
    has_bias: bool = False  # moe: expert biases
