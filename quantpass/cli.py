"""`quantpass` / `python -m quantpass`: run (the main job), explain, formats.

Everything a command line says is checked before any work starts (flags, formats, device, output
paths, prompt length); bad input prints one line on stderr and exits with code 2 (no traceback).
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

from . import cli_checks as checks
from .cli_checks import DEFAULT_LABEL, UsageError
from .presets import default_preset
from .quant_registry.spec import QuantizationConfig, parse_cli

COMMANDS = ("explain", "formats", "run")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage + message and exit; we want one line
        raise UsageError(f"{message} (see: {self.prog} --help)")


def _parser() -> argparse.ArgumentParser:
    from .lowering import LOWERINGS
    from .presets import DEFAULT_PRESETS, DTYPES, PRESETS

    root = _Parser(prog="quantpass", description="Quantize the linear and MoE layers of a model with torch.compile.")
    commands = root.add_subparsers(dest="command", parser_class=_Parser)
    quantization_help = (
        "--quantization NAME and --quantization-config.FIELD[.SUB] VALUE set the format (default: the "
        "formats with a fast kernel on the device: INT8 and INT4 weight-only on CPU, FP8 + MXFP8 on CUDA; "
        "see `quantpass formats`)"
    )
    run = commands.add_parser("run", help="compile a model with quantpass and compare it with the unquantized one")
    explain = commands.add_parser("explain", help="print the plan: what quantpass would do to every layer")
    formats = commands.add_parser("formats", help="the format names, their keys and the backends per device")
    for sub in (run, explain):
        sub.epilog = quantization_help
        sub.add_argument(
            "--model",
            help=f"a preset ({', '.join(PRESETS)}; default per device: {DEFAULT_PRESETS}) or a checkpoint dir",
        )
        sub.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
        sub.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bfloat16")
        sub.add_argument("--prompt-length", type=_positive, default=16)
        sub.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
        sub.add_argument(
            "--quantize-on-load",
            action="store_true",
            help="a full-precision checkpoint dir: quantize each weight as it is read (one --quantization "
            "format; never holds the model in full precision)",
        )
    run.add_argument("--compare", metavar="FMT1,FMT2", help=f"formats to compare (shorthands or {DEFAULT_LABEL!r})")
    run.add_argument("--new-tokens", type=_positive, default=8, help="greedy tokens generated for the speed test")
    run.add_argument("--rounds", type=_positive, default=5, help="timing rounds, the two models alternating")
    run.add_argument("--lowering", default="inductor", choices=LOWERINGS)
    run.add_argument(
        "--threads",
        type=_positive,
        help="CPU threads for torch (default: torch's; 1 steadies timings on a busy machine)",
    )
    run.add_argument("--no-verify", action="store_true", help="skip the per-site SQNR check at compile time")
    run.add_argument(
        "--keep-original-weights",
        action="store_true",
        help="keep each quantized weight's full-precision original (default: its storage is freed)",
    )
    run.add_argument(
        "--requantize",
        action="store_true",
        help="a pre-quantized checkpoint: allow another weight format (quantized again from the dequantized weights)",
    )
    run.add_argument(
        "--save",
        metavar="DIR",
        help="write the quantized model here (qp.save_pretrained: ModelOpt, fine-grained FP8 or compressed-tensors)",
    )
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
        named = checks.format_flag(argv, config)
        with _quiet():
            args.device = checks.parse_device(args.device)
            preset_defaulted, args.model = args.model is None, args.model or default_preset(args.device)
            model_config = checks.check_before_work(args)
            configs, why = checks.checkpoint_configs(args, config, named) or checks.configs_to_run(
                config, getattr(args, "compare", None), named, args.device
            )
            if getattr(args, "save", None):
                checks.check_exportable(configs, args.load_formats)
            checks.check_configs(configs, args.device, model_config)
            if why and preset_defaulted:
                why += f"; the {args.model} preset is the default model on {args.device}"
            if why:
                _step(why)
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


class _CompileError(Exception):
    """A format that can't run here or fails verification, unwrapped from Dynamo's exception."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def _unwrap_compile_error(error: BaseException) -> _CompileError | None:
    from .kernels.oracle import NoKernelError
    from .passes.verify import QuantizationError
    from .quant_registry.spec import WeightFormatConflict

    seen = error
    while seen is not None:
        if isinstance(seen, NoKernelError):
            return _CompileError(str(seen), 2)  # the user asked for something this machine can't run
        if isinstance(seen, QuantizationError):
            return _CompileError(str(seen), 1)
        if isinstance(seen, WeightFormatConflict):
            return _CompileError(str(seen).replace("requantize=True", "--requantize"), 2)
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


