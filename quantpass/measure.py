"""Measurements shared by `quantpass run` and the model benchmark (bench/model_bench.py).

Every quantized number is paired with the unquantized *compiled* model measured in the same
process, so ratios compare like with like (same lowering, same machine load).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from .backend import backend as quantpass_backend
from .metrics import cosine
from .plan import Plan
from .presets import unique_parameters
from .quant_registry.spec import QuantizationConfig

SEQUENCE_DIM = 1  # input_ids are [batch, sequence]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, each counted once."""
    return sum(p.numel() * p.element_size() for p in unique_parameters(model))


def quantized_weight_bytes(model: torch.nn.Module, plan: Plan) -> int:
    """`weight_bytes` with every quantized site's weights replaced by their quantized bytes (data +
    scales). A site compiled in several graphs counts once."""
    sites = {row.fqn: row for row in plan.quantized()}
    return weight_bytes(model) - sum(r.original_bytes for r in sites.values()) + sum(r.bytes for r in sites.values())


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


@dataclass
class Measurement:
    """One model compiled one way. `config` is None for the unquantized baseline."""

    name: str
    config: dict | None
    compile_seconds: float
    prefill_tokens_per_second: float
    generate_tokens_per_second: float
    weight_bytes: int
    tokens: list[int] = field(repr=False)
    logits: torch.Tensor = field(repr=False)
    plan: Plan | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("logits", "plan")}
        out["plan"] = None if self.plan is None else self.plan.to_dicts()
        out["summary"] = None if self.plan is None else self.plan.summary()
        return out


def measure(
    model: torch.nn.Module,
    ids: torch.Tensor,
    config: QuantizationConfig | None = None,
    name: str = "unquantized",
    lowering: str = "inductor",
    new_tokens: int = 16,
    prefill_repeats: int = 3,
    **options,
) -> Measurement:
    """Compile `model` (quantized with `config`, or plain when None) with the sequence dim dynamic,
    then time the compile (first call), prefill and a greedy generation of `new_tokens`."""
    torch._dynamo.reset()  # a clean cache: every compile is timed from scratch, none is reused
    backend = quantpass_backend(config, lowering=lowering, **options)
    compiled = torch.compile(model, backend=backend)
    prompt = ids.clone()
    torch._dynamo.mark_dynamic(prompt, SEQUENCE_DIM)
    with torch.no_grad():
        output, compile_seconds = timed(compiled, prompt)
        logits = _logits(output).float()
        prefill = [timed(compiled, ids)[1] for _ in range(prefill_repeats)]
        tokens, generate_seconds = greedy_generate(compiled, ids, new_tokens)
    plan = None if config is None else distinct_sites(backend.plan)
    return Measurement(
        name=name,
        config=None if config is None else config.to_dict(),
        compile_seconds=compile_seconds,
        prefill_tokens_per_second=ids.numel() / min(prefill),
        generate_tokens_per_second=tokens.numel() / generate_seconds,
        weight_bytes=weight_bytes(model) if plan is None else quantized_weight_bytes(model, plan),
        tokens=tokens.flatten().tolist(),
        logits=logits,
        plan=plan,
    )
