"""FP4 and FP8 on CPU: quantpass's FP4 kernel (kernels/cpu_fp4.py: MXFP4, NVFP4) or FP8 kernel
(kernels/cpu_fp8.py: every FP8 format) against the `reference` backend, which ran these formats on
CPU before them, side by side in one process. (Until 2026-12-01 evening this was bench/cpu_fp4.py.)

    python bench/cpu_kernels.py fp4                          # 1 thread, M = 1 .. 256
    python bench/cpu_kernels.py fp8 --threads 2 --ms 1 4 --rounds 9
    python bench/cpu_kernels.py fp8 --tiles avx2 avx512-bf16 --ms 1 4   # a kernel's tiles side by side
    git show HEAD~1:quantpass/kernels/csrc/linear_fp8.c > /tmp/old/linear_fp8.c   # with the headers it includes
    cp quantpass/kernels/csrc/*.h /tmp/old/
    python bench/cpu_kernels.py fp8 --ms 1 4 --source before=/tmp/old/linear_fp8.c   # another build beside this one
    python bench/cpu_kernels.py fp4 --ms 1 --graph-ops     # + the graph op compiled graphs call (C++, Python)

Method: 8 distinct 4096x4096 bf16 weights quantized once per format, used in rotation so every call
reads its weight from DRAM (8 x 8.4-17 MiB > the 48 MiB L3 here); x bf16 [M, 4096]; one call per
weight per round, rounds interleaved (ours, reference, ours, ...; with --source, each build of the family's C
source on each tile set; with --graph-ops, the graph ops too, on the first tile set), medians and spread (min-max) of
the per-call time over rounds, wall clock. GB/s: the quantized weight's bytes (codes + scales) per
call time. Each kernel's largest M (`MAX_M`, above it the cpu backend calls the reference) comes
from this table. Writes `cpu_<family>.csv` to --out (default $OUT or bench/out/).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path

import torch
from results import interleaved, utc_stamp, write_csv  # bench/results.py (scripts run from bench/)

from quantpass.kernels import cpu, cpu_avx2, cpu_fp4, cpu_fp8, reference
from quantpass.quant_registry import keys, quantize

FAMILIES = {  # family -> (kernel module, {format name: (weight key, activation key)})
    "fp4": (cpu_fp4, {
        "mxfp4": (keys.kMxfp4Static, None),
        "nvfp4_weight_only": (keys.kNvfp4Static, None),
        "nvfp4 (W4A4)": (keys.kNvfp4Static, keys.kNvfp4Dynamic),
    }),
    "fp8": (cpu_fp8, {
        "fp8_weight_only": (keys.kFp8StaticChannelSym, None),
        "fp8_per_channel": (keys.kFp8StaticChannelSym, keys.kFp8DynamicTokenSym),
        "fp8_per_block": (keys.kFp8Static128BlockSym, keys.kFp8Dynamic128Sym),
        "mxfp8": (keys.kMxfp8Static, keys.kMxfp8Dynamic),
    }),
}  # fmt: skip
LAYERS, SIZE = 8, 4096


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("family", choices=FAMILIES)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 4, 16, 64, 128, 256])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tiles", nargs="+", default=[], help="these tiles side by side (the kernel module's TILES)")
    parser.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="another version of the family's C source, built and timed beside this tree's (repeatable)",
    )
    parser.add_argument(
        "--graph-ops",
        action="store_true",
        help="also the graph ops compiled graphs call (C++, and the Python one it falls back to), on the kernel's tiles",
    )
    parser.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "out"))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    kernel, formats = FAMILIES[args.family]
    ok, reason = kernel.available()
    if not ok:
        raise SystemExit(f"quantpass's {args.family} CPU kernel can't run here: {reason}")
    tiles = args.tiles or [kernel.tiles() if hasattr(kernel, "tiles") else ""]
    kernel_library = kernel._library  # the kernel module calls its `_library` loader on every call
    builds = {"this tree": kernel_library}
    for name, path in (source.split("=", 1) for source in args.source):
        builds[name] = cpu_avx2.format_kernel(Path(path).resolve(), kernel.SIGNATURES, f"{args.family} {name}")
    versions = {(b, t): f"{b}, {t}" if len(builds) > 1 else t for b in builds for t in tiles}
    ops = graph_ops() if args.graph_ops else {}
    rows = []
    for name, (weight_key, activation) in formats.items():
        gen = torch.Generator().manual_seed(0)
        weights = [quantize(torch.randn(SIZE, SIZE, generator=gen).bfloat16(), weight_key) for _ in range(LAYERS)]
        nbytes = weights[0].nbytes
        for m in args.ms:
            x = torch.randn(m, SIZE, generator=gen).bfloat16()
            cases = {  # the reference on 2 of the weights: ~75 ms per call at M=1
                version: lambda x=x, ws=weights, a=activation, b=b, t=t: (
                    [on_build(kernel, builds[b], t)] + [kernel.linear(x, w, a) for w in ws]
                )
                for (b, t), version in versions.items()
            }
            for case, op in ops.items():
                cases[case] = lambda x=x, ws=weights, a=activation, op=op: (
                    [on_build(kernel, kernel_library, tiles[0])] + [graph_call(op, x, w, a) for w in ws]
                )
            cases["reference"] = lambda x=x, ws=weights[:2], a=activation: [reference.linear(x, w, a, None) for w in ws]
            runs = interleaved(cases, args.rounds)
            r_times = [t / 2 for t in runs["reference"]]
            r, r_lo, r_hi = statistics.median(r_times), min(r_times), max(r_times)
            for version in [*versions.values(), *ops]:
                times = [s / LAYERS for s in runs[version]]
                k, k_lo, k_hi = statistics.median(times), min(times), max(times)
                rows.append(
                    {"format": name, "M": m, "threads": args.threads, "tiles": version, "kernel_ms": k * 1e3,
                     "kernel_min_ms": k_lo * 1e3, "kernel_max_ms": k_hi * 1e3, "kernel_GBps": nbytes / k / 1e9,
                     "reference_ms": r * 1e3, "reference_min_ms": r_lo * 1e3, "reference_max_ms": r_hi * 1e3,
                     "reference_over_kernel": r / k}
                )  # fmt: skip
                print(f"{name} M={m} {version}: kernel {k * 1e3:.2f} ms, reference {r * 1e3:.1f} ms", flush=True)
    out = Path(args.out) / f"cpu_{args.family}.csv"
    write_csv(out, rows, {"date": utc_stamp(), "machine": platform.processor() or platform.machine()})
    print(f"\n{utc_stamp()}, {platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"`python bench/cpu_kernels.py {' '.join(sys.argv[1:])}`".rstrip())  # fmt: skip
    print(
        f"\n| format | M | {'build, tiles' if len(builds) > 1 else 'tiles'} | {args.family.upper()} kernel ms (spread) | GB/s | "
        "reference ms (spread) | reference / kernel |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['format']} | {r['M']} | {r['tiles']} | {r['kernel_ms']:.2f} ({r['kernel_min_ms']:.2f}-{r['kernel_max_ms']:.2f}) | "
            f"{r['kernel_GBps']:.1f} | {r['reference_ms']:.1f} ({r['reference_min_ms']:.1f}-{r['reference_max_ms']:.1f}) | "
            f"{r['reference_over_kernel']:.1f}x |"
        )
    print(f"\nCSV: {out}")


def graph_ops() -> dict:
    """{case: op}: the cpu backend's graph op as compiled graphs call it (C++ where it builds) and the Python op."""
    return {"graph op (C++)": cpu.graph_linear_op("cpu"), "graph op (Python)": torch.ops.quantpass.linear_cpu.default}


def graph_call(op, x, weight, activation):
    """A compiled graph's call of the linear op on this weight (positional, as Inductor's wrapper makes it)."""
    key = "" if activation is None else str(activation)
    return op(x, weight.data, weight.scale, weight.scale2, None, str(weight.key), key, "cpu", weight.data.shape[0],
              weight.input_scale)  # fmt: skip


def on_build(kernel, library, tiles: str) -> str:
    """Switch `kernel` (a module) to a build of its C source (`library`, a `format_kernel` loader) and that
    build to tile set `tiles` ("": leave it) before a case's calls."""
    kernel._library = library
    return kernel.tiles(tiles) if tiles else tiles


if __name__ == "__main__":
    main()
