"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, llm-compressor's output: the
RedHatAI / neuralmagic FP8-dynamic, W8A8, FP8-block, W4A16 and NVFP4 releases).

Such a config has no algo name: each `config_groups` entry gives its weights' and input
activations' quantization arguments (type, bits, strategy, dynamic, ...) and the modules it
`targets`. The arguments are read into quantpass's `(weight, activation)` QuantKey pair, and the
group becomes an `Algo` row like any other; its tensors are named as ModelOpt names them
(`weight`, `weight_scale`, `input_scale`; `weight_packed` for packed data). Read: the
`float-quantized` and `int-quantized` formats (8-bit weights), `pack-quantized` ints (4-bit in
groups of 128: W4A16; 8-bit per channel: weight-only INT8) and `nvfp4-pack-quantized` (NVFP4, W4A4 or
W4A16), symmetric, for the pairs quantpass has a format for; anything else raises naming the group,
the setting and what is read. The same tables write a group for a key pair (`group_for`, export), in
the format compressed-tensors' own writer picks for it.
"""

from __future__ import annotations

import torch

from ..quant_registry.formats import ELEMENTS, scale_shape
from ..quant_registry.keys import (
    INT8,
    QuantKey,
    kFp8Dynamic128Sym,
    kFp8DynamicTokenSym,
    kFp8Static128BlockSym,
    kFp8StaticChannelSym,
    kFp8StaticTensorSym,
    kInt4StaticGroup128Sym,
    kInt8DynamicTokenSym,
    kInt8StaticChannelSym,
    kNvfp4CalibratedGlobal,
    kNvfp4Static,
    needs_input_scale,
)
from ..quant_registry.spec import QuantSpec
from .algos import MIXED_PRECISION, MODELOPT_NAMES, Algo, Layout

PRODUCER = "compressed-tensors"
# `pack-quantized`: ints packed into int32 words (`weight_packed`, first in the lowest bits), offset by
# 2^(bits-1): 4-bit ones eight per word (as bytes, quantpass's INT4 layout), 8-bit ones four per word
# (as bytes, quantpass's INT8 with the sign bit flipped), beside the unpacked shape (`weight_shape`)
PACKED_NAMES = {**MODELOPT_NAMES, "data": "{m}.weight_packed", "shape": "{m}.weight_shape"}
# `nvfp4-pack-quantized`: ModelOpt's NVFP4 bytes and e4m3 group scales, its two global scales stored inverted
# (`weight_global_scale` = 1 / weight_scale_2, `input_global_scale` = 1 / input_scale), as compressed-tensors'
# own ModelOpt converter maps them
NVFP4_NAMES = {**MODELOPT_NAMES, "data": "{m}.weight_packed", "scale2": "{m}.weight_global_scale",
               "input_scale": "{m}.input_global_scale"}  # fmt: skip
FORMATS = {"float-quantized": MODELOPT_NAMES, "int-quantized": MODELOPT_NAMES, "naive-quantized": MODELOPT_NAMES,
           "pack-quantized": PACKED_NAMES, "nvfp4-pack-quantized": NVFP4_NAMES}  # fmt: skip
PACKED = {"pack-quantized": (kInt4StaticGroup128Sym, kInt8StaticChannelSym), "nvfp4-pack-quantized": (kNvfp4Static,)}
HOOKS = {"pack-quantized": ("int32_words",), "nvfp4-pack-quantized": ("inverse_global_scale",)}
# (type, bits, strategy, block or group size, dynamic) of symmetric arguments -> key
WEIGHT_KEYS = {
    ("float", 8, "tensor", None, False): kFp8StaticTensorSym,
    ("float", 8, "channel", None, False): kFp8StaticChannelSym,
    ("float", 8, "block", (128, 128), False): kFp8Static128BlockSym,
    ("int", 8, "channel", None, False): kInt8StaticChannelSym,
    ("int", 4, "group", 128, False): kInt4StaticGroup128Sym,  # pack-quantized
    ("float", 4, "tensor_group", 16, False): kNvfp4Static,  # nvfp4-pack-quantized
}
ACTIVATION_KEYS = {
    ("float", 8, "tensor", None, False): kFp8StaticTensorSym,  # calibrated: the checkpoint's `input_scale`
    ("float", 8, "token", None, True): kFp8DynamicTokenSym,
    ("float", 8, "group", 128, True): kFp8Dynamic128Sym,
    ("int", 8, "token", None, True): kInt8DynamicTokenSym,
    ("float", 4, "tensor_group", 16, "local"): kNvfp4CalibratedGlobal,  # group scales per call, calibrated global
}
EXTRA_ARGUMENTS = {kNvfp4Static: {"scale_dtype": "torch.float8_e4m3fn"},  # what its presets write beside them
                   kNvfp4CalibratedGlobal: {"scale_dtype": "torch.float8_e4m3fn"}}  # fmt: skip


def _describe(arguments: tuple) -> str:
    kind, bits, strategy, size, dynamic = arguments
    when = {True: "dynamic", False: "static"}.get(dynamic, f"dynamic {dynamic!r}")
    return f"{bits}-bit {kind} {strategy}{f' {size}' if size else ''} {when}"


def _key(args: dict, table: dict, where: str) -> QuantKey:
    size = args.get("block_structure") or args.get("group_size")
    size = tuple(size) if isinstance(size, list) else size
    dynamic = args.get("dynamic")
    dynamic = dynamic if isinstance(dynamic, str) else bool(dynamic)  # "local": per-group scales, a static global
    found = (args.get("type"), args.get("num_bits"), args.get("strategy"), size, dynamic)
    problem = None
    if args.get("symmetric") is False:
        problem = "asymmetric (zero points)"
    elif args.get("actorder") == "group":
        problem = "actorder 'group' (GPTQ's permuted groups, `weight_g_idx`)"
    elif found not in table:
        problem = _describe(found)
    if problem is not None:
        read = "; ".join(map(_describe, table))
        raise ValueError(f"{where}: {problem} is not supported; quantpass reads symmetric: {read}")
    return table[found]


def group_algo(name: str, group: dict, default_format: str | None, where: str) -> Algo:
    """One `config_groups` entry as an Algo row."""
    where = f"{where} config_groups[{name!r}]"
    fmt = group.get("format") or default_format
    if fmt not in FORMATS:
        raise ValueError(f"{where}: format {fmt!r} is not supported; quantpass reads: {', '.join(FORMATS)}")
    if group.get("output_activations"):
        raise ValueError(f"{where}: output_activations are not supported; quantpass quantizes weights and inputs")
    weight = _key(group.get("weights") or {}, WEIGHT_KEYS, f"{where} weights")
    packs = PACKED.get(fmt)
    if (packs is not None and weight not in packs) or (packs is None and ELEMENTS[weight.dtype].packed):
        packed = "; ".join(f"{name!r}: {', '.join(map(str, keys))}" for name, keys in PACKED.items())
        raise ValueError(f"{where}: {weight} weights in format {fmt!r}; quantpass reads packed: {packed}")
    inputs = group.get("input_activations")
    activation = None if not inputs else _key(inputs, ACTIVATION_KEYS, f"{where} input_activations")
    tensors = (
        "data",
        "scale",
        *("scale2",) * (weight.scale2 is not None),
        *("input_scale",) * needs_input_scale(activation),
    )
    offset = fmt == "pack-quantized" and weight.dtype == INT8  # its bytes are offset by 128: int8 again after
    hooks = HOOKS.get(fmt, ()) + ("offset_128",) * offset
    spec_name = QuantSpec(weight, activation).name()
    return Algo(f"{PRODUCER} {fmt} {spec_name}", weight, activation, tensors, FORMATS[fmt], hooks, producer=PRODUCER)


def _arguments(key: QuantKey, table: dict) -> dict | None:
    """The quantization arguments compressed-tensors writes for `key` (its presets' spelling)."""
    found = next((arguments for arguments, k in table.items() if k == key), None)
    if found is None:
        return None
    kind, bits, strategy, size, dynamic = found
    sizes = {"block_structure": list(size)} if strategy == "block" else {"group_size": size} if size else {}
    return {"num_bits": bits, "type": kind, "symmetric": True, "strategy": strategy, **sizes, "dynamic": dynamic,
            **EXTRA_ARGUMENTS.get(key, {})}  # fmt: skip


def group_for(weight: QuantKey, activation: QuantKey | None) -> dict | None:
    """A `config_groups` entry (without targets) storing `(weight, activation)`; None when the tables
    have no arguments for it."""
    weights = _arguments(weight, WEIGHT_KEYS)
    inputs = None if activation is None else _arguments(activation, ACTIVATION_KEYS)
    if weights is None or (activation is not None and inputs is None):
        return None
    # as compressed-tensors' own writer picks it (its `infer_module_format`): NVFP4 packed; with input
    # activations `int-` / `float-quantized`; weight-only ints packed, weight-only floats `naive-quantized`
    if weight in PACKED["nvfp4-pack-quantized"]:
        fmt = "nvfp4-pack-quantized"
    elif activation is None:
        fmt = "pack-quantized" if weights["type"] == "int" else "naive-quantized"
    else:
        fmt = f"{weights['type']}-quantized"
    return {"weights": weights, "input_activations": inputs, "output_activations": None, "format": fmt}


def export_row(weight: QuantKey, activation: QuantKey | None) -> Algo | None:
    """The row a `(weight, activation)` pair is written in as compressed-tensors, if it can be."""
    group = group_for(weight, activation)
    return None if group is None else group_algo("export", group, None, "export")


def stored_shapes(weight: QuantKey, shape: torch.Size) -> dict[str, tuple[int, ...]]:
    """The scales' shapes compressed-tensors writes (and transformers' reader checks): every group
    dim kept (`[N, 1]` per channel), `[1]` for a whole tensor's."""
    whole = weight.group_shape.row == weight.group_shape.col == -1
    return {"scale": (1,) if whole else scale_shape(weight, shape), "scale2": (1,), "input_scale": (1,)}


def export_config(targets: dict[Algo, list[str]], ignore: list[str]) -> dict:
    """config.json's `quantization_config` for layers written in compressed-tensors rows: one group per
    row, targeting `Linear` when there is one (the rest is in `ignore`), else the modules by name."""
    groups = {
        f"group_{i}": {
            "targets": ["Linear"] if len(targets) == 1 else sorted(names),
            **group_for(a.weight, a.activation),
        }
        for i, (a, names) in enumerate(targets.items())
    }
    formats = {group["format"] for group in groups.values()}
    return {
        "quant_method": PRODUCER,
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
    }


def layout(quant: dict, where: str) -> Layout:
    """A `quant_method: compressed-tensors` config's layout: one Algo row per config group."""
    groups = tuple(
        (tuple(group.get("targets") or ()), group_algo(name, group, quant.get("format"), where))
        for name, group in (quant.get("config_groups") or {}).items()
    )
    names = dict.fromkeys(algo.name for _, algo in groups)
    label = next(iter(names)) if len(names) == 1 else MIXED_PRECISION
    return Layout(PRODUCER, label, None, {}, tuple(quant.get("ignore") or ()), groups=groups, config=quant)
