"""`@qp.compile(**options)`: instances of a decorated `nn.Module` class compile with quantpass on
their first call.

    @qp.compile(linear="fp8_per_channel", dynamic_arg_dims={"input_ids": 1})
    class MyModel(nn.Module): ...

How it works: the decorator gives the class a `__call__` that, on an instance's first call, decides
whether to compile (`enabled`, `enable_if(instance)`), marks the dynamic dims of that call's
arguments, and calls `nn.Module.compile(backend=...)` on the instance; every later call goes through
the compiled `_call_impl`. One backend is shared by all instances of a decorated class: Dynamo
reuses a graph for every instance with the same structure (the weights are graph inputs, see
docs/design.md §2), so N decoder layers compile once.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
import typing
from dataclasses import dataclass, field

import torch

from .backend import BackendOptions, QuantpassBackend, experts_warning
from .debug import depyf_session
from .plan import Plan
from .plan_coverage import model_plan

logger = logging.getLogger("quantpass")

BATCH_DIM = 0  # the dim marked dynamic for tensor-annotated forward arguments


@dataclass
class CompileSettings:
    enabled: bool
    options: dict
    dynamic_arg_dims: dict[str, list[int]] | None  # None: infer from forward's annotations
    enable_if: typing.Callable | None
    backend: _PlanRecordingBackend | None = field(default=None, repr=False)


class _PlanRecordingBackend:
    """The class's quantpass backend, also recording which compiled graphs each call ran, so an
    instance that reuses another instance's graph still knows its plan."""

    def __init__(self, options: BackendOptions):
        self.quantpass = QuantpassBackend(options)
        self.ran: list[Plan] = []

    def __call__(self, gm, example_inputs):
        compiled_before = len(self.quantpass.plans)
        compiled = self.quantpass(gm, example_inputs)
        plan = self.quantpass.plans[-1] if len(self.quantpass.plans) > compiled_before else Plan()
        ran = self.ran

        def run(*args):  # Dynamo calls a backend's result with *args, whatever `_boxed_call` says
            ran.append(plan)
            return compiled(*args)

        return run


def compile(cls=None, *, enabled: bool = True, dynamic_arg_dims=None, enable_if=None, **options):
    """Class decorator: instances compile `forward` with the quantpass backend on their first call.

    `options` are the backend's (`linear`, `moe`, `targets`, `ignore`, `backend`, `lowering`,
    `verify`, `debug_dir`, `config`). `dynamic_arg_dims={"arg": dim or [dims]}` marks those dims of
    `forward`'s arguments dynamic before the first compile; when omitted, every argument annotated
    as a tensor gets dim 0 (batch) marked dynamic. `enable_if(instance) -> bool` decides per
    instance on its first call. Subclasses inherit the decoration; `qp.compile(enabled=False)` on a
    subclass opts it out. After the first call `instance.quantpass_plan` is the plan of the graphs
    it ran.
    """
    if cls is not None:  # used bare: @qp.compile
        return compile(enabled=enabled, dynamic_arg_dims=dynamic_arg_dims, enable_if=enable_if, **options)(cls)
    backend_options = BackendOptions.parse(**options)  # bad options fail at decoration time
    if enable_if is not None and not callable(enable_if):
        raise ValueError(f"invalid enable_if {enable_if!r}: expected a callable(instance) -> bool")
    dims = None if dynamic_arg_dims is None else _normalize_dims(dynamic_arg_dims)

    def decorate(module_class):
        if not (isinstance(module_class, type) and issubclass(module_class, torch.nn.Module)):
            raise TypeError(f"qp.compile decorates torch.nn.Module subclasses, not {module_class!r}")
        _check_arg_names(module_class, dims)
        settings = CompileSettings(enabled, dict(options), dims, enable_if)
        if enabled:
            settings.backend = _PlanRecordingBackend(backend_options)
        module_class._quantpass_settings = settings
        module_class.__call__ = _call
        module_class.__getstate__ = _without_state(module_class.__getstate__)
        module_class.quantpass_plan = property(_plan, doc="The plan of the graphs this instance ran.")
        return module_class

    return decorate


def _without_state(getstate):
    """A copy (`copy.deepcopy`, pickle / `torch.save`) is a new instance: it compiles on its own first
    call. Carrying the original's state over made it skip that and run eagerly, unquantized, while
    its plan still listed quantized layers (nn.Module already drops `_compiled_call_impl`)."""
    if getattr(getstate, "_quantpass", False):  # a decorated class's subclass: wrapped already
        return getstate

    def __getstate__(self):
        state = getstate(self)
        return {k: v for k, v in state.items() if k != "_quantpass_state"} if isinstance(state, dict) else state

    __getstate__._quantpass = True
    return __getstate__


