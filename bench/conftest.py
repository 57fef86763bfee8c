"""Options and the results file of the kernel benchmarks (`make bench`, bench/device_check.sh).

    --bench-suite NAME         shapes and formats (bench/suites.py); default cpu, or gpu-full with CUDA
    --bench-threads N          torch.set_num_threads(N) for the session (CPU timings)
    --bench-triton-interpret   run the triton provider on CPU through Triton's interpreter (slow)
    --bench-csv PATH           results file, one row per benchmark or skip (default bench/out/kernels.csv)
    --bench-rows WHICH         all (default), targets (the rows summary.TARGETS compare, on the shapes
                               tagged "target") or rest (every other row)
    --bench-append             add to the results file instead of starting it afresh (a second step)

Every bench flag lives here. Rows are appended as each benchmark finishes; the session ends with a
table of speed-ups vs torch_bf16 per shape (bench/summary.py).
"""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # bench/ helpers import each other as top-level modules

import providers
import suites
import summary

DEFAULT_CSV = Path(__file__).parent / "out" / "kernels.csv"
ROW_SETS = ("all", "targets", "rest")


def pytest_addoption(parser):
    group = parser.getgroup("quantpass bench")
    group.addoption("--bench-suite", default=None, help=f"one of {', '.join(suites.SUITES)}")
    group.addoption("--bench-threads", type=int, default=None, help="torch CPU threads")
    group.addoption("--bench-triton-interpret", action="store_true", help="triton provider on CPU (interpreter)")
    group.addoption("--bench-csv", default=str(DEFAULT_CSV), help="results file")
    group.addoption("--bench-rows", default="all", choices=ROW_SETS, help="the targets' rows, the others, or all")
    group.addoption("--bench-append", action="store_true", help="append to the results file")


def pytest_configure(config):
    if config.getoption("bench_triton_interpret", default=False):
        os.environ["TRITON_INTERPRET"] = "1"  # read when the first triton.jit runs, and by the oracle
    threads = config.getoption("bench_threads", default=None)
    if threads:
        torch.set_num_threads(threads)
    config._bench_results = (Path(config.getoption("bench_csv", default=str(DEFAULT_CSV))), [])


def pytest_generate_tests(metafunc):
    """`linear_case` / `moe_case`: the suite's (shape, format, provider) cases, in run order."""
    linear, linear_formats, moe, moe_formats = suites.suite(suites.selected(metafunc.config))
    which = metafunc.config.getoption("bench_rows", default="all")
    for kind, shapes, formats in (("linear", linear, linear_formats), ("moe", moe, moe_formats)):
        if f"{kind}_case" in metafunc.fixturenames:
            values, ids = providers.cases(kind, shapes, formats)
            if which != "all":  # the targets' rows first, as a step of their own (device_check.sh)
                keep = [is_target_row(kind, *case) == (which == "targets") for case in values]
                values, ids = [v for v, k in zip(values, keep) if k], [i for i, k in zip(ids, keep) if k]
            metafunc.parametrize(f"{kind}_case", values, ids=ids)


def is_target_row(kind: str, shape, format_name: str, provider: str) -> bool:
    """Whether a target of summary.TARGETS compares this row (its provider or its baseline)."""
    rows = {(t.kind, t.format, t.provider) for t in summary.TARGETS}
    rows |= {(t.kind, t.baseline_format, t.baseline) for t in summary.TARGETS}
    return shape.tag == "target" and (kind, format_name, provider) in rows


def pytest_report_header(config):
    return suite_description(config)


def suite_description(config) -> list[str]:
    name = suites.selected(config)
    linear, linear_formats, moe, moe_formats = suites.suite(name)
    lines = [
        f"bench suite {name}: {len(linear)} linear shapes x {len(linear_formats)} formats, "
        f"{len(moe)} MoE shapes x {len(moe_formats)} formats; torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads, device {_device_name()}"
    ]
    if name == "cpu":
        lines.append(suites.CPU_LEFT_OUT)
    return lines


def _device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    cpuinfo = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")] if cpuinfo.is_file() else []  # fmt: skip
    return f"cpu ({models[0]})" if models else "cpu"


@pytest.fixture(scope="session")
def record(pytestconfig):
    """record(**row): append one result (or skip, with `skipped=reason`) to the results file, which
    the first benchmark of the session starts afresh."""
    path, rows = pytestconfig._bench_results
    device = _device_name()
    path.parent.mkdir(parents=True, exist_ok=True)
    if not (pytestconfig.getoption("bench_append", default=False) and path.is_file()):
        with open(path, "w", newline="") as f:
            csv.DictWriter(f, summary.FIELDS).writeheader()

    def append(**row):
        row = {"device": device, **row}
        rows.append({field: row.get(field, "") for field in summary.FIELDS})
        with open(path, "a", newline="") as f:
            csv.DictWriter(f, summary.FIELDS).writerow(rows[-1])

    return append


def pytest_terminal_summary(terminalreporter, config):
    results = getattr(config, "_bench_results", None)
    if not results or not summary.timed(results[1]):
        return
    path, rows = results
    terminalreporter.write_sep("-", "speed-up vs torch_bf16 per shape (same session)")
    for line in suite_description(config):
        terminalreporter.write_line(line)
    terminalreporter.write_line(summary.results_table(rows))
    terminalreporter.write_line(f"results: {path}")
