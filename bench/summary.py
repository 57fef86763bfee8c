"""Kernel benchmark results -> tables: speed-up vs bf16 per shape, and the issues' speed targets.

The results file is the CSV bench/conftest.py appends to as each benchmark finishes (so a run cut
short by a time limit still leaves its rows). Speed-ups divide the `torch_bf16` median of the same
shape group by the provider's median: both measured in the same pytest session.

    python bench/summary.py bench/out/kernels.csv [--out bench/out/summary.md] [--pivot]
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass
from pathlib import Path

from quantpass.report import table

BASELINE = "torch_bf16"
FIELDS = [
    "kind", "group", "tag", "format", "provider", "m", "n", "k", "experts", "topk",
    "median_s", "rounds", "tflops", "weight_gbps", "sqnr_db", "weight_bytes", "device", "skipped",
]  # fmt: skip


@dataclass(frozen=True)
class Target:
    what: str
    kind: str
    format: str
    provider: str
    minimum: float  # speed-up vs torch_bf16 on the shape tagged "target" (bench/suites.py)


# fmt: off
TARGETS = [
    Target("FP8 per-row W8A8 linear, M=N=K=8192 (issue 4; native = the oracle's pick on sm90)", "linear", "fp8_per_channel", "native", 1.6),
    Target("block-FP8 Triton GEMM, M=N=K=8192 (issue 4)", "linear", "fp8_per_block", "triton", 1.3),
    Target("Triton FP8 fused MoE, E=64 top-8 H=4096 I=1536 T=4096, vs bf16 grouped_mm (issue 5)", "moe", "fp8_per_channel", "triton", 1.4),
]
# fmt: on


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def timed(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("median_s")]


def with_speedups(rows: list[dict]) -> list[dict]:
    """Timed rows plus `speedup` = the group's torch_bf16 median / this median (None without one)."""
    rows = timed(rows)
    baseline = {r["group"]: float(r["median_s"]) for r in rows if r["provider"] == BASELINE}
    return [
        {**r, "speedup": baseline[r["group"]] / float(r["median_s"]) if r["group"] in baseline else None} for r in rows
    ]


def _fmt(value, spec: str) -> str:
    return "-" if value in (None, "") else format(float(value), spec)


def results_table(rows: list[dict], markdown: bool = False) -> str:
    """One line per (shape, format, provider): median, TFLOP/s, GB/s of weights, SQNR, speed-up vs bf16."""
    lines = [
        [
            r["group"],
            r["format"] or "-",
            r["provider"],
            _fmt(float(r["median_s"]) * 1e3, ".3f"),
            _fmt(r["tflops"], ".3g"),
            _fmt(r["weight_gbps"], ".3g"),
            _fmt(r["sqnr_db"], ".1f"),
            "-" if r["speedup"] is None else f"{r['speedup']:.2f}x",
        ]
        for r in with_speedups(rows)
    ]
    headers = ["shape", "format", "provider", "median ms", "TFLOP/s", "weight GB/s", "SQNR dB", "vs bf16"]
    return table(headers, lines, markdown)


def speedup_pivot(rows: list[dict], kind: str, markdown: bool = False) -> str:
    """One line per (format, provider), one speed-up-vs-bf16 column per shape, then SQNR (dB) per shape."""
    rows = [r for r in with_speedups(rows) if r["kind"] == kind]
    groups = list(dict.fromkeys(r["group"] for r in rows))
    cells = {(r["format"], r["provider"], r["group"]): r for r in rows}
    lines = []
    for format_name, provider in dict.fromkeys((r["format"], r["provider"]) for r in rows):
        found = [cells.get((format_name, provider, g)) for g in groups]
        speeds = ["-" if r is None else f"{r['speedup']:.2f}x" for r in found]
        accuracy = "/".join(_fmt(r["sqnr_db"], ".1f") for r in found if r is not None)
        lines.append([format_name or "unquantized", provider, *speeds, accuracy])
    headers = ["format", "provider", *(g.removeprefix(kind + " ") for g in groups), "SQNR dB"]
    return table(headers, lines, markdown)


def target_results(rows: list[dict]) -> list[list[str]]:
    """[target, measured speed-up, minimum, PASS / FAIL / NOT RUN (why)] per target."""
    measured = {(r["kind"], r["format"], r["provider"]): r for r in with_speedups(rows) if r["tag"] == "target"}
    skipped = {(r["kind"], r["format"], r["provider"]): r["skipped"] for r in rows if r["tag"] == "target"}
    out = []
    for t in TARGETS:
        row = measured.get((t.kind, t.format, t.provider))
        if row is None or row["speedup"] is None:
            why = skipped.get((t.kind, t.format, t.provider)) or "no result (not in this suite, or the run stopped)"
            out.append([t.what, "-", f">= {t.minimum}x", f"NOT RUN ({why})"])
            continue
        status = "PASS" if row["speedup"] >= t.minimum else "FAIL"
        speed = f"{row['speedup']:.2f}x ({float(row['tflops']):.3g} TFLOP/s, {row['group']})"
        out.append([t.what, speed, f">= {t.minimum}x", status])
    return out


def bf16_peak(rows: list[dict]) -> str:
    peaks = [float(r["tflops"]) for r in timed(rows) if r["provider"] == BASELINE and r["kind"] == "linear"]
    return f"{max(peaks):.1f} TFLOP/s" if peaks else "not measured"


def report(rows: list[dict]) -> str:
    devices = sorted({r["device"] for r in rows if r.get("device")}) or ["unknown"]
    return "\n\n".join(
        [
            f"## Kernel benchmarks ({', '.join(devices)})",
            f"bf16 peak measured here (best torch_bf16 linear): {bf16_peak(rows)}",
            results_table(rows, markdown=True),
            "## Targets (speed-up vs torch_bf16 on the shape tagged `target`)",
            table(["target", "measured", "required", "status"], target_results(rows), markdown=True),
        ]
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv", type=Path, nargs="+", help="results files written by the kernel benchmarks")
    parser.add_argument("--out", type=Path, help="write the markdown here as well as to stdout")
    parser.add_argument("--pivot", action="store_true", help="speed-ups as one column per shape instead")
    args = parser.parse_args(argv)
    rows = [row for path in args.csv if path.is_file() for row in read_rows(path)]
    if args.pivot:
        text = "\n\n".join(speedup_pivot(rows, kind, markdown=True) for kind in ("linear", "moe"))
    else:
        text = report(rows)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