def _normalize_dims(dynamic_arg_dims) -> dict[str, list[int]]:
    if not isinstance(dynamic_arg_dims, dict):
        raise ValueError(f"invalid dynamic_arg_dims {dynamic_arg_dims!r}: expected a dict of argument name -> dim(s)")
    out = {}
    for name, dims in dynamic_arg_dims.items():
        dims = [dims] if isinstance(dims, int) else list(dims)
        if not all(isinstance(d, int) for d in dims):
            raise ValueError(f"invalid dynamic_arg_dims[{name!r}] {dims!r}: expected an int or a list of ints")
        out[name] = dims
    return out


def _check_arg_names(module_class, dims) -> None:
    if not dims:
        return
    parameters = inspect.signature(module_class.forward).parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    valid = [n for n in parameters if n != "self"]
    for name in dims:
        if name not in parameters and not takes_kwargs:
            raise ValueError(
                f"invalid dynamic_arg_dims argument {name!r} for {module_class.__name__}.forward; valid: {', '.join(valid)}"
            )


def _call(self, *args, **kwargs):
    if torch.compiler.is_compiling():  # called inside an outer compiled region: let it trace us
        return self._call_impl(*args, **kwargs)
    state = self.__dict__.get("_quantpass_state")
    if state is None:
        return _first_call(self, args, kwargs)
    if state is False:  # decided on the first call: eager
        return torch.nn.Module.__call__(self, *args, **kwargs)
    return _run_recording(self, state, args, kwargs)


def _first_call(self, args, kwargs):
    settings = type(self)._quantpass_settings
    active = settings.enabled and (settings.enable_if is None or bool(settings.enable_if(self)))
    if not active:
        self.__dict__["_quantpass_state"] = False
        return torch.nn.Module.__call__(self, *args, **kwargs)
    _mark_dynamic(type(self), settings, args, kwargs)
    if warning := experts_warning(self):
        logger.warning("%s", warning)
    self.compile(backend=settings.backend)
    state = self.__dict__["_quantpass_state"] = {"settings": settings, "plans": {}}
    with depyf_session(settings.backend.quantpass.options.debug_dir):
        return _run_recording(self, state, args, kwargs)


def _run_recording(self, state, args, kwargs):
    backend = state["settings"].backend
    backend.ran.clear()
    out = torch.nn.Module.__call__(self, *args, **kwargs)
    for plan in backend.ran:
        state["plans"].setdefault(id(plan), plan)
    return out


def _plan(self) -> Plan | None:
    """The plan of the graphs this instance ran; None before its first call or when not compiled."""
    state = self.__dict__.get("_quantpass_state")
    if not state:
        return None
    return model_plan(state["plans"].values(), [self])


def _mark_dynamic(module_class, settings: CompileSettings, args, kwargs) -> None:
    bound = inspect.signature(module_class.forward).bind(None, *args, **kwargs)
    arguments = {**bound.arguments, **bound.arguments.get(_var_keyword(module_class), {})}
    dims, mark = settings.dynamic_arg_dims, torch._dynamo.mark_dynamic
    if dims is None:  # inferred: a hint Dynamo may drop if the code specializes the dim
        dims, mark = (
            {name: [BATCH_DIM] for name in _tensor_annotated_args(module_class)},
            torch._dynamo.maybe_mark_dynamic,
        )
    for name, arg_dims in dims.items():
        value = arguments.get(name)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"dynamic_arg_dims names {module_class.__name__}.forward argument {name!r}, "
                f"but it got {type(value).__name__}, not a tensor"
            )
        for dim in arg_dims:
            if not -value.ndim <= dim < value.ndim:
                raise ValueError(
                    f"invalid dynamic dim {dim} for argument {name!r} of shape {tuple(value.shape)} "
                    f"in {module_class.__name__}.forward"
                )
            mark(value, dim % value.ndim)


def _var_keyword(module_class) -> str | None:
    parameters = inspect.signature(module_class.forward).parameters.values()
    return next((p.name for p in parameters if p.kind is inspect.Parameter.VAR_KEYWORD), None)


@functools.cache
def _tensor_annotated_args(module_class) -> tuple[str, ...]:
    """`forward`'s arguments annotated as a tensor (`torch.Tensor`, `torch.LongTensor | None`, ...)."""
    forward = module_class.forward
    try:
        hints = typing.get_type_hints(forward)
    except Exception:  # unresolvable forward references: fall back to the raw annotations
        hints = getattr(forward, "__annotations__", {})
    return tuple(name for name, hint in hints.items() if name != "return" and _is_tensor_type(hint))


def _is_tensor_type(hint) -> bool:
    if isinstance(hint, str):
        return hint.replace(" ", "").removesuffix("|None") in ("torch.Tensor", "Tensor", "Optional[torch.Tensor]")
    if isinstance(hint, type):
        return issubclass(hint, torch.Tensor)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_is_tensor_type(arg) for arg in typing.get_args(hint))
    return False
