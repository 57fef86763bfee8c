"""MoE at decode on CPU (issue 18: the cpu backend's kernels serve the MoE experts at decode): one MoE
layer at T=1 against its experts' kernels alone, and a MoE model's 1-token forward, 1 and 2 threads.

    python bench/cpu_moe_decode.py                      # both parts, INT4 and INT8, 1 and 2 threads
    python bench/cpu_moe_decode.py --parts layer --threads 1 --rounds 21
    python bench/cpu_moe_decode.py --formats fp8_weight_only fp8_per_block mxfp4   # other formats' one call

Method. Layer: Qwen3-30B-A3B's expert shapes (hidden 2048, expert intermediate 768, top 8) with 64
experts (the model has 128; 64 keep quantizing quick and are 151 MiB as INT4, 302 MiB as INT8, over
the 48 MB L3, so the routed experts come from DRAM), bf16 activations, one token; 8 routings (each the
top 8 of 64 at random) used in rotation. Cases, each once per round, rounds interleaved, median and
spread (min-max) over rounds, wall time: the routed experts' 16 GEMMs as two C calls
(csrc/bench_probes.c, no Python between the GEMMs: the kernels' own time, "kernels alone"); the graph
op a compiled graph calls, eager (`cpu.graph_moe_op`: the C++ op where it builds); the Python graph op
(`quantpass::fused_moe_cpu`); the per-expert loop with the same kernels (`reference.fused_moe` with
the cpu backend's matmul: what the backend ran before 2026-12-02 for INT8/INT4 weight-only, and before
2026-12-02 08:00 UTC for the others). The other formats, by their quantpass names (`ONE_CALL`):
INT8 W8A8 (`int8_per_channel`: its kernels alone take the activations unquantized), FP8 weight-only,
FP8 per 128x128 block with per-1x128 dynamic activations (`fp8_per_block`), MXFP8 W8A8, MXFP4 and
NVFP4 weight-only. The FP kernels have no C entry taking several layers, so in place of "kernels
alone" their 16 expert GEMMs are timed as a Python call each (`cpu_fp8.linear`, `cpu_fp4.linear`: the
kernels plus ~20-40 us of Python and ctypes per call). GB/s counts the routed experts' quantized
weights and scales once. Model: `Qwen3MoeForCausalLM` (hidden 2048, 32 experts of 768, top
8, 2 layers, 16/4 attention heads, vocab 1024), bf16, one token, no cache, compiled three ways:
quantpass (linears and experts in the format), torchao (INT8 and INT4: `quantize_` with the same
config as cpu_decode.py: it quantizes `nn.Linear` layers, so the experts, 3-D parameters, stay bf16;
lm_head left in bf16 by both) or, for the FP formats, the same compiled quantpass model with each MoE
layer as the per-expert loop (`cpu._moe_on_our_kernels` refusing, so the Python graph op runs the
loop), and plain Inductor in bf16.

Writes `cpu_moe_decode.csv` to --out (default $OUT or bench/out/) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import unittest.mock
from pathlib import Path

import cpu_decode  # bench/cpu_decode.py: the bandwidth probe, the kernels-alone call, torchao's configs
import results  # bench/results.py (scripts run from bench/)
import torch

import quantpass as qp
from quantpass.kernels import cpu, cpu_avx2, reference
from quantpass.moe_problem import GatedActivation, MoEProblem
from quantpass.quant_registry import formats
from quantpass.quant_registry.named_formats import SHORTHANDS

HIDDEN, INTER, EXPERTS, TOP_K, ROUTINGS = 2048, 768, 64, 8, 8
KERNELS_ALONE, GEMM_CALLS, GRAPH_OP, PYTHON_OP, LOOP = (
    "kernels alone (16 GEMMs, two C calls)",
    "16 expert GEMMs, a Python call each",
    "graph op (what compiled graphs call)",
    "Python graph op (quantpass::fused_moe_cpu)",
    "per-expert loop (before 2026-12-02)",
)
LOOP_MODEL = "quantpass, MoE layers as the per-expert loop"
# the formats: cpu_decode.py's INT8 and INT4 (weight-only; the model part against torchao), and by their
# quantpass names the other pairs a MoE layer runs in one call on CPU (the model part against the
# per-expert loop where the layer goes through the Python graph op)
ONE_CALL = (
    "int8_per_channel",
    "fp8_weight_only",
    "fp8_per_tensor",
    "fp8_per_block",
    "mxfp8",
    "mxfp4",
    "nvfp4_weight_only",
)
KEYS = {**{name: (key, None) for name, (_, key) in cpu_decode.FORMATS.items()}, **{n: SHORTHANDS[n] for n in ONE_CALL}}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["layer", "model"], choices=["layer", "model"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--formats", nargs="+", default=list(cpu_decode.FORMATS), choices=list(KEYS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "out"))
    return parser.parse_args()


def experts(name: str):
    """64 experts' w13 [E, 2I, H] and w2 [E, H, I], quantized and prepared for the cpu backend."""
    key = KEYS[name][0]
    gen = torch.Generator().manual_seed(0)
    w13 = formats.quantize(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5, key)
    w2 = formats.quantize(torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5, key)
    return cpu.prepare_moe_weights(w13, w2, "concat")