# -- commands -------------------------------------------------------------------------------------


def _load(args, trained: bool = True):
    import torch

    from .presets import load_model

    torch._dynamo.reset()  # a command starts from Dynamo's empty cache (main() may run twice in a process)

    _step(f"loading model {args.model!r}")
    loaded = load_model(args.model, args.dtype, args.device, _step, trained=trained, quantize_on_load=args.load_formats)
    ids = loaded.prompt(args.prompt_length)
    _step(f"{loaded.description}; {loaded.parameters / 1e6:.2f} M parameters; prompt of {ids.shape[1]} tokens")
    return loaded, ids


def _explain(args, config: QuantizationConfig) -> int:
    from .backend import explain

    loaded, ids = _load(args, trained=False)  # a plan depends on the architecture, not the weights
    model = loaded.model if loaded.load_quantized is None else loaded.quantizable()
    _step(f"capturing with Dynamo and planning {checks.config_label(config)}")
    plan = _guarded(lambda: explain(model, ids, config=config))
    print(plan)
    if args.json:
        _write_json(args.json, {"model": loaded.name, "config": config.to_dict(), "plan": plan.to_dicts()})
    return 0


def _run(args, configs) -> int:
    from .backend import BackendOptions
    from .debug import depyf_session
    from .measure import measure, time_side_by_side, warm_up
    from .report import comparison, run_table, summary_table

    options = backend_options(args)
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
    pairs = []
    for i, (label, config) in enumerate(configs, start=2):
        _step(f"[{i}/{steps}] {label}: compiling with quantpass ({args.lowering}), then {args.rounds} timing rounds")
        debug_dir = f"{args.debug_dir}/{label}" if args.debug_dir else None  # compile_NNN/ and depyf/
        model = loaded.quantizable()
        with depyf_session(debug_dir):
            result = _guarded(
                lambda model=model, config=config, label=label, debug_dir=debug_dir: measure(
                    model, ids, config, label, new_tokens=args.new_tokens, debug_dir=debug_dir, **options
                )
            )
        timed_baseline, timed_result = time_side_by_side([baseline, result], ids, rounds=args.rounds)
        timed_baseline.forward = timed_result.forward = result.forward = None  # the copy may go
        if args.save:
            from .checkpoints import save_pretrained

            save_pretrained(model, args.save)
            _step(f"wrote the quantized model to {args.save}")
        del model
        pairs.append((timed_baseline, timed_result))
        table = run_table(timed_baseline, timed_result, args.lowering)
        print(f"\n== {label}: {checks.config_label(config)} ==\n{timed_result.plan}\n\n{table}", flush=True)
    if len(pairs) > 1:
        print(f"\n== summary (vs unquantized, {loaded.name}) ==\n{summary_table(*zip(*pairs))}")
    _step(f"done in {time.perf_counter() - started:.0f} s")
    if args.json:
        payload = {
            "model": {"name": loaded.name, "description": loaded.description, "parameters": loaded.parameters},
            "prompt_length": ids.shape[1],
            "new_tokens": args.new_tokens,
            "lowering": args.lowering,
            "baseline": baseline.to_dict(),
            "formats": [
                {
                    **r.to_dict(),
                    **comparison(b, r),
                    "baseline_timings": {"prefill_seconds": b.prefill_seconds, "generate_seconds": b.generate_seconds},
                }
                for b, r in pairs
            ],
        }
        _write_json(args.json, payload)
    return 0


def backend_options(args) -> dict:
    """The quantpass backend options `quantpass run`'s flags give."""
    return {
        "lowering": args.lowering,
        "verify": not args.no_verify,
        "keep_original_weights": args.keep_original_weights,
        "requantize": args.requantize,
    }


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
