"""The backends: the contract each one implements (`Backend`) and the module of each backend name.

A backend is a module that provides every member of `Backend`; the defaults below (canonical
layout, no graph-visible op) are bound by name in the modules that need nothing of their own, so
each module states its whole contract. Modules load on first use: no module here imports triton or
flashinfer at import time (docs/design.md §5). Add a backend: a module, its `BackendName` member
(quant_registry/names.py), one `BACKEND_MODULES` row, and its rows in the oracle's candidate tables
(docs/design.md §10).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..quant_registry.names import BACKEND_NAMES, BackendName

if TYPE_CHECKING:
    import torch

    from ..moe_problem import GateUpLayout, MoEProblem
    from ..quant_registry.keys import QuantKey
    from ..quant_registry.qtensor import QTensor
    from .oracle import Capability, Problem

# Each backend's module; the names are `BackendName`'s (quant_registry/names.py), the one list of them.
BACKEND_MODULES = {
    BackendName.REFERENCE: "quantpass.kernels.reference",
    BackendName.NATIVE: "quantpass.kernels.torch_ops",
    BackendName.TRITON: "quantpass.kernels.triton",
    BackendName.CPU: "quantpass.kernels.cpu",
    BackendName.FLASHINFER: "quantpass.kernels.flashinfer",
}
if set(BACKEND_MODULES) != set(BackendName):
    raise ImportError(
        f"kernels/registry.py maps backends {sorted(BACKEND_MODULES)}; quant_registry/names.py's BackendName "
        f"names {sorted(BackendName)}: each backend name needs exactly one module"
    )
BACKENDS = tuple(sorted(BACKEND_MODULES))


@runtime_checkable
class Backend(Protocol):
    """What `oracle.py` and `ops.py` call on a backend module."""

    DEVICES: str  # a human note of where it runs (the real answer is `supports`)

    def supports(
        self, kind: str, capability: Capability, weight: QuantKey, activation: QuantKey | None, problem: Problem
    ) -> tuple[bool, str]:
        """(ok, reason) for a "linear" or "moe" site; the reason says why not (or, when ok, a few words
        on what runs). Pure: no GPU needed to ask."""

    def prepare_weight(self, kind: str, weight: QTensor) -> QTensor:
        """The backend's own layout of a linear weight, computed once per weight and cached; `linear`
        then receives it. Idempotent."""

    def prepare_moe_weights(self, w13: QTensor, w2: QTensor, gate_up_layout: GateUpLayout) -> tuple[QTensor, QTensor]:
        """The same for one MoE layer's experts; `fused_moe` then receives them."""

    def dequantize_prepared(self, weight: QTensor, dtype: torch.dtype) -> torch.Tensor:
        """A prepared weight back as the dense `[..., N, K]` tensor (gradients, restoring)."""

    def linear(self, x: torch.Tensor, weight: QTensor, activation: QuantKey | None, bias: torch.Tensor | None):
        """x `[M, K]` @ weight `[N, K]`.T (+ bias) -> `[M, N]` in x.dtype."""

    def fused_moe(self, problem: MoEProblem) -> torch.Tensor:
        """`problem.hidden` `[T, H]` -> `[T, H]` through the experts (`moe_problem.MoEProblem`; its
        weights as `prepare_moe_weights` left them). Called only for pairs in the oracle's `moe` table."""

    def graph_linear_op(self, device_type: str):
        """A graph-visible callable with `quantpass::linear`'s arguments (e.g. a `triton_op` on CUDA), or
        None for the generic op."""

    def graph_moe_op(self, device_type: str):
        """The same with `quantpass::fused_moe`'s arguments."""


# Defaults a module binds by name (`prepare_weight = registry.keep_layout`).
def keep_layout(kind: str, weight: QTensor) -> QTensor:
    """`prepare_weight` of a backend that runs on the canonical layout (formats.py's)."""
    return weight


def keep_moe_layout(w13: QTensor, w2: QTensor, gate_up_layout: GateUpLayout) -> tuple[QTensor, QTensor]:
    return w13, w2


def dequantize_canonical(weight: QTensor, dtype: torch.dtype) -> torch.Tensor:
    from ..quant_registry.formats import dequantize

    return dequantize(weight, dtype)


def no_graph_op(device_type: str) -> None:
    return None


MEMBERS = tuple(
    name for name in (*Backend.__annotations__, *vars(Backend)) if not name.startswith("_") and name != "DEVICES"
)


_LOADED: dict[str, Backend] = {}  # a plain dict, not functools.cache: Dynamo traces a lookup in it


def backend(name: str) -> Backend:
    """The backend module registered as `name` (imported and checked on first use)."""
    loaded = _LOADED.get(name)
    if loaded is not None:
        return loaded
    if name not in BACKEND_MODULES:
        raise ValueError(f"invalid backend {name!r}; valid: {', '.join(BACKEND_NAMES)}")
    module = importlib.import_module(BACKEND_MODULES[name])
    if not isinstance(module, Backend):
        missing = [m for m in ("DEVICES", *MEMBERS) if not hasattr(module, m)]
        raise TypeError(f"backend module {module.__name__} lacks {', '.join(missing)} (see kernels/registry.Backend)")
    _LOADED[name] = module
    return module
