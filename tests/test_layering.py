"""Detection does not depend on kernels or on the lowering, and does not change graphs.

No module of `quantpass/patterns` imports `quantpass.kernels`, or a `quantpass.passes` module other
than the generic FX helpers; and nothing it imports, transitively, reaches a kernel module (the
config validates backend names against `quant_registry/names.py`, not the kernel registry). No
module of `quantpass/patterns` calls an FX method that edits or builds a graph, or assigns a node's
fields: graph rewrites (the sharded-model normalizations included) are passes.

Read statically: every `import` statement a module runs (top level or inside a function, where the
lazy imports sit; not `if TYPE_CHECKING:` blocks) resolved to the quantpass module it names, then
followed. A package's `__init__` is not followed (`quantpass/__init__.py` imports the backend).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import quantpass

PACKAGE = Path(quantpass.__file__).resolve().parent
DETECTION = "quantpass.patterns"
FORBIDDEN = ("quantpass.kernels", "quantpass.passes")
ALLOWED = {"quantpass.passes.fx_utils"}  # graph helpers with no quantpass import (checked below)
# FX methods that change a graph or build one, called by name (`graph.erase_node(n)`, `n.update_arg(...)`);
# reading methods (`lint`, `find_nodes`, `format_node`) are not here.
GRAPH_EDITS = frozenset({
    "erase_node", "replace_all_uses_with", "replace_input_with", "inserting_before", "inserting_after",
    "create_node", "call_function", "call_method", "call_module", "get_attr", "placeholder", "output",
    "node_copy", "graph_copy", "eliminate_dead_code", "recompile", "update_arg", "update_kwarg", "insert_arg",
})  # fmt: skip
NODE_FIELDS = frozenset({"args", "kwargs", "target", "op", "name"})  # `node.args = ...` edits the graph too


def _path(module: str) -> Path | None:
    parts = module.split(".")[1:]
    for candidate in (PACKAGE.joinpath(*parts).with_suffix(".py"), PACKAGE.joinpath(*parts, "__init__.py")):
        if candidate.is_file():
            return candidate
    return None


def _modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        names.append(".".join(("quantpass", *(parts[:-1] if parts[-1] == "__init__" else parts))))
    return names


def imports(module: str) -> set[str]:
    """The quantpass modules `module`'s import statements name (`from . import x` names `.x` when x is a module)."""
    path = _path(module)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in _run_time_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            found.add(target)
            found |= {f"{target}.{alias.name}" for alias in node.names if _path(f"{target}.{alias.name}")}
    return {name for name in found if name.startswith("quantpass.") and _path(name) is not None}


def _run_time_nodes(tree: ast.AST):
    """Every node of `tree` but the bodies of `if TYPE_CHECKING:` (never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def reached(start: str) -> dict[str, list[str]]:
    """Every quantpass module `start` imports, transitively -> the chain of imports that gets there."""
    chains, todo = {start: [start]}, [start]
    while todo:
        module = todo.pop()
        if _path(module).name == "__init__.py" and module != start:
            continue  # importing a.b.c runs a/b/__init__.py too, but quantpass's own runs everything
        for name in sorted(imports(module)):
            if name not in chains:
                chains[name] = [*chains[module], name]
                todo.append(name)
    return chains


def graph_edits(module: str) -> list[str]:
    """`line: code` for each call of a `GRAPH_EDITS` method and each assignment to a `NODE_FIELDS`
    attribute in `module`."""
    return edits_in(_path(module).read_text())


def edits_in(source: str) -> list[str]:
    """The same for Python `source`, read by AST: the method or field name, whatever it is on."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in GRAPH_EDITS:
            found.append(f"{node.lineno}: {ast.unparse(node.func)}(...)")
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for part in (p for target in targets for p in ast.walk(target)):
                if isinstance(part, ast.Attribute) and isinstance(part.ctx, ast.Store) and part.attr in NODE_FIELDS:
                    found.append(f"{node.lineno}: {ast.unparse(part)} = ...")
    return found


def _forbidden(name: str) -> bool:
    return name not in ALLOWED and any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


DETECTION_MODULES = [m for m in _modules() if m == DETECTION or m.startswith(DETECTION + ".")]


def test_detection_modules_are_found():
    assert {"quantpass.patterns.linear", "quantpass.patterns.moe", "quantpass.patterns.site"} <= set(DETECTION_MODULES)


@pytest.mark.parametrize("module", DETECTION_MODULES)
def test_detection_imports_no_kernels_and_no_lowering(module):
    direct = {name for name in imports(module) if _forbidden(name)}
    assert not direct, f"{module} imports {sorted(direct)}: detection must not depend on kernels or the lowering"
    chains = reached(module)
    kernels = {n: " -> ".join(c) for n, c in chains.items() if n.startswith("quantpass.kernels.")}
    assert not kernels, f"{module} reaches kernel modules: " + "; ".join(kernels.values())


@pytest.mark.parametrize("module", DETECTION_MODULES)
def test_detection_does_not_edit_graphs(module):
    edits = graph_edits(module)
    assert not edits, f"{module} edits FX graphs ({'; '.join(edits)}): move the rewrite to quantpass/passes"


def test_the_graph_edit_scan_sees_each_spelling():
    """The check can fail: the passes that rewrite sharded graphs, and the FX helpers, are found editing."""
    sharded = " ".join(graph_edits("quantpass.passes.normalize_sharded"))
    for method in ("erase_node", "replace_all_uses_with", "replace_input_with", "inserting_before", "call_function"):
        assert f".{method}(...)" in sharded, (method, sharded)
    assert ".update_arg(...)" in " ".join(graph_edits("quantpass.passes.normalize_expert_parallel"))
    assert ".node_copy(...)" in " ".join(graph_edits("quantpass.passes.fx_utils"))  # building a graph counts
    source = "n.args = (x,)\nn.meta['seen'] = True\nsite.nodes.append(n)\nn.kwargs |= {}\ng.lint()\n"
    assert edits_in(source) == ["1: n.args = ...", "4: n.kwargs = ..."]  # meta, lists and lint are reading


def test_allowed_helpers_import_no_quantpass_module():
    for module in ALLOWED:
        assert imports(module) == set(), f"{module} must stay a leaf to be allowed from patterns/"


def test_the_scan_sees_imports_of_each_spelling():
    """The check can fail: the lowering does import kernels, relatively, lazily and through `from . import`."""
    assert "quantpass.kernels.ops" in imports("quantpass.passes.lower_linear")
    assert "quantpass.passes.attention_math" in imports("quantpass.passes.lower_attention")  # from . import x
    assert "quantpass.patterns.attention" in imports("quantpass.patterns.linear")  # inside a function
    chain = reached("quantpass.passes.lower")["quantpass.kernels.oracle"]
    assert chain[0] == "quantpass.passes.lower" and chain[-1] == "quantpass.kernels.oracle"
    assert "quantpass.quant_registry.spec" in reached("quantpass.patterns.moe")  # the config is followed...
    assert "quantpass.quant_registry.names" in imports("quantpass.quant_registry.spec")  # ...its backend names
    assert "quantpass.kernels.oracle" not in imports("quantpass.kernels.registry")  # under TYPE_CHECKING only
