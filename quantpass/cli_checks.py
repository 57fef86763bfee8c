"""What a `quantpass` command line asks for, checked before any work starts: the device, the
formats to run (defaults per device, --compare, a checkpoint's own formats), output paths and the
prompt length. Bad input raises `UsageError` (one line on stderr, exit code 2)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .quant_registry.names import Kind
from .quant_registry.spec import SHORTHANDS, QuantizationConfig, QuantSpec

DEFAULT_LABEL = "default"  # --compare name for the device's default formats
# What `quantpass run` compares when no format is given, per device type: one entry per format
# run, each kind taking the first name whose oracle pick on this device is a fast kernel (not the
# dequantizing `reference`). CPU: the cpu backend's weight-only INT8/INT4 kernels (FP8 and MX
# formats have only `reference` there); they win in bf16 models (see presets.default_dtype).
# CUDA: FP8 linears and MXFP8 experts where a kernel runs them, else the next fast format.
DEVICE_DEFAULTS: dict[str, list[dict[Kind, list[str]]]] = {
    "cpu": [
        {Kind.LINEAR: ["int8_weight_only"], Kind.MOE: ["int8_weight_only"]},
        {Kind.LINEAR: ["int4_weight_only"], Kind.MOE: ["int4_weight_only"]},
    ],
    "cuda": [
        {
            Kind.LINEAR: ["fp8_per_channel", "int8_weight_only"],
            Kind.MOE: ["mxfp8", "fp8_per_channel", "int8_weight_only"],
        },
    ],
}
# The sizes the oracle is asked about when choosing defaults (its answers depend on them little).
LINEAR_PROBLEM = {"n": 4096, "k": 4096}
MOE_PROBLEM = {"n": 1536, "k": 4096, "experts": 64, "topk": 8, "activation": "silu"}


class UsageError(ValueError):
    """Bad command-line input: one line on stderr, exit code 2."""


# -- checks before any work -----------------------------------------------------------------------


def parse_device(text: str | None) -> str:
    """A device this process can use, or a UsageError naming the ones it can."""
    import torch

    from .presets import default_device

    if text is None:
        return default_device()
    cuda = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    valid = ", ".join(["cpu", *(["cuda"] if cuda else []), *cuda])
    try:
        device = torch.device(text)
    except RuntimeError:
        raise UsageError(f"invalid device {text!r}; valid here: {valid}") from None
    if device.type == "cpu":
        return text
    if device.type != "cuda":
        raise UsageError(f"invalid device {text!r}: quantpass runs on cpu and cuda; valid here: {valid}")
    if not cuda:
        raise UsageError(
            f"invalid device {text!r}: this torch ({torch.__version__}) sees no CUDA device; valid here: cpu"
        )
    if device.index is not None and device.index >= len(cuda):
        raise UsageError(f"invalid device {text!r}: there are {len(cuda)} CUDA devices; valid here: {valid}")
    return text


def check_before_work(args):
    """Output paths, the model and the prompt length; returns the model's transformers config."""
    from .presets import model_config

    if args.json:
        check_output_file(args.json, "--json")
    if getattr(args, "debug_dir", None):
        check_output_dir(args.debug_dir, "--debug-dir")
    if getattr(args, "save", None):
        check_output_dir(args.save, "--save")
    config = model_config(args.model)  # raises naming the presets for a bad --model
    positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    needed = args.prompt_length + getattr(args, "new_tokens", 0)
    if positions is not None and needed > positions:
        plus = f" + --new-tokens {args.new_tokens}" if args.command == "run" else ""
        raise UsageError(
            f"invalid --prompt-length {args.prompt_length}: the model {args.model!r} has {positions} positions "
            f"(--prompt-length{plus} must fit)"
        )
    return config


