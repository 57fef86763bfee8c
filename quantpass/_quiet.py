"""Third-party start-up noise that says nothing to a quantpass user, filtered by exact message.

torchao (imported lazily for FP4 packing, and by transformers) logs one warning per CUDA/C++
extension it can't load on this machine ("Failed to load .../torchao/_C_mxfp8...so"), and registers
its enums as pytree constants, for which torch logs a deprecation warning per enum. Neither is
actionable here; anything else those loggers say still gets through.
"""

from __future__ import annotations

import logging
import re

# logger name -> messages (regex on the formatted message) dropped from that logger
NOISE = {
    "torchao": re.compile(r"Failed to load .*torchao[/\\]_C\w*\.[\w.-]*so\b"),
    "torch.utils._pytree": re.compile(
        r"<enum '\w+'> is an Enum subclass and is now natively supported by torch\.compile"
    ),
}


class _DropNoise(logging.Filter):
    def __init__(self, pattern: re.Pattern):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def quiet_third_party_import_noise() -> None:
    """Install the filters once per process (idempotent)."""
    for name, pattern in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise(pattern))
