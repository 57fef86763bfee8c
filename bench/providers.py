"""What the kernel benchmarks share: the providers, why one can't run here, timing, the derived numbers.

A provider is `torch_bf16` (the unquantized baseline: `F.linear` / bf16 `grouped_mm` MoE), `torch_fp32`
(linears in fp32) or one of the oracle's backends, called directly (`backend=...`), so each kernel is measured on its own. A backend
that can't run a (format, shape) on this device is skipped with the reason its `supports` gives.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch

from quantpass.kernels import oracle
from quantpass.metrics import sqnr
from quantpass.quant_registry.spec import QuantSpec

BASELINE = "torch_bf16"
# Linear only, a second unquantized reference: CPUs without bf16 instructions (AVX2) run fp32 GEMMs
# several times faster than bf16 ones, so "vs bf16" alone flatters quantized kernels there.
FP32 = "torch_fp32"
BACKENDS = ("reference", "native", "triton", "flashinfer", "cpu")
DTYPE = torch.bfloat16  # activations and unquantized weights, as served on GPUs
TRITON_ON_CPU = (
    "Triton runs on CPU only under its interpreter (~5 ms per program per K step); "
    "pass --bench-triton-interpret to measure it anyway"
)


@functools.cache
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def spec_of(format_name: str) -> QuantSpec:
    return QuantSpec.coerce(format_name, "format")


def candidates(kind: str, format_name: str) -> list[str]:
    """The backends the oracle's table lists for this format's key pair, in BACKENDS order."""
    spec = spec_of(format_name)
    listed = oracle.CANDIDATES[kind].get((spec.weight, spec.activation), [])
    return [b for b in BACKENDS if b in listed]


def cases(kind: str, shapes: list, formats: list[str]) -> tuple[list[tuple], list[str]]:
    """(shape, format, provider) cases in run order, and their ids: per shape, bf16 first (and fp32 for
    linears), then each format's backends (the oracle's candidates for its key pair)."""
    out = []
    for shape in shapes:
        out += [(shape, "", BASELINE)] + [(shape, "", FP32)] * (kind == "linear")
        out += [(shape, name, provider) for name in formats for provider in candidates(kind, name)]
    # ids like M1_N4096_K4096-int8_weight_only-cpu: no '=' or spaces, so `pytest -k` can select them
    ids = [
        f"{s.group.removeprefix(kind + ' ')}-{f or 'unquantized'}-{p}".replace("=", "").replace(" ", "_")
        for s, f, p in out
    ]
    return out, ids


def skip_unless_runnable(record, provider: str, format_name: str, problem: oracle.Problem, **row) -> None:
    """Record a skip row and pytest.skip, with the oracle's reason, when `provider` can't run this
    site (`row["kind"]`) here."""
    why = _refusal(row["kind"], provider, format_name, problem)
    if why is not None:
        record(format=format_name, provider=provider, skipped=why, **row)
        pytest.skip(why)


def _refusal(kind: str, provider: str, format_name: str, problem: oracle.Problem) -> str | None:
    spec = spec_of(format_name)
    try:
        module = oracle.backend_module(provider)
    except ImportError as e:
        return f"{provider} could not be imported: {e}"
    capability = oracle.Capability.detect(device())
    ok, why = module.supports(kind, capability, spec.weight, spec.activation, problem)
    if ok:
        return None
    hint = f" ({TRITON_ON_CPU})" if provider == "triton" and capability.device == "cpu" else ""
    return f"{provider}: {why}{hint}"


def synchronized_perf_counter() -> float:
    """pytest-benchmark's clock on CUDA: wait for queued kernels, so a round times their execution."""
    torch.cuda.synchronize()
    return time.perf_counter()


def measure(benchmark, record, fn, *, group: str, flops: float, weight_bytes: int, reference: torch.Tensor, **row):
    """Benchmark `fn` (one warm-up call first: compiles, autotunes, prepares weights), then put
    TFLOP/s, GB/s of weight bytes and SQNR vs the unquantized fp32 result into extra_info and `record`."""
    benchmark.group = group
    out = fn()
    accuracy = sqnr(reference, out.float())
    if device().type == "cuda":
        benchmark._timer = synchronized_perf_counter  # pytest-benchmark has no public per-test timer hook
    benchmark(fn)
    if benchmark.stats is None:  # --benchmark-disable: ran once, nothing timed
        return
    median = benchmark.stats.stats.median
    derived = {
        "tflops": flops / median / 1e12,
        "weight_gbps": weight_bytes / median / 1e9,
        "sqnr_db": round(accuracy, 2),
        "weight_bytes": weight_bytes,
    }
    benchmark.extra_info.update(derived)
    record(group=group, median_s=median, rounds=benchmark.stats.stats.rounds, **row, **derived)
