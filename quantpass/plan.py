"""The plan: what quantpass does (or did) to every layer, and why."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .quant_registry.names import Kind

# How a quantized row ends where its layer holds other weights than it says (`plan_coverage`)
RESTORED, NOT_RUN = "eager calls run on them", "not run yet: its weights are quantized on its first call"


NOTHING_COMPILED = (
    "nothing compiled yet: call the compiled model (`torch.compile(model)` compiles calls of the model "
    "itself; `model.generate(...)` runs the uncompiled forward: compile `model.forward` instead); if it "
    "was called, Dynamo ran it eagerly and nothing is quantized (a graph break inside a loop makes Dynamo "
    "skip the whole frame: `TORCH_LOGS=graph_breaks` says where)"
)


@dataclass
class PlanRow:
    """One site. `weight`/`activation` are registered key names (None when not quantized /
    unquantized activations); `backend` is None when the site is left unquantized; `reason` says
    why that choice (or why it was left alone); `rejected` maps backend -> why it couldn't run."""

    fqn: str
    kind: Kind
    weight: str | None
    activation: str | None
    backend: str | None
    reason: str
    rejected: dict[str, str] = field(default_factory=dict)
    format: str | None = None  # the shorthand (or weight/activation) for summaries
    bytes: int = 0  # quantized weight bytes (data + scales) when quantized
    original_bytes: int = 0  # the unquantized weights' bytes

    @property
    def quantized(self) -> bool:
        return self.backend is not None


@dataclass
class Plan:
    rows: list[PlanRow] = field(default_factory=list)
    frames: list[str] = field(default_factory=list)  # submodules whose forward was a graph of its own
    read: list[str] = field(default_factory=list)  # the parameters the graphs take as inputs, by name
    graphs: int = 1  # how many compiled graphs it tells of (a merged plan: 0 before any)

    def extend(self, other: Plan) -> None:
        """Add another graph's plan; a row the same as one already here is a recompile of the same
        frame (a new length in generation), not another layer or call: left out."""
        seen = {_identity(row) for row in self.rows}
        self.rows.extend(row for row in other.rows if _identity(row) not in seen)
        self.frames.extend(f for f in other.frames if f not in self.frames)
        self.read.extend(other.read)
        self.graphs += other.graphs

    def quantized(self, kind: str | None = None) -> list[PlanRow]:
        return [r for r in self.rows if r.quantized and kind in (None, r.kind)]

    def summary(self) -> str:
        """e.g. `linear: 28 quantized (fp8_per_block; triton 28) | 2 skipped | moe: 2 quantized (...)`.
        Counts layers: a layer called more than once (ALBERT's shared layer) has a row per call and
        counts once, quantized where every call is; `N calls` says how many rows that was, and the
        counts of layers that ran on weights restored to full precision or have not run yet follow."""
        parts = []
        for kind in Kind:
            layers: dict[str, list[PlanRow]] = {}
            for row in self.rows:
                if row.kind == kind:
                    layers.setdefault(row.fqn, []).append(row)
            if not layers:
                continue
            done = [rows for rows in layers.values() if all(r.quantized for r in rows)]
            formats = ", ".join(sorted({r.format for rows in done for r in rows if r.format}))
            backends = ", ".join(f"{b} {n}" for b, n in sorted(Counter(rows[0].backend for rows in done).items()))
            calls = sum(map(len, done))
            states = [f"{calls} calls"] if calls > len(done) else []
            for end, said in ((RESTORED, "with weights restored for eager calls"), (NOT_RUN, "not run yet")):
                if n := sum(any(r.reason.endswith(end) for r in rows) for rows in done):
                    states.append(f"{n} {said}")
            detail = f" ({'; '.join([formats, backends, *states])})" if done else ""
            parts.append(f"{kind}: {len(done)} quantized{detail} | {len(layers) - len(done)} skipped")
        if parts:
            return " | ".join(parts)
        return "no linear or moe layers found" if self.graphs else NOTHING_COMPILED

    def table(self) -> str:
        """One line per row. A reason many rows share (every layer of a model with the same kernel)
        is printed once, as a numbered note under the table; each row shows its number and what its
        own reason adds (the SQNR verify measured for it)."""
        headers = ("layer", "kind", "weight", "activation", "backend", "reason")
        notes, shown = _shared_reasons([r.reason for r in self.rows])
        cells = [
            (r.fqn, r.kind, r.weight or "-", r.activation or "-", r.backend or "-", s) for r, s in zip(self.rows, shown)
        ]
        widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headers)]
        widths[-1] = len(headers[-1])  # the reason column is last: don't pad it
        line = lambda row: "  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip()  # noqa: E731
        noted = ["", *(f"[{i}] {note}" for i, note in enumerate(notes, 1))] if notes else []
        return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells), *noted])

    def __str__(self) -> str:
        return f"{self.table()}\n{self.summary()}"

    def to_dicts(self) -> list[dict]:
        return [
            {
                "fqn": r.fqn,
                "kind": r.kind,
                "weight": r.weight,
                "activation": r.activation,
                "backend": r.backend,
                "reason": r.reason,
                "rejected": dict(r.rejected),
                "bytes": r.bytes,
                "original_bytes": r.original_bytes,
            }
            for r in self.rows
        ]


def _identity(row: PlanRow) -> tuple:
    """What was decided for the layer: for a quantized one, not its reason (only the first graph
    verifies: its reason ends with the measured SQNR)."""
    return row.fqn, row.kind, row.weight, row.activation, row.backend, None if row.quantized else row.reason


SEPARATOR = "; "  # between the parts of a reason: the choice, then what later steps add (verify, restores)
INLINE = 40  # a shared reason this short stays in its rows


def _shared_reasons(reasons: list[str]) -> tuple[list[str], list[str]]:
    """(notes, what each row shows). A reason is a chain of parts joined by SEPARATOR; a prefix of
    whole parts that two or more rows share becomes a note where those rows part ways (or end): the
    shortest such prefix, so rows that differ only in their verify figure share one note. A row
    shows `[n]` and the rest of its reason, so the note and the rest are the reason again."""
    prefixes = [_prefixes(reason) for reason in reasons]
    count = Counter(p for ps in prefixes for p in ps)
    notes: dict[str, int] = {}
    shown = []
    for reason, ps in zip(reasons, prefixes):
        # where rows part ways: the next longer prefix of this reason is on fewer rows (or there is none)
        parting = (p for p, longer in zip(ps, [*ps[1:], None]) if longer is None or count[longer] < count[p])
        base = next((p for p in parting if count[p] >= 2 and len(p) > INLINE), None)
        if base is None:
            shown.append(reason)
            continue
        number = notes.setdefault(base, len(notes) + 1)
        shown.append(f"[{number}]{reason[len(base) :]}")
    return list(notes), shown


def _prefixes(reason: str) -> list[str]:
    """The reason's prefixes of whole parts, shortest first (the last is the reason)."""
    parts = reason.split(SEPARATOR)
    return [SEPARATOR.join(parts[:i]) for i in range(1, len(parts) + 1)]
