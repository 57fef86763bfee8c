"""Process memory of a quantized model: one fresh process per mode, RSS measured by the kernel.

    python bench/memory.py                      # the default table (Llama-style, hidden 1024, 6 layers, bf16)
    python bench/memory.py --modes none int8_weight_only --hidden 512 --layers 2 --csv bench/out/memory.csv
    python bench/memory.py --arch llama4 --modes none int8_weight_only   # MoE: Llama 4's experts (moe slot too)

Per mode, a child process imports everything, compiles a throwaway 64x64 linear with the mode's
format (so its kernels' one-time costs, libraries and tables, fall before the baseline as INT8's
always did; in the tables before 2026-12-01 20:31 UTC every mode warmed with INT8), builds the model
from a seeded config (nothing downloaded) and then compiles and runs it once (`lowering="aot_eager"`
unless `--lowering` says otherwise: Inductor's own memory would blur the weights', but it is what
users run). Under `--lowering inductor` each mode runs twice in a new, empty Inductor cache of its own
(`TORCHINDUCTOR_CACHE_DIR`): the first child compiles everything (*cold cache* columns), the second
finds its graphs there (the main columns: every run after a model's first). Every mode, the
unquantized one too, is then measured in the same cache state; with the user's cache shared by all
modes, a mode whose graphs were cached and one whose graphs were not differ by the compile's own
memory. Columns:
- *weights MiB*: RSS after the first call minus RSS just before the model was built, minus what the
  `none` mode (unquantized, same compile) holds beyond its parameter bytes (activations, compiled
  code): what the weights cost the process, the issue's "minus a weightless model of the same shape".
- *peak MiB*: the process's peak RSS (VmHWM) during the compile and first call, minus RSS before build.
- *accounted MiB*: the bytes quantpass can name: parameter storages still allocated + its weight cache.
- *vs bf16*: weights MiB / the bf16 parameter bytes (three decimals: the 4-bit target is 0.32x, and
  runs of one mode differ by ~0.5 MiB).
- *live MiB*: the same as *weights MiB* after `malloc_trim(0)` (glibc hands back the free pages it
  keeps): what is really allocated. The gap is heap pages that per-call temporaries made resident
  again after the build trimmed them (bench/README.md, "Memory").

Modes `load:FORMAT` measure quantize-on-load instead: the parent saves the same model as a bf16
checkpoint (`save_pretrained`, a temporary directory) and the child loads it with
`qp.from_pretrained(dir, linear=FORMAT)`: *peak MiB* of loading above RSS before it, *held MiB* (the
quantized weights + the tensors left unquantized), the largest decoder layer's bf16 bytes, and the
issue's target peak <= held + largest layer; then one compiled call (`aot_eager`) and RSS after it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from results import utc_stamp, write_csv  # bench/results.py (scripts run from bench/)

MODES = ["none", "int8_weight_only", "int4_weight_only", "fp8_per_channel", "mxfp4", "nvfp4", "int8_weight_only+keep"]
LOAD_MODES = ["load:int8_weight_only", "load:int4_weight_only", "load:nvfp4"]
CHILD = r"""
import ctypes, gc, json, sys, torch, transformers, quantpass as qp
from quantpass.weight_cache import WEIGHTS

def rss():  # resident set and its peak, bytes
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024

mode, hidden, layers, threads, vocab, lowering, arch = sys.argv[1], *map(int, sys.argv[2:6]), *sys.argv[6:8]
torch.set_num_threads(threads)
if arch == "llama4":  # every layer MoE: 8 experts held in 3-D weights, run by bmm over all of them (top-1)
    config = transformers.Llama4TextConfig(hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=layers,
        intermediate_size_mlp=hidden * 2, num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=1,
        num_attention_heads=16, num_key_value_heads=4, head_dim=hidden // 16, vocab_size=vocab,
        max_position_embeddings=256)
else:
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4, vocab_size=vocab,
        max_position_embeddings=256)
