"""Quantized weights keyed by the parameter objects actually passed, never baked into a graph.

Dynamo reuses one compiled graph for every instance of a module class, so the runtime wrapper asks
this cache for each call's weights (docs/design.md §3). Two levels:

- a `ParamRecord` per parameter (held weakly: it dies with its parameter) says whether the
  parameter changed since its quantized copies were built: `_version` (in-place writes such as
  `param.copy_(new)`) and `data_ptr()` (`param.data = new`, `module.to(...)`). The storage the copies
  were built from is pinned by the record, so a new storage can never reuse its address and look
  unchanged. A change bumps the record's `generation`, which invalidates every entry built from it.
  Writes through `.data` (`p.data.copy_(new)`) bump neither: `refresh(param)` does
  (`qp.refresh_weights(model)`).
- entries: what a site built (backend-prepared QTensors) per (parameter objects, token).

Released parameters: once quantized, a parameter's storage is freed (`resize_(0)`; shape, dtype,
device and identity stay, so guards and graph inputs are unchanged). Its record then keeps the
*canonical* QTensor (formats.py's layout, `[..., N, K]`) it was quantized to: the source for any
other layout, for `restore` (dequantize back into the parameter when something must read it
unquantized) and for `qp.state_dict`.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import warnings
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback
from torch._dynamo.comptime import comptime
from torch._dynamo.eval_frame import OptimizedModule, innermost_backend, skip_code
from torch._dynamo.symbolic_convert import InstructionTranslator
from torch.compiler import is_compiling

from .distributed import is_dtensor, like_param, local_tensor
from .quant_registry.qtensor import QTensor

logger = logging.getLogger("quantpass")

CanonicalKey = Hashable  # (weight QuantKey, transposed): what a canonical QTensor was quantized as


@dataclass
class ParamRecord:
    ref: weakref.ref  # the parameter
    state: tuple[int, int]  # (_version, data_ptr) when last seen
    storage: torch.UntypedStorage  # pinned: its address can't be reused while we compare against it
    inference: bool  # created under inference_mode: no version counter
    plain: bool  # neither inference nor a DTensor: `generation` reads its state inline
    generation: int = 0
    released: bool = False
    canonical: dict[CanonicalKey, QTensor] = field(default_factory=dict)
    source: str | None = None  # where the value came from when not from this parameter's data (`note`: full precision)
    spec: object = None  # QuantSpec the value was declared with (a pre-quantized checkpoint's), else None
    activation: dict = field(default_factory=dict)  # CanonicalKey -> the activation key a graph ran it with
    restored: str | None = None  # why a released value was given back (its layer ran on full precision)


def _state(param: torch.Tensor, inference: bool) -> tuple[int, int]:
    param = local_tensor(param)  # a DTensor's shard: its own storage, version and address
    return (0 if inference else param._version, param.data_ptr())


class WeightCache:
    def __init__(self):
        self._records: dict[int, ParamRecord] = {}
        self._entries: dict[tuple, tuple[tuple, object]] = {}
        self._tokens: dict[Hashable, int] = {}
        self._finalizers: dict[int, weakref.finalize] = {}
        self.builds = 0  # how many times something was built (tests read it)
        self.release_epoch = 0  # bumped by every release: graphs that read parameters raw check it

    # ------------------------------------------------------------------ per-parameter records
    def record(self, param: torch.Tensor) -> ParamRecord:
        record = self._records.get(id(param))
        if record is None:
            inference = param.is_inference()
            storage = local_tensor(param).untyped_storage()
            plain = not inference and not is_dtensor(param)
            record = ParamRecord(weakref.ref(param), _state(param, inference), storage, inference, plain)
            self._records[id(param)] = record
            self._finalizers[id(param)] = weakref.finalize(param, self._forget, id(param))
        return record

    def generation(self, param: torch.Tensor) -> int:
        """The parameter's generation, bumped first if it changed since last seen. Runs for every
        quantized parameter on every compiled call: a plain tensor's state is read inline."""
        record = self._records.get(id(param)) or self.record(param)
        state = (param._version, param.data_ptr()) if record.plain else _state(param, record.inference)
        if state != record.state:
            self._changed(param, record, state)
        return record.generation

    def _changed(self, param, record: ParamRecord, state) -> None:
        record.state, record.storage = state, local_tensor(param).untyped_storage()
        record.generation += 1
        record.released = record.storage.nbytes() == 0 and param.numel() > 0
        if not record.released:  # new data: quantized copies of the old data are stale
            record.canonical.clear()
            record.activation.clear()
            record.source = record.spec = None

    def refresh(self, param: torch.Tensor) -> None:
        """Treat the parameter as changed (after writes through `.data`, which bump nothing)."""
        record = self._records.get(id(param))
        if record is not None and not record.released:
            self._changed(param, record, _state(param, record.inference))

    def is_released(self, param: torch.Tensor) -> bool:
        record = self._records.get(id(param))
        if record is None:
            return False
        self.generation(param)
        return record.released

    def canonical(self, param: torch.Tensor, key: CanonicalKey) -> QTensor | None:
        record = self._records.get(id(param))
        return None if record is None else record.canonical.get(key)

    def set_canonical(self, param: torch.Tensor, key: CanonicalKey, value: QTensor, activation) -> None:
        """Keep `value` as the parameter's quantized value, built for a graph that runs it with
        `activation` (a QuantKey; None: unquantized activations)."""
        record = self.record(param)
        record.canonical[key] = value
        record.activation[key] = activation

    def attach_quantized(self, param: torch.Tensor, weight: QTensor, spec, source: str, transposed: bool = False):
        """Make `weight` (formats.py's layout, `[..., N, K]`) the quantized value of a parameter that
        never held full-precision data (a pre-quantized checkpoint, quantize-on-load): its storage is
        freed and `spec` (a QuantSpec) becomes its layers' default, shown in the plan as `source`."""
        record = self.record(param)
        record.canonical, record.activation = {(spec.weight, transposed): weight}, {}
        record.spec, record.source = spec, source
        if not self.release(param):
            raise ValueError(f"attach_quantized: the parameter's storage is shared ({source}); give it its own")

    def declared(self, param: torch.Tensor):
        """(QuantSpec, source) of a parameter attached with `attach_quantized`, else None."""
        record = self._records.get(id(param))
        if record is None or record.spec is None:
            return None
        self.generation(param)  # new data assigned since (`p.data = ...`) drops the declaration
        return (record.spec, record.source) if record.spec is not None else None

    def canonical_values(self, param: torch.Tensor) -> dict[CanonicalKey, QTensor]:
        record = self._records.get(id(param))
        return {} if record is None else dict(record.canonical)

    def ran_with(self, param: torch.Tensor, key: CanonicalKey):
        """The activation key a graph runs the canonical value `key` with: the last graph built for it,
        else the spec it was declared with (`attach_quantized`); `...` when neither is known."""
        record = self._records.get(id(param))
        if record is None:
            return ...
        if key in record.activation:
            return record.activation[key]
        return record.spec.activation if record.spec is not None else ...

    def note(self, param: torch.Tensor, source: str) -> None:
        """Say where a full-precision parameter came from (a quantized checkpoint that stores it
        unquantized): the plan's reason for leaving its layer alone, until new data is assigned."""
        self.record(param).source = source

    def source(self, param: torch.Tensor) -> str | None:
        record = self._records.get(id(param))
        if record is None:
            return None
        self.generation(param)  # new data assigned since drops it
        return record.source

    def release(self, param: torch.Tensor) -> bool:
        """Free the parameter's storage; it must hold a canonical value. False when it can't be freed
        because other tensors may share its storage (a view, or a storage larger than the tensor). A
        storage that can't be resized (torch.load, a file mapped into memory) is first swapped for a
        private copy, which is then freed. A DTensor's local shard is what is freed."""
        record = self.record(param)
        if record.released:
            return True
        if not record.canonical:
            raise RuntimeError("quantpass: release() needs the parameter's quantized value first")
        local = local_tensor(param)
        storage = local.untyped_storage()
        if local.storage_offset() != 0 or storage.nbytes() != local.numel() * local.element_size():
            return False
        self.generation(param)  # fold any change made before now into the record
        if not storage.resizable():  # move to one we may free
            with torch.no_grad():
                local.set_(storage.clone(), 0, local.shape, local.stride())
            storage = local.untyped_storage()
        storage.resize_(0)
        record.state, record.storage, record.released = _state(param, record.inference), storage, True
        record.restored = None
        self.release_epoch += 1
        # copy.deepcopy / pickle (torch.save(model)) of a released weight: its dequantized value, never
        # freed memory (instance attributes win over Tensor's methods; `restore` removes them)
        ref = weakref.ref(param)
        param.__deepcopy__ = lambda memo: _dense_parameter(ref())
        param.__reduce_ex__ = lambda protocol: _dense_parameter(ref()).__reduce_ex__(protocol)
        return True

    def dense(self, param: torch.Tensor) -> torch.Tensor:
        """A released parameter's values, dequantized from its canonical value, in its own layout."""
        from .quant_registry.formats import dequantize

        (_, transposed), value = next(iter(self._records[id(param)].canonical.items()))
        dense = dequantize(value, param.dtype)
        return like_param(param, param_layout(dense, transposed, local_tensor(param).shape).to(param.device))

    def restore(self, param: torch.Tensor, why: str) -> None:
        """Give a released parameter its values back, dequantized from its canonical value, saying
        `why` (the plan reports it). Its quantized copies stay valid (they were made from these values)."""
        record = self._records[id(param)]
        record.restored = why
        dense, local = local_tensor(self.dense(param)), local_tensor(param)
        storage = local.untyped_storage()
        storage.resize_(local.numel() * local.element_size())
        with torch.no_grad():
            local.data.copy_(dense)  # through .data: no version bump, the quantized copies stay valid
        for name in ("__deepcopy__", "__reduce_ex__"):
            param.__dict__.pop(name, None)
        record.state, record.storage, record.released = _state(param, record.inference), storage, False

    def restored(self, param: torch.Tensor) -> str | None:
        """Why the parameter's released value was given back, while it still holds it; else None."""
        record = self._records.get(id(param))
        return record.restored if record is not None and not self.is_released(param) else None

    def released_params(self) -> list[torch.Tensor]:
        return [p for r in self._records.values() if r.released and (p := r.ref()) is not None]

    # ------------------------------------------------------------------ built entries
    def intern(self, token: Hashable) -> int:
        """A small int standing for `token`: hashing a tuple of QuantKeys on every call of a
        200-site model cost ~0.3 ms per forward (1.5 us per site, measured); an int costs ~0.3 us."""
        return self._tokens.setdefault(token, len(self._tokens))

    def get(self, params: Sequence[torch.Tensor], token: Hashable, build: Callable[[list[torch.Tensor]], object]):
        """The value `build(params)` made for these parameter objects and `token` (best an `intern`ed
        int: it is hashed on every call), rebuilt if any parameter changed since."""
        key = (*map(id, params), token)
        generations = tuple(map(self.generation, params))
        entry = self._entries.get(key)
        if entry is not None and entry[0] == generations:
            return entry[1]
        with torch.no_grad():
            value = build(list(params))
        self.builds += 1
        self._entries[key] = (tuple(map(self.generation, params)), value)
        return value

    def drop(self, params: Sequence[torch.Tensor], token: Hashable) -> None:
        """Forget what `get(params, token, ...)` built: the next `get` builds again."""
        self._entries.pop((*map(id, params), token), None)

    def _forget(self, param_id: int) -> None:
        self._finalizers.pop(param_id, None)
        self._records.pop(param_id, None)
        for key in [k for k in self._entries if param_id in k[:-1]]:
            del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self, params: Sequence[torch.Tensor] | None = None) -> int:
        """Bytes of the distinct tensors the cache holds (what quantpass adds to a process); with
        `params`, only what it holds for those parameters (one model's share)."""
        seen, total = set(), 0
        if params is None:
            entries, records = self._entries.values(), self._records.values()
        else:
            ids = {id(p) for p in params}
            entries = [value for key, value in self._entries.items() if ids.intersection(key[:-1])]
            records = [self._records[i] for i in ids if i in self._records]
        tensors = [t for _, value in entries for t in (value[1] if isinstance(value, tuple) else ())]
        tensors += [t for r in records for qt in r.canonical.values() for t in qt.tensors()]
        for t in tensors:
            if t is None:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    def clear(self) -> None:
        self._entries.clear()


