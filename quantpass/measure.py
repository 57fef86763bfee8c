"""Measurements shared by `quantpass run` and the model benchmark (bench/model_bench.py).

A quantized model is measured next to the unquantized one compiled with the same lowering in the
same process, and their timings are interleaved round by round, so load on a shared machine hits
both alike. A speed-up is the median of the per-round ratios, reported with their range; a range
that includes 1 is noise. A compile time is compared only with one that met the same state of
Inductor's on-disk kernel cache (`CompileCost.comparable`).
"""

from __future__ import annotations

import copy
import functools
import gc
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, fields, replace

import torch

from .backend import backend as quantpass_backend
from .lowering import lower
from .metrics import cosine
from .plan import Plan
from .presets import unique_parameters
from .quant_registry.spec import QuantizationConfig
from .weight_cache import WEIGHTS

SEQUENCE_DIM = 1  # input_ids are [batch, sequence]
KERNEL_SUFFIXES = (".so", ".cubin", ".hsaco")  # what Inductor builds per kernel (C++ on CPU, Triton on GPUs)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, each counted once."""
    return sum(p.numel() * p.element_size() for p in unique_parameters(model))


def quantized_weight_bytes(model: torch.nn.Module, plan: Plan) -> int:
    """`weight_bytes` with every quantized site's weights replaced by their quantized bytes (data +
    scales). A site compiled in several graphs counts once."""
    sites = {row.fqn: row for row in plan.quantized()}
    return weight_bytes(model) - sum(r.original_bytes for r in sites.values()) + sum(r.bytes for r in sites.values())


def storage_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind the model's parameters and buffers, as allocated now
    (a storage quantpass released counts 0)."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        storages[(storage.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def distinct_sites(plan: Plan) -> Plan:
    """The plan with each (layer, kind) once: a recompiled graph repeats its sites."""
    rows = {}
    for row in plan.rows:
        rows.setdefault((row.fqn, row.kind), row)
    return Plan(list(rows.values()))


def logits_agreement(reference: torch.Tensor, actual: torch.Tensor) -> tuple[float, float]:
    """(cosine similarity, fraction of positions whose top-1 token matches) of two `[..., vocab]` logits."""
    top1 = (reference.argmax(-1) == actual.argmax(-1)).double().mean().item()
    return cosine(reference, actual), top1


