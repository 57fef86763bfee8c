"""Compile every Triton kernel quantpass launches for a GPU target, on a machine without a GPU.

Our launchers run as they would on CUDA (Triton's JIT, not the interpreter) on CPU tensors, with a
stand-in driver that reports the target GPU; each launch becomes `warmup`: compile only, every
autotune config. That catches what only the compiled path sees, with the Triton installed here
(the H200 image has 3.6): frontend type errors, ops the architecture lacks, launches whose every
config needs more than the GPU's 227 KiB of shared memory per block (configs over it are listed:
the autotuner skips them at run time). Then `ptxas -v` (Triton's own) reads each config's PTX:
registers per thread and spilled bytes; a config that spills fails the check (the tuner could pick
it, and spills to local memory cost more than a smaller tile). Numerics are the GPU tier's job.
One line per kernel variant (`--report`: one per config); exit status 1 if any failed.

    python tests/triton_aot.py --sm 90 100 [--quick] [--report]

Also checked: every config of the shipped fused-MoE files (`kernels/triton/configs/*.json`).
`inspect(sm, label)` returns the compiled kernels of one case, for tests that read their IR.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import ClassVar

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: JIT functions, not interpreted

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

MAX_SHARED_BYTES = 232448  # H100 / H200 / B200: 227 KiB of shared memory per block
# M, N, K: decode (split-K), the small-batch bucket, prefill
LINEAR_SHAPES = {"quick": [(16, 4096, 4096)], "full": [(16, 4096, 4096), (64, 4096, 4096), (4096, 4096, 4096)]}
MOE_TOKENS = {"quick": [4096], "full": [1, 4096]}  # E=8 top-2 H=1024 I=512 (decode and sorted paths)
PTXAS_CACHE = Path(os.environ.get("QUANTPASS_PTXAS_CACHE", Path(tempfile.gettempdir()) / "quantpass_ptxas"))


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


def ptxas_path(sm: int) -> Path | None:
    """The ptxas Triton itself runs for `sm` (its bundled one, or TRITON_PTXAS_PATH), if present."""
    from triton.backends.nvidia import compiler

    try:
        path = Path(compiler.get_ptxas(sm).path)
    except Exception:  # no NVIDIA backend, or no binary
        return None
    return path if path.is_file() else None


@functools.cache
def _ptxas_report(ptx_hash: str, sm: int) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) of one kernel, from `ptxas -v` (cached on disk)."""
    cached = PTXAS_CACHE / f"{ptx_hash}.json"
    if cached.is_file():
        return tuple(json.loads(cached.read_text()))
    ptx = PTXAS_CACHE / f"{ptx_hash}.ptx"
    arch = f"sm_{sm}a" if sm >= 90 else f"sm_{sm}"
    done = subprocess.run(
        [str(ptxas_path(sm)), "-v", f"--gpu-name={arch}", str(ptx), "-o", os.devnull],
        capture_output=True,
        text=True,
        check=True,
    )
    text = done.stderr + done.stdout
    registers = max(int(r) for r in re.findall(r"Used (\d+) registers", text))
    stores = sum(int(s) for s in re.findall(r"(\d+) bytes spill stores", text))
    loads = sum(int(s) for s in re.findall(r"(\d+) bytes spill loads", text))
    cached.write_text(json.dumps([registers, stores, loads]))
    ptx.unlink()
    return registers, stores, loads


def ptxas_report(kernel, sm: int) -> tuple[int, int, int]:
    ptx = kernel.asm["ptx"]
    digest = hashlib.sha256(f"{sm}\n{ptx}".encode()).hexdigest()[:32]
    PTXAS_CACHE.mkdir(parents=True, exist_ok=True)
    if not (PTXAS_CACHE / f"{digest}.json").is_file():
        (PTXAS_CACHE / f"{digest}.ptx").write_text(ptx)
    return _ptxas_report(digest, sm)


