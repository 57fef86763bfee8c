"""Model benchmark: speed, memory and accuracy of each format on a whole model, in one process.

    python bench/model_bench.py --model dense --formats fp8_per_channel,int8_per_channel,int8_weight_only,int4_weight_only,mxfp8
    python bench/model_bench.py --model /path/to/checkpoint --device cuda --out $OUT

For a preset (quantpass.presets: small models trained on a synthetic language) or a local
transformers checkpoint, and a list of formats, it measures with `quantpass.measure` (the numbers
`quantpass run` prints): compile time, weight bytes, resident weight memory, logits agreement with
the unquantized model, prefill and greedy-generation tokens/s. Every ratio is against the
unquantized model compiled with Inductor in the same process, timed in alternating rounds.
Then a compile-time study: plain Inductor vs quantpass, alternating, after one untimed compile of
each, with Inductor's FX graph cache off and warm (`compile_study`).

Writes <out>/model_<name>.csv, <out>/model_<name>_compile.csv and <out>/model_<name>.png.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import warnings
from pathlib import Path

import torch
import torch._inductor.config  # config.patch below; torch imports Inductor lazily
from results import write_csv  # bench/results.py (scripts run from bench/)

from quantpass.backend import backend as quantpass_backend
from quantpass.measure import SEQUENCE_DIM, measure, quantized_copy, time_side_by_side, timed
from quantpass.presets import PRESETS, load_model, unique_parameters
from quantpass.quant_registry.spec import QuantizationConfig
from quantpass.report import comparison, kernels_used, layers_quantized, table

DEFAULT_FORMATS = "fp8_per_channel,int8_per_channel,int8_weight_only,int4_weight_only,mxfp8"
BF16_BYTES = 2
CACHE_MODES = {"fx graph cache off": False, "fx graph cache warm": True}


def bf16_bytes(model: torch.nn.Module) -> int:
    """The model's parameter bytes if it were stored in bf16 (the baseline the byte targets use)."""
    return sum(p.numel() for p in unique_parameters(model)) * BF16_BYTES


def quantized_layer_bytes(plan) -> tuple[int, int]:
    """(quantized bytes, unquantized bytes in the model's dtype) of the quantized sites, each once."""
    sites = {row.fqn: row for row in plan.quantized()}.values()
    return sum(r.bytes for r in sites), sum(r.original_bytes for r in sites)


def format_row(model, baseline, result, model_itemsize: int) -> dict:
    compared = comparison(baseline, result)
    quantized, original = quantized_layer_bytes(result.plan)
    return {
        "format": result.name,
        "layers_quantized": layers_quantized(result.plan),
        "kernels": kernels_used(result.plan),
        "compile_s": result.compile_seconds,
        "prefill_tok_s": result.prefill_tokens_per_second,
        "prefill_speedup": compared["prefill_speedup"],
        "prefill_speedup_range": "-".join(f"{r:.2f}" for r in compared["prefill_speedup_range"]),
        "generate_tok_s": result.generate_tokens_per_second,
        "generate_speedup": compared["generate_speedup"],
        "generate_speedup_range": "-".join(f"{r:.2f}" for r in compared["generate_speedup_range"]),
        "logits_cosine": compared["cosine"],
        "top1_agreement": compared["top1_agreement"],
        "weight_bytes": result.weight_bytes,
        "resident_bytes": result.resident_bytes,
        "resident_vs_unquantized": compared["resident_bytes_ratio"],
        "model_bytes_vs_bf16": result.weight_bytes / bf16_bytes(model),
        "quantized_layers_bytes_vs_bf16": quantized / (original / model_itemsize * BF16_BYTES),
    }


def baseline_row(baseline) -> dict:
    return {
        "format": "unquantized",
        "compile_s": baseline.compile_seconds,
        "prefill_tok_s": baseline.prefill_tokens_per_second,
        "prefill_speedup": 1.0,
        "generate_tok_s": baseline.generate_tokens_per_second,
        "generate_speedup": 1.0,
        "logits_cosine": 1.0,
        "top1_agreement": 1.0,
        "weight_bytes": baseline.weight_bytes,
        "resident_bytes": baseline.resident_bytes,
    }


