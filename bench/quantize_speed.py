"""Weight quantization throughput per format, quantpass beside torchao, interleaved in one process.

    python bench/quantize_speed.py                      # 2048x4096 bf16 weight, 1 thread, 5 rounds
    python bench/quantize_speed.py --rows 4096 --cols 4096 --threads 2 --csv bench/out/quantize_speed.csv

quantpass: `qp.quantize(weight, weight key)` (the path the pass takes: every check and search
included). torchao: the same format through its public entry where one runs on CPU
(`quantize_(linear, IntxWeightOnlyConfig / Int8WeightOnlyConfig)`), else its quantization
primitives for that format (`to_mx`, `nvfp4_quantize`, `_quantize_affine_float8`); "-" where torchao
has no such format. Rounds are interleaved (A, B, A, B, ...) so a noisy machine slows both alike;
medians with the spread.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
from results import utc_stamp, write_csv  # bench/results.py (scripts run from bench/)

import quantpass as qp
from quantpass.quant_registry import keys

FORMATS = {  # format -> quantpass weight key
    "int8_per_channel": keys.kInt8StaticChannelSym,
    "int4_per_group": keys.kInt4StaticGroup128Sym,
    "fp8_per_channel": keys.kFp8StaticChannelSym,
    "fp8_per_tensor": keys.kFp8StaticTensorSym,
    "fp8_per_block": keys.kFp8Static128BlockSym,
    "mxfp8": keys.kMxfp8Static,
    "mxfp4": keys.kMxfp4Static,
    "nvfp4": keys.kNvfp4Static,
}


def torchao_quantizer(name: str, weight: torch.Tensor):
    """A zero-argument callable quantizing `weight` as torchao does for this format, or None."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.quant_primitives import _choose_scale_float8, _quantize_affine_float8

    def through_quantize_(config):
        def run():
            linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
            linear.weight.data = weight  # no copy: the timing is quantize_'s
            quantize_(torch.nn.Sequential(linear), config())

        return run

    def fp8(block):
        def run():
            scale = _choose_scale_float8(weight, list(block))
            _quantize_affine_float8(weight, scale)

        return run

    rows, cols = weight.shape
    return {
        "int8_per_channel": through_quantize_(Int8WeightOnlyConfig),
        "int4_per_group": through_quantize_(
            lambda: IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(128))
        ),
        "fp8_per_channel": fp8((1, cols)),
        "fp8_per_tensor": fp8((rows, cols)),
        "fp8_per_block": fp8((128, 128)),
        "mxfp8": lambda: to_mx(weight, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL),
        "mxfp4": lambda: to_mx(weight, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.RCEIL),
        "nvfp4": lambda: nvfp4_quantize(weight, 16, per_tensor_amax_to_scale(weight.abs().amax())),
    }.get(name)


def measure(weight: torch.Tensor, rounds: int) -> list[dict]:
    rows = []
    for name, key in FORMATS.items():
        runs = {"quantpass": lambda key=key: qp.quantize(weight, key)}
        if (theirs := torchao_quantizer(name, weight)) is not None:
            runs["torchao"] = theirs
        times = {provider: [] for provider in runs}
        for run in runs.values():  # warm-up (torchao's first call imports and registers)
            run()
        for _ in range(rounds):
            for provider, run in runs.items():
                start = time.perf_counter()
                run()
                times[provider].append(time.perf_counter() - start)
        row = {"format": name, "weights": weight.numel()}
        for provider, values in times.items():
            row[f"{provider}_ms"] = statistics.median(values) * 1e3
            row[f"{provider}_spread_ms"] = f"{min(values) * 1e3:.0f}-{max(values) * 1e3:.0f}"
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| format | quantpass Mweights/s (ms, spread) | torchao Mweights/s (ms, spread) | quantpass / torchao |",
        "| --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        ours = r["weights"] / r["quantpass_ms"] / 1e3
        theirs = "-" if "torchao_ms" not in r else r["weights"] / r["torchao_ms"] / 1e3
        ratio = "-" if theirs == "-" else f"{ours / theirs:.2f}x"
        theirs_cell = "-" if theirs == "-" else f"{theirs:.1f} ({r['torchao_ms']:.0f}, {r['torchao_spread_ms']})"
        lines.append(
            f"| {r['format']} | {ours:.1f} ({r['quantpass_ms']:.0f}, {r['quantpass_spread_ms']}) | {theirs_cell} | {ratio} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--csv", type=Path, default=Path("bench/out/quantize_speed.csv"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    weight = torch.randn(args.rows, args.cols, generator=torch.Generator().manual_seed(0)).to(
        getattr(torch, args.dtype)
    )
    rows = measure(weight, args.rounds)
    write_csv(args.csv, rows)
    stamp = utc_stamp()
    print(f"{stamp}, {platform.processor() or platform.machine()}, {args.threads} thread(s), "
          f"{args.rows}x{args.cols} {args.dtype} weight, {args.rounds} interleaved rounds")  # fmt: skip
    print(table(rows))


if __name__ == "__main__":
    main()
