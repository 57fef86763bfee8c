"""Sweep fused-MoE launch configs on the GPU present; write the winners as a config file (`tuning.py`).

    python -m quantpass.kernels.triton.tune_moe --experts 64 --top-k 8 --hidden 4096 \\
        --intermediate 1536 --format fp8_per_channel --tokens 1,16,64,256,1024,4096 --out DIR

Per token count, every candidate config (`candidates`: block sizes around the rows each expert gets,
8 or 4 warps, 3 or 4 stages) runs the whole fused MoE (both GEMMs, activation quantization, routing)
on random routing; the fastest median of `triton.testing.do_bench` wins, and the file records the
device, date, shape and each winner's time next to the default config's. `--budget-s` stops the
sweep early (the token counts done so far are written). Needs CUDA.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

from . import tuning
from .scheme import ScaleMode, gemm_scheme

BLOCK_N = (64, 128, 256)
LAUNCH = ((4, 3), (8, 3), (8, 4))  # (num_warps, num_stages)


def candidates(tokens: int, num_experts: int, top_k: int, scheme) -> list[dict]:
    """Configs worth timing at this token count: BLOCK_M near the rows per expert (tl.dot's 16 at
    least), each BLOCK_N, BLOCK_K 128 (the block-FP8 group), grouped launch unless BLOCK_M is 16."""
    rows = tokens * top_k / max(num_experts, 1)
    block_ms = sorted({bm for bm in (16, 32, 64, 128) if bm <= max(16, 2 * rows)})[-2:]
    out = []
    for block_m in block_ms:
        for block_n in BLOCK_N:
            for warps, stages in LAUNCH:
                group = 1 if block_m == 16 else 16
                config = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, GROUP_M=group, num_warps=warps, num_stages=stages)  # fmt: skip
                out.append(tuning.fit_block_k(config, scheme))
    return out


def sweep(experts, top_k, hidden, intermediate, format_name, token_counts, budget_s, log=print) -> dict:
    """{tokens: (best config, its ms, the default config's ms)} for the token counts done in budget."""
    import triton.testing

    from ...moe_problem import GatedActivation, GateUpLayout, MoEActivation, MoEProblem
    from ...quant_registry import formats
    from ...quant_registry.spec import QuantSpec
    from .moe import fused_moe

    spec = QuantSpec.coerce(format_name, "format")
    scheme = gemm_scheme(spec.weight, spec.activation)
    if isinstance(scheme, str):
        raise ValueError(scheme)
    torch.manual_seed(0)
    w13 = formats.quantize(torch.randn(experts, 2 * intermediate, hidden, device="cuda") * 0.02, spec.weight)
    w2 = formats.quantize(torch.randn(experts, hidden, intermediate, device="cuda") * 0.02, spec.weight)
    start, results = time.perf_counter(), {}
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        weights, ids = torch.randn(tokens, experts, device="cuda").softmax(-1).topk(top_k, dim=-1)
        gated = GatedActivation(MoEActivation.SILU, GateUpLayout.CONCAT)
        problem = MoEProblem(x, weights, ids, w13, w2, gated, activation_key=spec.activation)

        def run(config, problem=problem):
            return lambda: fused_moe(problem, config=config)

        default_ms = triton.testing.do_bench(
            run(tuning.default_moe_config(tokens, experts, top_k, scheme, tuning.target_sm()))
        )
        best = (None, float("inf"))
        for config in candidates(tokens, experts, top_k, scheme):
            if time.perf_counter() - start > budget_s:
                log(f"budget of {budget_s} s spent: stopping at T={tokens}")
                return results
            try:
                ms = triton.testing.do_bench(run(config))
            except Exception as e:  # out of shared memory or registers: not a candidate here
                log(f"  T={tokens} {config}: {type(e).__name__}")
                continue
            if ms < best[1]:
                best = (config, ms)
        if best[0] is not None:
            results[tokens] = (best[0], best[1], default_ms)
        log(f"T={tokens}: {best[0]} {best[1]:.4f} ms (default config {default_ms:.4f} ms)")
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--format", default="fp8_per_channel")
    parser.add_argument("--tokens", default="1,16,64,256,1024,4096")
    parser.add_argument("--budget-s", type=float, default=200.0)
    parser.add_argument("--out", type=Path, default=tuning.CONFIG_DIR)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_moe needs a CUDA device")
        return 2
    tokens = [int(t) for t in args.tokens.split(",")]
    results = sweep(args.experts, args.top_k, args.hidden, args.intermediate, args.format, tokens, args.budget_s)
    if not results:
        return 1
    from ...quant_registry.spec import QuantSpec

    spec = QuantSpec.coerce(args.format, "format")
    scheme = gemm_scheme(spec.weight, spec.activation)
    block = scheme.b_group if scheme.b_scale == ScaleMode.BLOCK else None
    name = tuning.config_file_name(args.experts, args.intermediate, tuning.device_name(), scheme.name, block)
    timings = ", ".join(f"T={t}: {ms:.4f} ms vs default {base:.4f} ms" for t, (_, ms, base) in results.items())
    source = (
        f"tune_moe sweep on {torch.cuda.get_device_name()}, {datetime.date.today().isoformat()}, torch "
        f"{torch.__version__}: E={args.experts} top-{args.top_k} H={args.hidden} I={args.intermediate} "
        f"{args.format}, median of triton.testing.do_bench per config; {timings}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    tuning.write_moe_configs(args.out / name, {t: config for t, (config, _, _) in results.items()}, source)
    print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
