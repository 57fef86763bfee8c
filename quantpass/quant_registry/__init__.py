"""Names, keys, specs and reference numerics: everything a format is, without kernels."""

import torch

from . import formats, keys
from .formats import dequantize
from .keys import KEYS, GroupShape, QuantKey, ScaleDesc, key_name
from .qtensor import QTensor
from .spec import BACKEND_NAMES, KINDS, ROLE_NAMES, SHORTHANDS, QuantizationConfig, QuantSpec, parse_cli, quant_key

__all__ = [
    "BACKEND_NAMES",
    "KINDS",
    "SHORTHANDS",
    "GroupShape",
    "QTensor",
    "QuantKey",
    "QuantSpec",
    "QuantizationConfig",
    "ScaleDesc",
    "dequantize",
    "key_name",
    "keys",
    "parse_cli",
    "quant_key",
    "quantize",
]


def quantize(x: torch.Tensor, key: "QuantKey | QuantSpec | str", name: str = "tensor") -> QTensor:
    """Quantize `x` with `key`: a QuantKey, a key name (`"kInt8StaticChannelSym"`), or a format name
    (`"int8_weight_only"`, `"fp8_per_channel"`: its weight key, as a layer's weight would get)."""
    return formats.quantize(x, _key(key), name)


def _key(key) -> QuantKey:
    if isinstance(key, QuantKey):
        return key
    if isinstance(key, QuantSpec) and key.weight is not None:
        return key.weight
    if isinstance(key, str):
        if key in KEYS:  # any key, dynamic (activation) ones included
            return KEYS[key]
        if key in SHORTHANDS:
            return SHORTHANDS[key][0]
        if key in ROLE_NAMES and ROLE_NAMES[key][0] is not None:
            return ROLE_NAMES[key][0]
        valid = sorted({*SHORTHANDS, *(n for n, pair in ROLE_NAMES.items() if pair[0] is not None)})
        raise ValueError(
            f"invalid key {key!r} for quantize; valid: {', '.join(valid)}, or a key name ({', '.join(KEYS)})"
        )
    raise ValueError(
        f"invalid key {key!r} for quantize: pass a format name (e.g. 'int8_weight_only'), "
        "a key name (e.g. 'kInt8StaticChannelSym') or a QuantKey (qp.keys.kInt8StaticChannelSym)"
    )
