"""Two (or more) versions of csrc/linear_avx2.c side by side: each built as its own library, timed on
cpu_decode.py's method (8 distinct 4096x4096 layers in rotation, so the weights come from DRAM; all 8 in
one C call, csrc/bench_probes.c), rounds interleaved, with the bandwidth probe in the same process.

    git show fd98d9f:quantpass/kernels/csrc/linear_avx2.c > /tmp/old/linear_avx2.c
    cp quantpass/kernels/csrc/cpu_common.h /tmp/old/          # the headers the old source includes
    python bench/kernel_ab.py old=/tmp/old/linear_avx2.c new=quantpass/kernels/csrc/linear_avx2.c

`--layers 24` puts 200 MB of INT4 weights in rotation instead of 67 MB (an L3 of 32 MB or more may
hold part of 67 MB between passes). Each version runs INT4 and INT8 on each of their tile sets (`avx2`, and
`avx512-vnni` where the CPU and the version have them), and on each decode tile height where it has them
(`8-row`, `4-row`). `--m 2` multiplies 2 activation rows (the decode tile heights then don't apply).
Prints one markdown row per (format, threads, version); writes kernel_ab.csv to --out.
"""

from __future__ import annotations

import argparse
import ctypes
import os
from pathlib import Path

import cpu_decode  # bench/cpu_decode.py (scripts run from bench/)
import results
import torch

from quantpass.kernels import cpu, cpu_avx2


def load(source: str) -> ctypes.CDLL:
    """This version of the source, built as quantpass builds its own (a build error raises)."""
    path = cpu_avx2.build(os.environ.get("CC") or "cc", Path(source).resolve(), after=("-lm",))
    return cpu_avx2.with_signatures(ctypes.CDLL(str(path)))


# the tile sets' C switch and names by weight bits
TILE_SWITCHES = {4: ("qp_int4_vnni", cpu_avx2.INT4_TILES), 8: ("qp_int8_vnni", cpu_avx2.INT8_TILES)}


def cases(libs: dict[str, ctypes.CDLL], name: str, threads: int, m: int = 1) -> dict:
    """{version (tiles): one pass over the layers in rotation}"""
    _, weights, _ = cpu_decode.layer_weights(name)
    key = cpu_decode.FORMATS[name][1]
    bits, mode = cpu.BITS[key], cpu_avx2.MODES[cpu.ACTIVATION_MODES[key][0]]
    x, out = (
        torch.randn(m, cpu_decode.SIZE, dtype=torch.bfloat16),
        torch.empty(m, cpu_decode.SIZE, dtype=torch.bfloat16),
    )
    out_of = {}
    for version, lib in libs.items():
        switch_name, names = TILE_SWITCHES[bits]
        switch = getattr(lib, switch_name, None)  # older sources have no INT8 switch
        if switch is not None:
            switch.argtypes, switch.restype = (ctypes.c_int,), ctypes.c_int
        for tiles in names if switch is not None else ("",):
            if tiles and names[switch(names.index(tiles))] != tiles:
                continue  # this CPU lacks them
            run = cpu_decode.kernel_alone(x, weights, [out] * cpu_decode.LAYERS, bits, mode, threads, lib)
            heights = cpu_avx2.DECODE_TILES if m == 1 and hasattr(lib, "qp_decode_rows") else ("",)

            for decode in heights:

                def each(run=run, switch=switch, names=names, tiles=tiles, decode=decode, lib=lib):
                    if tiles:
                        switch(names.index(tiles))
                    if decode:
                        lib.qp_decode_rows(cpu_avx2.DECODE_TILES.index(decode))
                    run()

                label = ", ".join(filter(None, (tiles, decode)))
                out_of[f"{version} ({label})" if label else version] = each
    return out_of, weights[0].nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", nargs="+", help="NAME=PATH of a linear_avx2.c")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--formats", nargs="+", default=list(cpu_decode.FORMATS), choices=list(cpu_decode.FORMATS))
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--layers", type=int, default=cpu_decode.LAYERS, help="distinct weights in rotation")
    parser.add_argument("--m", type=int, default=1, help="activation rows per call")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "out"))
    args = parser.parse_args()
    cpu_decode.LAYERS = args.layers  # more layers: less of the rotation fits in a large L3
    libs = {name: load(path) for name, path in (s.split("=", 1) for s in args.sources)}
    stamp, rows = results.utc_stamp(), []
    print(f"# kernel A/B, {stamp}; M = {args.m}; torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}")
    print("| format | threads | version (tiles) | ms/layer | spread | GB/s | % of bandwidth |")
    print("| --- | ---: | --- | ---: | --- | ---: | ---: |")
    for threads in args.threads:
        torch.set_num_threads(threads)
        bandwidth = cpu_decode.best_read(cpu_decode.bandwidth(args.rounds, threads))
        for name in args.formats:
            versions, nbytes = cases(libs, name, threads, args.m)
            for version, times in results.interleaved(versions, args.rounds).items():
                med, lo, hi = (t / cpu_decode.LAYERS for t in cpu_decode.stats(times))
                gbps = nbytes / med / 1e9
                rows.append(dict(format=name, m=args.m, threads=threads, version=version, ms=med * 1e3, min_ms=lo * 1e3,
                                 max_ms=hi * 1e3, gbps=gbps, bandwidth=bandwidth))  # fmt: skip
                print(f"| {name} | {threads} | {version} | {med * 1e3:.3f} | {lo * 1e3:.3f}-{hi * 1e3:.3f} | "
                      f"{gbps:.1f} | {gbps / bandwidth * 100:.0f}% |")  # fmt: skip
        print(f"(bandwidth, {threads} thread(s): {bandwidth:.1f} GB/s)")
    results.write_csv(Path(args.out) / "kernel_ab.csv", rows, {"date": stamp})


if __name__ == "__main__":
    main()
