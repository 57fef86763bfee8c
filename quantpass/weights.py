"""The weights of a quantized model, seen from the user's side: update, refresh, export.

quantpass frees each original weight's storage once it is quantized (`keep_original_weights=False`,
the default; the Parameter object keeps its shape, dtype and device). What still works on such a
model, and how:

- `qp.load_weights(model, state_dict_or_pairs)`: new full-precision weights (RL weight sync, a
  fine-tuned checkpoint) quantized straight into the cache, one tensor at a time, no full-precision
  copy kept. `model.load_state_dict(...)` routes released weights through it.
- `qp.refresh_weights(model)`: after writes through `.data` (`p.data.copy_(new)`), which bump no
  version counter (with `keep_original_weights=True`; a released weight has no `.data` to write).
- `qp.state_dict(model)` and `model.state_dict()`: released weights as their dequantized values;
  `qp.state_dict(model, quantized=True)`: quantized weights as `QTensor`s (formats.py's layout).
- Running a module eagerly after release restores its weights (weight_cache.py, with a warning), as
  do `torch.compile(model)` with another backend (on its call) and `torch.compile(fn)` with another
  backend (each module Dynamo traces for it).

Anything else that reads a released weight directly (`p.sum()`, `model.half()`) reads freed memory
and can crash the process (its storage has no bytes): keep the originals for such code, or read
`state_dict`'s dequantized value.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Iterable, Mapping

import torch

from .quant_registry.formats import quantize
from .quant_registry.qtensor import QTensor
from .weight_cache import WEIGHTS, canonical_layout

logger = logging.getLogger("quantpass")


def _root(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "_orig_mod", model)  # torch.compile's wrapper: its parameters are the model's


def load_weights(
    model: torch.nn.Module, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
) -> int:
    """Load full-precision tensors by parameter name; returns how many were loaded. A released
    (quantized) weight is quantized straight into the cache in the format(s) it runs in; any other
    parameter or buffer is copied into (its quantized copies, if any, follow on the next call)."""
    model = _root(model)
    items = weights.items() if isinstance(weights, Mapping) else weights
    targets = {**dict(model.named_buffers()), **dict(model.named_parameters(remove_duplicate=False))}
    count = 0
    for name, value in items:
        target = targets.get(name)
        if target is None:
            example = next(iter(targets), "")
            raise KeyError(
                f"qp.load_weights: {type(model).__name__} has no parameter or buffer {name!r} (e.g. {example!r})"
            )
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"qp.load_weights: {name!r} has shape {tuple(target.shape)}, got {tuple(value.shape)}")
        load_weight(target, value, name)
        count += 1
    return count


def load_weight(param: torch.Tensor, value: torch.Tensor, name: str = "weight") -> None:
    if WEIGHTS.is_released(param):
        record = WEIGHTS.record(param)
        value = value.to(param.device)
        record.canonical = {
            (key, transposed): quantize(canonical_layout(value, transposed, qt.shape), key, name=name)
            for (key, transposed), qt in record.canonical.items()
        }
        record.source = None
        record.generation += 1  # the prepared copies are rebuilt from the new canonical values
        return
    with torch.no_grad():
        param.copy_(value)  # bumps _version: quantized copies follow on the next call


def refresh_weights(model: torch.nn.Module) -> None:
    """Re-quantize, on the next call, every weight of `model` (after writes through `.data`)."""
    for param in _root(model).parameters():
        WEIGHTS.refresh(param)


def state_dict(model: torch.nn.Module, quantized: bool = False) -> dict[str, torch.Tensor | QTensor]:
    """`model.state_dict()` with every released weight's dequantized value, never freed memory; with
    `quantized=True`, each weight quantpass holds quantized is its `QTensor` instead, but one held as a
    matrix of another shape (an einsum's [H, n, d] weight: no checkpoint layout has it), dequantized."""
    result = {}
    for name, value in _state_tensors(_root(model)):
        canonical = WEIGHTS.canonical_values(value) if quantized else {}
        canonical = {key: qt for key, qt in canonical.items() if len(qt.shape) == value.dim()}
        if canonical:
            result[name] = next(iter(canonical.values()))
        elif WEIGHTS.is_released(value):
            result[name] = WEIGHTS.dense(value)
        else:
            result[name] = value.detach()
    return result


def _state_tensors(model: torch.nn.Module):
    """(name, tensor) of what `model.state_dict()` holds: parameters and persistent buffers, read
    directly (state_dict() itself would dequantize every released weight through its hooks)."""
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, param in module._parameters.items():
            if param is not None:
                yield dot + name, param
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield dot + name, buffer


# ---------------------------------------------------------------------------- module hooks
_HOOKED: weakref.WeakSet = weakref.WeakSet()
_PARAMETER_SOURCE = re.compile(r"(.*)\._parameters\['[^']+'\]")


def graph_owners(gm: torch.fx.GraphModule) -> list[torch.nn.Module]:
    """The modules that own the parameters Dynamo lifted into `gm` (call it from inside the
    backend: it reads the frame Dynamo is tracing and the placeholders' sources, e.g.
    `L['self']._modules['mlp']._parameters['weight']` -> that `mlp` module)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:
        return []
    if tx is None:
        return []
    scope, owners = {"L": tx.f_locals, "G": tx.f_globals}, {}
    for node in gm.graph.find_nodes(op="placeholder"):
        source = getattr(node.meta.get("grapharg"), "source", None)
        name = source.name() if callable(getattr(source, "name", None)) else getattr(source, "name", None)
        match = _PARAMETER_SOURCE.fullmatch(name or "")
        if match is None:
            continue
        try:
            module = eval(match.group(1), {"__builtins__": {}}, scope)
        except Exception:
            continue
        if isinstance(module, torch.nn.Module):
            owners[id(module)] = module
    return list(owners.values())


def hook_owners(modules: Iterable[torch.nn.Module]) -> None:
    """Make `state_dict()` / `load_state_dict()` of modules whose weights may be released safe."""
    for module in modules:
        if module in _HOOKED:
            continue
        _HOOKED.add(module)
        module._register_state_dict_hook(_dense_in_state_dict)
        module._register_load_state_dict_pre_hook(_load_released, with_module=True)
        module.register_load_state_dict_post_hook(_not_missing)


def _dense_in_state_dict(module, destination, prefix, local_metadata):
    for name, param in module._parameters.items():
        if param is not None and WEIGHTS.is_released(param) and prefix + name in destination:
            destination[prefix + name] = WEIGHTS.dense(param)


_LOADED: dict[int, set[str]] = {}  # module id -> keys a load_state_dict call routed through load_weight


def _load_released(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    for name, param in module._parameters.items():
        key = prefix + name
        if param is not None and key in state_dict and WEIGHTS.is_released(param):
            load_weight(param, state_dict.pop(key), key)
            _LOADED.setdefault(id(module), set()).add(key)


def _not_missing(module, incompatible_keys):
    loaded = _LOADED.pop(id(module), set())
    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in loaded]
