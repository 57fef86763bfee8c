"""One MoE layer's experts as the backends take them: `MoEProblem` (routing, weights, activation key)
and its `GatedActivation` (which activation, how gate and up are laid out, GPT-OSS's constants).

Every backend's `fused_moe(problem)` takes a `MoEProblem` (kernels/registry.Backend); the
`quantpass::fused_moe` op keeps a flat schema (torch.library takes tensors and scalars, not
dataclasses) and `kernels/ops.py` is the one place that packs it into a `MoEProblem`.

This module imports no kernel: detection (`patterns/`) reads the activations and traces
`gated_activation` from here. The names are `StrEnum`s (quant_registry/names.py): a member equals,
prints and serialises as its string ("silu"), so plan rows, JSON and string comparisons are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .quant_registry.names import StrEnum

if TYPE_CHECKING:
    from .quant_registry.keys import QuantKey
    from .quant_registry.qtensor import QTensor


class MoEActivation(StrEnum):
    SILU = "silu"
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    SWIGLUOAI = "swigluoai"  # GPT-OSS: clamped, (up + 1) * gate * sigmoid(alpha * gate)
    SILU_CLAMPED = "silu_clamped"  # DeepSeek-V4: silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


class GateUpLayout(StrEnum):
    """Where gate and up sit along w13's 2I rows."""

    CONCAT = "concat"  # [gate; up]
    INTERLEAVED = "interleaved"  # gate on even rows, up on odd rows (GPT-OSS)


ACTIVATIONS = tuple(MoEActivation)
GATE_UP_LAYOUTS = tuple(GateUpLayout)


def check_gated(activation: str, gate_up_layout: str) -> None:
    """Raise naming the bad value and the valid ones (plain strings pass: a member equals its string)."""
    if gate_up_layout not in GATE_UP_LAYOUTS:
        raise ValueError(f"invalid gate_up_layout {gate_up_layout!r}; valid: {', '.join(GATE_UP_LAYOUTS)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"invalid MoE activation {activation!r}; valid: {', '.join(ACTIVATIONS)}")


@dataclass(frozen=True)
class GatedActivation:
    """[T, 2I] gate/up projections -> [T, I]. `alpha` is `swigluoai`'s, `limit` its and `silu_clamped`'s
    (the others ignore them)."""

    activation: MoEActivation | str
    gate_up_layout: GateUpLayout | str
    alpha: float = 0.0
    limit: float = 0.0

    def __post_init__(self):
        check_gated(self.activation, self.gate_up_layout)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self.gate_up_layout == GateUpLayout.CONCAT:
            gate, up = h.chunk(2, dim=-1)
        else:
            gate, up = h[..., 0::2], h[..., 1::2]
        if self.activation == MoEActivation.SILU:
            return F.silu(gate) * up
        if self.activation == MoEActivation.GELU:
            return F.gelu(gate) * up
        if self.activation == MoEActivation.GELU_TANH:
            return F.gelu(gate, approximate="tanh") * up
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        if self.activation == MoEActivation.SILU_CLAMPED:
            return F.silu(gate) * up
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))  # swigluoai


def gated_activation(h: torch.Tensor, activation: str, gate_up_layout: str, alpha: float, limit: float) -> torch.Tensor:
    """`GatedActivation(activation, gate_up_layout, alpha, limit)(h)`: the form detection traces."""
    return GatedActivation(activation, gate_up_layout, alpha, limit)(h)


@dataclass(frozen=True, eq=False)  # eq=False: tensors don't compare to a bool
class MoEProblem:
    """The experts of one MoE layer, routing already done: hidden [T, H] and topk_weights/ids [T, k]
    -> [T, H].

    w13 [E, 2I, H], w2 [E, H, I] hold the local experts (in the backend's prepared layout), b13 [E, 2I]
    and b2 [E, H] their optional biases. `expert_map` [global E] maps a global expert id to its local
    index, -1 for experts that live elsewhere (they contribute nothing here). `activation_key`
    quantizes each GEMM's input (None: not quantized). The router weight multiplies each expert's
    output, or its input with `apply_router_weight_on_input` (Llama-4).
    """

    hidden: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    w13: QTensor
    w2: QTensor
    gated: GatedActivation
    activation_key: QuantKey | None = None
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    expert_map: torch.Tensor | None = None
    apply_router_weight_on_input: bool = False
