"""`qp.from_pretrained`: a transformers model whose quantized layers never held full precision.

The model is built with its parameters on the meta device (buffers such as rotary tables are
computed as usual), then filled from the safetensors shards one tensor at a time:

- a pre-quantized layer (ModelOpt, gpt-oss MXFP4, transformers' fine-grained FP8, compressed-tensors)
  gets the checkpoint's own tensors as its quantized value (`WEIGHTS.attach_quantized`), declared with
  the checkpoint's spec; per-expert tensors are stacked into transformers' fused `[E, 2I, H]` /
  `[E, H, I]` expert parameters;
- with formats in the options (`linear="int8_weight_only"`), each full-precision linear/experts
  weight is quantized as it is read (quantize-on-load): one layer's full-precision values at a time;
- everything else is loaded as it is stored.

`torch.compile(model, backend="quantpass")` with no options then runs the declared formats.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

from ..quant_registry.formats import dequantize, quantize
from ..quant_registry.names import Kind
from ..quant_registry.qtensor import QTensor
from ..quant_registry.spec import QuantizationConfig
from ..weight_cache import WEIGHTS, return_freed_memory
from . import compressed_tensors, shards
from .algos import Algo, Layout, parse_quantization
from .convert import join_rows, roles, stack_experts, to_qtensor

logger = logging.getLogger("quantpass")

CONFIG_OPTIONS = ("linear", "moe", "targets", "ignore")
# Per-expert checkpoint names of transformers' fused experts (gate, up, down): what transformers 5
# and ModelOpt write for Qwen/DeepSeek/OLMoE-style experts, and Mixtral's names.
EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
EXPERT_DATA = ("weight", "weight_blocks", "weight_packed")  # an expert projection's data, per expert (ModelOpt: weight)
QUANTIZE_CHUNK = 1 << 14  # elements quantized at once on load: bounds the fp32 temporaries (64 KiB each)


@dataclass
class CheckpointInfo:
    """What `from_pretrained` read, kept on the model (`model.quantpass_checkpoint`) for export."""

    path: str
    layout: Layout
    algos: dict = field(default_factory=dict)  # layer FQN -> Algo it was stored in
    stored_shapes: dict = field(default_factory=dict)  # tensor name -> shape as stored (byte-identical export)
    stored_dtypes: dict = field(default_factory=dict)  # tensor name -> dtype as stored
    renamed: bool = False  # its names were transformers' legacy ones (`renamings`): export writes them so again


# ---------------------------------------------------------------------------- reading the config
def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def detect(path: str) -> Layout | None:
    """The checkpoint's quantization layout; None when it is not a pre-quantized checkpoint."""
    hf_quant = _read_json(os.path.join(path, "hf_quant_config.json"))
    if hf_quant is not None:
        return parse_quantization(hf_quant.get("quantization", {}), "modelopt", f"{path}/hf_quant_config.json")
    config = _read_json(os.path.join(path, "config.json")) or {}
    quant = config.get("quantization_config") or {}
    method = quant.get("quant_method")
    where = f"{path}/config.json quantization_config"
    if method == "modelopt":
        return parse_quantization(quant, "modelopt", where)
    if method == "mxfp4":
        return parse_quantization(quant, "gpt-oss", where)
    if method == "fp8":
        return parse_quantization(quant, "transformers", where)
    if method == compressed_tensors.PRODUCER:
        return compressed_tensors.layout(quant, where)
    if method is not None:
        raise ValueError(
            f"{where}: quant_method {method!r} is not supported; quantpass reads: modelopt, mxfp4, fp8, compressed-tensors"
        )
    return None


def describe(path: str) -> list[str]:
    """One line per fact about a checkpoint directory's formats (for `quantpass run/explain`)."""
    layout = detect(path)
    if layout is None:
        return [f"{path}: unquantized checkpoint (quantize it on load with --quantization)"]
    lines = [f"{path}: {layout.producer} checkpoint, quant_algo {layout.quant_algo}"]
    rows = [layout.default] if layout.default is not None else []
    rows += [r for r in dict.fromkeys([*layout.per_layer.values(), *(a for _, a in layout.groups)]) if r not in rows]
    for row in rows:
        activation = row.activation if "input_scale" not in row.tensors else f"{row.activation} (input_scale)"
        lines.append(f"  {row.name}: weight {row.weight}, activation {activation}")
    for name, count in layout.formats().items():
        lines.append(f"  {count} layer(s) in {name}")
    if layout.exclude:
        lines.append(f"  left unquantized: {', '.join(layout.exclude)}")
    return lines


