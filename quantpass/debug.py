"""Debug output (opt-in: `debug_dir=` or QUANTPASS_DEBUG_DIR).

Per compile, `compile_NNN/` holds:
- `before.py`, `after.py`: Dynamo's graph and the rewritten graph (readable code, shapes in comments);
- `plan.txt`: what was done to every layer and why;
- `dynamo_code.py`: depyf's decompilation of the bytecode Dynamo generated for the frame (how Python
  calls the compiled graph: argument order, resume functions after graph breaks). It is written by a
  Dynamo bytecode hook, which runs after the backend returned, matched to the folder by compile id.

depyf's other dumps (guards, AOT forward graphs, Inductor's generated kernels) come from
`depyf.prepare_debug`, which must wrap the *call* that triggers compilation; a backend runs inside
that call and can't open it. `depyf_session(root)` does that wrapping: the `qp.compile` decorator and
`quantpass run --debug-dir` use it around the first call, writing `root/depyf/`. With plain
`torch.compile(..., backend="quantpass")`, wrap your first call yourself:
`with depyf.prepare_debug("dump"): model(x)`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from pathlib import Path

logger = logging.getLogger("quantpass")

_compile_ids = itertools.count()
_pending: dict[object, list[Path]] = {}  # Dynamo compile id -> folders awaiting the frame's bytecode
_hook_lock = threading.Lock()
_hook_handle = None


def dump_compile(root: str | Path, gm, result) -> Path:
    """Write `compile_NNN/{before.py, after.py, plan.txt}` under `root` (and, once Dynamo has
    generated the frame's bytecode, `dynamo_code.py`); returns the folder."""
    folder = Path(root) / f"compile_{next(_compile_ids):03d}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "before.py").write_text(gm.print_readable(print_output=False))
    if result.graph_module is not None:
        (folder / "after.py").write_text(result.graph_module.print_readable(print_output=False))
    (folder / "plan.txt").write_text(str(result.plan) + "\n")
    _await_bytecode(folder)
    logger.info("quantpass debug output in %s", folder)
    return folder


def _await_bytecode(folder: Path) -> None:
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    if compile_id is None:  # called outside Dynamo (e.g. a pass run by hand): no bytecode will come
        return
    _install_hook()
    _pending.setdefault(compile_id, []).append(folder)


def _install_hook() -> None:
    global _hook_handle
    with _hook_lock:
        if _hook_handle is None:
            import torch._dynamo.convert_frame as convert_frame

            _hook_handle = convert_frame.register_bytecode_hook(_write_dynamo_code)


def _write_dynamo_code(code, new_code):
    """Dynamo bytecode hook: decompile the frame's new bytecode into the folders of its compile."""
    from torch._guards import CompileContext

    folders = _pending.pop(CompileContext.current_compile_id(), None)
    if not folders:
        return None
    try:
        import depyf

        source = depyf.decompile(new_code)
    except Exception as e:  # depyf can't decompile every bytecode; say so instead of failing the compile
        source = f"# depyf could not decompile this frame's bytecode: {type(e).__name__}: {e}\n"
    header = (
        f"# depyf: Dynamo's bytecode for {code.co_name} ({code.co_filename}:{code.co_firstlineno}), decompiled.\n"
        "# __compiled_fn_* is the graph in before.py, compiled by quantpass (after.py + lowering).\n"
    )
    for folder in folders:
        (folder / "dynamo_code.py").write_text(header + source)
    return None


@contextlib.contextmanager
def depyf_session(root: str | Path | None):
    """`depyf.prepare_debug(root/depyf)` around the calls that compile, or nothing when root is None.

    depyf writes `full_code_for_*.py` (guards + decompiled code), `__transformed_code_*.py` and
    `__compiled_fn_*.py` (captured, AOT forward and Inductor graphs) there. Not re-entrant.
    """
    if root is None:
        yield None
        return
    import warnings

    import depyf

    folder = Path(root) / "depyf"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*debug `torch.compile`.*")
        with depyf.prepare_debug(str(folder)):
            yield folder
