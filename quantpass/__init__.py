"""quantpass: a torch.compile backend that quantizes the linear and MoE layers of unmodified models.

`import quantpass` needs no GPU, no FlashInfer and does not import Triton.
"""

from ._quiet import quiet_third_party_import_noise
from .backend import backend, explain
from .checkpoints import from_pretrained, save_pretrained
from .decorator import compile
from .functional import linear
from .passes.verify import QuantizationError
from .plan import Plan, PlanRow
from .quant_registry import QTensor, QuantizationConfig, QuantKey, QuantSpec, dequantize, keys, quant_key, quantize
from .weights import load_weights, refresh_weights, state_dict

quiet_third_party_import_noise()  # torchao is imported later, lazily (FP4 packing) or by transformers

__all__ = [
    # compile
    "backend",
    "compile",
    "explain",
    "Plan",
    "PlanRow",
    "QuantizationError",
    # config
    "QuantKey",
    "QuantSpec",
    "QuantizationConfig",
    "keys",
    "quant_key",
    # numerics
    "QTensor",
    "dequantize",
    "linear",
    "quantize",
    # weights of a quantized model
    "load_weights",
    "refresh_weights",
    "state_dict",
    # pre-quantized checkpoints (ModelOpt, gpt-oss MXFP4, fine-grained FP8, compressed-tensors) and export
    "from_pretrained",
    "save_pretrained",
]
