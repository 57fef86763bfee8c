"""Process memory of a quantized model: one fresh process per mode, RSS measured by the kernel.

    python bench/memory.py                      # the default table (Llama-style, hidden 1024, 6 layers, bf16)
    python bench/memory.py --modes none int8_weight_only --hidden 512 --layers 2 --csv bench/out/memory.csv

Per mode, a child process imports everything, builds the model from a seeded config (nothing
downloaded) and then compiles and runs it once (`lowering="aot_eager"`: Inductor's own memory would
blur the weights'). Columns:
- *weights MiB*: RSS after the first call minus RSS just before the model was built, minus what the
  `none` mode (unquantized, same compile) holds beyond its parameter bytes (activations, compiled
  code): what the weights cost the process, the issue's "minus a weightless model of the same shape".
- *peak MiB*: the process's peak RSS (VmHWM) during the compile and first call, minus RSS before build.
- *accounted MiB*: the bytes quantpass can name: parameter storages still allocated + its weight cache.
- *vs bf16*: weights MiB / the bf16 parameter bytes.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

MODES = ["none", "int8_weight_only", "int4_weight_only", "fp8_per_channel", "int8_weight_only+keep"]
CHILD = r"""
import json, sys, torch, transformers, quantpass as qp
from quantpass.weight_cache import WEIGHTS

def rss():  # resident set and its peak, bytes
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024

mode, hidden, layers, threads, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
    num_attention_heads=16, num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=256)
ids = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(0))
with torch.no_grad():  # warm the compile machinery on a throwaway model: its memory is not the weights'
    torch.compile(torch.nn.Linear(64, 64), backend=qp.backend(linear="int8_weight_only", lowering="aot_eager"))(torch.randn(2, 64))
torch._dynamo.reset()
before, _ = rss()
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
built, _ = rss()
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM: the peak below is the compile's
name, _, keep = mode.partition("+")
options = {"lowering": "aot_eager"} if name == "none" else {"linear": name, "lowering": "aot_eager", "keep_original_weights": bool(keep)}
with torch.no_grad():
    torch.compile(model, backend=qp.backend(**options))(ids)
after, peak = rss()
held = sum(p.untyped_storage().nbytes() for p in {id(p): p for p in model.parameters()}.values())
print(json.dumps({"mode": mode, "before": before, "built": built, "after": after, "peak": peak,
                  "param_bytes": param_bytes, "accounted": held + WEIGHTS.nbytes()}))
"""


def measure(mode: str, hidden: int, layers: int, threads: int, vocab: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(hidden), str(layers), str(threads), str(vocab)],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"mode {mode} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    mib = 2**20
    base = next((r for r in rows if r["mode"] == "none"), None)
    overhead = 0 if base is None else (base["after"] - base["before"]) - base["param_bytes"]
    lines = [
        "| mode | weights MiB | vs bf16 | peak MiB (compile + first call) | peak vs none | accounted MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        weights = (r["after"] - r["before"]) - overhead
        peak = r["peak"] - r["before"]
        peak_ratio = "" if base is None else f"{peak / (base['peak'] - base['before']):.2f}x"
        lines.append(
            f"| {r['mode']} | {weights / mib:.0f} | {weights / r['param_bytes']:.2f}x | {peak / mib:.0f} | "
            f"{peak_ratio} | {r['accounted'] / mib:.0f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=MODES)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=256, help="small: the embedding and head stay unquantized")
    parser.add_argument("--csv", type=Path, default=Path("bench/out/memory.csv"))
    args = parser.parse_args(argv)
    rows = [measure(mode, args.hidden, args.layers, args.threads, args.vocab) for mode in args.modes]
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{stamp}, {platform.processor() or platform.machine()}, torch threads {args.threads}, "
          f"Llama-style hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, bf16, `python bench/memory.py "
          f"{' '.join(argv or sys.argv[1:])}`".rstrip())  # fmt: skip
    print(table(rows))


if __name__ == "__main__":
    main()