def _logits(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, *args, **kwargs):
    """(fn's result, seconds), synchronizing CUDA around the call."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    _sync(device)
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    _sync(device)
    return out, time.perf_counter() - start


@torch.no_grad()
def greedy_generate(forward, ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float]:
    """Greedy decoding without a KV cache (each step re-runs the whole sequence, so one dynamic-shape
    graph serves every step): returns (the new token ids `[batch, new_tokens]`, seconds)."""
    device = ids.device
    _sync(device)
    start = time.perf_counter()
    for _ in range(new_tokens):
        torch._dynamo.mark_dynamic(ids, SEQUENCE_DIM)  # as the prompt was: the same guards, no recompile
        next_token = _logits(forward(ids))[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_token], dim=SEQUENCE_DIM)
    _sync(device)
    return ids[:, -new_tokens:], time.perf_counter() - start


def warm_up(lowering: str, device: str | torch.device = "cpu") -> float:
    """Compile and run a tiny function once, so the first measured compile doesn't also pay the
    lowering's one-time start-up (imports, C++/Triton toolchain checks: ~10 s cold on CPU).
    Returns the seconds it took."""
    if lowering != "inductor":
        return 0.0
    x = torch.randn(8, 8, device=device)
    _, seconds = timed(torch.compile(lambda t: torch.relu(t @ t) + 1, backend="inductor"), x)
    return seconds


# -- compile cost -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompileCost:
    """The first call's seconds, and how many kernels Inductor compiled from source during it
    (None: no Inductor). Inductor's FX graph cache is off for the call (both sides lower from
    scratch), but the kernels it builds stay cached on disk and a later compile reuses them."""

    seconds: float
    kernels_built: int | None = None

    def comparable(self, other: CompileCost) -> bool:
        """Same cache state: no kernel built on either side (or no Inductor on either)."""
        return self.kernels_built == other.kernels_built and self.kernels_built in (None, 0)

    def label(self) -> str:
        if self.kernels_built is None:
            return ""
        return f"built {self.kernels_built} kernel{'s' * (self.kernels_built != 1)}"


def _inductor_kernel_files() -> set[str]:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    found = set()
    for folder, _, files in os.walk(cache_dir()):
        found.update(os.path.join(folder, f) for f in files if f.endswith(KERNEL_SUFFIXES))
    return found


def _first_call(compiled, prompt: torch.Tensor, lowering: str) -> tuple[torch.Tensor, CompileCost]:
    if lowering != "inductor":
        output, seconds = timed(compiled, prompt)
        return output, CompileCost(seconds)
    import torch._inductor.config

    files = _inductor_kernel_files()
    with torch._inductor.config.patch(fx_graph_cache=False):
        output, seconds = timed(compiled, prompt)
    return output, CompileCost(seconds, len(_inductor_kernel_files() - files))


# -- one compiled model, and timing two side by side ---------------------------------------------


@dataclass
class Measurement:
    """One model compiled one way (`config` None: the unquantized baseline) and, once timed next to
    another (`time_side_by_side`), its seconds per round: prefill = best of a few forwards of the
    prompt, generate = one greedy generation of `new_tokens`."""

    name: str
    config: dict | None
    compile: CompileCost
    weight_bytes: int  # parameters, quantized sites at their quantized bytes
    resident_bytes: int  # what the process holds for the weights (`storage_bytes` + quantpass's cache for them)
    prompt_tokens: int
    tokens: list[int] = field(repr=False)
    logits: torch.Tensor = field(repr=False)
    plan: Plan | None = field(default=None, repr=False)
    forward: object = field(default=None, repr=False)
    prefill_seconds: list[float] = field(default_factory=list)
    generate_seconds: list[float] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def compile_seconds(self) -> float:
        return self.compile.seconds

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / statistics.median(self.prefill_seconds)

    @property
    def generate_tokens_per_second(self) -> float:
        return self.new_tokens / statistics.median(self.generate_seconds)

    def to_dict(self) -> dict:
        skip = ("logits", "plan", "forward")  # not JSON; `forward` is a compiled model (asdict would deep-copy it)
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        out["compile"] = asdict(self.compile)
        if self.prefill_seconds:
            out["prefill_tokens_per_second"] = self.prefill_tokens_per_second
            out["generate_tokens_per_second"] = self.generate_tokens_per_second
        out["plan"] = None if self.plan is None else self.plan.to_dicts()
        out["summary"] = None if self.plan is None else self.plan.summary()
        return out


def measure(
    model: torch.nn.Module,
    ids: torch.Tensor,
    config: QuantizationConfig | None = None,
    name: str = "unquantized",
    lowering: str = "inductor",
    new_tokens: int = 8,
    **options,
) -> Measurement:
    """Compile `model` (quantized with `config`, or plain when None) with the sequence dim dynamic;
    time the first call (the compile) and keep its logits and one greedy generation's tokens. The
    compiled forward stays in the result for `time_side_by_side`: Dynamo's cache is not reset, so
    measure each configuration on its own model object (`quantized_copy`)."""
    # The unquantized side gets a plain lowering, not quantpass with no config: Dynamo would take
    # the two backends for equal and serve this graph to a later model of the same class.
    backend = _plain(lowering) if config is None else quantpass_backend(config, lowering=lowering, **options)
    compiled = torch.compile(model, backend=backend)
    prompt = ids.clone()
    torch._dynamo.mark_dynamic(prompt, SEQUENCE_DIM)
    with torch.no_grad():
        output, cost = _first_call(compiled, prompt, lowering)
        tokens, _ = greedy_generate(compiled, ids, new_tokens)
    plan = None if config is None else distinct_sites(backend.plan)
    return Measurement(
        name=name,
        config=None if config is None else config.to_dict(),
        compile=cost,
        weight_bytes=weight_bytes(model) if plan is None else quantized_weight_bytes(model, plan),
        resident_bytes=storage_bytes(model) + WEIGHTS.nbytes(unique_parameters(model)),
        prompt_tokens=ids.shape[SEQUENCE_DIM],
        tokens=tokens.flatten().tolist(),
        logits=_logits(output).float(),
        plan=plan,
        forward=compiled,
    )


@functools.cache
def _plain(lowering: str):
    """One plain backend per lowering: Dynamo takes two calls' backends as equal only if they are the
    same object; a new one per call would recompile (and hit Dynamo's recompile limit) every time."""

    def plain_backend(gm, example_inputs):
        return lower(gm, example_inputs, lowering)

    return plain_backend


def quantized_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` to quantize, so the original stays unquantized next to it (quantpass may
    release a quantized model's original weights)."""
    gc.collect()  # a previous copy's cached quantized weights die with it
    return copy.deepcopy(model)


def time_side_by_side(
    sides: list[Measurement], ids: torch.Tensor, rounds: int = 5, prefill_calls: int = 3
) -> list[Measurement]:
    """Time each side's prefill and generation in `rounds` interleaved rounds (the order of the
    sides reversed every other round); returns copies with `prefill_seconds` / `generate_seconds`
    filled, one entry per round."""
    prefill = [[] for _ in sides]
    generate = [[] for _ in sides]
    with torch.no_grad():
        for round_ in range(rounds):
            order = list(enumerate(sides))[:: -1 if round_ % 2 else 1]
            for i, side in order:
                prefill[i].append(min(timed(side.forward, ids)[1] for _ in range(prefill_calls)))
            for i, side in order:
                generate[i].append(greedy_generate(side.forward, ids, side.new_tokens)[1])
    return [replace(side, prefill_seconds=p, generate_seconds=g) for side, p, g in zip(sides, prefill, generate)]


@dataclass(frozen=True)
class Ratio:
    """`median` of per-round ratios and their range; `noise`: the range includes 1."""

    median: float
    low: float
    high: float

    @property
    def noise(self) -> bool:
        return self.low <= 1.0 <= self.high

    @classmethod
    def of(cls, ratios: list[float]) -> Ratio:
        return cls(statistics.median(ratios), min(ratios), max(ratios))


def speedup(baseline: list[float], other: list[float]) -> Ratio:
    """How many times faster `other` ran than `baseline`, round by round (seconds per round)."""
    return Ratio.of([b / o for b, o in zip(baseline, other)])
