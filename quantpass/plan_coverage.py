"""Plan rows for the model's linears that no compiled graph named.

The pass sees graphs, not the model. A linear called only from code Dynamo ran eagerly (the frame of
a graph break it could not resume from, e.g. one inside a loop), or not called on the inputs compiled
with, got no row: the plan said nothing about it and it stayed unquantized. Where a graph break made
Dynamo compile a submodule's forward as a graph of its own, the other modules of that class may run
on the same graph (`passes/frame_names.py`): their linears got no row of their own either.
`unreached_rows` gives both a row, from the model that was compiled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch.nn as nn

from .plan import NOT_RUN, RESTORED, Plan, PlanRow
from .quant_registry.names import Kind
from .weight_cache import WEIGHTS

LINEAR_CLASS_NAMES = ("Conv1D",)  # transformers' GPT-2 style linear (its weight stored [in, out])
UNREACHED = (
    "in no compiled graph: not called on these inputs, or called from code Dynamo ran eagerly (after a "
    "graph break it could not resume from, e.g. one inside a loop); left unquantized"
)
UNMATCHED = (
    "its weight is in a compiled graph, read by no linear the pass knows (e.g. an einsum on it); left unquantized"
)


def model_plan(plans: Iterable[Plan], roots: Iterable[nn.Module]) -> Plan:
    """The graphs' plans together, accounted against the compiled models: a row for each of their
    linears no graph named (`unreached_rows`), and what each quantized layer holds now
    (`with_weight_states`)."""
    merged = Plan(graphs=0)
    for plan in plans:
        merged.extend(plan)
    for root in roots:
        merged.rows += unreached_rows(root, merged)
        with_weight_states(root, merged)
    return merged


def unreached_rows(root: nn.Module, plan: Plan) -> list[PlanRow]:
    """A row for each linear of `root` that no row of `plan` names: where it sits in another instance
    of a class whose forward was a graph of its own, that graph's row for the same layer (Dynamo runs
    the instance on it where its guards pass); else "in no compiled graph"."""
    named, read = {row.fqn for row in plan.rows}, set(plan.read)
    served = _served(root, plan)
    rows = []
    for path, module in root.named_modules():
        if path in named or not (isinstance(module, nn.Linear) or type(module).__name__ in LINEAR_CLASS_NAMES):
            continue
        owners = [(owner, rest) for owner, rest in _splits(path) if (type(root.get_submodule(owner)), rest) in served]
        if not owners:
            reason = UNMATCHED if f"{path}.weight" in read else UNREACHED
            rows.append(PlanRow(path, Kind.LINEAR, None, None, None, reason))
            continue
        owner, rest = owners[-1]
        frame, source = served[type(root.get_submodule(owner)), rest]
        reason = f"as {source.fqn}: runs on the graph of {frame}'s forward where Dynamo's guards let {owner} use it"
        rows.append(dataclasses.replace(source, fqn=path, reason=reason, rejected=dict(source.rejected)))
    return rows


def with_weight_states(root: nn.Module, plan: Plan) -> None:
    """Say where a quantized row's layer holds other weights than the row says, read from the weight
    cache after the graphs ran: its released weights were given back to full precision since (it ran
    outside the compiled graphs, e.g. a frame Dynamo ran eagerly past its recompile limit), or it has
    no quantized weights yet (served by another instance's graph, not called so far: an expert no token
    was routed to)."""
    for i, row in enumerate(plan.rows):
        if not row.quantized or row.reason.endswith((RESTORED, NOT_RUN)):  # noted for another root already
            continue
        try:
            params = [p for p in root.get_submodule(row.fqn)._parameters.values() if p is not None]
        except AttributeError:  # a projection inside an attention call, an expert GEMM: no module of its own
            continue
        if restored := next(filter(None, map(WEIGHTS.restored, params)), None):
            note = f"its full-precision weights were restored since ({restored}): {RESTORED}"
        elif params and not WEIGHTS.nbytes(params):  # nothing quantized for them yet
            note = NOT_RUN
        else:
            continue
        plan.rows[i] = dataclasses.replace(row, reason=f"{row.reason}; {note}", rejected=dict(row.rejected))


def _splits(path: str):
    """(owner path, the path below it) for each dot of `path`."""
    parts = path.split(".")
    for i in range(1, len(parts)):
        yield ".".join(parts[:i]), ".".join(parts[i:])


def _served(root: nn.Module, plan: Plan) -> dict[tuple[type, str], tuple[str, PlanRow]]:
    """(class of a frame's module, a layer's path below it) -> (the frame, that layer's row)."""
    served = {}
    for frame in plan.frames:
        try:
            cls = type(root.get_submodule(frame))
        except AttributeError:  # a frame of another model compiled with the same backend
            continue
        for row in plan.rows:
            if row.fqn.startswith(frame + "."):
                served.setdefault((cls, row.fqn.removeprefix(frame + ".")), (frame, row))
    return served
