"""What the bench scripts write: a CSV of result rows and the UTC stamp printed next to them."""

from __future__ import annotations

import csv
import datetime
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