def config_of(kernel) -> str:
    """`BMxBNxBK wN sS [split K]` of a compiled GEMM; the kernel's name for the others."""
    names = kernel.src.fn.arg_names
    constants = {names[key[0]]: value for key, value in kernel.src.constants.items() if len(key) == 1}
    if "BLOCK_M" not in constants:
        return f"{kernel.name} w{kernel.metadata.num_warps}"
    tile = "x".join(str(constants[name]) for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    split = f" split{constants['SPLIT_K']}" if constants.get("SPLIT_K", 1) > 1 else ""
    return f"{tile} g{constants['GROUP_M']} w{kernel.metadata.num_warps} s{kernel.metadata.num_stages}{split}"


def linear_case(weight, activation, m, n, k, device="cpu"):
    from quantpass.kernels import triton as backend
    from quantpass.quant_registry import formats

    def run():  # operands made when the case runs: a shard builds only its own
        x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
        backend.linear(x, formats.quantize(torch.randn(n, k, device=device) / k**0.5, weight), activation, None)

    return run


def moe_case(weight, activation, experts, top_k, hidden, inter, tokens, config=None, device="cpu"):
    from quantpass.kernels.triton import moe
    from quantpass.moe_problem import GatedActivation, MoEProblem
    from quantpass.quant_registry import formats

    def run():
        w13 = formats.quantize(torch.randn(experts, 2 * inter, hidden, device=device) / hidden**0.5, weight)
        w2 = formats.quantize(torch.randn(experts, hidden, inter, device=device) / inter**0.5, weight)
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)
        topk_weights, topk_ids = torch.randn(tokens, experts, device=device).softmax(-1).topk(top_k, dim=-1)
        gated = GatedActivation("silu", "concat", 1.702, 7.0)
        moe.fused_moe(MoEProblem(x, topk_weights, topk_ids, w13, w2, gated, activation), config=config)

    return run


