"""Run one zoo cell (architecture x format) through quantpass and measure it against eager.

A cell compiles the model with `torch.compile(model, backend=qp.backend(linear=FMT, moe=FMT,
lowering="aot_eager"))` (`"inductor"` under `make test-zoo-inductor`) under `torch.no_grad()` (the
object form of `backend="quantpass", options={...}`: the same code path, and it keeps the plans) and
checks three things:

- it runs (no crash while compiling or running);
- its output is close to eager's: cosine >= `COSINE_FLOOR[format][is an MoE model]`;
- it quantizes >= `COVERAGE` of the model's eligible weight layers.

Weight layers are counted from the model, not from the plan, so a layer that never reaches the
pass counts as not quantized: an `nn.Linear`/`Conv1D`, `nn.MultiheadAttention`'s packed input
projection, each 3-D expert weight tensor of an `*experts` module, any other 3-D parameter but a
bias, an embedding or a token (a dim of 1) (XLNet's einsum projections), and any other module's
2-D `weight` (MoE routers). Embeddings, convolutions, norms and biases are not weight layers. A
layer is quantized when every plan row naming it is; it is excluded from the eligible count when its
row says the defaults leave it alone (output head, weight tied to an embedding, MoE router).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from transformers.pytorch_utils import Conv1D
from zoo_models import Arch

import quantpass as qp
from quantpass.metrics import cosine

FORMATS = ("int8_weight_only", "fp8_per_channel", "nvfp4", "mxfp8")
# Floors on the cosine of the model's output to eager's, (dense models, MoE models). Measured over
# every zoo cell that runs (2026-12-01, tests/zoo/generate.py; docs/model-support.md lists each):
# the worst working dense cell gave INT8 weight-only 0.9997, FP8 per-channel 0.9932, NVFP4 0.9108
# (4-bit weights and activations through 2 layers of std-0.1 random weights); the worst MoE cell
# 0.9996 / 0.9728 / 0.8676, lower because a quantized layer before a router flips near-tied top-k
# picks (FP8's 3-bit mantissa: weights at ~31 dB SQNR against INT8's ~44). MXFP8 (W8A8, power-of-two
# scales per 32; added 2026-12-02): worst dense 0.9918, worst MoE 0.9894. The floors leave room
# for other CPUs' rounding. What a broken layer gives: zeroing any one eligible layer of any zoo
# model (eager, 517 layers) drops the cosine below 0.998 for 93% of them, below 0.985 for 79%,
# below 0.85 for 42%. So the end-to-end cosine is the coarse check; verify's per-layer SQNR is the
# fine one.
COSINE_FLOOR = {
    "int8_weight_only": (0.998, 0.998),
    "fp8_per_channel": (0.985, 0.95),
    "nvfp4": (0.85, 0.8),
    "mxfp8": (0.985, 0.95),
}
# The lowering after quantpass's pass: the doc's rows are measured with aot_eager (fast); `make
# test-zoo-inductor` runs the default tier through Inductor, what users run (ZOO_LOWERING=inductor).
DOC_LOWERING = "aot_eager"
LOWERING = os.environ.get("ZOO_LOWERING", DOC_LOWERING)
COVERAGE = 0.9  # the requirement: >= 90% of eligible weight layers quantized
DEFAULT_IGNORE = "left alone by default"
NOT_A_LAYER = (nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)

# Cells that fail today. CAUSES: one line per root cause; KNOWN_FAILURES: architecture (every
# format) or (architecture, format) -> its causes, in the order they bite. The tests mark these
# cells xfail(strict=True), so a fix flips them to a failure until the entry goes; the doc lists the
# causes once and names them in the failing rows.
CAUSES: dict[str, str] = {}  # none today: swin's dict-source-names and the torch shapes' opaque-mha are fixed
KNOWN_FAILURES: dict[str | tuple[str, str], tuple[str, ...]] = {}


def known_causes(arch: str, fmt: str) -> tuple[str, ...]:
    """The root causes of a cell known to fail, or ()."""
    return KNOWN_FAILURES.get((arch, fmt), KNOWN_FAILURES.get(arch, ()))


def known_failure(arch: str, fmt: str) -> str | None:
    """A known-failing cell's diagnosis (its causes' lines), or None."""
    return "; then ".join(CAUSES[c] for c in known_causes(arch, fmt)) or None


@dataclass
class Result:
    """One cell's outcome; `error` (a crash, one normalized line) leaves the numbers unset."""

    arch: str
    format: str
    moe: bool = False
    error: str | None = None
    quantized: int = 0
    eligible: int = 0
    total: int = 0
    moe_quantized: int = 0
    moe_found: int = 0
    cosine: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def failures(self) -> list[str]:
        """The checks this cell fails (empty: it conforms)."""
        if self.error is not None:
            return ["crash"]
        failed = []
        if not (self.cosine is not None and self.cosine >= COSINE_FLOOR[self.format][self.moe]):  # also NaN
            failed.append("cosine")
        if self.quantized < COVERAGE * self.eligible or self.eligible == 0:
            failed.append("coverage")
        return failed


