"""Pre-quantized checkpoints: load without full precision, export (NVIDIA ModelOpt, gpt-oss MXFP4,
transformers fine-grained FP8, compressed-tensors).

`from_pretrained(path, **options)` and `save_pretrained(model, path)` are public as
`qp.from_pretrained` / `qp.save_pretrained`; `detect` and `describe` tell what a directory holds
and `dequantized` gives a loaded checkpoint's full-precision twin (the CLI's `run --model DIR`
and `explain`). The formats: algos.py, one table.
"""

from .algos import ALGOS, GPT_OSS_MXFP4, QUANT_ALGOS, Algo, Layout
from .load import CheckpointInfo, dequantized, describe, detect, from_pretrained
from .save import save_pretrained

__all__ = [
    "ALGOS",
    "GPT_OSS_MXFP4",
    "QUANT_ALGOS",
    "Algo",
    "CheckpointInfo",
    "Layout",
    "dequantized",
    "describe",
    "detect",
    "from_pretrained",
    "save_pretrained",
]