ids = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(0))
# warm the compile machinery and the mode's own kernels on a throwaway model: one-time costs (kernel
# libraries, lookup tables, the code pages their ops touch) are not the weights'. The unquantized mode
# warms with INT8 (it runs none of them).
warm = mode.partition("+")[0] if mode != "none" else "int8_weight_only"
with torch.no_grad():
    torch.compile(torch.nn.Linear(64, 64), backend=qp.backend(linear=warm, lowering=lowering))(torch.randn(2, 64))
torch._dynamo.reset()
before, _ = rss()
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
built, _ = rss()
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM: the peak below is the compile's
name, _, keep = mode.partition("+")
options = {"lowering": lowering} if name == "none" else {"linear": name, "lowering": lowering, "keep_original_weights": bool(keep)}
if name != "none" and arch == "llama4":
    options["moe"] = name
with torch.no_grad():
    torch.compile(model, backend=qp.backend(**options))(ids)
after, peak = rss()
held = sum(p.untyped_storage().nbytes() for p in {id(p): p for p in model.parameters()}.values())
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
print(json.dumps({"mode": mode, "before": before, "built": built, "after": after, "peak": peak, "live": rss()[0],
                  "param_bytes": param_bytes, "accounted": held + WEIGHTS.nbytes()}))
"""
LOAD_CHILD = r"""
import json, sys, torch, quantpass as qp
from quantpass.checkpoints import load, shards
from quantpass.weight_cache import WEIGHTS

def rss():  # resident set and its peak, bytes
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024

mode, path, threads, vocab, lowering = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
fmt = mode.split(":", 1)[1]
torch.set_num_threads(threads)
load._build(path, None)  # imports the model's modules: not part of loading
qp.quantize(torch.randn(64, 256), qp.QuantSpec.from_name(fmt).weight)
before, _ = rss()
open("/proc/self/clear_refs", "w").write("5")  # the peak below is the load's
model = qp.from_pretrained(path, linear=fmt)
loaded, peak = rss()
unquantized = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])
# a released parameter keeps its shape and dtype: the decoder layer's bytes as stored
largest_layer = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model.model.layers)
ids = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    torch.compile(model, backend=qp.backend(lowering=lowering))(ids)
print(json.dumps({"mode": mode, "before": before, "loaded": loaded, "peak": peak, "after": rss()[0],
                  "held": WEIGHTS.nbytes() + unquantized, "largest_layer": largest_layer,
                  "checkpoint": sum(e.nbytes for e in shards.index(path).values())}))
"""


SAVE = r"""
import sys, torch, transformers
hidden, layers, vocab, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
    num_attention_heads=16, num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=256)
