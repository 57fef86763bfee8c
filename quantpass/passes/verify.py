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
PATTERN_FLOOR_DB = 10.0  # below this a site is wrong, whatever the reference says (a wrong pattern: ~0 dB)
REFERENCE_MARGIN_DB = 10.0  # a kernel within floor + this of the reference computes the format


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
    original's output there), or on sample inputs when None. Raises below the format's floor, unless
    the format itself loses that much there (`_format_loss`)."""
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
    original = original.reshape(quantized.shape)
    value = sqnr(original, quantized)
    floor = floor_db(q)
    loss = None if value >= floor else _format_loss(q, example_inputs, inputs, original, quantized, value, floor)
    q.row.reason += f"; verified {value:.1f} dB" + ("" if loss is None else f" ({loss})")
    logger.debug("verify %s (%s, %s): %.1f dB (floor %.0f)", site.fqn, q.spec.name(), q.backend, value, floor)
    if not value >= floor and loss is None:  # also catches NaN
        raise QuantizationError(
            f"layer {site.fqn!r}: {q.spec.name()} on backend {q.backend!r} gives SQNR {value:.1f} dB against "
            f"the unquantized layer, below the {floor:.0f} dB floor for this format; the kernel or the "
            "pattern is wrong: report it, and meanwhile pick another backend or verify=False at your own risk"
        )
    return value


def _format_loss(q, example_inputs, inputs, original, quantized, value: float, floor: float) -> str | None:
    """Why a site below its floor is still right, or None: the reference backend, quantizing the same
    weights the same way, loses as much on these activations and the kernel matches it within
    `REFERENCE_MARGIN_DB` of the floor. CvT's 2-label classifier in FP8 gave 12.9-16.7 dB on its real
    activations, as hand fake-quantization does (its 4 outputs small against the products they sum:
    they cancel), and the compile raised. Never below
    `PATTERN_FLOOR_DB`: a wrong pattern (the kernel and the reference computing the same wrong thing)
    gives ~0 dB."""
    from .quantize import quantized_weight  # the pass imports verify

    site, lowering, backend = q.site, q.lowering, "reference"
    if q.backend == backend or not value >= PATTERN_FLOOR_DB:
        return None
    try:
        with torch.no_grad():
            params = [example_inputs[p.index] for p in site.params]
            canonical = [quantized_weight(p, ref, q.spec) for p, ref in zip(params, site.params)]
            weights = lowering.prepare(site, canonical, q.spec, backend)
            expected = lowering.run_quantized(site, inputs, weights, q.spec, backend, q.device_type)
    except Exception:  # no reference for this site: no second opinion
        logger.debug("verify %s: no reference run", site.fqn, exc_info=True)
        return None
    agree, format_db = sqnr(expected, quantized), sqnr(original, expected)
    if not agree >= floor + REFERENCE_MARGIN_DB:
        return None
    logger.warning(
        "quantpass: layer %r: %s gives %.1f dB against the unquantized layer on the activations that reach "
        "it, below the %.0f dB floor, and so does the format itself (the reference: %.1f dB; the %s kernel "
        "matches it, %.1f dB): this layer loses accuracy in this format; name it in `ignore` to keep it "
        "unquantized",
        site.fqn, q.spec.name(), value, floor, format_db, q.backend, agree,
    )  # fmt: skip
    return f"below the {floor:.0f} dB floor as the format itself: the reference {format_db:.1f} dB, kernel vs it {agree:.1f} dB"


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
