"""The Dynamo backend: options -> config, run the pass, lower, wrap with the weight supplier.

`torch.compile(model, backend="quantpass", options={...})` reaches `quantpass_backend` through the
`torch_dynamo_backends` entry point; `qp.backend(config, **options)` builds the same thing as an
object that also keeps the plans of what it compiled.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from dataclasses import dataclass, field

import torch

from . import envs
from .debug import dump_compile
from .lowering import LOWERINGS, lower
from .passes.frame_names import compiled_root
from .passes.quantize import Binding
from .passes.quantize_pass import QuantizePass
from .plan import Plan
from .plan_coverage import model_plan, unreached_rows
from .quant_registry.spec import QuantizationConfig
from .weight_cache import WEIGHTS, install_eager_guard, return_freed_memory
from .weights import graph_owners, hook_owners

logger = logging.getLogger("quantpass")

install_eager_guard()  # before any trace (see its docstring)

CONFIG_OPTIONS = ("linear", "moe", "targets", "ignore", "backend")
FLAGS = {"verify": True, "keep_original_weights": False, "requantize": False}  # boolean options, defaults
OPTIONS = ("config", *CONFIG_OPTIONS, "lowering", "debug_dir", *FLAGS)


def _configure_logging() -> None:
    level = envs.log_level()
    if level is None:
        return
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[quantpass %(levelname)s] %(message)s"))
        logger.addHandler(handler)
    try:
        logger.setLevel(level.upper())
    except ValueError:
        raise ValueError(f"invalid QUANTPASS_LOG {level!r}; valid: critical, debug, error, info, warning") from None


_configure_logging()


@dataclass(frozen=True)
class BackendOptions:
    config: QuantizationConfig
    lowering: str = "inductor"
    verify: bool = True
    debug_dir: str | None = None
    keep_original_weights: bool = False  # else each original weight's storage is freed once quantized
    requantize: bool = False  # a pre-quantized checkpoint's weights may be quantized to another format

    @classmethod
    def parse(cls, config=None, **options) -> BackendOptions:
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"invalid quantpass option {unknown[0]!r}; valid: {', '.join(sorted(OPTIONS))}")
        if config is not None and not isinstance(config, QuantizationConfig):
            config = QuantizationConfig.from_dict(config)
        overrides = QuantizationConfig(**{k: options[k] for k in CONFIG_OPTIONS if k in options})
        merged = (config or QuantizationConfig()).merged_with(overrides)
        lowering = options.get("lowering", "inductor")
        if lowering not in LOWERINGS:
            raise ValueError(f"invalid quantpass option lowering={lowering!r}; valid: {', '.join(LOWERINGS)}")
        flags = {name: options.get(name, default) for name, default in FLAGS.items()}
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise ValueError(f"invalid quantpass option {name}={value!r}; valid: True, False")
        debug_dir = options.get("debug_dir") or envs.debug_dir()
        return cls(merged, lowering, debug_dir=None if debug_dir is None else str(debug_dir), **flags)


class QuantizedGraph:
    """What Dynamo calls: supplies each site's quantized weights from the cache, then runs.

    A parameter this graph reads unquantized may have been released by another graph that
    quantized it (an embedding tied to a quantized output head): it is restored first, with a
    warning, never read as freed memory. The check costs one dict lookup per call until something
    is released again (`WEIGHTS.release_epoch`)."""

    def __init__(self, compiled, bindings: list[Binding], raw_params: list[int]):
        self.compiled = compiled  # a Dynamo-level callable: called with *args, never boxed
        self.bindings = bindings
        self.raw_params = raw_params
        self.checked: dict[int, int] = {}  # id of the first raw parameter -> release epoch last checked

    def __call__(self, *args):
        if self.raw_params and self.checked.get(id(args[self.raw_params[0]])) != WEIGHTS.release_epoch:
            self._restore_released(args)
        return self.compiled(*args, *(t for binding in self.bindings for t in binding.tensors(args)))

    def _restore_released(self, args) -> None:
        for index in self.raw_params:
            if WEIGHTS.is_released(args[index]):
                logger.warning(
                    "quantpass: a graph reads a weight of shape %s unquantized after quantpass released it (a tied "
                    "weight, or a graph Dynamo compiled for another instance of the class without quantizing it); "
                    "restoring it from its quantized value (pass keep_original_weights=True to keep originals)",
                    tuple(args[index].shape),
                )
                WEIGHTS.restore(args[index], "read unquantized by a graph")
        self.checked[id(args[self.raw_params[0]])] = WEIGHTS.release_epoch


@dataclass
class QuantpassBackend:
    """A Dynamo backend; `plans` holds one Plan per graph it compiled. With `keep_graphs` set (tests,
    debugging), `graphs` also keeps (Dynamo's graph, the rewritten graph or None) per compile: off by
    default, since every node's metadata (fake tensors, stack traces) then lives as long as the
    backend: 0.7 MiB for a 6-layer Llama (bench/README.md, "Memory")."""

    options: BackendOptions
    plans: list[Plan] = field(default_factory=list)
    graphs: list[tuple] = field(default_factory=list)
    keep_graphs: bool = False
    warned_grad: bool = False
    roots: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # the modules compiled (not kept alive)

    def __post_init__(self):
        options = self.options  # one pass per backend: it remembers what it verified across graphs
        self.quantize_pass = QuantizePass(
            options.config, options.verify, options.keep_original_weights, options.requantize
        )

    @property
    def plan(self) -> Plan:
        """All compiled graphs' plans together, and a row for each linear of the compiled models that
        no graph named (`plan_coverage`)."""
        return model_plan(self.plans, list(self.roots))

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        options = self.options
        if options.config.is_empty and not any(WEIGHTS.declared(v) for v in example_inputs if _is_param(v)):
            # nothing to quantize: plain lowering, still guarded against released weights (Dynamo may
            # serve this graph to another instance of the class, e.g. a pre-quantized one)
            raw = [i for i, v in enumerate(example_inputs) if _is_param(v)]
            self.plans.append(Plan())  # a graph, with nothing to plan
            return QuantizedGraph(_lower(gm, example_inputs, options.lowering), [], raw).__call__
        quantize_pass = self.quantize_pass
        result = quantize_pass(gm, example_inputs)
        self.plans.append(result.plan)
        if (root := compiled_root()) is not None:
            self.roots.add(root)
        if self.keep_graphs:
            self.graphs.append((gm, result.graph_module))
        logger.info("%s", result.plan.summary())
        self._warn_grad(result)
        if result.sites and not options.keep_original_weights:
            hook_owners(graph_owners(gm))  # state_dict()/load_state_dict() of released weights
        if options.debug_dir:
            dump_compile(options.debug_dir, gm, result)
        if result.graph_module is None:  # nothing quantized in this graph
            compiled = _lower(gm, example_inputs, options.lowering, quantize_pass.uuid())
            return QuantizedGraph(compiled, [], result.raw_params).__call__
        inputs = [*example_inputs, *result.extra_inputs]
        compiled = _lower(result.graph_module, inputs, options.lowering, quantize_pass.uuid())
        # A bound method, not the object: depyf.prepare_debug reads `__code__` of what backends return.
        return QuantizedGraph(compiled, result.bindings, result.raw_params).__call__

    def _warn_grad(self, result) -> None:
        if self.warned_grad or not any("weight requires grad" in q.row.reason for q in result.sites):
            return
        self.warned_grad = True
        logger.warning(
            "quantpass: weights require grad with grad mode on; quantized layers still apply (inputs get "
            "gradients through the dequantized weights, quantized weights none); use torch.no_grad() for inference"
        )

    def __eq__(self, other):  # Dynamo compares backends to decide whether a cache entry fits
        return isinstance(other, QuantpassBackend) and self.options == other.options

    __hash__ = object.__hash__


def _lower(gm, example_inputs, lowering: str, cache_uuid: str | None = None):
    """`lower`, then the heap the compile freed handed back to the OS: after a model's first Inductor
    compile an INT8 Llama's process held 3 MiB less (bench/README.md, "Memory")."""
    compiled = lower(gm, example_inputs, lowering, cache_uuid)
    return_freed_memory()
    return compiled


def _is_param(value) -> bool:
    return isinstance(value, torch.nn.Parameter)


def backend(config: QuantizationConfig | dict | None = None, **options) -> QuantpassBackend:
    """A quantpass Dynamo backend: `torch.compile(model, backend=qp.backend(cfg, lowering=...))`."""
    return QuantpassBackend(BackendOptions.parse(config=config, **options))


def quantpass_backend(gm, example_inputs, options: dict | None = None, mode: str | None = None):
    """The `torch_dynamo_backends` entry point: `torch.compile(m, backend="quantpass", options=...)`.

    torch.compile runs no backend code before the first call, so `options` are checked here, once
    per graph; a bad one raises `InvalidOptionError` (a ValueError) whose first line names it.
    """
    try:
        if mode not in (None, "default"):
            raise ValueError(f"invalid mode {mode!r} for backend 'quantpass'; it takes options=, not mode=")
        compiler = backend(**(options or {}))
    except ValueError as e:
        raise _invalid_option(f"quantpass options: {e}", inspect.currentframe()) from None
    return compiler(gm, example_inputs)


class InvalidOptionError(ValueError):
    """A bad `options=` of `torch.compile(..., backend="quantpass")`, found at the first call."""


def _invalid_option(message: str, frame) -> InvalidOptionError:
    """Dynamo wraps what a backend raises in BackendCompilerFailed, whose message starts with
    "backend='quantpass' raised:"; a ShortenTraceback it re-raises as it is, minus Dynamo's frames."""
    error_class = _dynamo_pass_through_error()
    if error_class is None:  # a torch without it: Dynamo's wrapper line comes first
        return InvalidOptionError(message)
    return error_class(message, first_useful_frame=frame)


@functools.cache
def _dynamo_pass_through_error():
    try:
        from torch._dynamo.exc import ShortenTraceback
    except ImportError:
        return None
    return type("InvalidOptionError", (ShortenTraceback, InvalidOptionError), {"__module__": __name__})


def experts_warning(model) -> str | None:
    """Why a transformers MoE model's experts would never reach quantpass, or None.

    transformers' "eager" experts implementation loops over experts with data-dependent shapes:
    Dynamo breaks the graph there and no expert weight appears in any graph (measured on
    Mixtral/Qwen3-MoE/DeepSeek-V3/GPT-OSS, transformers 5.x); `grouped_mm`/`batched_mm` give one.
    """
    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) != "eager":
        return None
    if not any(name.endswith("experts") for name, _ in model.named_modules()):
        return None
    can_switch = getattr(type(model), "_can_set_experts_implementation", None)
    if can_switch is not None and not can_switch():  # its own expert loop (DBRX, Switch, NLLB-MoE, JetMoE)
        return (
            f"{type(model).__name__} runs its experts in a loop of its own, with no grouped_mm or batched_mm "
            "implementation to switch to: no fused MoE layer; the expert weights that reach a graph are quantized "
            "one by one (weight-only where they are 3-D), the others stay unquantized, and the plan says which"
        )
    return (
        f"{type(model).__name__} uses transformers' 'eager' experts implementation: Dynamo breaks the graph "
        "in its expert loop, so quantpass never sees the expert weights; call "
        "model.set_experts_implementation('grouped_mm') (or 'batched_mm') before compiling"
    )


