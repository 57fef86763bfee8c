"""Text tables for the command line: formats (from the oracle's tables), and `quantpass run` results."""

from __future__ import annotations

from collections import Counter

from .kernels.oracle import CANDIDATES, REFERENCE_CAPABILITIES, kernel_table
from .measure import Measurement, logits_agreement, speedup
from .plan import Plan
from .quant_registry.named_formats import ROLE_NAMES, SHORTHANDS, format_for
from .quant_registry.names import Kind
from .quant_registry.spec import QuantizationConfig


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
    pairs = list(dict.fromkeys([*SHORTHANDS.values(), *(p for table in CANDIDATES.values() for p in table)]))
    rows = []
    for weight, activation in pairs:
        fmt = format_for((weight, activation))
        name = fmt.name if fmt is not None else _role_spelling(weight, activation)
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
        index = ("weight", "activation").index(role)
        name = None if key is None else next((n for n, keys in ROLE_NAMES.items() if keys[index] == key), None)
        spelled.append(f"{role}={name or key or 'none'}")
    return ", ".join(spelled)


def formats_table(markdown: bool = False) -> str:
    headers = ["name", "weight key", "activation key", "kind", *REFERENCE_CAPABILITIES]
    return table(headers, format_rows(), markdown)


# -- quantpass run --------------------------------------------------------------------------------


def config_label(config: QuantizationConfig) -> str:
    """'fp8_per_channel' when linears and experts agree, else 'linear X, moe Y'; a config that names
    no weight format runs the formats a checkpoint declared."""
    linear, moe = (None if s is None else s.name() for s in (config.linear, config.moe))
    if linear == moe:
        return linear or "the checkpoint's formats"
    return ", ".join(f"{kind} {name}" for kind, name in ((Kind.LINEAR, linear), (Kind.MOE, moe)) if name)


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def layers_quantized(plan: Plan) -> str:
    parts = []
    for kind in Kind:
        rows = [r for r in plan.rows if r.kind == kind]
        if rows:
            parts.append(f"{kind} {sum(r.quantized for r in rows)}/{len(rows)}")
    return ", ".join(parts) or "no layers found"


def kernels_used(plan: Plan) -> str:
    counts = Counter(r.backend for r in plan.quantized())
    return ", ".join(f"{backend} {n}" for backend, n in sorted(counts.items())) or "-"


def comparison(baseline: Measurement, quantized: Measurement) -> dict:
    """The numbers a run reports for one format, against the unquantized compiled model timed in
    the same rounds. Speed-ups: median of the per-round ratios, their range, and whether that range
    includes 1 (noise). The compile-time ratio is None when the two compiles met different states
    of Inductor's kernel cache (`CompileCost.comparable`)."""
    cos, top1 = logits_agreement(baseline.logits, quantized.logits)
    same = sum(a == b for a, b in zip(baseline.tokens, quantized.tokens))
    comparable = baseline.compile.comparable(quantized.compile)
    out = {
        "cosine": cos,
        "top1_agreement": top1,
        "generated_tokens_same": same,
        "weight_bytes_ratio": quantized.weight_bytes / baseline.weight_bytes,
        "resident_bytes_ratio": quantized.resident_bytes / baseline.resident_bytes,
        "compile_time_ratio": quantized.compile_seconds / baseline.compile_seconds if comparable else None,
    }
    for phase in ("prefill", "generate"):
        ratio = speedup(getattr(baseline, f"{phase}_seconds"), getattr(quantized, f"{phase}_seconds"))
        out |= {f"{phase}_speedup": ratio.median, f"{phase}_speedup_range": [ratio.low, ratio.high]}
        out[f"{phase}_speedup_within_noise"] = ratio.noise
    return out


def _rate(m: Measurement, phase: str, digits: int) -> str:
    """'tokens/s median (slowest-fastest round)'."""
    units = m.prompt_tokens if phase == "prefill" else m.new_tokens
    seconds = getattr(m, f"{phase}_seconds")
    median = getattr(m, f"{phase}_tokens_per_second")
    return f"{median:.{digits}f} ({units / max(seconds):.{digits}f}-{units / min(seconds):.{digits}f})"


def _speedup(c: dict, phase: str) -> str:
    low, high = c[f"{phase}_speedup_range"]
    noise = ", within noise" if c[f"{phase}_speedup_within_noise"] else ""
    return f"{c[f'{phase}_speedup']:.2f}x ({low:.2f}-{high:.2f}{noise})"


def _compile_cell(m: Measurement) -> str:
    label = m.compile.label()
    return f"{m.compile_seconds:.1f} s" + (f" ({label})" if label else "")


def run_table(baseline: Measurement, quantized: Measurement, lowering: str) -> str:
    c = comparison(baseline, quantized)
    new_tokens = baseline.new_tokens
    compile_ratio = "-" if c["compile_time_ratio"] is None else f"{c['compile_time_ratio']:.2f}x"
    rows = [
        ["layers quantized", "-", layers_quantized(quantized.plan), ""],
        ["kernels", lowering, f"{kernels_used(quantized.plan)} (+ {lowering})", ""],
        ["weight bytes", mib(baseline.weight_bytes), mib(quantized.weight_bytes), f"{c['weight_bytes_ratio']:.2f}x"],
        [
            "resident weight memory",
            mib(baseline.resident_bytes),
            mib(quantized.resident_bytes),
            f"{c['resident_bytes_ratio']:.2f}x",
        ],
        ["logits cosine similarity", "1", f"{c['cosine']:.4f}", ""],
        ["top-1 token agreement", "100.0%", f"{100 * c['top1_agreement']:.1f}%", ""],
        ["greedy tokens identical", f"{new_tokens}/{new_tokens}", f"{c['generated_tokens_same']}/{new_tokens}", ""],
        ["compile time (first call)", _compile_cell(baseline), _compile_cell(quantized), compile_ratio],
        ["prefill tokens/s", _rate(baseline, "prefill", 0), _rate(quantized, "prefill", 0), _speedup(c, "prefill")],
        [
            f"generate tokens/s ({new_tokens} greedy)",
            _rate(baseline, "generate", 1),
            _rate(quantized, "generate", 1),
            _speedup(c, "generate"),
        ],
    ]
    text = table(["", "unquantized", quantized.name, "ratio"], rows)
    notes = [
        f"tokens/s: median of {len(baseline.prefill_seconds)} rounds (slowest-fastest), the two models alternating"
    ]
    if c["compile_time_ratio"] is None:
        notes.append(
            "compile times not compared: Inductor built kernels from source during at least one of them, "
            "which later compiles reuse from its cache; a second run compares the two with every kernel cached"
        )
    return text + "\n" + "\n".join(f"({note})" for note in notes)


def summary_table(baseline_by_format: list[Measurement], results: list[Measurement]) -> str:
    rows = []
    for baseline, m in zip(baseline_by_format, results):
        c = comparison(baseline, m)
        rows.append(
            [
                m.name,
                layers_quantized(m.plan),
                f"{c['weight_bytes_ratio']:.2f}x",
                f"{c['resident_bytes_ratio']:.2f}x",
                f"{c['cosine']:.4f}",
                f"{100 * c['top1_agreement']:.1f}%",
                f"{c['generated_tokens_same']}/{m.new_tokens}",
                _speedup(c, "prefill"),
                _speedup(c, "generate"),
            ]
        )
    headers = ["format", "layers quantized", "weight bytes", "resident", "cosine", "top-1", "greedy", "prefill speed",
               "generate speed"]  # fmt: skip
    return table(headers, rows)