def weight_layers(model: nn.Module) -> list[str]:
    """The model's weight layers, by name (see the module docstring)."""
    layers = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, Conv1D)):
            layers.append(name)
            continue
        if isinstance(module, NOT_A_LAYER):
            continue
        for pname, param in module.named_parameters(recurse=False):
            packed_in_proj = isinstance(module, nn.MultiheadAttention) and pname.endswith("proj_weight")
            matrices = param.dim() == 3 and "bias" not in pname
            experts = matrices and name.endswith("experts")
            einsum = matrices and 1 not in param.shape and "emb" not in pname  # not ViT's cls_token
            if packed_in_proj or experts or einsum:
                layers.append(f"{name}.{pname}" if name else pname)
            elif param.dim() == 2 and pname == "weight":
                layers.append(name)
    return layers


def _rows_by_layer(layers: list[str], plan: qp.Plan) -> tuple[dict[str, list], list]:
    """Each layer's plan rows: a row names a layer exactly, or (an MoE row) the module holding it."""
    by_layer: dict[str, list] = {layer: [] for layer in layers}
    unmatched = []
    for row in plan.rows:
        if row.fqn in by_layer:
            by_layer[row.fqn].append(row)
            continue
        inside = [layer for layer in layers if layer.startswith(row.fqn + ".")]
        for layer in inside:
            by_layer[layer].append(row)
        if not inside:
            unmatched.append(row)
    return by_layer, unmatched


def _short(reason: str) -> str:
    return reason.split(";")[0].removesuffix(" (name it in targets to quantize)")


def count(result: Result, model: nn.Module, plan: qp.Plan) -> None:
    """Fill `result`'s layer counts and notes from the model's weight layers and the plan."""
    layers = weight_layers(model)
    by_layer, unmatched = _rows_by_layer(layers, plan)
    result.total = len(layers)
    excluded, left, unseen = Counter(), Counter(), []
    for layer, rows in by_layer.items():
        if rows and all(row.quantized for row in rows):
            result.quantized += 1
        elif any(DEFAULT_IGNORE in row.reason for row in rows):
            excluded[_short(next(r.reason for r in rows if DEFAULT_IGNORE in r.reason))] += 1
        elif rows:
            left[_short(next(r.reason for r in rows if not r.quantized))] += 1
        else:
            unseen.append(layer)
    result.eligible = result.total - sum(excluded.values())
    moe_rows = [row for row in plan.rows if row.kind == "moe"]
    result.moe_found, result.moe_quantized = len(moe_rows), sum(row.quantized for row in moe_rows)
    result.notes += [f"{n} {why}" for why, n in sorted(excluded.items())]
    result.notes += [f"{n} not quantized: {why}" for why, n in sorted(left.items())]
    if unseen:
        result.notes.append(f"{len(unseen)} never reached the pass (e.g. {unseen[0]})")
    if unmatched:
        result.notes.append(f"plan rows matching no weight layer: {', '.join(sorted({r.fqn for r in unmatched}))}")


def error_line(error: BaseException) -> str:
    """The innermost cause of a crash as one stable line: type, first line, no addresses/counters."""
    while (inner := getattr(error, "inner_exception", None) or error.__cause__) is not None:
        error = inner
    lines = [line for line in str(error).strip().splitlines() if line.strip()] or [""]
    text = f"{type(error).__name__}: {lines[0].strip()}"
    text = re.sub(r"<eval_with_key>\.\d+", "<eval_with_key>", text)
    text = re.sub(r"0x[0-9a-fA-F]+", "0x…", text)
    return text if len(text) <= 160 else text[:159] + "…"


def run_cell(arch: Arch, fmt: str, model: nn.Module | None = None) -> Result:
    """Compile `arch`'s model (built here unless given) with `fmt` and measure it; a crash is
    recorded in the result, never raised."""
    result = Result(arch.name, fmt, arch.moe)
    model, inputs = model if model is not None else arch.build(), arch.inputs()
    options = {"linear": fmt, "lowering": LOWERING, **({"moe": fmt} if arch.moe else {})}
    backend = qp.backend(**options)
    torch._dynamo.reset()
    with torch.no_grad():
        reference = arch.output(model(**inputs))
        try:
            output = arch.output(torch.compile(model, backend=backend)(**inputs))
        except Exception as e:
            result.error = error_line(e)
            return result
        finally:
            torch._dynamo.reset()
    result.cosine = cosine(reference, output)
    count(result, model, backend.plan)
    return result
