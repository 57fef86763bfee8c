"""Every environment variable quantpass reads, in one place (README lists them)."""

from __future__ import annotations

import os

ENV_VARS = {
    "QUANTPASS_DISABLED_BACKENDS": "comma-separated backends the oracle must not pick automatically",
    "QUANTPASS_DEBUG_DIR": "dump graphs before/after the pass, the plan and depyf output per compile here",
    "QUANTPASS_CPU_KERNEL": "0 keeps INT8/INT4 weight-only on aten's CPU kernels (FP8/FP4 on the reference) instead of building quantpass's AVX2 ones",
    "QUANTPASS_LOG": "log level of the 'quantpass' logger (debug shows the oracle's rejections)",
    "TRITON_INTERPRET": "1 runs Triton kernels on CPU tensors through Triton's interpreter",
}


def disabled_backends() -> frozenset[str]:
    raw = os.environ.get("QUANTPASS_DISABLED_BACKENDS", "")
    return frozenset(name.strip() for name in raw.split(",") if name.strip())


def debug_dir() -> str | None:
    return os.environ.get("QUANTPASS_DEBUG_DIR") or None


def log_level() -> str | None:
    return os.environ.get("QUANTPASS_LOG") or None


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cpu_kernel_enabled() -> bool:
    return os.environ.get("QUANTPASS_CPU_KERNEL", "1") != "0"
