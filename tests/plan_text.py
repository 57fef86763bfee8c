"""Read a printed plan (`str(plan)`, `quantpass explain` / `run` output) the way a user does."""

from __future__ import annotations

import re


def printed_reason(text: str, layer: str) -> str:
    """The reason the first row of `layer` shows in `text`, with a shared reason's note (`[n]`, printed
    under the table) put back; the row's other columns before it, joined by single spaces."""
    row = re.search(rf"^{re.escape(layer)}  .*$", text, re.M)
    assert row, f"no row for {layer!r} in:\n{text}"
    columns = re.split(r"  +", row.group(0), maxsplit=5)
    note = re.fullmatch(r"\[(\d+)\](.*)", columns[-1])
    if note:
        number, rest = note.groups()
        noted = re.search(rf"^\[{number}\] (.*)$", text[row.end() :], re.M)
        assert noted, f"row {layer!r} shows note [{number}], which is not under its table:\n{text}"
        columns[-1] = noted.group(1) + rest
    return " ".join(columns)
