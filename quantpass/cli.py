"""`quantpass` / `python -m quantpass`: run (the main job), explain, formats.

Bad flags or values print one line on stderr and exit with code 2 (no traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
import warnings

from .quant_registry.spec import SHORTHANDS, QuantizationConfig, QuantSpec, parse_cli

COMMANDS = ("explain", "formats", "run")
DEFAULT_CONFIG = {"linear": "fp8_per_channel", "moe": "mxfp8"}
DEFAULT_LABEL = "default"  # --compare name for DEFAULT_CONFIG


class UsageError(ValueError):
    """Bad command-line input: one line on stderr, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage + message and exit; we want one line
        raise UsageError(f"{message} (see: {self.prog} --help)")


def _parser() -> argparse.ArgumentParser:
    from .lowering import LOWERINGS
    from .presets import DEFAULT_PRESET, DTYPES, PRESETS

    root = _Parser(prog="quantpass", description="Quantize the linear and MoE layers of a model with torch.compile.")
    commands = root.add_subparsers(dest="command", parser_class=_Parser)
    quantization_help = (
        "--quantization NAME and --quantization-config.FIELD[.SUB] VALUE set the format "
        f"(default: linear {DEFAULT_CONFIG['linear']}, moe {DEFAULT_CONFIG['moe']}; see `quantpass formats`)"
    )
    run = commands.add_parser("run", help="compile a model with quantpass and compare it with the unquantized one")
    explain = commands.add_parser("explain", help="print the plan: what quantpass would do to every layer")
    formats = commands.add_parser("formats", help="the format names, their keys and the backends per device")
    for sub in (run, explain):
        sub.epilog = quantization_help
        sub.add_argument("--model", default=DEFAULT_PRESET, help=f"a preset ({', '.join(PRESETS)}) or a checkpoint dir")
        sub.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
        sub.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: float32 on CPU, else bf16")
        sub.add_argument("--prompt-length", type=_positive, default=16)
        sub.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    run.add_argument("--compare", metavar="FMT1,FMT2", help=f"formats to compare (shorthands or {DEFAULT_LABEL!r})")
    run.add_argument("--new-tokens", type=_positive, default=8, help="greedy tokens generated for the speed test")
    run.add_argument("--lowering", default="inductor", choices=LOWERINGS)
    run.add_argument(
        "--threads",
        type=_positive,
        help="CPU threads for torch (default: torch's; 1 steadies timings on a busy machine)",
    )
    run.add_argument("--no-verify", action="store_true", help="skip the per-site SQNR check at compile time")
    run.add_argument("--debug-dir", metavar="DIR", help="dump graphs, plans and depyf output per compile here")
    formats.add_argument("--markdown", action="store_true", help="a Markdown table (as in README.md)")
    return root


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected a positive integer")
    return int(text)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        config, rest = parse_cli(argv)
        args = _parser().parse_args(rest)
        if args.command is None:
            raise UsageError(f"missing command; valid: {', '.join(COMMANDS)} (see: quantpass --help)")
        if args.command == "formats":
            if config.fields_set:
                raise UsageError("formats takes no --quantization flags")
            return _formats(args)
        named = any(a == "--quantization" or a.startswith("--quantization=") for a in argv)
        configs = _configs(config, getattr(args, "compare", None), named)
        with _quiet():
            return _explain(args, configs[0][1]) if args.command == "explain" else _run(args, configs)
    except ValueError as e:  # bad flags, names or values (quantpass errors name the valid choices)
        print(f"quantpass: error: {e}", file=sys.stderr)
        return 2
    except _CompileError as e:
        print(f"quantpass: error: {e}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:  # e.g. `quantpass formats | head`: stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 1


def _configs(flags: QuantizationConfig, compare: str | None, named: bool) -> list[tuple[str, QuantizationConfig]]:
    """(label, config) per format to run; `named`: --quantization was given. Dotted flags apply on
    top of each format."""
    if compare is None:
        config = flags if named else _with_default(flags)
        return [(_label(config) if named else DEFAULT_LABEL, config)]
    if named:
        raise UsageError("--compare and --quantization both choose formats; use one of them")
    configs = []
    for name in filter(None, (n.strip() for n in compare.split(","))):
        if name == DEFAULT_LABEL:
            configs.append((name, _with_default(flags)))
            continue
        if name not in SHORTHANDS:
            QuantSpec.from_name(name)  # raises naming the valid names when it isn't a key either
        configs.append((name, QuantizationConfig(linear=name, moe=name).merged_with(flags)))
    if not configs:
        raise UsageError(f"--compare {compare!r} names no format; e.g. --compare {DEFAULT_LABEL},int8_per_channel")
    return configs


def _with_default(flags: QuantizationConfig) -> QuantizationConfig:
    """DEFAULT_CONFIG under the flags: a flag giving a kind's weight format replaces the default
    spec; one giving only its activation (`--quantization-config.moe.activation none`) edits it."""
    base = {}
    for kind, name in DEFAULT_CONFIG.items():
        spec = getattr(flags, kind)
        if kind not in flags.fields_set or (spec is not None and "weight" not in spec.fields_set):
            base[kind] = name
    return QuantizationConfig(**base).merged_with(flags)


def _label(config: QuantizationConfig) -> str:
    from .report import config_label

    return config_label(config)


class _CompileError(Exception):
    """A format that can't run here or fails verification, unwrapped from Dynamo's exception."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def _unwrap_compile_error(error: BaseException) -> _CompileError | None:
    from .kernels.oracle import NoKernelError
    from .passes.verify import QuantizationError

    seen = error
    while seen is not None:
        if isinstance(seen, NoKernelError):
            return _CompileError(str(seen), 2)  # the user asked for something this machine can't run
        if isinstance(seen, QuantizationError):
            return _CompileError(str(seen), 1)
        seen = getattr(seen, "inner_exception", None) or seen.__cause__
    return None


def _step(message: str) -> None:
    print(f"[quantpass] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _quiet():
    """Noise in a report, silenced while a command runs: Dynamo warns once per traced lru_cache etc.
    in transformers; torchao logs warnings about optional C++ extensions when it is imported."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\._dynamo.*")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


