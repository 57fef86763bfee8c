"""Verify (default on): each distinct (kind, spec, backend, shape) runs once against the original.

The original site (the unquantized layer, computed by the graph's own code for MoE) and the
rewritten op run on one sample input whose statistics follow the example input's; an SQNR below
the format's floor raises `QuantizationError` naming the layer, format, backend and the measured
value. Floors sit far below what a working kernel gives (8-bit ~28-31 dB, 4-bit ~17-20 dB on
Gaussian data), far above what a broken one does (< 5 dB).
"""

from __future__ import annotations

import logging

import torch

from ..metrics import sqnr
from .quantize import QuantizedSite

logger = logging.getLogger("quantpass")

FLOOR_DB = {8: 20.0, 4: 10.0}  # by the narrowest quantized operand's bits


class QuantizationError(RuntimeError):
    """A quantized layer is numerically wrong (verify caught it)."""


def floor_db(q: QuantizedSite) -> float:
    bits = [q.spec.weight.bits] + ([q.spec.activation.bits] if q.spec.activation is not None else [])
    return FLOOR_DB[min(bits)]


def _like(example_inputs) -> torch.Tensor | None:
    """The first floating example input that is not a parameter: the model's activations."""
    for value in example_inputs:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not isinstance(value, torch.nn.Parameter):
            return value
    return None


def verify_sites(sites: list[QuantizedSite], example_inputs) -> dict[str, float]:
    """Measure SQNR once per class of site; raise on the first below its floor. Returns fqn -> dB."""
    like = _like(example_inputs)
    measured, seen = {}, set()
    for q in sites:
        site = q.site
        values = [example_inputs[p.index] for p in site.params]
        token = (site.kind, q.spec.pair, q.backend, site.problem, values[0].dtype)
        if token in seen:
            continue
        seen.add(token)
        with torch.no_grad():
            inputs = site.sample_inputs(like, values[0].device, values[0].dtype)
            original = site.run_original(inputs, values)
            quantized = site.run_quantized(inputs, q.binding.qtensors(example_inputs), q.spec, q.backend, q.device_type)
        value = sqnr(original, quantized)
        measured[site.fqn] = value
        q.row.reason += f"; verified {value:.1f} dB"
        floor = floor_db(q)
        logger.debug("verify %s (%s, %s): %.1f dB (floor %.0f)", site.fqn, q.spec.name(), q.backend, value, floor)
        if not value >= floor:  # also catches NaN
            raise QuantizationError(
                f"layer {site.fqn!r}: {q.spec.name()} on backend {q.backend!r} gives SQNR {value:.1f} dB against "
                f"the unquantized layer, below the {floor:.0f} dB floor for this format; the kernel or the "
                "pattern is wrong: report it, and meanwhile pick another backend or verify=False at your own risk"
            )
    return measured
