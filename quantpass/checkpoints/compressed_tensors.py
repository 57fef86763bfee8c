"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, llm-compressor's output: the
RedHatAI / neuralmagic FP8-dynamic, W8A8 and FP8-block releases).

Such a config has no algo name: each `config_groups` entry gives its weights' and input
activations' quantization arguments (type, bits, strategy, dynamic, ...) and the modules it
`targets`. The arguments are read into quantpass's `(weight, activation)` QuantKey pair, and the
group becomes an `Algo` row like any other; its tensors are named as ModelOpt names them
(`weight`, `weight_scale`, `input_scale`). Read: the `float-quantized` and `int-quantized` formats
(unpacked 8-bit weights, symmetric) for the pairs quantpass has a format for; anything else raises
naming the group, the setting and what is read.
"""

from __future__ import annotations

from ..quant_registry.keys import (
    QuantKey,
    kFp8Dynamic128Sym,
    kFp8DynamicTokenSym,
    kFp8Static128BlockSym,
    kFp8StaticChannelSym,
    kFp8StaticTensorSym,
    kInt8DynamicTokenSym,
    kInt8StaticChannelSym,
)
from ..quant_registry.spec import QuantSpec
from .algos import MIXED_PRECISION, MODELOPT_NAMES, Algo, Layout

PRODUCER = "compressed-tensors"
FORMATS = ("float-quantized", "int-quantized", "naive-quantized")
# (type, strategy, block or group size, dynamic) of 8-bit symmetric arguments -> key
WEIGHT_KEYS = {
    ("float", "tensor", None, False): kFp8StaticTensorSym,
    ("float", "channel", None, False): kFp8StaticChannelSym,
    ("float", "block", (128, 128), False): kFp8Static128BlockSym,
    ("int", "channel", None, False): kInt8StaticChannelSym,
}
ACTIVATION_KEYS = {
    ("float", "tensor", None, False): kFp8StaticTensorSym,  # calibrated: the checkpoint's `input_scale`
    ("float", "token", None, True): kFp8DynamicTokenSym,
    ("float", "group", 128, True): kFp8Dynamic128Sym,
    ("int", "token", None, True): kInt8DynamicTokenSym,
}


def _key(args: dict, table: dict, where: str) -> QuantKey:
    size = args.get("block_structure") or args.get("group_size")
    found = (args.get("type"), args.get("strategy"), tuple(size) if isinstance(size, list) else size,
             bool(args.get("dynamic")))  # fmt: skip
    if args.get("num_bits") != 8 or args.get("symmetric") is False or found not in table:
        read = "; ".join(
            f"type {t}, strategy {s}{f', size {n}' if n else ''}, {'dynamic' if d else 'static'}"
            for t, s, n, d in table
        )
        raise ValueError(
            f"{where}: {args.get('num_bits')}-bit {'symmetric' if args.get('symmetric', True) else 'asymmetric'} "
            f"type {found[0]}, strategy {found[1]}{f', size {found[2]}' if found[2] else ''}, "
            f"{'dynamic' if found[3] else 'static'} is not supported; quantpass reads 8-bit symmetric: {read}"
        )
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
    inputs = group.get("input_activations")
    activation = None if not inputs else _key(inputs, ACTIVATION_KEYS, f"{where} input_activations")
    tensors = ("data", "scale", "input_scale") if activation == kFp8StaticTensorSym else ("data", "scale")
    spec_name = QuantSpec(weight, activation).name()
    return Algo(f"{PRODUCER} {fmt} {spec_name}", weight, activation, tensors, MODELOPT_NAMES, producer=PRODUCER)


def layout(quant: dict, where: str) -> Layout:
    """A `quant_method: compressed-tensors` config's layout: one Algo row per config group."""
    groups = tuple(
        (tuple(group.get("targets") or ()), group_algo(name, group, quant.get("format"), where))
        for name, group in (quant.get("config_groups") or {}).items()
    )
    names = dict.fromkeys(algo.name for _, algo in groups)
    label = next(iter(names)) if len(names) == 1 else MIXED_PRECISION
    return Layout(PRODUCER, label, None, {}, tuple(quant.get("ignore") or ()), groups=groups, config=quant)