def check_output_file(path: str, flag: str) -> None:
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"invalid {flag} {path!r}: it is a directory; give a file path")
    parent = target.parent
    if not parent.is_dir():
        raise UsageError(f"invalid {flag} {path!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise UsageError(f"invalid {flag} {path!r}: not writable")


def check_output_dir(path: str, flag: str) -> None:
    folder = Path(path)
    existing = next(p for p in (folder, *folder.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise UsageError(f"invalid {flag} {path!r}: {str(existing)!r} is a file, not a directory")
    if not os.access(existing, os.W_OK):
        raise UsageError(f"invalid {flag} {path!r}: {str(existing)!r} is not writable")
    try:  # made now and written to once: os.access says yes to root anywhere (/proc too)
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as error:
        raise UsageError(f"invalid {flag} {path!r}: {error.strerror or error}") from None


def check_configs(configs: list[tuple[str, QuantizationConfig]], device: str, model_config) -> None:
    """Each spec has a kernel on this device (no compile is spent learning that it hasn't)."""
    import torch

    from .kernels.oracle import candidates

    kinds = list(Kind) if is_moe(model_config) else [Kind.LINEAR]
    device_type = torch.device(device).type
    for label, config in configs:
        checks = [(spec, [kind]) for kind in kinds if (spec := getattr(config, kind)) is not None]
        checks += [(spec, kinds) for spec in config.targets.values() if spec is not None]  # a layer of any kind
        for spec, spec_kinds in checks:
            if spec.weight is not None and all(candidates(k, spec.pair, device_type) is None for k in spec_kinds):
                raise UsageError(
                    f"format {label!r}: no {' or '.join(spec_kinds)} kernel for weight {spec.weight} with activation "
                    f"{spec.activation or 'none'} (see `quantpass formats` for the pairs each kind runs)"
                )


def is_moe(model_config) -> bool:
    text = model_config.get_text_config()
    return any(getattr(text, name, 0) for name in ("num_experts", "num_local_experts", "n_routed_experts"))


# -- formats --------------------------------------------------------------------------------------


def format_flag(argv: list[str], flags: QuantizationConfig) -> str | None:
    """The flag that names the format to run, or None (then `quantpass run` picks the device's): --quantization,
    or config flags giving linear or MoE layers a weight format (`--quantization-config.linear NAME`, the
    JSON form), which name one run as the same options to torch.compile would. Flags that only change
    an activation, ignore layers or pick a backend apply on top of each format."""
    if any(a == "--quantization" or a.startswith("--quantization=") for a in argv):
        return "--quantization"
    kinds = [kind for kind in ("linear", "moe") if kind in flags.fields_set]
    named = [kind for kind in kinds if getattr(flags, kind) is not None and getattr(flags, kind).weight is not None]
    return f"--quantization-config.{named[0]}" if named else None


def checkpoint_configs(args, flags: QuantizationConfig, named: str | None):
    """For a checkpoint that loads quantized (pre-quantized, or --quantize-on-load): the one config
    to compile with (the layers' own formats, plus any activation override in `flags`) and why;
    None for anything else. Sets `args.load_formats`, the formats to apply as the weights load."""
    from .backend import CONFIG_OPTIONS
    from .presets import PRESETS, checkpoint_layout

    args.load_formats = None
    if args.model in PRESETS:
        if args.quantize_on_load:
            raise UsageError(f"--quantize-on-load needs a checkpoint directory; {args.model!r} is a preset")
        return None
    layout = checkpoint_layout(args.model)
    if getattr(args, "compare", None) and (layout is not None or args.quantize_on_load):
        raise UsageError("--compare needs a full-precision model; this checkpoint loads quantized (one format)")
    if args.quantize_on_load:
        if layout is not None:
            raise UsageError(f"--quantize-on-load: {args.model!r} is already quantized ({layout.quant_algo})")
        if not named:
            raise UsageError("--quantize-on-load needs the format to apply: --quantization NAME")
        args.load_formats = {f: getattr(flags, f) for f in flags.fields_set if f in CONFIG_OPTIONS}
        return [(config_label(flags), QuantizationConfig())], None
    if layout is None:
        return None
    label = f"checkpoint {layout.quant_algo}"
    why = f"{args.model} is a {layout.producer} checkpoint ({layout.quant_algo}): running its own formats"
    return [(label, QuantizationConfig().merged_with(flags))], why


def check_exportable(configs, load_formats: dict | None) -> None:
    """--save: one format, each (weight, activation) pair one a checkpoint format stores (export.py)."""
    from .checkpoints.export import exact_rows, modelopt_row
    from .quant_registry.keys import needs_input_scale

    if len(configs) != 1:
        raise UsageError(f"--save writes one quantized model; {len(configs)} formats are compared")
    config = configs[0][1]
    specs = [config.linear, config.moe, *config.targets.values(), *(load_formats or {}).values()]
    for spec in specs:
        if isinstance(spec, QuantSpec) and spec.weight is not None:
            static = needs_input_scale(spec.activation)
            try:
                exact_rows(spec.weight, spec.activation, static) or modelopt_row(spec.weight, static, "--save")
            except ValueError as e:
                raise UsageError(str(e)) from None


def configs_to_run(flags: QuantizationConfig, compare: str | None, named: str | None, device: str):
    """([(label, config)] per format to run, the line saying why when defaults were chosen);
    `named`: the flag that named the format (`format_flag`). Other config flags apply on top of each
    format."""
    if compare is None:
        if named:
            return [(config_label(flags), flags)], None
        defaults, why = device_defaults(device)
        return [(label, config.merged_with(flags)) for label, config in defaults], why
    if named:
        raise UsageError(f"--compare and {named} both choose formats; use one of them")
    configs, why = [], None
    for name in filter(None, (n.strip() for n in compare.split(","))):
        if name == DEFAULT_LABEL:
            defaults, why = device_defaults(device)
            configs += [(label, config.merged_with(flags)) for label, config in defaults]
            continue
        if name not in SHORTHANDS:
            QuantSpec.from_name(name)  # raises naming the valid names when it isn't a key either
        configs.append((name, QuantizationConfig(linear=name, moe=name).merged_with(flags)))
    if not configs:
        raise UsageError(f"--compare {compare!r} names no format; e.g. --compare {DEFAULT_LABEL},int8_per_channel")
    return configs, why


def device_defaults(device: str) -> tuple[list[tuple[str, QuantizationConfig]], str]:
    """The formats `quantpass run` compares on `device` when none is given, and one line saying why."""
    import torch

    from .kernels.oracle import Capability, NoKernelError, Problem, select
    from .presets import default_dtype

    capability = Capability.detect(device)
    problems = {Kind.LINEAR: Problem(**LINEAR_PROBLEM), Kind.MOE: Problem(**MOE_PROBLEM)}
    runs, backends = [], []
    for per_kind in DEVICE_DEFAULTS[torch.device(device).type]:
        names = {}
        for kind, options in per_kind.items():
            for name in options:
                spec = QuantSpec.from_name(name)
                try:
                    backend = select(kind, spec.weight, spec.activation, capability, problems[kind]).backend
                except NoKernelError:
                    continue
                if backend != "reference" or name == options[-1]:
                    names[kind] = name
                    backends.append(backend)
                    break
        config = QuantizationConfig(**names)
        runs.append((config_label(config), config))
    labels = " and ".join(label for label, _ in runs)
    kernels = ", ".join(dict.fromkeys(backends))
    why = (
        f"no format given: comparing {labels} in {default_dtype(device)} with the unquantized model, the formats "
        f"with a fast kernel on {device} (backend {kernels}); --quantization, --compare and --dtype choose others"
    )
    return runs, why


def config_label(config: QuantizationConfig) -> str:
    from . import report

    return report.config_label(config)