def compile_seconds(model, ids, backend) -> tuple[float, float]:
    """(first call, first call minus a second one) of a fresh `torch.compile`: the first is Dynamo +
    passes + lowering + one forward; the second subtracts the forward, which quantized kernels can
    make slow on CPU (the cpu backend's INT4 kernel with fp32 activations: ~25 ms a call)."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    prompt = ids.clone()
    torch._dynamo.mark_dynamic(prompt, SEQUENCE_DIM)
    with torch.no_grad():
        first = timed(compiled, prompt)[1]
        return first, first - timed(compiled, prompt)[1]


def compile_study(model, ids, formats: list[str], repeats: int) -> list[dict]:
    """Plain Inductor vs quantpass per format: one untimed compile of each, then `repeats` timed
    rounds, compilers interleaved so machine load hits them alike; medians per compiler."""
    compilers = {"inductor": "inductor"} | {
        f"quantpass {name}": quantpass_backend(QuantizationConfig(linear=name, moe=name)) for name in formats
    }
    rows = []
    for mode, fx_graph_cache in CACHE_MODES.items():
        with torch._inductor.config.patch(fx_graph_cache=fx_graph_cache):
            samples = {label: [] for label in compilers}
            for round_ in range(repeats + 1):
                for label, backend in compilers.items():
                    seconds = compile_seconds(model, ids, backend)
                    if round_:  # round 0 warms the process (and the cache, where it is on)
                        samples[label].append(seconds)
        plain = [statistics.median(column) for column in zip(*samples["inductor"])]
        for label, pairs in samples.items():
            first, compile_only = (statistics.median(column) for column in zip(*pairs))
            rows.append(
                {
                    "cache": mode,
                    "compiler": label,
                    "first_call_s": first,
                    "first_call_vs_inductor": first / plain[0],
                    "compile_only_s": compile_only,
                    "compile_only_vs_inductor": compile_only / plain[1],
                    "first_call_samples_s": " ".join(f"{first:.2f}" for first, _ in pairs),
                }
            )
    return rows


def plot(path: Path, rows: list[dict], title: str) -> None:
    """Speed-up vs unquantized (prefill, generation) against the logits' cosine distance, one point
    per format (log scale: 8-bit formats sit near 1e-4, 4-bit ones near 1e-2)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for axis, key, label in zip(axes, ("prefill_speedup", "generate_speedup"), ("prefill", "generation")):
        for row in rows:
            distance = max(1 - row["logits_cosine"], 1e-7)
            axis.scatter(row[key], distance, s=50, label=row["format"])
        axis.axvline(1.0, color="grey", lw=0.8, ls="--")
        axis.set_xlabel(f"{label} tokens/s vs unquantized (x, right is faster)")
        axis.set_yscale("log")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("1 - logits cosine vs unquantized (lower is more accurate)")
    axes[1].legend(fontsize=8, loc="best")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def print_tables(rows: list[dict], compile_rows: list[dict], markdown: bool) -> None:
    headers = ["format", "layers", "kernels", "compile s", "prefill tok/s", "vs unq.", "generate tok/s", "vs unq.",
               "cosine", "top-1", "model bytes vs bf16", "quantized layers vs bf16"]  # fmt: skip
    lines = [
        [r["format"], r.get("layers_quantized", "-"), r.get("kernels", "-"), f"{r['compile_s']:.1f}",
         f"{r['prefill_tok_s']:.0f}", f"{r['prefill_speedup']:.2f}x", f"{r['generate_tok_s']:.1f}",
         f"{r['generate_speedup']:.2f}x", f"{r['logits_cosine']:.4f}", f"{100 * r['top1_agreement']:.1f}%",
         f"{r['model_bytes_vs_bf16']:.3f}x", f"{r.get('quantized_layers_bytes_vs_bf16', 1.0):.3f}x"]
        for r in rows
    ]  # fmt: skip
    print(table(headers, lines, markdown), end="\n\n")
    if not compile_rows:
        return
    lines = [
        [r["cache"], r["compiler"], f"{r['first_call_s']:.2f}", f"{r['first_call_vs_inductor']:.2f}x",
         f"{r['compile_only_s']:.2f}", f"{r['compile_only_vs_inductor']:.2f}x", r["first_call_samples_s"]]
        for r in compile_rows
    ]  # fmt: skip
    headers = ["Inductor cache", "compiler", "first call s", "vs Inductor", "minus a forward s", "vs Inductor",
               "first-call samples s"]  # fmt: skip
    print(table(headers, lines, markdown))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="dense", help=f"a preset ({', '.join(PRESETS)}) or a checkpoint dir")
    parser.add_argument("--formats", default=DEFAULT_FORMATS, help="comma-separated format names")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: presets' per device)")
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds, unquantized and quantized alternating")
    parser.add_argument("--compile-formats", default="int8_weight_only,fp8_per_channel",
                        help="formats in the compile-time study ('' skips it)")  # fmt: skip
    parser.add_argument("--compile-repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or Path(__file__).parent / "out"))
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)

    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    model = loaded.model
    parameter = next(model.parameters())
    ids = loaded.prompt(args.prompt_length)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    print(f"{loaded.description}; prompt {args.prompt_length} tokens, {args.new_tokens} generated; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)  # fmt: skip

    # Every compile lowers from scratch (a cached graph would make the baseline's compile time
    # incomparable); one untimed compile first: the process's first Inductor compile is ~10 s slower.
    with torch._inductor.config.patch(fx_graph_cache=False):
        compile_seconds(model, ids, "inductor")  # untimed
        baseline = measure(model, ids, None, new_tokens=args.new_tokens)
        rows, failed = [], {}
        for name in formats:
            print(f"measuring {name}", flush=True)
            try:
                config = QuantizationConfig(linear=name, moe=name)
                result = measure(quantized_copy(model), ids, config, name, new_tokens=args.new_tokens)
            except Exception as e:  # a format this device can't run: report it, measure the others
                failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                print(f"  {name} failed: {failed[name]}", flush=True)
                continue
            timed_baseline, result = time_side_by_side([baseline, result], ids, rounds=args.rounds)
            result.forward = None  # the quantized copy may go
            if not rows:  # the unquantized row: its timings from the first format's rounds
                bf16_ratio = baseline.weight_bytes / bf16_bytes(model)
                rows.append({**baseline_row(timed_baseline), "model_bytes_vs_bf16": bf16_ratio})
            rows.append(format_row(model, timed_baseline, result, parameter.element_size()))
    study_formats = [f.strip() for f in args.compile_formats.split(",") if f.strip()]
    compile_rows = compile_study(model, ids, study_formats, args.compile_repeats) if study_formats else []

    stem = f"model_{Path(loaded.name).name}"
    header = {
        "date": datetime.date.today().isoformat(),
        "model": loaded.name,
        "dtype": str(parameter.dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name() if parameter.is_cuda else platform.processor() or "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    written = [f"{stem}.csv", f"{stem}.png"] + [f"{stem}_compile.csv"] * bool(compile_rows)
    write_csv(args.out / written[0], rows, header)
    if compile_rows:
        write_csv(args.out / written[2], compile_rows, header)
    title = f"{loaded.description}; {header['date']}, torch {torch.__version__}, {header['threads']} threads"
    plot(args.out / written[1], rows[1:], title)
    print_tables(rows, compile_rows, args.markdown)
    for name, why in failed.items():
        print(f"{name}: not measured: {why}")
    print(f"\nwrote {', '.join(str(args.out / name) for name in written)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