torch.manual_seed(0)
transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
"""


def _child(args: list[str], what: str, env: dict | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True, timeout=1800, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-3000:]}")
    lines = done.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


def measure(
    mode: str, hidden: int, layers: int, threads: int, vocab: int, lowering: str, checkpoint=None, arch="llama"
) -> dict:
    """One child's figures; under Inductor two children sharing a new, empty Inductor cache: the first
    compiles everything (a cold cache: `cold_*` figures), the second finds its graphs there (a warm cache,
    every later run: the main figures)."""
    if mode.startswith("load:"):
        args = [LOAD_CHILD, mode, checkpoint, str(threads), str(vocab), lowering]
    else:
        args = [CHILD, mode, str(hidden), str(layers), str(threads), str(vocab), lowering, arch]
    if lowering != "inductor":
        return _child(args, f"mode {mode}")
    with tempfile.TemporaryDirectory(prefix="quantpass-inductor-cache-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        cold = _child(args, f"mode {mode}, cold Inductor cache", env)
        warm = _child(args, f"mode {mode}, warm Inductor cache", env)
    return {**warm, **{f"cold_{key}": cold[key] for key in ("before", "after", "live", "peak")}}


def held(rows: list[dict], prefix: str = "") -> dict[str, tuple[float, float]]:
    """{mode: (weights, live)} bytes from the `prefix`ed figures ("", or "cold_" under Inductor): what a
    mode's process grew by up to its first call, less what the unquantized mode grew by beyond its
    parameter bytes (activations, compiled code)."""
    base = next((r for r in rows if r["mode"] == "none"), None)

    def grown(r, what):
        return r[prefix + what] - r[prefix + "before"]

    def extra(what):
        return 0 if base is None else grown(base, what) - base["param_bytes"]

    return {r["mode"]: (grown(r, "after") - extra("after"), grown(r, "live") - extra("live")) for r in rows}


def table(rows: list[dict]) -> str:
    mib = 2**20
    rows = [r for r in rows if not r["mode"].startswith("load:")]
    base = next((r for r in rows if r["mode"] == "none"), None)
    cold = held(rows, "cold_") if all("cold_after" in r for r in rows) else None
    lines = [
        "| mode | weights MiB | vs bf16 | live MiB | live vs bf16 | peak MiB (compile + first call) | peak vs none "
        "| accounted MiB |" + (" cold cache: weights MiB | vs bf16 |" if cold else ""),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if cold else ""),
    ]
    warm = held(rows)
    for r in rows:
        weights, live = warm[r["mode"]]
        peak = r["peak"] - r["before"]
        peak_ratio = "" if base is None else f"{peak / (base['peak'] - base['before']):.2f}x"
        lines.append(
            f"| {r['mode']} | {weights / mib:.1f} | {weights / r['param_bytes']:.3f}x | {live / mib:.1f} | "
            f"{live / r['param_bytes']:.3f}x | {peak / mib:.0f} | {peak_ratio} | {r['accounted'] / mib:.1f} |"
            + (f" {cold[r['mode']][0] / mib:.1f} | {cold[r['mode']][0] / r['param_bytes']:.3f}x |" if cold else "")
        )
    return "\n".join(lines)


def load_table(rows: list[dict]) -> str:
    mib = 2**20
    lines = [
        "| mode | bf16 checkpoint MiB | peak MiB (load) | held MiB | largest layer MiB (bf16) | peak <= held + layer "
        "| RSS MiB after load | RSS MiB after first call |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for r in (r for r in rows if r["mode"].startswith("load:")):
        peak, bound = r["peak"] - r["before"], r["held"] + r["largest_layer"]
        lines.append(
            f"| {r['mode']} | {r['checkpoint'] / mib:.0f} | {peak / mib:.1f} | {r['held'] / mib:.1f} | "
            f"{r['largest_layer'] / mib:.1f} | {'yes' if peak <= bound else 'NO'} ({bound / mib:.1f}) | "
            f"{(r['loaded'] - r['before']) / mib:.1f} | {(r['after'] - r['before']) / mib:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=MODES + LOAD_MODES, help="FORMAT[+keep] or load:FORMAT")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=256, help="small: the embedding and head stay unquantized")
    parser.add_argument("--lowering", default="aot_eager", help="the backends' lowering (inductor: what users run)")
    parser.add_argument(
        "--arch", choices=("llama", "llama4"), default="llama", help="llama4: every layer MoE (8 experts)"
    )
    parser.add_argument("--csv", type=Path, default=Path(__file__).parent / "out" / "memory.csv")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="quantpass-memory-") as checkpoint:
        if any(mode.startswith("load:") for mode in args.modes):
            _child([SAVE, str(args.hidden), str(args.layers), str(args.vocab), checkpoint], "saving the checkpoint")
        rows = [
            measure(mode, args.hidden, args.layers, args.threads, args.vocab, args.lowering, checkpoint, args.arch)
            for mode in args.modes
        ]
    write_csv(args.csv, rows)
    stamp = utc_stamp()
    print(f"{stamp}, {platform.processor() or platform.machine()}, torch threads {args.threads}, "
          f"{'Llama 4' if args.arch == 'llama4' else 'Llama'}-style hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, bf16, lowering {args.lowering}, `python bench/memory.py "
          f"{' '.join(argv or sys.argv[1:])}`".rstrip())  # fmt: skip
    tables = [
        make(rows)
        for make, load in ((table, False), (load_table, True))
        if any(r["mode"].startswith("load:") == load for r in rows)
    ]
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