def _load(args):
    from .presets import load_model, prompt_ids

    _step(f"loading model {args.model!r}")
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    ids = prompt_ids(loaded.vocab_size, args.prompt_length, device=next(loaded.model.parameters()).device)
    _step(f"{loaded.description}; {loaded.parameters / 1e6:.2f} M parameters; prompt of {ids.shape[1]} tokens")
    return loaded, ids


def _explain(args, config: QuantizationConfig) -> int:
    from .backend import explain

    loaded, ids = _load(args)
    _step(f"capturing with Dynamo and planning {_label(config)}")
    plan = _guarded(lambda: explain(loaded.model, ids, config=config))
    print(plan)
    if args.json:
        _write_json(args.json, {"model": loaded.name, "config": config.to_dict(), "plan": plan.to_dicts()})
    return 0


def _run(args, configs) -> int:
    from .backend import BackendOptions
    from .debug import depyf_session
    from .measure import measure, warm_up
    from .report import comparison, run_table, summary_table

    options = {"lowering": args.lowering, "verify": not args.no_verify}
    for _, config in configs:
        BackendOptions.parse(config=config, **options)  # bad options fail before any work
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    loaded, ids = _load(args)
    steps = len(configs) + 1
    if args.lowering == "inductor":
        _step("warming up Inductor (its one-time start-up is not part of any compile time below)")
        warm_up(args.lowering, ids.device)
    _step(f"[1/{steps}] unquantized: compiling ({args.lowering}) and generating {args.new_tokens} tokens")
    baseline = measure(loaded.model, ids, None, lowering=args.lowering, new_tokens=args.new_tokens)
    results = []
    for i, (label, config) in enumerate(configs, start=2):
        _step(f"[{i}/{steps}] {label}: compiling with quantpass ({args.lowering}) and generating")
        debug_dir = f"{args.debug_dir}/{label}" if args.debug_dir else None  # compile_NNN/ and depyf/
        with depyf_session(debug_dir):
            result = _guarded(
                lambda config=config, label=label, debug_dir=debug_dir: measure(
                    loaded.model, ids, config, label, new_tokens=args.new_tokens, debug_dir=debug_dir, **options
                )
            )
        results.append(result)
        print(f"\n== {label}: {_label(config)} ==\n{result.plan}\n\n{run_table(baseline, result, args.lowering)}")
    if len(results) > 1:
        print(f"\n== summary (vs unquantized, {loaded.name}) ==\n{summary_table(baseline, results)}")
    _step(f"done in {time.perf_counter() - started:.0f} s")
    if args.json:
        payload = {
            "model": {"name": loaded.name, "description": loaded.description, "parameters": loaded.parameters},
            "prompt_length": ids.shape[1],
            "new_tokens": args.new_tokens,
            "lowering": args.lowering,
            "baseline": baseline.to_dict(),
            "formats": [{**r.to_dict(), **comparison(baseline, r)} for r in results],
        }
        _write_json(args.json, payload)
    return 0


def _guarded(fn):
    try:
        return fn()
    except Exception as e:
        unwrapped = _unwrap_compile_error(e)
        if unwrapped is None:
            raise
        raise unwrapped from None


def _write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    _step(f"wrote {path}")


def _formats(args) -> int:
    from .report import formats_table

    print(formats_table(markdown=args.markdown))
    if not args.markdown:
        print("\nbackends in the oracle's priority order, for a 4096x4096 layer; '-': none runs there")
    return 0