# ---------------------------------------------------------------------------- building the model
@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters created inside are on the meta device (no memory); buffers are computed as usual."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _build(path: str, dtype):
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    for attribute in ("quantization_config",):  # ours to apply: transformers must not try
        if hasattr(config, attribute):
            delattr(config, attribute)
    if dtype is None:  # transformers' dtype="auto": the config's, else the stored weights'
        dtype = getattr(config, "dtype", None) or _stored_dtype(path) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with _parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _stored_dtype(path: str) -> torch.dtype | None:
    """The full-precision dtype most of a checkpoint's bytes are stored in (16 bits or more: not FP8 or
    FP4 data), for a config that names none."""
    stored: dict[torch.dtype, int] = {}
    for entry in shards.index(path).values():
        if entry.dtype.is_floating_point and entry.dtype.itemsize >= 2:
            stored[entry.dtype] = stored.get(entry.dtype, 0) + entry.nbytes
    return max(stored, key=stored.get, default=None)


# ---------------------------------------------------------------------------- the loader
def renamings(model_type: str, reverse: bool = False) -> list:
    """transformers' renamings of this model type's checkpoint names (legacy ones, as its own loader
    applies them: Mixtral's `block_sparse_moe` is `mlp`, in transformers 5's own saves and ModelOpt's
    exports); `reverse`: back to the stored names, for export."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # a transformers without them renames nothing either
        return []
    found = [t for t in get_checkpoint_conversion_mapping(model_type) or () if isinstance(t, WeightRenaming)]
    return [t.reverse_transform() for t in reversed(found)] if reverse else found


def renamed(name: str, transforms: list) -> str:
    """`name` (a tensor, a module or a glob over modules) through `renamings`' transforms."""
    for transform in transforms:
        name, _ = transform.rename_source_key(name)
    return name