def explain(
    model, *example_inputs, config: QuantizationConfig | dict | None = None, kwargs: dict | None = None, **options
) -> Plan:
    """What quantpass would do to `model` on these inputs (positional, and keyword ones in `kwargs`:
    `kwargs={"input_ids": ids, "attention_mask": mask}`): captures with Dynamo, quantizes nothing.

    Runs the model once (uncompiled, under `torch.no_grad()`: quantpass is for inference); weights
    quantpass already released (a model compiled before) run as their dequantized values, the
    model itself is left as it is.
    """
    if inputs := sorted(set(options) - set(OPTIONS)):  # `explain(model, input_ids=ids)`: the model's, not ours
        raise ValueError(
            f"invalid quantpass option {inputs[0]!r}; valid: {', '.join(sorted(OPTIONS))}. The model's keyword "
            f"inputs go in kwargs: qp.explain(model, kwargs={{{inputs[0]!r}: ...}})"
        )
    opts = BackendOptions.parse(config=config, **options)
    if warning := experts_warning(model):
        logger.warning("%s", warning)
    plan = Plan(graphs=0)

    def planner(gm, inputs):
        plan.extend(QuantizePass(opts.config, verify=False)(gm, inputs, plan_only=True).plan)

        def run(*args):
            return gm.forward(*(WEIGHTS.dense(a) if _is_param(a) and WEIGHTS.is_released(a) else a for a in args))

        return run

    with torch.no_grad():
        torch.compile(model, backend=planner)(*example_inputs, **(kwargs or {}))
    if isinstance(model, torch.nn.Module):  # a function has no layers of its own to account for
        plan.rows += unreached_rows(model, plan)
    return plan
