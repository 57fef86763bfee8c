"""What the kernel benchmarks share: the providers, why one can't run here, timing, the derived numbers.

A provider is `torch_bf16` (the unquantized baseline: `F.linear` / bf16 `grouped_mm` MoE), `torch_fp32`
(linears in fp32) or one of the oracle's backends, called directly (`backend=...`), so each kernel is
measured on its own. Linear `native` and `triton` also come as variants:

- `<backend>_compiled` (target shapes, formats that quantize activations): the graph op a rewritten
  model calls, under `torch.compile` - what users get (Inductor fuses `native`'s activation
  quantization; eager runs it as ~7 separate ops).
- `<backend>_gemm` (formats that quantize activations): the GEMM alone on activations quantized
  beforehand (`torch._scaled_mm` / `F.scaled_mm` / `torch._int_mm` for native, our GEMM kernel for triton).

A provider that can't run a (format, shape) on this device is skipped with the reason its backend's
`supports` gives. On CUDA, decode rows (M <= 16) are timed in a CUDA graph (`do_bench_cudagraph`:
no Python or launch overhead) over copies of the weights whose total passes twice the L2 cache, so
every call reads its weight from HBM; other rows by pytest-benchmark with a synchronized clock.
"""

from __future__ import annotations

import functools
import math
import statistics
import time

import pytest
import torch

from quantpass.kernels import oracle
from quantpass.kernels.registry import BACKEND_MODULES
from quantpass.metrics import sqnr
from quantpass.quant_registry.qtensor import QTensor
from quantpass.quant_registry.spec import QuantSpec

BASELINE = "torch_bf16"
# Linear only, a second unquantized reference: CPUs without bf16 instructions (AVX2) run fp32 GEMMs
# several times faster than bf16 ones, so "vs bf16" alone flatters quantized kernels there.
FP32 = "torch_fp32"
BACKENDS = tuple(BACKEND_MODULES)  # the registry's names, in its order (reference first)
VARIANTS = ("compiled", "gemm")  # linear: `native_compiled`, `triton_gemm`, ...
VARIANT_BACKENDS = ("native", "triton")
DTYPE = torch.bfloat16  # activations and unquantized weights, as served on GPUs
DECODE_MAX_M = 16  # rows up to this are decode rows: CUDA-graph timed, weights rotated past L2
L2_FALLBACK_BYTES = 50 * 2**20  # H200: 50 MB of L2 (not 60), if torch can't say
TRITON_ON_CPU = (
    "Triton runs on CPU only under its interpreter (~5 ms per program per K step); "
    "pass --bench-triton-interpret to measure it anyway"
)


@functools.cache
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def spec_of(format_name: str) -> QuantSpec:
    return QuantSpec.coerce(format_name, "format")


def backend_of(provider: str) -> str:
    """`native_compiled` -> `native`."""
    base, _, variant = provider.rpartition("_")
    return base if variant in VARIANTS and base in VARIANT_BACKENDS else provider


def candidates(kind: str, format_name: str, tag: str = "") -> list[str]:
    """The providers for this format: the backends the oracle's table lists for its key pair (in
    BACKENDS order), each followed by its variants where they apply (linear only)."""
    spec = spec_of(format_name)
    listed = oracle.CANDIDATES[kind].get((spec.weight, spec.activation), [])
    out = []
    for backend in (b for b in BACKENDS if b in listed):
        out.append(backend)
        if kind == "linear" and backend in VARIANT_BACKENDS and spec.activation is not None:
            out += [f"{backend}_compiled"] * (tag == "target") + [f"{backend}_gemm"]
    return out


def cases(kind: str, shapes: list, formats: list[str]) -> tuple[list[tuple], list[str]]:
    """(shape, format, provider) cases in run order, and their ids: per shape, bf16 first (and fp32 for
    linears), then each format's providers."""
    out = []
    for shape in shapes:
        out += [(shape, "", BASELINE)] + [(shape, "", FP32)] * (kind == "linear")
        out += [(shape, name, provider) for name in formats for provider in candidates(kind, name, shape.tag)]
    # ids like M1_N4096_K4096-int8_weight_only-cpu: no '=' or spaces, so `pytest -k` can select them
    ids = [
        f"{s.group.removeprefix(kind + ' ')}-{f or 'unquantized'}-{p}".replace("=", "").replace(" ", "_")
        for s, f, p in out
    ]
    return out, ids


