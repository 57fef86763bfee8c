"""What the bench scripts write: a CSV of result rows and the UTC stamp printed next to them."""

from __future__ import annotations

import csv
import datetime
import time
from pathlib import Path


def write_csv(path: Path, rows: list[dict], header: dict | None = None) -> None:
    """`rows` as CSV (columns in first-seen order), each prefixed with the `header` fields."""
    header = header or {}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, [*header, *dict.fromkeys(k for r in rows for k in r)])
        writer.writeheader()
        writer.writerows({**header, **r} for r in rows)


def utc_stamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def interleaved(cases: dict, rounds: int, clock=time.perf_counter) -> dict[str, list[float]]:
    """{name: seconds of each round}: one untimed warm-up, then each case once per round (A, B, A, B, ...),
    so a noisy machine slows every case alike."""
    for fn in cases.values():
        fn()
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    return times