def layer_cases(name: str, w13, w2, threads: int) -> tuple[dict, int]:
    """{case: one call per routing in turn}, and the bytes one call's routed experts hold."""
    key, act = KEYS[name]
    gen = torch.Generator().manual_seed(1)
    problems = []
    for _ in range(ROUTINGS):
        ids = torch.randperm(EXPERTS, generator=gen)[:TOP_K][None]
        weights = torch.rand(1, TOP_K, generator=gen).softmax(-1).bfloat16()
        hidden = torch.randn(1, HIDDEN, generator=gen).bfloat16()
        problems.append(MoEProblem(hidden, weights, ids, w13, w2, GatedActivation("silu", "concat"), act))
    x13, x2 = torch.randn(1, HIDDEN).bfloat16(), torch.randn(1, INTER).bfloat16()
    o13, o2 = torch.empty(1, 2 * INTER), torch.empty(1, HIDDEN)
    family, alone = cpu.FORMAT_KERNELS.get(key), []
    for p in problems:
        routed = p.topk_ids[0].tolist()
        if family is not None:  # a Python call per expert GEMM (no C entry takes several layers)
            experts13, experts2 = [w13[e] for e in routed], [w2[e] for e in routed]
            alone.append(
                [
                    lambda a=experts13, b=experts2: [
                        family.linear(x, w, act) for x, ws in ((x13, a), (x2, b)) for w in ws
                    ]
                ]
            )
            continue
        bits, mode = cpu.BITS[key], cpu_avx2.MODES[cpu.ACTIVATION_MODES[key][0]]
        first = cpu_decode.kernel_alone(x13, [w13[e] for e in routed], [o13] * TOP_K, bits, mode, threads)
        second = cpu_decode.kernel_alone(x2, [w2[e] for e in routed], [o2] * TOP_K, bits, mode, threads)
        alone.append((first, second))
    graph_op, python_op = cpu.graph_moe_op("cpu"), torch.ops.quantpass.fused_moe_cpu.default
    args = [(p.hidden, p.topk_weights, p.topk_ids, w13.data, w13.scale, w13.scale2, w2.data, w2.scale, w2.scale2, None, None,
             None, str(key), "" if act is None else str(act), "cpu", "silu", "concat", False, INTER, 0.0, 0.0) for p in problems]  # fmt: skip

    def each(fn):
        return lambda: [fn(i) for i in range(ROUTINGS)]

    cases = {
        (KERNELS_ALONE if family is None else GEMM_CALLS): each(lambda i: [run() for run in alone[i]]),
        GRAPH_OP: each(lambda i: graph_op(*args[i])),
        PYTHON_OP: each(lambda i: python_op(*args[i])),
        LOOP: each(lambda i: reference.fused_moe(problems[i], expert_matmul=cpu._expert_matmul)),
    }
    for i, p in enumerate(problems):  # every case computes the same layer (up to the activation's last bits)
        ours, loop = graph_op(*args[i]).float(), reference.fused_moe(p, expert_matmul=cpu._expert_matmul).float()
        assert torch.allclose(ours, loop, rtol=1e-2, atol=1e-2), (ours - loop).abs().max()
    per_expert = (w13.nbytes + w2.nbytes) // EXPERTS
    return cases, per_expert * TOP_K