def skip_unless_runnable(record, provider: str, format_name: str, problem: oracle.Problem, **row) -> None:
    """Record a skip row and pytest.skip, with the oracle's reason, when `provider` can't run this
    site (`row["kind"]`) here."""
    why = _refusal(row["kind"], backend_of(provider), format_name, problem)
    if why is not None:
        record(format=format_name, provider=provider, skipped=why, **row)
        pytest.skip(why)


def _refusal(kind: str, backend: str, format_name: str, problem: oracle.Problem) -> str | None:
    spec = spec_of(format_name)
    try:
        module = oracle.backend_module(backend)
    except ImportError as e:
        return f"{backend} could not be imported: {e}"
    capability = oracle.Capability.detect(device())
    ok, why = module.supports(kind, capability, spec.weight, spec.activation, problem)
    if ok:
        return None
    hint = f" ({TRITON_ON_CPU})" if backend == "triton" and capability.device == "cpu" else ""
    return f"{backend}: {why}{hint}"


def l2_bytes() -> int:
    props = torch.cuda.get_device_properties(device()) if device().type == "cuda" else None
    return getattr(props, "L2_cache_size", 0) or L2_FALLBACK_BYTES


def weight_copies(weight_bytes: int, rows: int) -> int:
    """How many copies of a weight a decode row cycles through: enough that the others (2x L2 of
    them) evict each copy from L2 before its next use. 1 off CUDA and for larger M (compute bound)."""
    if device().type != "cuda" or rows > DECODE_MAX_M:
        return 1
    return max(1, math.ceil(2 * l2_bytes() / max(weight_bytes, 1)))


def clone(weight):
    """A copy in new memory (a tensor or a QTensor)."""
    if isinstance(weight, QTensor):
        scale2 = None if weight.scale2 is None else weight.scale2.clone()
        return QTensor(weight.data.clone(), weight.scale.clone(), scale2, weight.key, weight.shape, weight.dtype)
    return weight.clone()


def synchronized_perf_counter() -> float:
    """pytest-benchmark's clock on CUDA: wait for queued kernels, so a round times their execution."""
    torch.cuda.synchronize()
    return time.perf_counter()


def measure(benchmark, record, calls, *, group: str, flops: float, weight_bytes: int, reference: torch.Tensor, **row):
    """Benchmark `calls` (one call per weight copy, `weight_copies`; one warm-up call each first:
    compiles, autotunes), then put TFLOP/s, GB/s of weight bytes and SQNR vs the unquantized fp32
    result into extra_info and `record`."""
    benchmark.group = group
    out = calls[0]()
    accuracy = sqnr(reference, out.float())
    for call in calls[1:]:
        call()
    median, rounds, timing = None, None, "pytest-benchmark"
    if device().type == "cuda" and row.get("m", DECODE_MAX_M + 1) <= DECODE_MAX_M:
        median, rounds, timing = _cuda_graph_median(calls)
        if median is not None:  # timed here, not by the fixture; its private mode stops an "unused" warning
            benchmark._mode = "triton.testing.do_bench_cudagraph"
    if median is None:
        if device().type == "cuda":
            benchmark._timer = synchronized_perf_counter  # pytest-benchmark has no public per-test timer hook
        benchmark(calls[0])
        if benchmark.stats is None:  # --benchmark-disable: ran once, nothing timed
            return
        median, rounds = benchmark.stats.stats.median, benchmark.stats.stats.rounds
    derived = {
        "tflops": flops / median / 1e12,
        "weight_gbps": weight_bytes / median / 1e9,
        "sqnr_db": round(accuracy, 2),
        "weight_bytes": weight_bytes,
        "timing": timing,
    }
    benchmark.extra_info.update(derived)
    record(group=group, median_s=median, rounds=rounds, **row, **derived)


def _cuda_graph_median(calls) -> tuple[float | None, int | None, str]:
    """Median seconds per call of `calls` replayed round-robin from a CUDA graph, or (None, None, why)."""
    import triton.testing

    try:
        times = triton.testing.do_bench_cudagraph(lambda: [call() for call in calls], rep=100, return_mode="all")
    except Exception as e:  # a provider that can't be captured is still timed, by pytest-benchmark
        return None, None, f"pytest-benchmark (CUDA graph capture failed: {type(e).__name__})"
    return statistics.median(times) / 1e3 / len(calls), len(times), f"cuda graph, {len(calls)} weight copies"
