"""docs/model-support.md: rendered from zoo results, parsed back so tests can check each cell."""

from __future__ import annotations

import re
from pathlib import Path

from zoo_models import ARCHS, Arch
from zoo_run import CAUSES, COSINE_FLOOR, COVERAGE, FORMATS, KNOWN_FAILURES, Result

DOC = Path(__file__).resolve().parents[2] / "docs" / "model-support.md"
ARCH_HEADER = ("architecture", "family", "model", "dtype", "input")
RESULT_HEADER = ("architecture", "format", "status", "quantized / eligible / total", "MoE sites", "cosine", "notes")
# between a run and the table: other CPUs round (and route MoE tokens) differently, by more where the
# cell's error (1 - cosine) is large: granitemoe x nvfp4 gives 0.8745 on AVX-512 tiles (AMD Zen 4) and
# 0.8797 on AVX2 ones (Zen 3), 4% of its error apart
COSINE_TOLERANCE = 0.005
COSINE_RELATIVE_TOLERANCE = 0.1  # of the error


def close_cosines(want: float, got: float) -> bool:
    return abs(want - got) <= max(COSINE_TOLERANCE, COSINE_RELATIVE_TOLERANCE * (1 - min(want, got)))


INTRO = """\
# Model support

<!-- Generated: do not edit. `PYTHONPATH=$PWD python tests/zoo/generate.py` rewrites this file (the
whole matrix: about 6 CPU-minutes; name architectures to redo only their rows). The zoo tests
fail when a cell they run disagrees with its row here. -->

Each cell compiles a tiny random-config model (seeded, 1-2 layers, hidden 32-64, nothing downloaded;
`tests/zoo/zoo_models.py`) on CPU with `torch.compile(model, backend="quantpass", options={{"linear":
FORMAT, "moe": FORMAT, "lowering": "aot_eager"}})` under `torch.no_grad()` (the `moe` slot only for
MoE models) and compares its output with eager's. `make test` runs one format per architecture (the
formats rotate), `make test-zoo` every cell; both check each cell they run against this table.
`make test-zoo-inductor` runs `make test`'s cells with `"lowering": "inductor"` (what users run):
every column but the cosine must match this table, and the cosine its floor.

- **quantized / eligible / total**: weight layers, counted from the model (an `nn.Linear` or GPT-2
  `Conv1D`, `nn.MultiheadAttention`'s packed input projection, each 3-D expert weight tensor, an MoE
  router's weight), not from the plan, so a layer that never reaches the pass counts as not
  quantized. *Eligible* leaves out the layers quantpass's defaults leave alone: the output head, a
  weight tied to an embedding, MoE routers. A cell needs >= {coverage:.0%} of its eligible layers
  quantized.
- **MoE sites**: experts regions quantized / found (a fused MoE op, or, where the region is not a provable
  fused MoE such as Llama 4's dense bmm, its weights held quantized under the graph's own GEMMs).
- **cosine**: of the model's output to eager's (logits or last hidden state; CLIP: both embeddings).
  A cell needs at least the floor of its format (dense / MoE models; MoE floors are lower because a
  quantized layer upstream of a router flips near-tied top-k choices): {floors}.
- **status**: `ok`, or `FAIL` with the checks that failed (`crash`, `cosine`, `coverage`). A failure
  known at generation time names its causes (`known:`, listed below); a crash shows its error, not
  numbers.
"""


def floors_text() -> str:
    return ", ".join(f"`{fmt}` {dense} / {moe}" for fmt, (dense, moe) in COSINE_FLOOR.items())


def causes_table() -> str:
    if not CAUSES:
        return "None: every cell conforms."
    rows = []
    for cause, text in CAUSES.items():
        archs = sorted({key if isinstance(key, str) else key[0] for key, c in KNOWN_FAILURES.items() if cause in c})
        rows.append([cause, ", ".join(archs), escape(text)])
    return _table(("cause", "architectures", "diagnosis"), rows)


def escape(text: str) -> str:
    return text.replace("|", "\\|")


def _split(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [cell.strip() for cell in cells]


def _table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def arch_row(arch: Arch, model) -> list[str]:
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    experts = getattr(model.config, "_experts_implementation", None) if arch.moe else None
    dtype += f", {experts} experts" if experts else ""
    inputs = ", ".join(f"{k} {list(v.shape)}" for k, v in arch.inputs().items())
    return [arch.name, arch.family, type(model).__name__, dtype, escape(inputs)]


def result_row(result: Result, known: tuple[str, ...]) -> list[str]:
    failures = result.failures
    status = "ok" if not failures else "FAIL: " + ", ".join(failures)
    notes = ([f"known: {', '.join(known)}"] if known and failures else []) + list(result.notes)
    if result.error is not None:
        return [result.arch, result.format, status, "-", "-", "-", escape("; ".join([*notes, result.error]))]
    counts = f"{result.quantized} / {result.eligible} / {result.total}"
    moe = f"{result.moe_quantized} / {result.moe_found}" if result.moe_found else "-"
    return [result.arch, result.format, status, counts, moe, f"{result.cosine:.4f}", escape("; ".join(notes))]


def render(arch_rows: list[list[str]], result_rows: list[list[str]]) -> str:
    intro = INTRO.format(coverage=COVERAGE, floors=floors_text())
    return (
        f"{intro}\n## Architectures\n\n{_table(ARCH_HEADER, arch_rows)}\n\n"
        f"## Results\n\n{_table(RESULT_HEADER, result_rows)}\n\n"
        f"## Known failures\n\n{causes_table()}\n"
    )


def parse(text: str) -> tuple[dict[str, list[str]], dict[tuple[str, str], list[str]]]:
    """(architecture -> its row, (architecture, format) -> its row), from the doc's two tables."""
    arch_rows, result_rows = {}, {}
    section = None
    for line in text.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif line.startswith("| ") and not line.startswith(("| architecture |", "|---")):
            cells = _split(line)
            if section == "Architectures":
                arch_rows[cells[0]] = cells
            elif section == "Results":
                result_rows[(cells[0], cells[1])] = cells
    return arch_rows, result_rows


def ordered(arch_rows: dict, result_rows: dict) -> tuple[list[list[str]], list[list[str]]]:
    """Rows in zoo order (ARCHS, then FORMATS); rows of architectures no longer in the zoo dropped."""
    archs = [arch_rows[a.name] for a in ARCHS if a.name in arch_rows]
    results = [result_rows[(a.name, f)] for a in ARCHS for f in FORMATS if (a.name, f) in result_rows]
    return archs, results


def mismatch(expected: list[str], actual: list[str]) -> str | None:
    """Why a cell's fresh row differs from the doc's row (cosines as `close_cosines` allows), or None."""
    if len(expected) != len(actual):
        return f"doc row {expected} has {len(expected)} columns, not {len(actual)}"
    header = RESULT_HEADER if len(actual) == len(RESULT_HEADER) else ARCH_HEADER
    for name, want, got in zip(header, expected, actual):
        close = name == "cosine" and "-" not in (want, got) and close_cosines(float(want), float(got))
        if want != got and not close:
            return f"{name}: docs/model-support.md says {want!r}, this run gives {got!r}"
    return None
