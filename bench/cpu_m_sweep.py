"""The cpu backend's M switch, measured: its weight-only kernels against dequantize + matmul (and,
quantpass's kernels against aten's) over M, for one N x K. `cpu.KERNEL_MAX_M` and `cpu.OURS_MAX_M`
come from this table.

    python bench/cpu_m_sweep.py --threads 1 2 --m 1 8 32 128 256 384 512
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F

from quantpass.kernels import cpu, cpu_avx2
from quantpass.quant_registry import quantize
from quantpass.quant_registry.keys import kInt4StaticGroup128Sym, kInt8StaticChannelSym

KEYS = {"int8": kInt8StaticChannelSym, "int4": kInt4StaticGroup128Sym}


CLOCK = time.perf_counter


def median_ms(rounds: int, fn, *args) -> float:
    fn(*args)
    times = []
    for _ in range(rounds):
        start = CLOCK()
        fn(*args)
        times.append(CLOCK() - start)
    return sorted(times)[len(times) // 2] * 1e3


@contextlib.contextmanager
def aten_kernels():
    """The cpu backend as it is without quantpass's kernels (they are chosen at prepare and call time)."""
    found = cpu_avx2.available
    cpu_avx2.available = lambda: (False, "measuring aten's kernels")
    try:
        yield
    finally:
        cpu_avx2.available = found


def prepared_weights(w: torch.Tensor, name: str) -> dict[str, tuple]:
    """{label: (prepared weight, on aten's kernel)}: quantpass's kernel (where it runs) and aten's."""
    qt = quantize(w, KEYS[name])
    weights = {}
    if cpu_avx2.available()[0]:
        weights[f"quantpass {name.upper()}"] = (cpu.prepare_weight("linear", qt), False)
        if name == "int8" and cpu_avx2.int8_tiles() != "avx2":  # side by side with the tiles used elsewhere
            weights["quantpass INT8, AVX2 tiles"] = (weights["quantpass INT8"][0], "avx2")
    with aten_kernels():
        weights[f"aten {name.upper()}"] = (cpu.prepare_weight("linear", qt), True)
    return weights


def kernel(x: torch.Tensor, weight, aten: bool | str) -> torch.Tensor:
    """aten's kernel (aten True), ours (False), or ours on INT8 tile set `aten` (a name)."""
    if isinstance(aten, str):
        before = cpu_avx2.int8_tiles()
        cpu_avx2.int8_tiles(aten)
        try:
            return cpu._our_kernel(x, weight, None)
        finally:
            cpu_avx2.int8_tiles(before)
    if not aten:
        return cpu._our_kernel(x, weight, None)
    return cpu._aten_kernel(x, weight)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", choices=sorted(KEYS), default="int4")
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 8, 32, 128, 256, 384, 512])
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    parser.add_argument("--bf16-max-m", type=int, default=8, help="bf16 F.linear only up to this M (slow on AVX2)")
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall", help="thread: CPU time, 1 thread only")
    args = parser.parse_args()
    if args.clock == "thread":
        global CLOCK
        CLOCK = time.thread_time

    torch.manual_seed(0)
    w = torch.randn(args.n, args.k, dtype=torch.bfloat16)
    weights = prepared_weights(w, args.format)
    first = next(iter(weights.values()))[0]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{args.format} {args.n}x{args.k}, bf16 x, median ms ({args.clock} clock); {when}")
    print("| threads | row | " + " | ".join(f"M={m}" for m in args.m) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in args.m) + " |")
    for threads in args.threads:
        torch.set_num_threads(threads)
        rows: dict[str, list[str]] = {label: [] for label in (*weights, "dequantize + matmul", "bf16 F.linear")}
        for m in args.m:
            x = torch.randn(m, args.k, dtype=torch.bfloat16)
            rounds = 21 if m <= 32 else 5
            for label, (weight, aten) in weights.items():
                rows[label].append(f"{median_ms(rounds, kernel, x, weight, aten):.3g}")
            rows["dequantize + matmul"].append(f"{median_ms(rounds, cpu._large_m_matmul, x, first):.3g}")
            slow = m > args.bf16_max_m
            rows["bf16 F.linear"].append("" if slow else f"{median_ms(rounds, F.linear, x, w):.3g}")
        for label, cells in rows.items():
            print(f"| {threads} | {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
