"""Kernel benchmark results -> tables: speed-up vs bf16 per shape, accuracy gates, the issues' speed targets.

The results file is the CSV bench/conftest.py appends to as each benchmark finishes (so a run cut
short by a time limit still leaves its rows). Speed-ups divide the `torch_bf16` median of the same
shape group by the provider's median: both measured in the same pytest session. Every row's SQNR
(vs the unquantized fp32 result) is gated against its format's floor (`SQNR_FLOORS`): PASS / FAIL.

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
    "median_s", "rounds", "tflops", "weight_gbps", "sqnr_db", "weight_bytes", "timing", "device", "skipped",
]  # fmt: skip

# Accuracy floors, dB of SQNR against the unquantized fp32 result, per format: (linear, moe). Each is
# the minimum measured with the reference backend (3 seeds; linear M=64 N=K=1024, MoE E=8 top-2 H=512
# I=256 T=64; weights std 0.02, bf16; 2026-12-01) less 3 dB. The bf16 baseline's are its CPU rows
# (55.6 / 45.4 dB) less a chosen 15 / 10 dB (not measured on a GPU: its accumulation order differs).
# fmt: off
SQNR_FLOORS = {
    "": (40.0, 35.0),  # unquantized: torch_bf16 / torch_fp32
    "fp8_per_tensor": (25.0, 20.0), "fp8_per_channel": (25.0, 20.0), "fp8_per_block": (25.0, 20.0),
    "mxfp8": (25.0, 20.0), "nvfp4": (14.0, 9.0), "int8_per_channel": (36.0, 30.0), "mxfp4": (16.0, 11.0),
    "fp8_weight_only": (28.0, 23.0), "int8_weight_only": (38.0, 34.0), "int4_weight_only": (16.0, 11.0),
    "nvfp4_weight_only": (17.0, 12.0),
}
# fmt: on


@dataclass(frozen=True)
class Target:
    what: str
    kind: str
    format: str
    provider: str
    minimum: float  # speed-up vs `baseline` on the shape tagged "target" (bench/suites.py)
    baseline: str = BASELINE  # a provider; "" = torch_bf16 of the unquantized rows
    baseline_format: str = ""  # the baseline row's format ("" for the unquantized providers)


# fmt: off
TARGETS = [
    Target("FP8 per-row W8A8 linear, M=N=K=8192, as users run it (torch.compile: Inductor fuses the activation quantization; issue 4)", "linear", "fp8_per_channel", "native_compiled", 1.6),
    Target("block-FP8 Triton GEMM, M=N=K=8192 (issue 4)", "linear", "fp8_per_block", "triton", 1.3),
    Target("Triton FP8 per-row GEMM vs torch._scaled_mm, pre-quantized activations, M=N=K=8192 (issue 14)", "linear", "fp8_per_channel", "triton_gemm", 0.9, "native_gemm", "fp8_per_channel"),
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


def accuracy(row: dict) -> tuple[float | None, str]:
    """(floor, "PASS" / "FAIL" / "-") of a timed row's SQNR against its format's floor."""
    floors = SQNR_FLOORS.get(row["format"])
    if floors is None or row.get("sqnr_db") in (None, ""):
        return None, "-"
    floor = floors[row["kind"] == "moe"]
    return floor, "PASS" if float(row["sqnr_db"]) >= floor else "FAIL"


def _fmt(value, spec: str) -> str:
    return "-" if value in (None, "") else format(float(value), spec)


def results_table(rows: list[dict], markdown: bool = False) -> str:
    """One line per (shape, format, provider): median, TFLOP/s, GB/s of weights, SQNR and its gate,
    speed-up vs bf16, how it was timed."""
    lines = []
    for r in with_speedups(rows):
        floor, gate = accuracy(r)
        lines.append(
            [
                r["group"],
                r["format"] or "-",
                r["provider"],
                _fmt(float(r["median_s"]) * 1e3, ".4f"),
                _fmt(r["tflops"], ".3g"),
                _fmt(r["weight_gbps"], ".3g"),
                _fmt(r["sqnr_db"], ".1f"),
                f"{gate} (>= {floor:g})" if floor is not None else gate,
                "-" if r["speedup"] is None else f"{r['speedup']:.2f}x",
                r.get("timing") or "-",
            ]
        )
    headers = ["shape", "format", "provider", "median ms", "TFLOP/s", "weight GB/s", "SQNR dB", "accuracy", "vs bf16", "timing"]  # fmt: skip
    return table(headers, lines, markdown)


def accuracy_counts(rows: list[dict]) -> str:
    gates = [accuracy(r)[1] for r in timed(rows)]
    failed = [f"{r['group']} {r['format']} {r['provider']}" for r in timed(rows) if accuracy(r)[1] == "FAIL"]
    return f"accuracy: {gates.count('PASS')} PASS, {gates.count('FAIL')} FAIL" + (
        f" ({'; '.join(failed)})" if failed else ""
    )


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
    measured = {(r["kind"], r["format"], r["provider"]): r for r in timed(rows) if r["tag"] == "target"}
    skipped = {(r["kind"], r["format"], r["provider"]): r["skipped"] for r in rows if r["tag"] == "target"}
    out = []
    for t in TARGETS:
        required = f">= {t.minimum}x {t.baseline}"
        keys = [(t.kind, t.format, t.provider), (t.kind, t.baseline_format, t.baseline)]
        row, base = (measured.get(key) for key in keys)
        if row is None or base is None:
            why = next((skipped[key] for key in keys if skipped.get(key)), None)
            out.append(
                [t.what, "-", required, f"NOT RUN ({why or 'no result (not in this suite, or the run stopped)'})"]
            )
            continue
        speedup = float(base["median_s"]) / float(row["median_s"])
        floor, gate = accuracy(row)
        status = "PASS" if speedup >= t.minimum and gate != "FAIL" else "FAIL"
        if gate == "FAIL":
            status += f" (SQNR {float(row['sqnr_db']):.1f} dB < {floor:g})"
        speed = f"{speedup:.2f}x ({float(row['tflops']):.3g} TFLOP/s, {row['group']})"
        out.append([t.what, speed, required, status])
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
            accuracy_counts(rows),
            "## Targets (speed-up vs the baseline provider on the shape tagged `target`)",
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
