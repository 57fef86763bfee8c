"""Regenerate docs/model-support.md from zoo runs.

PYTHONPATH=$PWD python tests/zoo/generate.py            # every architecture x format
PYTHONPATH=$PWD python tests/zoo/generate.py gpt2 bert  # only these rows; the rest are kept
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from zoo_models import ARCHS, BY_NAME
from zoo_run import FORMATS, known_causes, run_cell
from zoo_table import DOC, arch_row, ordered, parse, render, result_row


def main(argv: list[str]) -> int:
    unknown = sorted(set(argv) - set(BY_NAME))
    if unknown:
        print(f"unknown architecture {unknown[0]!r}; valid: {', '.join(BY_NAME)}", file=sys.stderr)
        return 2
    names = set(argv or BY_NAME)
    arch_rows, result_rows = parse(DOC.read_text()) if DOC.exists() else ({}, {})
    for arch in ARCHS:
        if arch.name not in names:
            continue
        arch_rows[arch.name] = arch_row(arch, arch.build())
        for fmt in FORMATS:
            start = time.perf_counter()
            result = run_cell(arch, fmt)
            result_rows[(arch.name, fmt)] = row = result_row(result, known_causes(arch.name, fmt))
            print(f"{time.perf_counter() - start:5.1f}s  " + " | ".join(row[:6]), flush=True)
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(render(*ordered(arch_rows, result_rows)))
    missing = [(a.name, f) for a in ARCHS for f in FORMATS if (a.name, f) not in result_rows]
    if missing:
        print(f"{len(missing)} cells have no row yet (first: {missing[0]}): run without arguments", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