class _Loader:
    def __init__(self, path, model, layout: Layout | None, config: QuantizationConfig, requantize: bool, device):
        self.model, self.config, self.requantize = model, config, requantize
        self.device = torch.device(device)
        transforms = renamings(getattr(model.config, "model_type", ""))
        stored = shards.index(path)
        self.entries = {renamed(name, transforms): entry for name, entry in stored.items()}
        was_renamed = any(name not in self.entries for name in stored)
        if layout is not None and was_renamed:  # its layers by the model's names too
            per_layer = {renamed(fqn, transforms): algo for fqn, algo in layout.per_layer.items()}
            layout = replace(layout, per_layer=per_layer, exclude=tuple(renamed(p, transforms) for p in layout.exclude))
        self.layout = layout
        self.used: set[str] = set()
        self.info = CheckpointInfo(path, layout or parse_quantization({}, "none", path), renamed=was_renamed)

    def read(self, name: str) -> torch.Tensor:
        self.used.add(name)
        self.info.stored_shapes[name] = self.entries[name].shape
        self.info.stored_dtypes[name] = self.entries[name].dtype
        return shards.read(self.entries[name]).to(self.device)

    def algo(self, module_fqn: str, data_name: str) -> Algo | None:
        if self.layout is None:
            return None
        algo = self.layout.algo_of(module_fqn)
        entry = self.entries.get(data_name)
        if algo is not None and entry is not None and entry.dtype.is_floating_point and entry.dtype.itemsize >= 2:
            logger.debug("quantpass: %s is stored in %s, not %s: loaded unquantized", data_name, entry.dtype, algo.name)
            return None
        return algo

    def checkpoint_qtensor(self, algo: Algo, param_name: str, shape, dtype) -> QTensor:
        tensors = {}
        for role in roles(algo):
            name = algo.tensor_name(role, param_name)
            if name in self.entries:
                tensors[role] = self.read(name)
        return to_qtensor(algo, tensors, shape, dtype, param_name)

    # -- one parameter -------------------------------------------------------------------------
    def attach(self, module: nn.Module, name: str, fqn: str, kind: Kind, value, algo: Algo | None, transposed=False):
        """Set `module.name` from `value` (a QTensor from the checkpoint, or a full-precision tensor)."""
        old = module._parameters[name]
        if algo is None:
            value = _as_built(value, old, f"{fqn}.{name}")  # quantized on load from the model's dtype
        if algo is not None:
            source = f"checkpoint: {algo.name}"
            spec, why = self.config.resolve_with_reason(fqn, kind, algo.spec, source, requantize=self.requantize)
            if spec.weight != algo.weight:  # requantize=True: another format, from the dequantized values
                value = _quantize_streaming(dequantize(value, torch.float32), spec.weight, f"{fqn}.{name}")
            self.info.algos[fqn] = algo
            return self._attach(module, name, old, value, spec, why, transposed)
        spec = self._on_load_spec(fqn, kind, module, name)
        if spec is None:
            self.keep(module, name, value, old.requires_grad)
            return None
        matrix = value.transpose(-2, -1) if transposed else value
        qt = _quantize_streaming(matrix, spec.weight, f"{fqn}.{name}")
        del value, matrix
        # glibc keeps freed temporaries below its (adaptive) mmap threshold and the holes between kept
        # results resident: 51 MiB peak instead of 29 MiB loading a 31 MiB checkpoint as INT8 (83 vs 28 for INT4)
        return_freed_memory()
        return self._attach(module, name, old, qt, spec, f"quantized on load: {spec.name()}", transposed)

    def keep(self, module: nn.Module, name: str, value: torch.Tensor, requires_grad: bool) -> None:
        """`module.name` full precision; a matrix of a quantized checkpoint (a linear, a router, an embedding
        lm_head may be tied to) is noted as stored so: the plan's reason for leaving its layer alone."""
        param = module._parameters[name] = nn.Parameter(value, requires_grad=requires_grad)
        if self.layout is not None and value.dim() >= 2:
            WEIGHTS.note(param, f"checkpoint: stored unquantized (a {self.layout.quant_algo} checkpoint)")

    def _attach(self, module, name, old, qt: QTensor, spec, source: str, transposed: bool):
        param = nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device=self.device), requires_grad=False)
        qt = QTensor(*qt.tensors(), qt.key, qt.shape, old.dtype, input_scale=qt.input_scale)
        WEIGHTS.attach_quantized(param, qt, spec, source, transposed=transposed)
        module._parameters[name] = param
        return param

    def _on_load_spec(self, fqn: str, kind: str, module: nn.Module, name: str):
        """Quantize-on-load: the config's spec for a full-precision layer; the pass's default skips
        (output head, tied weights, MoE routers) stay unquantized unless a target names them; an
        activation-only option is for the checkpoint's quantized layers and leaves this one alone."""
        spec, _ = self.config.resolve_with_reason(fqn, kind)
        if spec is None or self.config.matches_target(fqn):
            return spec
        if (
            fqn.split(".")[-1] == "lm_head"
            or _tied(self.model, module._parameters[name])
            or _is_router(self.model, fqn, module)
        ):
            return None
        return spec

    # -- the model -----------------------------------------------------------------------------
    def load(self) -> CheckpointInfo:
        for fqn, module in self.model.named_modules():
            if _fused_experts(module):
                self.load_experts(fqn, module)
                continue
            for name, param in list(module._parameters.items()):
                full = f"{fqn}.{name}" if fqn else name
                if param is None or param.device.type != "meta":
                    continue
                if isinstance(module, nn.Linear) and name == "weight":
                    self.load_linear(fqn, module)
                elif full in self.entries:
                    self.keep(module, name, _as_built(self.read(full), param, full), param.requires_grad)
            for name, buffer in module._buffers.items():
                full = f"{fqn}.{name}" if fqn else name
                if buffer is not None and full in self.entries:
                    module._buffers[name] = self.read(full)
        for module in self.model.modules():  # buffers computed at build time (rotary tables)
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device != self.device:
                    module._buffers[name] = buffer.to(self.device)
        self.model.tie_weights()
        missing = [n for n, p in self.model.named_parameters() if p.device.type == "meta"]
        if missing:
            raise ValueError(
                f"{self.info.path}: the checkpoint has no tensor for {len(missing)} parameter(s), e.g. {missing[:3]}"
            )
        unused = sorted(set(self.entries) - self.used)
        if unused:
            logger.warning("quantpass: %d checkpoint tensor(s) not used by %s, e.g. %s", len(unused),
                           type(self.model).__name__, unused[:5])  # fmt: skip
        return self.info

    def load_linear(self, fqn: str, module: nn.Linear) -> None:
        name = f"{fqn}.weight"
        algo = self.algo(fqn, name)
        if algo is not None:
            value = self.checkpoint_qtensor(algo, name, module.weight.shape, module.weight.dtype)
        elif name in self.entries:
            value = self.read(name)
        else:
            return  # tied to another parameter (lm_head): tie_weights fills it
        self.attach(module, "weight", fqn, Kind.LINEAR, value, algo)

    def load_experts(self, fqn: str, module: nn.Module) -> None:
        """transformers' fused experts: `gate_up_proj` ([E, 2I, H], or stored `[E, H, 2I]`: transposed)
        and `down_proj`, from fused tensors or one tensor per expert and projection."""
        gate_up, down = module.gate_up_proj, module.down_proj
        transposed = gate_up.shape[1] == down.shape[2]  # [E, H, 2I] with [E, I, H]; never both layouts
        experts = gate_up.shape[0]
        shapes = {"gate_up_proj": _matrix(gate_up.shape, transposed), "down_proj": _matrix(down.shape, transposed)}
        fused = {n: f"{fqn}.{n}" for n in shapes}
        names = next(
            (names for names in EXPERT_NAMES if any(f"{fqn}.0.{names[0]}.{s}" in self.entries for s in EXPERT_DATA)),
            None,
        )  # fmt: skip
        for param_name, (rows, cols) in shapes.items():
            param = getattr(module, param_name)
            if names is None:  # fused tensors: bf16, or quantized (gpt-oss `{p}_blocks`/`{p}_scales`)
                declared = self.layout.algo_of(fqn) if self.layout else None
                algo = declared and self.algo(fqn, declared.tensor_name("data", fused[param_name]))
                value = (
                    self.checkpoint_qtensor(algo, fused[param_name], (experts, rows, cols), param.dtype)
                    if algo is not None
                    else self.read(fused[param_name])
                )
            else:
                parts = names[:2] if param_name == "gate_up_proj" else names[2:]
                first = f"{fqn}.0.{parts[0]}.weight"  # MIXED_PRECISION names the experts or each projection
                algo = self.algo(f"{fqn}.0.{parts[0]}", first) or self.algo(fqn, first)
                value = self._per_expert(fqn, parts, algo, experts, rows, cols, param.dtype, transposed)
            self.attach(module, param_name, fqn, Kind.MOE, value, algo, transposed)
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            bias = getattr(module, name, None)
            if bias is not None and f"{fqn}.{name}" in self.entries:
                module._parameters[name] = nn.Parameter(
                    _as_built(self.read(f"{fqn}.{name}"), bias, f"{fqn}.{name}"), requires_grad=False
                )

    def _per_expert(self, fqn, parts, algo, experts, rows, cols, dtype, transposed):
        each = rows // len(parts)
        if algo is None:
            dense = torch.stack(
                [torch.cat([self.read(f"{fqn}.{e}.{p}.weight") for p in parts]) for e in range(experts)]
            )
            return dense.transpose(-2, -1).contiguous() if transposed else dense
        stacked = []
        for e in range(experts):
            qts = [self.checkpoint_qtensor(algo, f"{fqn}.{e}.{p}.weight", (each, cols), dtype) for p in parts]
            stacked.append(qts[0] if len(qts) == 1 else join_rows(qts, f"{fqn}.{e}.{'+'.join(parts)}"))
        return stack_experts(stacked)