WEIGHTS = WeightCache()


def param_layout(matrix: torch.Tensor, transposed: bool, shape) -> torch.Tensor:
    """A canonical `[..., N, K]` value in its parameter's layout: transposed back, viewed as the
    parameter's `shape` (a weight an einsum reads as a matrix: `ParamRef.shape`)."""
    return (matrix.transpose(-2, -1) if transposed else matrix).reshape(shape)


def canonical_layout(value: torch.Tensor, transposed: bool, shape) -> torch.Tensor:
    """A parameter's value in the layout of its canonical value of `shape` (`[..., N, K]`)."""
    stored = (*shape[:-2], shape[-1], shape[-2]) if transposed else tuple(shape)
    matrix = value.reshape(stored)
    return (matrix.transpose(-2, -1) if transposed else matrix).contiguous()


def _dense_parameter(param: torch.Tensor) -> torch.Tensor:
    value = WEIGHTS.dense(param) if WEIGHTS.is_released(param) else param.detach().clone()
    return torch.nn.Parameter(value, param.requires_grad) if isinstance(param, torch.nn.Parameter) else value


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim`, or None elsewhere."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def return_freed_memory() -> None:
    """Hand memory freed by releases back to the OS. glibc keeps freed chunks below its mmap
    threshold (which grows to 32 MiB as big blocks are freed) in its heap: without this, releasing
    the weights of a hidden-512 Llama left the process's RSS where it was (measured 2026-12-01)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


_EAGER_GUARD: list = []


def install_eager_guard() -> None:
    """A module that runs eagerly (outside a compiled graph: the user's own `model(x)` to compare, a
    fallback after a graph break) gets its released weights back before its forward reads them,
    with a warning; a global forward pre-hook, which compiled code never runs (Dynamo folds
    `is_compiling()`; while it traces, the hook only checks the graph's backend at trace time:
    `_restore_before_another_backend`), costing ~1 us per eager module call. Installed when
    quantpass's backend is imported, before any trace: Dynamo traces module calls differently with a
    global hook, and a frame whose analysis it restarts after the backend ran (dynamic shapes) must
    see the same."""
    if not _EAGER_GUARD:
        _EAGER_GUARD.append(torch.nn.modules.module.register_module_forward_pre_hook(_restore_before_eager_use))
        # torch.compile(module) then warns that global hooks fire once more for its wrapper module:
        # harmless here (a wrapper has no parameters of its own), and said on every compiled call.
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")


OUTSIDE = "runs outside the compiled model"
EAGER_CAUSES = (
    ". Called from a compiled model, it ran eagerly: Dynamo runs a frame eagerly past "
    "torch._dynamo.config.recompile_limit (its warning says 'hit config.recompile_limit'; raise the limit) "
    "or after a graph break it could not resume from. `plan` names the layers"
)
_READS_CHILD_WEIGHTS = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer)
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> release epoch checked


def _restore_before_eager_use(module, args):
    # `is_compiling` by its own name: Dynamo folds it to True here and traces no further. Reached as
    # `torch.compiler.is_compiling`, every compiled module also got a guard that this module's `torch`
    # is torch.nn's, evaluated in Python on each call (its only Python guard)
    if is_compiling():
        comptime(_restore_before_another_backend)  # at trace time only: nothing in the graph
        return
    compiling = get_eval_frame_callback()
    if compiling and not isinstance(module, OptimizedModule):
        _before_a_compiled_forward(module, compiling)
        return
    if _CHECKED.get(module) == WEIGHTS.release_epoch:  # nothing released since its last eager call
        return
    _CHECKED[module] = WEIGHTS.release_epoch
    if isinstance(module, OptimizedModule):  # torch.compile(model): the wrapper's own call, not traced
        backend = _backend_of(module)
        if backend is None or _is_quantpass(backend):
            return
        # Another backend (plain `torch.compile(model)` to compare) would read the freed storages.
        _restore_released(module._orig_mod.parameters(), module, f"compiled with backend {_backend_name(backend)}")
    else:
        _restore_released(_own_weights(module), module, OUTSIDE)


# Dynamo would otherwise compile the hook as a frame of its own wherever eager code calls a module under
# torch.compile (between the graphs of a model with graph breaks), once per module class, up to its
# recompile limit (8) and then with a warning naming this function. Traced inside a module call, it is
# still inlined (the `is_compiling` branch).
skip_code(_restore_before_eager_use.__code__)


@torch._dynamo.disable  # what it calls must not become frames Dynamo compiles
def _before_a_compiled_forward(module: torch.nn.Module, callback) -> None:
    """The module is called from the eager code between the graphs of a compiled function or model:
    its forward is compiled next, by that torch.compile's backend."""
    backend = _given_backend(callback)
    if not _is_quantpass(backend):
        _restore_released(_own_weights(module), module, f"traced for backend {_backend_name(backend)}")


def _restore_before_another_backend(ctx) -> None:
    """Dynamo runs this while it traces a module call (`comptime`): where the graph goes to a backend
    other than quantpass (`torch.compile(fn)` over a model whose weights quantpass released, Inductor
    or any other), the module gets its released weights back before Dynamo reads them (Inductor
    refused the freed storages: "data is not allocated yet"). Read through Dynamo's private tracing
    state, as torch 2.13 keeps it; where that is not there, nothing happens (`tests/test_weights.py`
    checks that it is)."""
    try:
        backend = _given_backend(InstructionTranslator.current_tx().output.compiler_fn)
        module = ctx.get_local("module")._i_will_not_complain_if_bc_breaks_VariableTracker().value
    except (AttributeError, KeyError):
        return
    if isinstance(module, torch.nn.Module) and not _is_quantpass(backend):
        _restore_released(_own_weights(module), module, f"traced for backend {_backend_name(backend)}")


def _own_weights(module: torch.nn.Module):
    # A few torch modules read their children's weights without calling them (MultiheadAttention's
    # out_proj, the encoder layer's fast path); any other module's children get their own call.
    return module.parameters() if isinstance(module, _READS_CHILD_WEIGHTS) else module._parameters.values()


def _restore_released(params, module: torch.nn.Module, where: str) -> None:
    for param in params:
        if param is not None and WEIGHTS.is_released(param):
            log = logger.debug if _EAGER_GUARD[1:] else logger.warning  # one warning per process
            _EAGER_GUARD.append(True)
            log(
                "quantpass: %s %s, but quantpass released its weights after quantizing them; restoring "
                "them dequantized (keep_original_weights=True keeps the originals)%s",
                type(getattr(module, "_orig_mod", module)).__name__,
                where,
                EAGER_CAUSES if where == OUTSIDE else "",
            )
            WEIGHTS.restore(param, where)


def _backend_of(wrapper: OptimizedModule):
    """The backend `torch.compile` was given for this wrapper (Dynamo's private backend chain, read as
    torch 2.13 keeps it), or None where it is not there (`tests/test_weights.py` checks that each way of
    compiling with quantpass is recognised)."""
    try:
        return _given_backend(wrapper.dynamo_ctx.callback)
    except AttributeError:
        return None


def _given_backend(callback):
    """The backend given to torch.compile, under Dynamo's wrappers of it (`callback`: one of them)."""
    backend = innermost_backend(callback)
    return getattr(backend, "compiler_fn", backend)  # torch.compile's wrapper of a backend given options


def _is_quantpass(backend) -> bool:
    return str(getattr(backend, "__module__", "")).partition(".")[0] == "quantpass"


def _backend_name(backend) -> str:
    name = getattr(backend, "__name__", None) or type(backend).__name__
    return "inductor" if name == "_TorchCompileInductorWrapper" else name
