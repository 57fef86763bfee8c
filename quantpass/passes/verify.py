"""Verify (default on): each distinct (kind, spec, backend, shape) is checked once against the original.

The rewritten op runs on the activations that reach the site in the example call (build.py runs
Dynamo's graph alongside, up to `VERIFY_ROWS` rows of them) and its output is compared with what
the original layer computed there; where the graph can't be run, on a sample input whose
statistics follow the example input's. An SQNR below the format's floor raises `QuantizationError`
naming the layer, format, backend and the measured value. Floors sit far below what a working
kernel gives (8-bit ~28-31 dB, 4-bit ~17-20 dB on Gaussian data), far above what a broken one does
(< 5 dB).
"""

from __future__ import annotations

import logging

import torch

from ..distributed import local_tensor
from ..metrics import sqnr
from ..quant_registry import named_formats
from ..quant_registry.formats import ELEMENTS
from ..quant_registry.keys import needs_input_scale
from ..weight_cache import WEIGHTS

logger = logging.getLogger("quantpass")

VERIFY_ROWS = 32  # activation rows a site is verified on


class QuantizationError(RuntimeError):
    """A quantized layer is numerically wrong (verify caught it)."""


def floor_db(q) -> float:
    return named_formats.floor_db(q.spec.weight, q.spec.activation)


def verify_token(q, example_inputs) -> tuple:
    """Sites with the same token are checked once: the first one stands for the rest."""
    site = q.site
    return (site.kind, q.spec.pair, q.backend, site.problem, example_inputs[site.params[0].index].dtype)


def rows(value):
    """Up to `VERIFY_ROWS` leading rows of an activation, as a `[rows, last dim]` copy (a vector,
    e.g. a bias, as it is)."""
    if not isinstance(value, torch.Tensor) or value.dim() <= 1:
        return value.detach().clone() if isinstance(value, torch.Tensor) else value
    return value.detach().reshape(-1, value.shape[-1])[:VERIFY_ROWS].clone()


def verify_site(q, example_inputs, inputs=None, original=None) -> float:
    """SQNR of the quantized site against the original on `inputs` (real activations, with the
    original's output there), or on sample inputs when None. Raises below the format's floor."""
    site, lowering = q.site, q.lowering
    values = [example_inputs[p.index] for p in site.params]
    with torch.no_grad():
        if inputs is None:
            inputs = lowering.sample_inputs(site, _like(example_inputs), values[0].device, values[0].dtype)
            inputs[0] = _calibrated(inputs[0], q, example_inputs)
            values = [WEIGHTS.dense(v) if WEIGHTS.is_released(v) else v for v in values]  # a recompile's
            values = [local_tensor(v) for v in values]  # a sharded weight: the shard the site computes with
            original = lowering.run_original(site, inputs, values)
        qtensors = q.binding.qtensors(example_inputs)
        quantized = lowering.run_quantized(site, inputs, qtensors, q.spec, q.backend, q.device_type)
    value = sqnr(original.reshape(quantized.shape), quantized)
    q.row.reason += f"; verified {value:.1f} dB"
    floor = floor_db(q)
    logger.debug("verify %s (%s, %s): %.1f dB (floor %.0f)", site.fqn, q.spec.name(), q.backend, value, floor)
    if not value >= floor:  # also catches NaN
        raise QuantizationError(
            f"layer {site.fqn!r}: {q.spec.name()} on backend {q.backend!r} gives SQNR {value:.1f} dB against "
            f"the unquantized layer, below the {floor:.0f} dB floor for this format; the kernel or the "
            "pattern is wrong: report it, and meanwhile pick another backend or verify=False at your own risk"
        )
    return value


def _calibrated(x: torch.Tensor, q, example_inputs) -> torch.Tensor:
    """Sample activations for a static activation scale (a checkpoint's calibrated `input_scale`)
    spanning the range it was calibrated for: any other range measures clipping, not the kernel."""
    key = q.spec.activation
    if not needs_input_scale(key):
        return x
    input_scale = q.binding.qtensors(example_inputs)[0].input_scale.float().max()
    amax = input_scale * ELEMENTS[key.dtype].max * (ELEMENTS[key.scale.dtype].max if key.scale2 is not None else 1)
    return (x.float() * (amax / x.float().abs().amax().clamp(min=1e-12))).to(x.dtype)


def _like(example_inputs) -> torch.Tensor | None:
    """The first floating example input that is not a parameter: the model's activations."""
    for value in example_inputs:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not isinstance(value, torch.nn.Parameter):
            return value
    return None
