"""Layer names after a graph break: from the model the user compiled, not from Dynamo's frame.

A graph break inside a submodule's forward (a data-dependent expert loop, Longformer's windowed
attention) makes Dynamo compile that forward as a frame of its own, whose graph names layers from
the submodule (`attn.Wqkv`), the same for every block. The plan, `ignore` and `targets` then saw
those names: full paths matched nothing, silently. `frame_prefix` finds the path of the frame's
module in the compiled model (its parameters are the graph's inputs) so the pass names layers as
the model does; `shared_instances` lists the other modules of the frame's class, which Dynamo may run
on the same graph (its guards decide), and then with the plan of the instance it was compiled for.
"""

from __future__ import annotations

import logging
import sys

import torch.nn as nn

logger = logging.getLogger("quantpass")


def compiled_root() -> nn.Module | None:
    """The module being compiled, from the call stack: `torch.compile(model)`'s original module, a
    module compiled in place (`model.compile()`, the decorator), or the module whose method was
    compiled (`model.forward = torch.compile(model.forward)`, transformers' way for generation: Dynamo's
    wrapper holds the bound method); None for a compiled function."""
    from torch._dynamo.eval_frame import OptimizedModule, _TorchDynamoContext

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, OptimizedModule):
            return owner._orig_mod
        if isinstance(owner, nn.Module) and getattr(owner, "_compiled_call_impl", None) is not None:
            return owner
        if isinstance(owner, _TorchDynamoContext) and (method := _method_owner(frame.f_locals.get("fn"))):
            return method
        frame = frame.f_back
    return None


def _method_owner(fn) -> nn.Module | None:
    """The module of the bound method a Dynamo compile wrapper runs (it keeps the method as `fn` or
    as what `fn` wraps), if it runs one."""
    owner = getattr(getattr(fn, "__wrapped__", fn), "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


def embedding_weights() -> set[int]:
    """The ids of the compiled model's embedding weights (none for a compiled function): a head tied to
    one is tied also where the embedding runs in another graph. XLM has a graph break between them: its
    head was quantized against the default, the embedding's storage freed, and every later graph read
    the embedding back from the head's INT8 values."""
    root = compiled_root()
    return set() if root is None else {id(m.weight) for m in root.modules() if isinstance(m, nn.Embedding)}


def frame_prefix(root: nn.Module, relative: dict[int, str], example_inputs) -> str:
    """The frame's module path in `root` plus a dot ("" at the root, or where it can't be told): the
    part every graph parameter's path in `root` has before its path in the frame. `relative`: graph
    input index -> the parameter's name in the frame."""
    names: dict[int, list[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    prefixes = set()
    for index, name in relative.items():
        found = [full for full in names.get(id(example_inputs[index]), []) if full.endswith(name)]
        if not found or name in found:
            return ""  # not in `root`, or named from the root already
        prefixes.update(full[: -len(name)] for full in found if full[-len(name) - 1] == ".")
    return prefixes.pop() if len(prefixes) == 1 else ""


def shared_instances(root: nn.Module, module: nn.Module) -> list[str]:
    """The paths of the other modules of the frame's module's class (Dynamo may run them on the same graph)."""
    return [path for path, other in root.named_modules() if type(other) is type(module) and other is not module]


def name_from_the_model(sites: list, rows: list, example_inputs, config, relative: dict[int, str]) -> str | None:
    """Sites and rows (in place) named from the compiled model where this graph is a submodule's frame;
    a note on each site says so, and a warning where the config treats another instance of the module
    differently (Dynamo may run that instance on this graph: then this instance's plan applies to it).
    `relative`: graph input index -> the name of the parameter it is in the frame (every parameter the
    graph reads: a frame whose only linear reads its weight cast, LongCat's router, has no site params).
    Returns the frame's module path, None where the graph is not a submodule's frame."""
    root = compiled_root()
    prefix = frame_prefix(root, relative, example_inputs) if root is not None and relative else ""
    if not prefix:
        return None
    for item in (*sites, *rows):
        item.fqn = prefix + item.fqn
    frame = prefix.removesuffix(".")
    module = root.get_submodule(frame)
    others, kind_of = shared_instances(root, module), type(module).__name__
    for site in sites:
        reuse = f" (Dynamo may run it for the {len(others)} other {kind_of} modules too)" if others else ""
        site.notes.append(f"in a graph of {frame}'s forward, compiled on its own after a graph break{reuse}")
        kind, name = site.config_kind or site.kind, site.fqn.removeprefix(prefix)
        mine = config.resolve_with_reason(site.fqn, kind)[0]
        differ = [o for o in others if config.resolve_with_reason(f"{o}.{name}", kind)[0] != mine]
        if differ:
            logger.warning(
                "quantpass: the config gives %s.%s another spec than %s (%s); where Dynamo runs %s on the graph it "
                "compiled for %s (a graph break in %s.forward), %s's plan applies to it: name layers alike across "
                "instances, or remove the graph break",
                differ[0], name, site.fqn, mine.name() if mine is not None else "left alone", differ[0], frame,
                kind_of, frame,
            )  # fmt: skip
    return frame
