"""Debug output (opt-in): per compile, the graph before and after the pass and the plan."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

logger = logging.getLogger("quantpass")

_compile_ids = itertools.count()


def dump_compile(root: str | Path, gm, result) -> Path:
    """Write `compile_NNN/{before.py, after.py, plan.txt}` under `root`; returns the folder."""
    folder = Path(root) / f"compile_{next(_compile_ids):03d}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "before.py").write_text(gm.print_readable(print_output=False))
    if result.graph_module is not None:
        (folder / "after.py").write_text(result.graph_module.print_readable(print_output=False))
    (folder / "plan.txt").write_text(str(result.plan) + "\n")
    logger.info("quantpass debug output in %s", folder)
    return folder