def _as_built(value: torch.Tensor, built: torch.Tensor, name: str) -> torch.Tensor:
    """A stored full-precision tensor in the dtype the model was built in (`from_pretrained`'s `dtype`,
    else the config's), as transformers loads it: an fp32 checkpoint in a bf16 model and the reverse;
    a shape other than the model's, or packed bytes where the model has a floating-point parameter, raise
    naming the tensor (they failed later, in tracing or on the first out-of-range token id)."""
    if tuple(value.shape) != tuple(built.shape):
        raise ValueError(f"{name}: stored shape {tuple(value.shape)}, the model expects {tuple(built.shape)}")
    if built.is_floating_point() and not value.is_floating_point():
        raise ValueError(
            f"{name} is stored as {value.dtype}, not a floating-point dtype, and the checkpoint's quantization "
            "config names no format for its layer"
        )
    if value.is_floating_point() and built.is_floating_point() and value.dtype != built.dtype:
        return value.to(built.dtype)
    return value


def _matrix(shape, transposed: bool) -> tuple[int, int]:
    """(N, K) of one expert's matrix from a fused parameter's shape."""
    return (shape[2], shape[1]) if transposed else (shape[1], shape[2])


def _fused_experts(module: nn.Module) -> bool:
    params = module._parameters
    return all(getattr(params.get(n), "dim", lambda: 0)() == 3 for n in ("gate_up_proj", "down_proj"))


def _tied(model: nn.Module, param) -> bool:
    embeddings = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    return any(param is e for e in embeddings)


def _is_router(model: nn.Module, fqn: str, module: nn.Module) -> bool:
    """An MoE router: a linear whose outputs are the experts (the pass sees it feed top-k)."""
    config = getattr(model, "config", None)
    counts = {getattr(config, n, None) for n in ("num_experts", "num_local_experts", "n_routed_experts")} - {None}
    return getattr(module, "out_features", None) in counts and fqn.split(".")[-1] in ("gate", "router")


