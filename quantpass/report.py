"""Text tables for the command line: formats (from the oracle's tables), and `quantpass run` results."""

from __future__ import annotations

from collections import Counter

from .kernels.oracle import CANDIDATES, REFERENCE_CAPABILITIES, kernel_table
from .measure import Measurement, logits_agreement
from .plan import Plan
from .quant_registry.spec import ROLE_NAMES, SHORTHANDS, QuantizationConfig


def table(headers, rows, markdown: bool = False) -> str:
    rows = [[str(c) for c in row] for row in rows]
    if markdown:
        lines = [headers, ["---"] * len(headers), *rows]
        return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


# -- quantpass formats ----------------------------------------------------------------------------


def format_rows() -> list[list[str]]:
    """One row per (name, kind): name, weight key, activation key, kind, then the backends that
    can run it on each reference device, in the oracle's priority order."""
    backends = {(row["kind"], row["weight"], row["activation"]): row["backends"] for row in kernel_table()}
    names = {pair: name for name, pair in reversed(SHORTHANDS.items())}  # first shorthand per pair wins
    pairs = list(dict.fromkeys([*SHORTHANDS.values(), *(p for table in CANDIDATES.values() for p in table)]))
    rows = []
    for weight, activation in pairs:
        name = names.get((weight, activation)) or _role_spelling(weight, activation)
        for kind in CANDIDATES:
            per_device = backends.get((kind, weight, activation))
            if per_device is None:
                continue
            devices = [", ".join(per_device.get(d, [])) or "-" for d in REFERENCE_CAPABILITIES]
            rows.append([name, str(weight), str(activation) if activation else "-", kind, *devices])
    return rows


def _role_spelling(weight, activation) -> str:
    """A pair with no shorthand, as a config spells it: 'weight=mxfp4, activation=mxfp8'."""
    spelled = []
    for role, key in (("weight", weight), ("activation", activation)):
        name = next((n for n, keys in ROLE_NAMES.items() if keys[("weight", "activation").index(role)] == key), None)
        spelled.append(f"{role}={name or key or 'none'}")
    return ", ".join(spelled)


def formats_table(markdown: bool = False) -> str:
    headers = ["name", "weight key", "activation key", "kind", *REFERENCE_CAPABILITIES]
    return table(headers, format_rows(), markdown)


# -- quantpass run --------------------------------------------------------------------------------


def config_label(config: QuantizationConfig) -> str:
    """'fp8_per_channel' when linears and experts agree, else 'linear X, moe Y'."""
    linear, moe = (None if s is None else s.name() for s in (config.linear, config.moe))
    if linear == moe:
        return linear or "nothing"
    return ", ".join(f"{kind} {name}" for kind, name in (("linear", linear), ("moe", moe)) if name)


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def layers_quantized(plan: Plan) -> str:
    parts = []
    for kind in ("linear", "moe"):
        rows = [r for r in plan.rows if r.kind == kind]
        if rows:
            parts.append(f"{kind} {sum(r.quantized for r in rows)}/{len(rows)}")
    return ", ".join(parts) or "no layers found"


def kernels_used(plan: Plan) -> str:
    counts = Counter(r.backend for r in plan.quantized())
    return ", ".join(f"{backend} {n}" for backend, n in sorted(counts.items())) or "-"


def comparison(baseline: Measurement, quantized: Measurement) -> dict:
    """The numbers a run reports for one format, against the unquantized compiled model."""
    cos, top1 = logits_agreement(baseline.logits, quantized.logits)
    same = sum(a == b for a, b in zip(baseline.tokens, quantized.tokens))
    return {
        "cosine": cos,
        "top1_agreement": top1,
        "generated_tokens_same": same,
        "weight_bytes_ratio": quantized.weight_bytes / baseline.weight_bytes,
        "compile_time_ratio": quantized.compile_seconds / baseline.compile_seconds,
        "prefill_speedup": quantized.prefill_tokens_per_second / baseline.prefill_tokens_per_second,
        "generate_speedup": quantized.generate_tokens_per_second / baseline.generate_tokens_per_second,
    }


def run_table(baseline: Measurement, quantized: Measurement, lowering: str) -> str:
    c = comparison(baseline, quantized)
    new_tokens = len(baseline.tokens)
    rows = [
        ["layers quantized", "-", layers_quantized(quantized.plan), ""],
        ["kernels", lowering, f"{kernels_used(quantized.plan)} (+ {lowering})", ""],
        ["weight bytes", mib(baseline.weight_bytes), mib(quantized.weight_bytes), f"{c['weight_bytes_ratio']:.2f}x"],
        ["logits cosine similarity", "1", f"{c['cosine']:.4f}", ""],
        ["top-1 token agreement", "100.0%", f"{100 * c['top1_agreement']:.1f}%", ""],
        ["greedy tokens identical", f"{new_tokens}/{new_tokens}", f"{c['generated_tokens_same']}/{new_tokens}", ""],
        [
            "compile time (first call)",
            f"{baseline.compile_seconds:.1f} s",
            f"{quantized.compile_seconds:.1f} s",
            f"{c['compile_time_ratio']:.2f}x",
        ],
        [
            "prefill tokens/s",
            f"{baseline.prefill_tokens_per_second:.0f}",
            f"{quantized.prefill_tokens_per_second:.0f}",
            f"{c['prefill_speedup']:.2f}x",
        ],
        [
            f"generate tokens/s ({new_tokens} greedy)",
            f"{baseline.generate_tokens_per_second:.1f}",
            f"{quantized.generate_tokens_per_second:.1f}",
            f"{c['generate_speedup']:.2f}x",
        ],
    ]
    return table(["", "unquantized", quantized.name, "ratio"], rows)


def summary_table(baseline: Measurement, results: list[Measurement]) -> str:
    rows = []
    for m in results:
        c = comparison(baseline, m)
        rows.append(
            [
                m.name,
                layers_quantized(m.plan),
                f"{c['weight_bytes_ratio']:.2f}x",
                f"{c['cosine']:.4f}",
                f"{100 * c['top1_agreement']:.1f}%",
                f"{m.compile_seconds:.1f} s",
                f"{c['generate_speedup']:.2f}x",
            ]
        )
    headers = ["format", "layers quantized", "weight bytes", "cosine", "top-1", "compile", "generate speed"]
    return table(headers, rows)
