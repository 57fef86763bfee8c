"""Compile every Triton kernel quantpass launches for a GPU target, on a machine without a GPU.

Our launchers run as they would on CUDA (Triton's JIT, not the interpreter) on CPU tensors, with a
stand-in driver that reports the target GPU; each launch becomes `warmup`: compile only, every
autotune config. That catches what only the compiled path sees, with the Triton installed here
(the H200 image has 3.6): frontend type errors, ops the architecture lacks, launches whose every
config needs more than the GPU's 227 KiB of shared memory per block (configs over it are listed:
the autotuner skips them at run time). Numerics are the GPU tier's job. One line per kernel
variant; exit status 1 if any failed.

    python tests/triton_aot.py --sm 90 100 [--quick]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback
from typing import ClassVar

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: JIT functions, not interpreted

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

MAX_SHARED_BYTES = 232448  # H100 / H200 / B200: 227 KiB of shared memory per block
LINEAR_SHAPES = {"quick": [(16, 4096, 4096)], "full": [(16, 4096, 4096), (4096, 4096, 4096)]}  # M, N, K
MOE_TOKENS = {"quick": [4096], "full": [1, 4096]}  # E=8 top-2 H=1024 I=512 (decode and sorted paths)


class StandInDriver:
    """What Triton's JIT asks the active driver while compiling, answered for `sm`."""

    def __init__(self, sm: int):
        self.target = GPUTarget("cuda", sm, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def __getattr__(self, name):
        raise RuntimeError(f"compile-only check: the driver's {name!r} isn't available without a GPU")


class CompileOnly:
    """Stands in for `torch.library.wrap_triton(kernel)`: `[grid](...)` compiles instead of launching.
    With `first_config_only`, an autotuned kernel compiles its first config (a quick check: every
    kernel variant compiles, not every tile size)."""

    compiled: ClassVar[list] = []
    first_config_only = False

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if CompileOnly.first_config_only and hasattr(self.kernel, "configs"):  # a triton.autotune wrapper
                result = self.kernel.fn.warmup(*args, grid=grid, **kwargs, **self.kernel.configs[0].all_kwargs())
            else:
                result = self.kernel.warmup(*args, grid=grid, **kwargs)
            CompileOnly.compiled.extend(result if isinstance(result, list) else [result])

        return launch


def cases(size: str):
    """(label, thunk) for every linear and MoE pair the oracle offers Triton, on bf16 activations."""
    from quantpass.kernels import oracle
    from quantpass.kernels import triton as backend
    from quantpass.kernels.triton import moe
    from quantpass.quant_registry import formats

    for (weight, activation), backends in oracle.LINEAR_CANDIDATES.items():
        if "triton" not in backends:
            continue
        for m, n, k in LINEAR_SHAPES[size]:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            qt = formats.quantize(torch.randn(n, k) / k**0.5, weight)
            yield f"linear {weight}/{activation} M={m}", lambda x=x, qt=qt, a=activation: backend.linear(x, qt, a, None)
    experts, top_k, hidden, inter = 8, 2, 1024, 512
    for (weight, activation), backends in oracle.MOE_CANDIDATES.items():
        if "triton" not in backends:
            continue
        w13 = formats.quantize(torch.randn(experts, 2 * inter, hidden) / hidden**0.5, weight)
        w2 = formats.quantize(torch.randn(experts, hidden, inter) / inter**0.5, weight)
        for tokens in MOE_TOKENS[size]:
            x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
            topk_weights, topk_ids = torch.randn(tokens, experts).softmax(-1).topk(top_k, dim=-1)
            args = (
                x,
                topk_weights,
                topk_ids,
                w13,
                w2,
                None,
                None,
                None,
                activation,
                "silu",
                "concat",
                False,
                1.702,
                7.0,
            )
            yield f"moe {weight}/{activation} T={tokens}", lambda args=args: moe.fused_moe(*args)


def check(sm: int, size: str) -> list[str]:
    from quantpass.kernels.triton import gemm, quant

    driver.set_active(StandInDriver(sm))
    gemm.wrap_triton = quant.wrap_triton = CompileOnly
    CompileOnly.first_config_only = size == "quick"
    failures = []
    for label, run in cases(size):
        CompileOnly.compiled.clear()
        start = time.perf_counter()
        try:
            run()
        except Exception as error:  # report every failing variant, not just the first
            failures.append(f"sm{sm} {label}: {type(error).__name__}: {str(error).strip()[:400]}")
            print(f"FAIL  sm{sm} {label}\n{traceback.format_exc(limit=3)}", flush=True)
            continue
        # Triton's autotuner skips a config that runs out of shared memory; a launch fails only if all do.
        shared = sorted(kernel.metadata.shared for kernel in CompileOnly.compiled)
        over = sum(size > MAX_SHARED_BYTES for size in shared)
        if shared and over == len(shared):
            failures.append(f"sm{sm} {label}: every config needs > {MAX_SHARED_BYTES} B of shared memory {shared}")
        status = "FAIL" if shared and over == len(shared) else "ok  "
        note = f", {over} over {MAX_SHARED_BYTES} B (the autotuner skips them)" if over else ""
        took = time.perf_counter() - start
        print(
            f"{status}  sm{sm} {label}: {len(shared)} kernels, shared {shared[0]}..{shared[-1]} B{note}, {took:.1f} s"
        )
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sm", type=int, nargs="+", default=[90, 100])
    parser.add_argument(
        "--quick", action="store_true", help="decode linears (first autotune config only) and prefill MoE"
    )
    args = parser.parse_args()
    if len(args.sm) > 1:  # one process per target: a JIT function caches its kernels by device, not target
        flags = ["--quick"] if args.quick else []
        runs = [subprocess.run([sys.executable, __file__, "--sm", str(sm), *flags]) for sm in args.sm]
        return max(run.returncode for run in runs)
    print(f"triton {triton.__version__}, torch {torch.__version__}: compile-only for sm{args.sm[0]}", flush=True)
    failures = check(args.sm[0], "quick" if args.quick else "full")
    print(f"sm{args.sm[0]}: {len(failures)} failed" + "".join(f"\n  {failure}" for failure in failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
