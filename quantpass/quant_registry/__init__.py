"""Names, keys, specs and reference numerics: everything a format is, without kernels."""

from . import keys
from .formats import dequantize, quantize
from .keys import GroupShape, QuantKey, ScaleDesc, key_name
from .qtensor import QTensor
from .spec import BACKEND_NAMES, KINDS, SHORTHANDS, QuantizationConfig, QuantSpec, parse_cli, quant_key

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
