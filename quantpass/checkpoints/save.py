"""`qp.save_pretrained`: a quantpass-quantized model as a checkpoint that loads back running what it ran.

Each quantized weight (`qp.state_dict(model, quantized=True)`) is written in the row export.py
chooses for it (ModelOpt's, transformers' fine-grained FP8, compressed-tensors'; a loaded
checkpoint's own), fused experts one tensor per expert and projection as ModelOpt writes them,
MXFP4 experts as gpt-oss's release stores them. A model loaded with `qp.from_pretrained` is written
back with byte-identical tensors.
"""

from __future__ import annotations

import json
import logging
import os
import re

import torch
import torch.nn as nn

from ..quant_registry.qtensor import QTensor
from ..weight_cache import WEIGHTS
from ..weights import _root, state_dict
from . import shards
from .algos import GPT_OSS_MXFP4, MIXED_PRECISION, Algo, hf_quantization_config
from .compressed_tensors import export_config, stored_shapes
from .convert import from_qtensor, roles, split_rows
from .export import SINGLE_ROW, choose, exact_rows, modelopt_row
from .load import EXPERT_NAMES, _fused_experts, renamed, renamings

PRODUCER = {"name": "quantpass", "version": "0.1.0"}
logger = logging.getLogger("quantpass")


def save_pretrained(model: nn.Module, path: str | os.PathLike) -> None:
    """Write `model` (a transformers model quantized by quantpass or loaded by `qp.from_pretrained`)
    to `path`: model.safetensors, config.json and, for ModelOpt algos, hf_quant_config.json."""
    path = os.fspath(path)
    root = _root(model)
    info = getattr(root, "quantpass_checkpoint", None)
    stored = (info.stored_shapes, info.stored_dtypes) if info is not None else ({}, {})
    experts = {fqn for fqn, m in root.named_modules() if _fused_experts(m)}
    tensors: dict[str, torch.Tensor] = {}
    written: set[int] = set()
    quantized: dict[str, QTensor] = {}
    for name, value in state_dict(root, quantized=True).items():
        if isinstance(value, QTensor):
            quantized[name] = value
        elif value.untyped_storage().data_ptr() not in written or not value.numel():
            written.add(value.untyped_storage().data_ptr())  # a tied weight (lm_head = embed_tokens): written once
            tensors[name] = value
    ran = {name: _ran_with(root.get_parameter(name)) for name in quantized}
    candidates = {name: _candidates(info, experts, name, qt, ran[name]) for name, qt in quantized.items()}
    chosen = choose(candidates) or {name: _fallback(info, experts, name, qt) for name, qt in quantized.items()}
    layers: dict[str, Algo] = {}  # quantized module FQN (ModelOpt naming) -> its algo
    changed: dict[tuple, list[str]] = {}  # (activation it is set up for, the algo storing it) -> layers
    for name, value in quantized.items():
        fqn, _, param = name.rpartition(".")
        algo = chosen[name]
        if ran[name] is not ... and ran[name] != algo.activation:
            changed.setdefault((ran[name], algo), []).append(fqn)
        if fqn in experts and algo is not GPT_OSS_MXFP4:
            names = _expert_names(info, fqn)
            for e in range(value.shape[0]):
                parts = names[:2] if param == "gate_up_proj" else names[2:]
                sizes = [value.shape[-2] // len(parts)] * len(parts)
                for part, qt in zip(parts, split_rows(value[e], sizes, name)):
                    layers[f"{fqn}.{e}.{part}"] = algo
                    _put(tensors, algo, f"{fqn}.{e}.{part}.weight", qt, stored)
        else:
            layers[fqn] = algo
            _put(tensors, algo, name, value, stored)
    for (activation, algo), fqns in changed.items():  # a checkpoint's format fixes the activations it loads with
        runs, stores = (
            f"{a} activations" if a is not None else "unquantized activations" for a in (activation, algo.activation)
        )
        logger.warning(
            "quantpass: %d layer(s) (e.g. %s) run with %s; they are written as %s, which declares %s: they load "
            "back so unless from_pretrained's linear= / moe= pass {'activation': '%s'}",
            len(fqns), fqns[0], runs, algo.name, stores, activation or "none",
        )  # fmt: skip
    transforms = renamings(root.config.model_type, reverse=True) if info is not None and info.renamed else []
    tensors = {renamed(name, transforms): tensor for name, tensor in tensors.items()}  # the names it loaded with
    os.makedirs(path, exist_ok=True)
    shards.write(os.path.join(path, "model.safetensors"), tensors, {"format": "pt"})
    _write_configs(root, path, layers, info, transforms)


def _ran_with(param: torch.Tensor):
    """The activation key the model runs `param`'s quantized value with (`...`: not known)."""
    return WEIGHTS.ran_with(param, next(iter(WEIGHTS.canonical_values(param))))


def _known(info, experts: set[str], name: str, qt: QTensor) -> Algo | None:
    """The row a weight was loaded from (gpt-oss's for MXFP4 experts), if it still holds that key."""
    fqn = name.rpartition(".")[0]
    if fqn in experts and qt.key == GPT_OSS_MXFP4.weight:
        return GPT_OSS_MXFP4
    known = info.algos.get(fqn) if info is not None else None
    return known if known is not None and known.weight == qt.key else None


def _candidates(info, experts: set[str], name: str, qt: QTensor, activation) -> list[Algo]:
    known = _known(info, experts, name, qt)
    rows = [] if activation is ... else exact_rows(qt.key, activation, qt.input_scale is not None)
    return list(dict.fromkeys([known, *rows] if known is not None else rows))


def _fallback(info, experts: set[str], name: str, qt: QTensor) -> Algo:
    """When no producer keeps every layer's activations: the loaded row, else ModelOpt's for the weight."""
    return _known(info, experts, name, qt) or modelopt_row(qt.key, qt.input_scale is not None, name)


def _expert_names(info, fqn: str) -> tuple[str, str, str]:
    """The per-expert names the loaded checkpoint used (`w1/w3/w2` for Mixtral's), else ModelOpt's."""
    if info is not None:
        for names in EXPERT_NAMES:
            if f"{fqn}.0.{names[0]}.weight" in info.stored_shapes:
                return names
    return EXPERT_NAMES[0]


def _put(tensors: dict, algo: Algo, param_name: str, qt: QTensor, stored: tuple[dict, dict]) -> None:
    names = {role: algo.tensor_name(role, param_name) for role in roles(algo)}
    shapes, dtypes = ({role: found[n] for role, n in names.items() if n in found} for found in stored)
    if algo.producer == "compressed-tensors" and not shapes:  # exported: the shapes its readers check
        shapes = stored_shapes(algo.weight, qt.shape)
    for role, tensor in from_qtensor(algo, qt, shapes, dtypes).items():
        tensors[names[role]] = tensor


def _module_of(fqn: str) -> str:
    """The module a quantized layer belongs to: an expert's projection (`...experts.3.gate_proj`) its
    experts module, anything else itself (`lm_head` too)."""
    parts = fqn.split(".")
    return ".".join(parts[:-2]) if len(parts) > 2 and parts[-2].isdigit() else fqn


def _ct_target(fqn: str) -> str:
    """A compressed-tensors target naming one layer: its module name; an expert's projection as a regex
    matching that projection of every expert of its module, the names vLLM looks its fused experts' scheme
    up by (`<experts>.0.gate_proj`, `.0.up_proj`, `.0.down_proj`) and quantpass's loader each expert's by."""
    module = _module_of(fqn)
    if module == fqn:
        return fqn
    return rf"re:^{re.escape(module)}\.\d+\.{re.escape(fqn.rsplit('.', 1)[1])}$"


def _write_configs(root: nn.Module, path: str, layers: dict[str, Algo], info, transforms: list) -> None:
    config = root.config.to_dict()
    config.pop("quantization_config", None)
    dtype = next((p.dtype for p in root.parameters() if p.is_floating_point()), None)
    if dtype is not None:  # the model's dtype, as transformers' save_pretrained records it
        config["dtype"] = str(dtype).removeprefix("torch.")
    quantized = {_module_of(fqn) for fqn in layers}
    exclude = [renamed(pattern, transforms) for pattern in _excluded(root, quantized, info)]
    layers = {renamed(fqn, transforms): algo for fqn, algo in layers.items()}
    algos = set(layers.values())
    producers = {algo.producer for algo in algos}
    own = [algo for algo in algos if algo.producer != "modelopt"]  # formats a config.json declares on its own
    if own and (len(producers) > 1 or (len(algos) > 1 and own[0].producer in SINGLE_ROW)):
        names = ", ".join(sorted(algo.name for algo in algos))
        raise ValueError(f"cannot write {names} in one checkpoint: {own[0].name} has no mixed-precision layout here")
    if own and own[0].producer == "compressed-tensors" and (info is None or set(info.algos) != quantized):
        targets: dict[Algo, list[str]] = {}  # the layers each row stores
        for fqn, algo in layers.items():
            targets.setdefault(algo, []).append(_ct_target(fqn))
        config["quantization_config"] = export_config({a: sorted(set(n)) for a, n in targets.items()}, exclude)
    elif own:
        config["quantization_config"] = hf_quantization_config(own[0], exclude, info.layout if info else None)
    elif algos:
        quantization = {"kv_cache_quant_algo": None}
        if len(algos) == 1:
            (algo,) = algos
            quantization["quant_algo"] = algo.name
            if algo.group_size is not None:
                quantization["group_size"] = algo.group_size
        else:
            quantization["quant_algo"] = MIXED_PRECISION
            quantization["quantized_layers"] = {  # experts by their module, as ModelOpt names them
                _module_of(fqn): {"quant_algo": a.name, **({"group_size": a.group_size} if a.group_size else {})}
                for fqn, a in sorted(layers.items())
            }
        quantization["exclude_modules"] = exclude
        with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": PRODUCER, "quantization": quantization}, f, indent=4)
        # config.json's flat form, as ModelOpt's export writes it: readers of this form (vLLM) take the
        # unquantized modules from `ignore`; `exclude_modules` stays for those that read it here
        config["quantization_config"] = {
            "quant_method": "modelopt",
            "producer": PRODUCER,
            **quantization,
            "ignore": exclude,
        }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def _excluded(root: nn.Module, quantized: set[str], info) -> list[str]:
    """Modules left unquantized: a loaded checkpoint's own list while the same layers are quantized,
    else every module with a matrix of weights (linear, embedding, a router that is no nn.Linear:
    transformers 5's `TopKRouter`) and every experts module that is not quantized. A reader quantizes
    what the list leaves out: vLLM's Qwen3-MoE loader failed on a router missing from ModelOpt's own
    list (what ModelOpt 0.47's export says of the routers it now adds)."""
    if info is not None and set(info.algos) == quantized:
        return list(info.layout.exclude)
    return [fqn for fqn, module in root.named_modules() if fqn and fqn not in quantized and _has_weights(module)]


def _has_weights(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    matrix = isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.is_floating_point()
    return matrix or isinstance(module, nn.Linear | nn.Embedding) or _fused_experts(module)