def cases(size: str):
    """(label, thunk) for every linear and MoE pair the oracle offers Triton, on bf16 activations, and
    every config of the shipped fused-MoE config files."""
    from quantpass.kernels import oracle
    from quantpass.kernels import triton as backend
    from quantpass.kernels.triton import tuning
    from quantpass.quant_registry.spec import QuantSpec

    for (weight, activation), backends in oracle.LINEAR_CANDIDATES.items():
        if "triton" not in backends:
            continue
        for m, n, k in LINEAR_SHAPES[size]:
            yield f"linear {weight}/{activation} M={m}", linear_case(weight, activation, m, n, k)
    for (weight, activation), backends in oracle.MOE_CANDIDATES.items():
        if "triton" not in backends:
            continue
        for tokens in MOE_TOKENS[size]:
            yield f"moe {weight}/{activation} T={tokens}", moe_case(weight, activation, 8, 2, 1024, 512, tokens)
    # The shipped tuned files: each distinct config at the file's N (H = 1024: any H compiles alike).
    by_dtype = {}
    for name in ("fp8_per_tensor", "fp8_per_channel", "fp8_per_block", "int8_per_channel", "int4_weight_only"):
        spec = QuantSpec.coerce(name, "format")
        scheme = backend.gemm_scheme(spec.weight, spec.activation)
        by_dtype.setdefault(scheme.name, (spec.weight, spec.activation))
    for path in sorted(tuning.CONFIG_DIR.glob("*.json")):
        fields = dict(part.split("=", 1) for part in path.stem.split(",") if "=" in part)
        if fields.get("dtype") not in by_dtype:
            continue
        weight, activation = by_dtype[fields["dtype"]]
        configs = {json.dumps(c, sort_keys=True): c for c in json.loads(path.read_text())["configs"].values()}
        for config in configs.values() if size == "full" else list(configs.values())[-1:]:
            inter, tile = int(fields["N"]), "x".join(str(config[key]) for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
            label = f"moe file E={fields['E']} N={inter} {fields['dtype']} {tile}"
            experts = min(int(fields["E"]), 8)  # E is no kernel argument: 8 experts compile alike, and quantize faster
            yield label, moe_case(weight, activation, experts, 8, 1024, inter, 4 * config["BLOCK_M"], config)


def suite_cases(name: str, device: str):
    """(label, thunk) for the Triton launches of one bench suite (bench/suites.py): its shapes and
    formats, as the benchmarks launch them. Compiling them fills Triton's cache (device_check.sh)."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
    import suites

    from quantpass.kernels import oracle
    from quantpass.quant_registry.spec import QuantSpec

    linear, linear_formats, moe_shapes, moe_formats = suites.suite(name)
    for shape in linear:
        for format_name in linear_formats:
            spec = QuantSpec.coerce(format_name, "format")
            if "triton" in oracle.LINEAR_CANDIDATES.get((spec.weight, spec.activation), ()):
                label = f"linear {format_name} {shape.group}"
                yield label, linear_case(spec.weight, spec.activation, shape.m, shape.n, shape.k, device)
    for shape in moe_shapes:
        for format_name in moe_formats:
            spec = QuantSpec.coerce(format_name, "format")
            if "triton" in oracle.MOE_CANDIDATES.get((spec.weight, spec.activation), ()):
                args = (shape.experts, shape.topk, shape.hidden, shape.intermediate, shape.tokens)
                yield f"moe {format_name} {shape.group}", moe_case(spec.weight, spec.activation, *args, device=device)


def check(sm: int | None, todo, quick: bool, report: bool = False) -> list[str]:
    """Compile each case of `todo`; `sm` None: for the CUDA device present (its real driver)."""
    from quantpass.kernels.triton import gemm, quant

    if sm is not None:
        driver.set_active(StandInDriver(sm))
    else:
        major, minor = torch.cuda.get_device_capability()
        sm = major * 10 + minor
    gemm.wrap_triton = quant.wrap_triton = CompileOnly
    CompileOnly.first_config_only = quick
    has_ptxas = report is not None and ptxas_path(sm) is not None
    if not has_ptxas and report is not None:
        print(f"no ptxas for sm{sm}: registers and spills are not checked", flush=True)
    failures = []
    for label, run in todo:
        CompileOnly.compiled.clear()
        start = time.perf_counter()
        try:
            run()
        except Exception as error:  # report every failing variant, not just the first
            failures.append(f"sm{sm} {label}: {type(error).__name__}: {str(error).strip()[:400]}")
            print(f"FAIL  sm{sm} {label}\n{traceback.format_exc(limit=3)}", flush=True)
            continue
        problems, lines = [], []
        # Triton's autotuner skips a config that runs out of shared memory; a launch fails only if all do.
        shared = sorted(kernel.metadata.shared for kernel in CompileOnly.compiled)
        over = sum(size > MAX_SHARED_BYTES for size in shared)
        if shared and over == len(shared):
            problems.append(f"every config needs > {MAX_SHARED_BYTES} B of shared memory {shared}")
        registers = []
        for kernel in CompileOnly.compiled if has_ptxas else ():
            regs, stores, loads = ptxas_report(kernel, sm)
            registers.append(regs)
            spill = f", SPILLS {stores} B stored / {loads} B loaded" if stores or loads else ""
            lines.append(f"      {config_of(kernel)}: {regs} registers, shared {kernel.metadata.shared} B{spill}")
            if stores or loads:
                problems.append(f"{config_of(kernel)} spills {stores} B ({regs} registers)")
        failures += [f"sm{sm} {label}: {problem}" for problem in problems]
        note = f", {over} over {MAX_SHARED_BYTES} B (the autotuner skips them)" if over else ""
        regs = f", registers {min(registers)}..{max(registers)}" if registers else ""
        took = time.perf_counter() - start
        status = "FAIL" if problems else "ok  "
        print(f"{status}  sm{sm} {label}: {len(shared)} kernels, shared {shared[0]}..{shared[-1]} B{note}{regs}, {took:.1f} s")  # fmt: skip
        for line in lines if report or problems else ():
            print(line)
        sys.stdout.flush()
    return failures


def compile_kernels(sm: int, run) -> list:
    """Compile-only `run()` (a function calling our launchers) for `sm`; its compiled kernels, for
    tests that read their TTGIR / PTX (`kernel.asm`). Call in a fresh process: it swaps the driver."""
    from quantpass.kernels.triton import gemm, quant

    driver.set_active(StandInDriver(sm))
    gemm.wrap_triton = quant.wrap_triton = CompileOnly
    CompileOnly.compiled.clear()
    run()
    return list(CompileOnly.compiled)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sm", type=int, nargs="+", default=[90, 100])
    parser.add_argument(
        "--quick", action="store_true", help="decode linears (first autotune config only) and prefill MoE"
    )
    parser.add_argument("--report", action="store_true", help="one line per config: registers, shared memory, spills")
    parser.add_argument("--suite", help="compile a bench suite's launches instead (fills Triton's cache; no ptxas)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the GPU present, its driver")
    parser.add_argument("--jobs", type=int, default=1, help="processes, each compiling a share of the cases")
    parser.add_argument("--shard", default="0/1", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sms = [None] if args.device == "cuda" else args.sm
    if len(sms) > 1 or args.jobs > 1:  # one process per target (a JIT function caches its kernels by
        # device, not target) and per share of the cases
        flags = ["--quick"] * args.quick + ["--report"] * args.report + ["--device", args.device]
        flags += ["--suite", args.suite] if args.suite else []
        commands = [
            [sys.executable, __file__, *flags, *(["--sm", str(sm)] if sm else []), "--shard", f"{shard}/{args.jobs}"]
            for sm in sms
            for shard in range(args.jobs)
        ]
        runs = [subprocess.Popen(command) for command in commands]
        return max(run.wait() for run in runs)
    sm = sms[0]
    shard, shards = (int(part) for part in args.shard.split("/"))
    todo = list(suite_cases(args.suite, args.device) if args.suite else cases("quick" if args.quick else "full"))
    todo = todo[shard::shards]
    where = "the CUDA device present" if sm is None else f"sm{sm}"
    print(f"triton {triton.__version__}, torch {torch.__version__}: compile-only for {where}, {len(todo)} cases", flush=True)  # fmt: skip
    report = None if args.suite else args.report  # None: no ptxas (a cache warm-up)
    failures = check(sm, todo, args.quick, report)
    print(f"{where}: {len(failures)} failed" + "".join(f"\n  {failure}" for failure in failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