def _quantize_streaming(value: torch.Tensor, key, name: str) -> QTensor:
    """`quantize(value, key)`, bit for bit, computed QUANTIZE_CHUNK elements at a time (per expert
    for `[E, N, K]`) into preallocated outputs, so the fp32 temporaries stay near one chunk instead
    of several times the weight. A scale that spans every row (per-tensor, NVFP4's global scale2)
    comes out the same in every chunk because each chunk carries one extra row holding the
    weight's absolute maximum (dropped afterwards)."""
    if value.dim() == 3:
        return stack_experts([_quantize_streaming(value[e], key, name) for e in range(value.shape[0])])
    rows, cols = value.shape
    group_rows = key.group_shape.row
    if rows * cols <= QUANTIZE_CHUNK or (group_rows not in (-1, 1) and rows % group_rows and rows < group_rows):
        return quantize(value, key, name)
    whole_rows = group_rows == -1 or key.scale2 is not None
    step = max(1, QUANTIZE_CHUNK // cols)
    step = step if group_rows in (-1, 1) else max(group_rows, step // group_rows * group_rows)
    amax_row = None
    if whole_rows:
        amax_row = value.new_zeros(1, cols)
        amax_row[0, 0] = max(value[s : s + step].abs().amax() for s in range(0, rows, step))
    first = quantize(_chunk(value, 0, step, amax_row), key, name)
    data = first.data.new_empty((rows, first.data.shape[-1]))
    scale = (
        first.scale
        if group_rows == -1
        else first.scale.new_empty((-(-rows // max(group_rows, 1)), first.scale.shape[-1]))
    )
    for start in range(0, rows, step):
        part = first if start == 0 else quantize(_chunk(value, start, step, amax_row), key, name)
        stop = min(start + step, rows)
        data[start:stop] = part.data[: stop - start]
        if group_rows != -1:
            size = -(-(stop - start) // max(group_rows, 1))
            scale[start // max(group_rows, 1) : start // max(group_rows, 1) + size] = part.scale[:size]
        del part
    return QTensor(data, scale, first.scale2, key, value.shape, value.dtype)


def _chunk(value: torch.Tensor, start: int, step: int, amax_row: torch.Tensor | None) -> torch.Tensor:
    chunk = value[start : start + step]
    return chunk if amax_row is None else torch.cat([chunk, amax_row])


def from_pretrained(
    path: str | os.PathLike, *, dtype=None, device="cpu", requantize: bool = False, **options
) -> nn.Module:
    """The transformers model of a checkpoint directory, quantized layers holding the checkpoint's
    tensors (a ModelOpt, gpt-oss MXFP4, transformers fine-grained FP8 or compressed-tensors checkpoint),
    or quantized as they load when the options name formats (`linear="int8_weight_only"`, `moe=...`,
    `targets`, `ignore`). For a pre-quantized checkpoint the options may change activations
    (`moe={"activation": "mxfp8"}`); another weight format raises unless `requantize=True`. Tensors go
    to `device` as they are read (`model.to()` afterwards would read the quantized layers' freed storage). `dtype`: the model's (full-precision
    tensors stored in another are cast as they load); by default the config's, else the one most of the
    stored full-precision bytes have, as transformers' `dtype="auto"`."""
    path = os.fspath(path)
    if not os.path.isdir(path):  # else transformers reads it as a Hub repo id (quantpass never downloads)
        raise FileNotFoundError(f"{path!r} is not a checkpoint directory (config.json and *.safetensors)")
    unknown = sorted(set(options) - set(CONFIG_OPTIONS))
    if unknown:
        valid = ", ".join(("device", "dtype", "requantize", *CONFIG_OPTIONS))
        raise ValueError(f"invalid from_pretrained option {unknown[0]!r}; valid: {valid}")
    config = QuantizationConfig(**options)
    layout = detect(path)
    model = _build(path, dtype)
    model.quantpass_checkpoint = _Loader(path, model, layout, config, requantize, device).load()
    from ..backend import experts_warning

    if experts_warning(model) is not None:  # transformers' eager expert loop never reaches quantpass
        model.set_experts_implementation("grouped_mm")
    return model


def dequantized(model: nn.Module) -> nn.Module:
    """`model` (in place) with every quantized weight replaced by a plain full-precision parameter
    holding its dequantized value: the "unquantized" side when comparing a pre-quantized checkpoint
    with itself (`quantpass run --model DIR`). It holds the full-precision copy a comparison needs."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and WEIGHTS.declared(param) is not None:
                module._parameters[name] = nn.Parameter(WEIGHTS.dense(param), requires_grad=False)
    return model