def qwen3_moe(name: str) -> dict:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(hidden_size=HIDDEN, intermediate_size=5632, moe_intermediate_size=INTER, num_experts=32,
                            num_experts_per_tok=TOP_K, num_hidden_layers=2, num_attention_heads=16,
                            num_key_value_heads=4, head_dim=128, vocab_size=1024, max_position_embeddings=256,
                            decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, experts_implementation="grouped_mm").to(torch.bfloat16).eval()
    fmt = cpu_decode.FORMATS[name][0] if name in cpu_decode.FORMATS else name
    plain = torch.compile(copy.deepcopy(model))  # quantpass releases the weights of the model it compiles
    theirs = torch.compile(cpu_decode.torchao_quantized(model, name, skip="lm_head")) if fmt != name else None
    ours = torch.compile(model, backend=qp.backend(linear=fmt, moe=fmt, backend="cpu"))
    ids = torch.randint(0, 1024, (1, 1))
    cases = {"quantpass (linears + experts)": lambda: ours(ids, use_cache=False).logits}
    if theirs is not None:
        cases["torchao (linears; experts bf16)"] = lambda: theirs(ids, use_cache=False).logits
    elif KEYS[name][0] in cpu.FORMAT_KERNELS:  # its C++ graph op hands the layer to the Python one

        def loop():  # the same compiled model, each MoE layer as the per-expert loop (the one call refused)
            with unittest.mock.patch.object(cpu, "_moe_on_our_kernels", lambda *args: None):
                return ours(ids, use_cache=False).logits

        cases[LOOP_MODEL] = loop
    cases["bf16 (plain Inductor)"] = lambda: plain(ids, use_cache=False).logits
    return cases


def main() -> None:
    args = parse_args()
    stamp = results.utc_stamp()
    machine = f"{platform.processor() or platform.machine()}, torch {torch.__version__}"
    print(f"# MoE at decode, {stamp}; {machine}; load average {os.getloadavg()[0]:.1f}")
    rows = []
    weights = {name: experts(name) for name in args.formats} if "layer" in args.parts else {}
    with torch.no_grad():
        for threads in args.threads:
            torch.set_num_threads(threads)
            torch._dynamo.reset()
            if "layer" in args.parts:
                bandwidth = cpu_decode.best_read(cpu_decode.bandwidth(5, threads))
                print(f"\n## layer, {threads} thread(s), bandwidth {bandwidth:.2f} GB/s")
                print("| format | case | ms (median) | spread | GB/s | % of bandwidth | vs the first case |")
                print("| --- | --- | --- | --- | --- | --- | --- |")
                for name in args.formats:
                    cases, nbytes = layer_cases(name, *weights[name], threads)
                    times = cpu_decode.interleaved(cases, args.rounds)
                    alone = statistics.median(next(iter(times.values())))  # kernels alone, or their calls
                    for case, samples in times.items():
                        med, lo, hi = (t / ROUTINGS for t in cpu_decode.stats(samples))
                        gbps = nbytes / med / 1e9
                        ratio = med * ROUTINGS / alone
                        rows.append(dict(part="layer", threads=threads, format=name, case=case, ms=med * 1e3,
                                         min_ms=lo * 1e3, max_ms=hi * 1e3, gbps=gbps, pct=gbps / bandwidth * 100,
                                         vs_alone=ratio))  # fmt: skip
                        print(f"| {name} | {case} | {med * 1e3:.3f} | {lo * 1e3:.3f}-{hi * 1e3:.3f} | {gbps:.2f} | "
                              f"{gbps / bandwidth * 100:.0f}% | {ratio:.2f}x |")  # fmt: skip
            if "model" in args.parts:
                for name in args.formats:
                    times = cpu_decode.interleaved(qwen3_moe(name), args.rounds)
                    med = {case: statistics.median(ts) for case, ts in times.items()}
                    ours = med["quantpass (linears + experts)"]
                    for case, samples in times.items():
                        m, lo, hi = cpu_decode.stats(samples)
                        rows.append(dict(part="model", threads=threads, format=name, case=case, ms=m * 1e3,
                                         min_ms=lo * 1e3, max_ms=hi * 1e3, vs_quantpass=m / ours))  # fmt: skip
                    print(f"\nQwen3-MoE 2048x2 1-token forward {name}, {threads} thread(s): " + ", ".join(
                        f"{case} {m * 1e3:.1f} ms ({m / ours:.2f}x)" for case, m in med.items()))  # fmt: skip
    path = Path(args.out) / "cpu_moe_decode.csv"
    results.write_csv(path, rows, {"date": stamp})
    print(f"\n{path}; load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
