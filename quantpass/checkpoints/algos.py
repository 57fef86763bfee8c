"""Pre-quantized checkpoint formats: the one table from a checkpoint's algorithm to quantpass's keys.

Everything a format implies is derived from its `(weight, activation)` QuantKey pair (convert.py:
scale shapes, padding, packing, what the layer runs with); a row adds only the checkpoint's
tensor names and, where a format truly differs, a named hook (`HOOKS`). ModelOpt's `quant_algo`s
(NVIDIA Model Optimizer's `hf_quant_config.json`), gpt-oss's MXFP4 release and transformers'
fine-grained FP8 (`quant_method: fp8`: DeepSeek-V3/R1, Qwen3 FP8 releases) are rows alike; a
compressed-tensors config's groups become rows as it is read (compressed_tensors.py).
To support a new format: add a row; add a hook only for what the key pair can't say.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field

import torch

from ..quant_registry.keys import (
    QuantKey,
    kFp8Dynamic128Sym,
    kFp8DynamicTokenSym,
    kFp8Static128BlockSym,
    kFp8StaticChannelSym,
    kFp8StaticTensorSym,
    kMxfp4Static,
    kMxfp8Dynamic,
    kMxfp8Static,
    kNvfp4CalibratedGlobal,
    kNvfp4Static,
)
from ..quant_registry.spec import QuantSpec, pattern_matches

# Tensor names relative to the weight's parameter name `{p}` (`model.layers.0.mlp.down_proj.weight`)
# and its module `{m}`: ModelOpt writes `{p}_scale`, `{p}_scale_2`, `{m}.input_scale`; gpt-oss
# writes `{p}_blocks` / `{p}_scales` for its fused expert parameters.
MODELOPT_NAMES = {"data": "{p}", "scale": "{p}_scale", "scale2": "{p}_scale_2", "input_scale": "{m}.input_scale"}
GPT_OSS_NAMES = {"data": "{p}_blocks", "scale": "{p}_scales"}
# transformers' fine-grained FP8 writes the per-block dequantization multiplier as `{p}_scale_inv`
# (DeepSeek's name: the inverse of the scale the weight was multiplied by).
HF_FP8_NAMES = {"data": "{p}", "scale": "{p}_scale_inv"}


@dataclass(frozen=True)
class Algo:
    """One checkpoint format. `activation`: what its layers run with by default (a static key reads
    the checkpoint's calibrated `input_scale`). `tensors`: the roles it stores, named by `names`."""

    name: str
    weight: QuantKey
    activation: QuantKey | None
    tensors: tuple[str, ...]
    names: dict = field(compare=False)  # role -> tensor name template
    hooks: tuple[str, ...] = ()
    group_size: int | None = None  # written to hf_quant_config.json
    producer: str = "modelopt"  # whose checkpoint layout: one checkpoint holds one producer's rows

    @property
    def spec(self) -> QuantSpec:
        return QuantSpec(self.weight, self.activation)

    def tensor_name(self, role: str, param: str) -> str:
        return self.names[role].format(p=param, m=param.rsplit(".", 1)[0])


# fmt: off
# THE table: ModelOpt quant_algo -> keys, stored tensors, hooks.
ALGOS: dict[str, Algo] = {
    "FP8":                       Algo("FP8", kFp8StaticTensorSym, kFp8StaticTensorSym,
                                      ("data", "scale", "input_scale"), MODELOPT_NAMES),
    "FP8_PER_CHANNEL_PER_TOKEN": Algo("FP8_PER_CHANNEL_PER_TOKEN", kFp8StaticChannelSym, kFp8DynamicTokenSym,
                                      ("data", "scale"), MODELOPT_NAMES),
    "FP8_PB_WO":                 Algo("FP8_PB_WO", kFp8Static128BlockSym, None,
                                      ("data", "scale"), MODELOPT_NAMES, hooks=("block_scale_shape",)),
    "NVFP4":                     Algo("NVFP4", kNvfp4Static, kNvfp4CalibratedGlobal,
                                      ("data", "scale", "scale2", "input_scale"), MODELOPT_NAMES, group_size=16),
    "W4A16_NVFP4":               Algo("W4A16_NVFP4", kNvfp4Static, None,
                                      ("data", "scale", "scale2"), MODELOPT_NAMES, hooks=("drop_input_scale",),
                                      group_size=16),
    "MXFP8":                     Algo("MXFP8", kMxfp8Static, kMxfp8Dynamic,
                                      ("data", "scale"), MODELOPT_NAMES, group_size=32),
}
# gpt-oss's release (config.json `quantization_config: {"quant_method": "mxfp4"}`): fused experts only.
GPT_OSS_MXFP4 = Algo("MXFP4", kMxfp4Static, None, ("data", "scale"), GPT_OSS_NAMES, hooks=("gpt_oss_blocks",),
                     group_size=32, producer="gpt-oss")
# transformers' fine-grained FP8 (`quant_method: fp8`, `weight_block_size: [128, 128]`, dynamic activations in
# 1x128 groups: DeepSeek's recipe, quantpass's fp8_per_block); `scale_fmt: ue8m0` stores power-of-two scales.
HF_FP8 = {"float": Algo("FP8_BLOCK", kFp8Static128BlockSym, kFp8Dynamic128Sym, ("data", "scale"), HF_FP8_NAMES,
                        producer="transformers"),
          "ue8m0": Algo("FP8_BLOCK_UE8M0", kFp8Static128BlockSym, kFp8Dynamic128Sym, ("data", "scale"), HF_FP8_NAMES,
                        hooks=("e8m0_scale",), producer="transformers")}
# fmt: on
MIXED_PRECISION = "MIXED_PRECISION"  # per-layer algos in `quantized_layers`
QUANT_ALGOS = (*ALGOS, MIXED_PRECISION)


# ---------------------------------------------------------------------------- the named residue
def _block_scale_shape(role: str, tensor: torch.Tensor, want: tuple[int, ...]) -> torch.Tensor:
    """FP8_PB_WO: ModelOpt writes the 128x128 block scales as its block-amax keeps them,
    `[Nb, 1, Kb, 1]` (or `[]` for one block), where readers expect `[Nb, Kb]`; the elements are
    in the same row-major order, so any shape with `Nb * Kb` elements reads as `[Nb, Kb]`."""
    if role == "scale" and tensor.numel() == torch.Size(want).numel():
        return tensor.reshape(want)
    return tensor


def _drop_input_scale(role: str, tensor: torch.Tensor, want) -> torch.Tensor | None:
    """W4A16_NVFP4: older ModelOpt exports also wrote an `input_scale` the format never uses."""
    if role == "input_scale":
        warnings.warn(
            "W4A16_NVFP4 checkpoint has an input_scale (written by older ModelOpt versions); W4A16 runs "
            "unquantized activations, so it is ignored. Re-export the checkpoint to drop it",
            DeprecationWarning,
            stacklevel=4,
        )
        return None
    return tensor


def _gpt_oss_blocks(role: str, tensor: torch.Tensor, want) -> torch.Tensor:
    """gpt-oss stores FP4 data as `[E, N, K/32, 16]` bytes (one 32-element block per row of 16)."""
    return tensor.flatten(-2) if role == "data" and tensor.dim() == len(want) + 1 else tensor


def _e8m0_scale(role: str, tensor: torch.Tensor, want) -> torch.Tensor:
    """FP8_BLOCK_UE8M0: power-of-two block scales stored as e8m0 bytes; as fp32 they are the same values."""
    return tensor.float() if role == "scale" and tensor.dtype == torch.float8_e8m0fnu else tensor


def _int32_words(role: str, tensor: torch.Tensor, want) -> torch.Tensor | None:
    """compressed-tensors' pack-quantized ints: words of eight nibbles (four bytes), read as their
    little-endian bytes (quantpass's two-per-byte INT4 layout; INT8 then goes through `offset_128`); its
    `weight_shape` says what the data's shape already says."""
    if role == "data" and tensor.dtype == torch.int32:
        return tensor.contiguous().view(torch.uint8)[..., : want[-1]]
    return None if role == "shape" else tensor


def _offset_128(role: str, tensor: torch.Tensor, want) -> torch.Tensor:
    """compressed-tensors' pack-quantized INT8: each int stored plus 128 (an unsigned byte); flipping the
    sign bit reads it as int8 again, and is its own inverse, so writing one back calls it too."""
    return (tensor.view(torch.uint8) ^ 0x80).view(torch.int8) if role == "data" else tensor


def _inverse_global_scale(role: str, tensor: torch.Tensor, want) -> torch.Tensor:
    """compressed-tensors' NVFP4: the global scales it stores are the reciprocals of ModelOpt's (the
    weight's and the input's dequantization multipliers), taken in float64 and rounded once; its own
    inverse, so writing one back (`convert.from_qtensor`) calls it too."""
    return (1 / tensor.double()).float() if role in ("scale2", "input_scale") else tensor


# hook name -> fn(role, checkpoint tensor, canonical shape) -> tensor to use (None: drop it)
HOOKS = {
    "block_scale_shape": _block_scale_shape,
    "drop_input_scale": _drop_input_scale,
    "gpt_oss_blocks": _gpt_oss_blocks,
    "e8m0_scale": _e8m0_scale,
    "int32_words": _int32_words,
    "offset_128": _offset_128,
    "inverse_global_scale": _inverse_global_scale,
}
# hook name -> roles the hook reads (and, for `int32_words`, writes) beside the algo's own
EXTRA_ROLES = {"drop_input_scale": ("input_scale",), "int32_words": ("shape",)}


def algo(name: str, where: str = "checkpoint") -> Algo:
    found = ALGOS.get(name.upper())
    if found is None:
        valid = ", ".join(QUANT_ALGOS)
        raise ValueError(f"{where}: unsupported quant_algo {name!r}; quantpass reads: {valid}")
    return found


def algo_for(weight: QuantKey, has_input_scale: bool) -> Algo:
    """The ModelOpt algo a quantized weight exports as: NVFP4 with a calibrated input scale, W4A16_NVFP4
    without; FP8 per-tensor needs one (quantized online, it has none: no algo stores it)."""
    rows = [a for a in ALGOS.values() if a.weight == weight and ("input_scale" in a.tensors) == has_input_scale]
    if rows:
        return rows[0]
    exportable = ", ".join(
        f"{a.name} ({a.weight}{' + input_scale' * ('input_scale' in a.tensors)})" for a in ALGOS.values()
    )
    raise ValueError(
        f"no ModelOpt quant_algo stores {weight} weights {'with' if has_input_scale else 'without'} a calibrated "
        f"input scale; exportable: {exportable}"
    )


@dataclass(frozen=True)
class Layout:
    """What a checkpoint says about its layers: per layer FQN (a linear module, or an experts
    module), the Algo it is stored in, or None for layers stored unquantized."""

    producer: str  # "modelopt", "gpt-oss", "transformers" (its fine-grained FP8), "compressed-tensors" or "none"
    quant_algo: str | None
    default: Algo | None  # every linear not excluded (None: per-layer or none)
    per_layer: dict  # MIXED_PRECISION: module FQN -> Algo
    exclude: tuple[str, ...]
    groups: tuple = ()  # compressed-tensors: (targets, Algo) per config group, the first match wins
    config: dict = field(default_factory=dict, compare=False)  # the quantization config as read (export)

    def algo_of(self, fqn: str) -> Algo | None:
        excluded = {"transformers": _skipped, "compressed-tensors": _ct_matches}.get(self.producer, _excluded)
        if any(excluded(pattern, fqn) for pattern in self.exclude):
            return None
        if self.per_layer:
            return self.per_layer.get(fqn)
        if self.groups:
            return next((algo for targets, algo in self.groups if any(_ct_matches(t, fqn) for t in targets)), None)
        return self.default

    def formats(self) -> dict[str, int]:
        """Algo name -> how many layers the config names explicitly (for `describe`)."""
        counts: dict[str, int] = {}
        for row in self.per_layer.values():
            counts[row.name] = counts.get(row.name, 0) + 1
        return counts


def _excluded(pattern: str, fqn: str) -> bool:
    """ModelOpt's exclude_modules are globs over module names (`model.layers.*.mlp.gate`, `lm_head`);
    an excluded module excludes what is inside it (`*.self_attn` -> its projections)."""
    return pattern_matches(pattern, fqn) or pattern_matches(pattern.rstrip("*").rstrip(".") + ".*", fqn)


def _ct_matches(target: str, fqn: str) -> bool:
    """compressed-tensors' `targets` / `ignore` entries: `re:<regex>` matched from the start of the
    module name, a class name (`Linear`: every linear and expert projection quantpass loads), or a
    module name."""
    if target.startswith("re:"):
        return re.match(target[3:], fqn) is not None
    return target == "Linear" or target == fqn


def _skipped(pattern: str, fqn: str) -> bool:
    """transformers' `modules_to_not_convert`: a regex from the start up to a module boundary
    (`model.layers.1` skips `model.layers.1.mlp`, not `model.layers.11`), or a suffix (`lm_head`)."""
    return re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", fqn) is not None or fqn.endswith(pattern)


def parse_quantization(quant: dict, producer: str, where: str) -> Layout:
    """A ModelOpt `quantization` section (hf_quant_config.json), or gpt-oss's or transformers' fine-grained
    FP8 quantization_config (config.json)."""
    if producer == "gpt-oss":
        exclude = tuple(quant.get("modules_to_not_convert") or ())
        return Layout(producer, GPT_OSS_MXFP4.name, GPT_OSS_MXFP4, {}, exclude)
    if producer == "transformers":
        row = _hf_fp8(quant, where)
        exclude = tuple(quant.get("modules_to_not_convert") or quant.get("ignored_layers") or ())
        return Layout(producer, row.name, row, {}, exclude, config=quant)
    name = quant.get("quant_algo")
    exclude = tuple(quant.get("exclude_modules") or quant.get("ignore") or ())
    if name is None:
        return Layout(producer, None, None, {}, exclude)
    if str(name).upper() == MIXED_PRECISION:
        layers = quant.get("quantized_layers") or {}
        missing = [fqn for fqn, entry in layers.items() if not isinstance(entry, dict) or "quant_algo" not in entry]
        if missing:
            raise ValueError(f"{where}: quantized_layers entry {missing[0]!r} has no quant_algo")
        per_layer = {fqn: algo(entry["quant_algo"], f"{where}: layer {fqn!r}") for fqn, entry in layers.items()}
        return Layout(producer, MIXED_PRECISION, None, per_layer, exclude)
    return Layout(producer, algo(name, where).name, algo(name, where), {}, exclude)


# transformers' fine-grained FP8 settings quantpass reads, and the values it reads in each (the first
# is transformers' default, for a setting the config leaves out)
HF_FP8_SETTINGS = {
    "weight_block_size": ([128, 128],),
    "activation_scheme": ("dynamic",),
    "scale_fmt": tuple(HF_FP8),
    "expert_dtype": ("fp8",),
}


def _hf_fp8(quant: dict, where: str) -> Algo:
    """The row of a `quant_method: fp8` config; a setting quantpass has no kernel layout for raises,
    naming it and what is read."""
    for setting, valid in HF_FP8_SETTINGS.items():
        value = quant.get(setting)
        value = list(value) if isinstance(value, tuple | list) else value
        if value is not None and value not in valid:
            raise ValueError(
                f"{where}: fp8 {setting} {value!r} is not supported; quantpass reads: {', '.join(map(str, valid))}"
            )
    return HF_FP8[quant.get("scale_fmt") or "float"]


def hf_quantization_config(algo: Algo, exclude: list[str], layout: Layout | None) -> dict:
    """config.json's `quantization_config` for a checkpoint of a non-ModelOpt producer's rows (export): a
    compressed-tensors checkpoint's as it was read."""
    if algo.producer == "compressed-tensors":
        return dict(layout.config)
    if algo is GPT_OSS_MXFP4:
        return {"quant_method": "mxfp4", "modules_to_not_convert": exclude}
    scale_fmt = next(fmt for fmt, row in HF_FP8.items() if row is algo)
    settings = {setting: valid[0] for setting, valid in HF_FP8_SETTINGS.items()}
    return {"quant_method": "fp8", **settings, "scale_fmt": scale_fmt, "modules_to_not_convert": exclude or None}
