"""What the kernel benchmarks measure: shapes and formats per suite, one literal table each.

A suite is chosen with `--bench-suite` (bench/conftest.py); the default is `cpu` without CUDA and
`gpu-full` with it. `gpu-quick` is what bench/device_check.sh runs inside its time budget;
`tiny` exercises every code path in seconds (device_check.sh --dry-run on a CPU).

`tag="target"` marks the shapes the issues set speed targets on (bench/summary.py TARGETS).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinearShape:
    m: int  # tokens
    n: int  # out features
    k: int  # in features
    tag: str = ""

    @property
    def group(self) -> str:
        return f"linear M={self.m} N={self.n} K={self.k}"


@dataclass(frozen=True)
class MoEShape:
    tokens: int
    experts: int
    topk: int
    hidden: int  # H
    intermediate: int  # I: w13 is [E, 2I, H], w2 [E, H, I]
    tag: str = ""

    @property
    def group(self) -> str:
        return f"moe E={self.experts} top-{self.topk} H={self.hidden} I={self.intermediate} T={self.tokens}"


def _linear_grid(ms, nks, tag=""):
    return [LinearShape(m, n, k, tag) for n, k in nks for m in ms]


def _moe_grid(tokens, experts, topk, hidden, intermediate, tag=""):
    return [MoEShape(t, experts, topk, hidden, intermediate, tag) for t in tokens]


LLM_NK = [(4096, 4096), (14336, 4096), (4096, 14336)]  # attention-like, MLP up, MLP down
H200_LINEAR_TARGET = LinearShape(8192, 8192, 8192, "target")  # issue 4: FP8 per-row, block-FP8
H200_MOE_TARGET = MoEShape(4096, 64, 8, 4096, 1536, "target")  # issue 5: Triton FP8 fused MoE

ALL_FORMATS = [
    "fp8_per_tensor", "fp8_per_channel", "fp8_per_block", "mxfp8", "nvfp4", "int8_per_channel",
    "mxfp4", "fp8_weight_only", "int8_weight_only", "int4_weight_only", "nvfp4_weight_only",
]  # fmt: skip
CPU_FORMATS = ["fp8_per_channel", "fp8_per_block", "mxfp8", "int8_per_channel", "int8_weight_only", "int4_weight_only", "mxfp4"]  # fmt: skip
GPU_QUICK_LINEAR_FORMATS = ["fp8_per_channel", "fp8_per_block", "mxfp8", "int8_per_channel", "int4_weight_only", "mxfp4"]  # fmt: skip
GPU_QUICK_MOE_FORMATS = ["fp8_per_tensor", "fp8_per_channel", "fp8_per_block", "mxfp8", "int8_per_channel", "int4_weight_only", "mxfp4"]  # fmt: skip

# suite -> (linear shapes, linear formats, MoE shapes, MoE formats). Targets come first so a run cut
# short by a time limit still has them.
# fmt: off
SUITES: dict[str, tuple[list[LinearShape], list[str], list[MoEShape], list[str]]] = {
    "gpu-full": (
        [H200_LINEAR_TARGET, *_linear_grid([1, 8, 512, 4096], LLM_NK)], ALL_FORMATS,
        [H200_MOE_TARGET, *_moe_grid([1, 8, 512], 64, 8, 4096, 1536), *_moe_grid([1, 8, 512, 4096], 8, 2, 4096, 14336)],
        ALL_FORMATS,
    ),
    "gpu-quick": (
        [H200_LINEAR_TARGET, LinearShape(1, 4096, 4096)], GPU_QUICK_LINEAR_FORMATS,
        [H200_MOE_TARGET, MoEShape(1, 64, 8, 4096, 1536)], GPU_QUICK_MOE_FORMATS,
    ),
    "cpu": (
        [LinearShape(1, 4096, 4096), LinearShape(8, 4096, 4096), LinearShape(512, 1024, 1024)], CPU_FORMATS,
        [*_moe_grid([1, 8, 512], 8, 2, 1024, 512), MoEShape(64, 64, 8, 256, 128)], CPU_FORMATS,
    ),
    "tiny": (
        [LinearShape(64, 256, 256, "target"), LinearShape(1, 256, 256)], GPU_QUICK_LINEAR_FORMATS,
        [MoEShape(16, 8, 2, 256, 128, "target"), MoEShape(1, 8, 2, 256, 128)], GPU_QUICK_MOE_FORMATS,
    ),
}
# fmt: on

# Why the cpu suite is not the full grid (printed in the pytest header and in bench/README.md).
# Measured 2026-12 on the shared 2-core AVX2 EPYC (no bf16/AMX instructions): bf16 F.linear at
# M=512, 4096x4096 takes ~5 s per call, the reference backend ~0.3-0.6 s per call at 4096x4096.
CPU_LEFT_OUT = (
    "left out on CPU to keep `make bench` under 5 minutes: M=4096 and N or K = 14336 linears (bf16 GEMMs "
    "take seconds per call here), prefill shrunk to M=512 at 1024x1024, MoE shrunk to H=1024/I=512 (E=8) "
    "and H=256/I=128 (E=64) from the GPU suites' H=4096 (the reference quantizes INT4 at ~2 M weights/s); run `--bench-suite gpu-full` for the full grid"
)


def selected(config) -> str:
    """The suite a pytest session runs: --bench-suite, else cpu, or gpu-full where CUDA is."""
    import torch

    return config.getoption("bench_suite", default=None) or ("gpu-full" if torch.cuda.is_available() else "cpu")


def suite(name: str) -> tuple[list[LinearShape], list[str], list[MoEShape], list[str]]:
    if name not in SUITES:
        raise ValueError(f"invalid bench suite {name!r}; valid: {', '.join(sorted(SUITES))}")
    return SUITES[name]
