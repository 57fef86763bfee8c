"""Where a compiled single-linear module's call spends its time beside its kernel, at decode (M=1):
plain torch.compile (bf16, Inductor) and quantpass (INT8 / INT4 weight-only, Inductor), measured
inside the same calls with timestamps.

    python bench/call_overhead.py                 # 1 thread, 8 layers in rotation, 30 rounds

Method: 8 distinct 4096x4096 linears per case, each `torch.compile`d on its own, called in rotation on
one bf16 token (so every call's weights, and everything else the call touches, come from DRAM after
the previous call streamed 8-16 MiB through the caches: the issue-18 method). The backend's compiled
callable is wrapped to stamp its entry and exit; for quantpass also its inner graph, so the columns
are: *to the backend's callable* (the module call, Dynamo's guards and frame, hooks), *quantpass's
prelude* (the weight cache lookup that supplies the quantized weights), *graph* (the lowered graph:
the kernel), *back to the caller*. Importing quantpass installs a global module pre-hook (the eager
guard, weight_cache.install_eager_guard), which every module call then pays, compiled or not, plain
torch.compile's included; `--without-eager-guard` takes it off first, to show its share (a separate
run: Dynamo guards on the hooks, so switching it within a run recompiles). Every case runs once per
round, rounds interleaved; medians over rounds x layers, wall clock.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch
import torch._dynamo
from torch._inductor.compile_fx import compile_fx

import quantpass as qp
from quantpass import weight_cache

LAYERS, SIZE = 8, 4096
NS = time.perf_counter_ns


def stamped(fn, stamps: list, first: str, last: str):
    def call(*args):
        stamps.append((first, NS()))
        out = fn(*args)
        stamps.append((last, NS()))
        return out

    return call


def case(layers, backend_for):
    """(compiled layers, stamps list) with every compiled callable stamped."""
    stamps: list = []

    def spy(gm, example_inputs):
        compiled = backend_for(gm, example_inputs)
        inner = getattr(compiled, "__self__", None)  # quantpass's QuantizedGraph: stamp its graph too
        if inner is not None and hasattr(inner, "compiled"):
            inner.compiled = stamped(inner.compiled, stamps, "graph in", "graph out")
        return stamped(compiled, stamps, "callable in", "callable out")

    # One Dynamo context for the 8 modules: torch.compile(layer) per layer would give each its own
    # backend wrapper, so 8 cache entries Dynamo walks in turn (and a recompile limit to raise); users
    # compile a model once, which one context per case stands for.
    context = torch._dynamo.optimize(spy)
    return [context(layer) for layer in layers], stamps


PARTS = ("to the backend's callable", "quantpass's prelude", "graph", "back to the caller", "total")


def one_round(compiled, stamps, x, samples: dict[str, list]) -> None:
    """Each layer called once; its parts' nanoseconds appended to `samples`."""
    for layer in compiled:
        stamps.clear()
        start = NS()
        layer(x)
        end = NS()
        at = dict(stamps)
        inner_in, inner_out = at.get("graph in", at["callable in"]), at.get("graph out", at["callable out"])
        for name, value in zip(
            PARTS,
            (
                at["callable in"] - start,
                inner_in - at["callable in"],
                inner_out - inner_in,
                end - inner_out,
                end - start,
            ),
        ):
            samples[name].append(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument(
        "--without-eager-guard",
        action="store_true",
        help="take quantpass's global module pre-hook off first (a diagnosis: released weights then go unguarded)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64  # one cache entry per case, one code object
    if args.without_eager_guard:
        weight_cache._EAGER_GUARD[0].remove()
    x = torch.randn(1, SIZE, dtype=torch.bfloat16)

    def layers():
        torch.manual_seed(0)
        return [torch.nn.Linear(SIZE, SIZE, bias=False).to(torch.bfloat16) for _ in range(LAYERS)]

    cases = [("bf16, plain torch.compile", *case(layers(), compile_fx))]  # (label, compiled layers, stamps)
    for fmt in ("int8_weight_only", "int4_weight_only"):
        cases.append((f"{fmt}, quantpass", *case(layers(), qp.backend(linear=fmt, backend="cpu"))))
    samples = {label: {name: [] for name in PARTS} for label, *_ in cases}
    with torch.no_grad():
        for _, compiled, stamps in cases:  # compile and warm
            for _ in range(2):
                one_round(compiled, stamps, x, {name: [] for name in PARTS})
        for _ in range(args.rounds):  # interleaved: every case once per round
            for label, compiled, stamps in cases:
                one_round(compiled, stamps, x, samples[label])
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"\n{stamp}, {platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"`python bench/call_overhead.py {' '.join(sys.argv[1:])}`".rstrip())  # fmt: skip
    print("\n| case | " + " | ".join(f"{n} (us)" for n in PARTS) + " |")
    print("| --- |" + " ---: |" * len(PARTS))
    for label, parts in samples.items():
        print(f"| {label} | " + " | ".join(f"{statistics.median(parts[n]) / 1e3:.0f}" for n in PARTS) + " |")


if __name__ == "__main__":
    main()
