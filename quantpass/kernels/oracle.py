"""The backend oracle: which kernel runs each quantized site, and why.

Candidates are data: one literal table per kind, `(weight key, activation key) -> backends in
priority order`, reordered per device type by `PRIORITY_BY_DEVICE`. Capability lives with each kernel
module (`supports(kind, capability, weight, activation, problem) -> (ok, reason)`). Precedence
(docs/design.md §5): a backend the user named > `QUANTPASS_DISABLED_BACKENDS` > auto priority. A named
backend that can't run raises with its reason; auto with nothing left raises listing every rejection.

Two device rules on top of the tables: a backend that says it runs a pair by emulation (its reason
starts with "emulated") is tried after every other candidate but `reference`, since emulation is
slower by design than a native path; and HIP (ROCm) devices get only `reference` until quantpass's
GPU kernels support them (see `HIP_REFUSAL`).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass, field

import torch

from .. import envs
from ..problem import Problem  # pure data, shared with detection (patterns/)
from ..quant_registry import keys as k
from ..quant_registry.keys import QuantKey
from ..quant_registry.names import Kind
from ..quant_registry.spec import KINDS
from .registry import BACKEND_NAMES, BACKENDS
from .registry import backend as backend_module  # the one registry of backends (kernels/registry.py)

logger = logging.getLogger("quantpass")

Pair = tuple[QuantKey, "QuantKey | None"]

# fmt: off
LINEAR_CANDIDATES: dict[Pair, list[str]] = {
    (k.kFp8StaticTensorSym,    k.kFp8DynamicTensorSym): ["native", "triton", "cpu", "reference"],
    (k.kFp8StaticChannelSym,   k.kFp8DynamicTokenSym):  ["native", "triton", "cpu", "reference"],
    (k.kFp8Static128BlockSym,  k.kFp8Dynamic128Sym):    ["native", "triton", "cpu", "reference"],
    (k.kMxfp8Static,           k.kMxfp8Dynamic):        ["flashinfer", "native", "triton", "cpu", "reference"],
    (k.kMxfp4Static,           None):                   ["triton", "native", "cpu", "reference"],
    (k.kMxfp4Static,           k.kMxfp8Dynamic):        ["triton", "reference"],
    (k.kNvfp4Static,           k.kNvfp4Dynamic):        ["native", "cpu", "reference"],
    (k.kInt8StaticChannelSym,  k.kInt8DynamicTokenSym): ["cpu", "native", "triton", "reference"],
    (k.kFp8StaticChannelSym,   None):                   ["triton", "native", "cpu", "reference"],
    (k.kInt8StaticChannelSym,  None):                   ["cpu", "triton", "native", "reference"],
    (k.kInt4StaticGroup128Sym, None):                   ["cpu", "triton", "native", "reference"],
    (k.kNvfp4Static,           None):                   ["triton", "native", "cpu", "reference"],
    # static activation scales (a pre-quantized checkpoint's input_scale): the reference backend, and
    # on CPU the FP8 kernel (it multiplies the reference's activations)
    (k.kFp8StaticTensorSym,    k.kFp8StaticTensorSym):    ["cpu", "reference"],
    (k.kNvfp4Static,           k.kNvfp4CalibratedGlobal): ["reference"],
    (k.kFp8Static128BlockSym,  None):                     ["cpu", "reference"],  # ModelOpt FP8_PB_WO (weight-only)
}

MOE_CANDIDATES: dict[Pair, list[str]] = {
    (k.kFp8StaticTensorSym,    k.kFp8DynamicTensorSym): ["triton", "cpu", "reference"],
    (k.kFp8StaticChannelSym,   k.kFp8DynamicTokenSym):  ["triton", "cpu", "reference"],
    (k.kFp8Static128BlockSym,  k.kFp8Dynamic128Sym):    ["triton", "cpu", "reference"],
    (k.kMxfp8Static,           k.kMxfp8Dynamic):        ["flashinfer", "triton", "cpu", "reference"],
    (k.kMxfp4Static,           None):                   ["triton", "cpu", "reference"],
    (k.kMxfp4Static,           k.kMxfp8Dynamic):        ["triton", "reference"],
    (k.kNvfp4Static,           k.kNvfp4Dynamic):        ["cpu", "reference"],
    (k.kInt8StaticChannelSym,  k.kInt8DynamicTokenSym): ["triton", "cpu", "reference"],
    (k.kFp8StaticChannelSym,   None):                   ["triton", "cpu", "reference"],
    (k.kInt8StaticChannelSym,  None):                   ["triton", "native", "cpu", "reference"],
    (k.kInt4StaticGroup128Sym, None):                   ["triton", "cpu", "reference"],
    (k.kNvfp4Static,           None):                   ["triton", "cpu", "reference"],
    (k.kFp8StaticTensorSym,    k.kFp8StaticTensorSym):    ["cpu", "reference"],
    (k.kNvfp4Static,           k.kNvfp4CalibratedGlobal): ["reference"],
    (k.kFp8Static128BlockSym,  None):                     ["cpu", "reference"],  # ModelOpt FP8_PB_WO (weight-only)
}
# fmt: on
CANDIDATES = {Kind.LINEAR: LINEAR_CANDIDATES, Kind.MOE: MOE_CANDIDATES}

# Platform-gated priorities: the same backends, reordered for one device type. CPU has no FP8
# matrix units: torch._scaled_mm emulates and ran at the reference's speed (bench/README.md,
# "Measurements behind choices in the code"), while tracing native's activation
# quantization into every graph made the dense preset compile 1.5x plain Inductor (the opaque
# reference op: 1.0x); every FP8 pair runs first on the cpu backend's FP8 kernel (kernels/cpu_fp8.py:
# 29-43x the reference at M=1 on a 4096x4096 weight, 1.6-2.6x at M=64, bench/README.md "FP8 on
# CPU"), the reference above its largest M. MXFP4 and NVFP4: the cpu backend's FP4 kernel (kernels/cpu_fp4.py; 55x
# the reference at M=1 on a 4096x4096 weight, 1.2-1.4x at M=256), then the reference; native's traced e2m1
# decode ran 1.3x slower than the reference's at M=1 (even at M=32), compiled 4x slower, and kept ~10
# weight-sized temporaries per call without Inductor (bench/README.md, "Measurements behind choices
# in the code"). Native stays available by name.
# fmt: off
CPU_PRIORITY = {
    Kind.LINEAR: {
        (k.kFp8StaticTensorSym,   k.kFp8DynamicTensorSym): ["cpu", "reference", "native", "triton"],
        (k.kFp8StaticChannelSym,  k.kFp8DynamicTokenSym):  ["cpu", "reference", "native", "triton"],
        (k.kFp8Static128BlockSym, k.kFp8Dynamic128Sym):    ["cpu", "native", "triton", "reference"],
        (k.kMxfp8Static,          k.kMxfp8Dynamic):        ["cpu", "flashinfer", "native", "triton", "reference"],
        (k.kFp8StaticChannelSym,  None):                   ["cpu", "triton", "native", "reference"],
        (k.kMxfp4Static,          None):                   ["cpu", "reference", "native", "triton"],
        (k.kNvfp4Static,          None):                   ["cpu", "reference", "native", "triton"],
        (k.kNvfp4Static,          k.kNvfp4Dynamic):        ["cpu", "reference", "native"],
    },
    Kind.MOE: {
        (k.kFp8StaticTensorSym,   k.kFp8DynamicTensorSym): ["cpu", "triton", "reference"],
        (k.kFp8StaticChannelSym,  k.kFp8DynamicTokenSym):  ["cpu", "triton", "reference"],
        (k.kFp8Static128BlockSym, k.kFp8Dynamic128Sym):    ["cpu", "triton", "reference"],
        (k.kMxfp8Static,          k.kMxfp8Dynamic):        ["cpu", "flashinfer", "triton", "reference"],
        (k.kFp8StaticChannelSym,  None):                   ["cpu", "triton", "reference"],
    },
}
# fmt: on
PRIORITY_BY_DEVICE = {"cpu": CPU_PRIORITY}


def candidates(kind: str, pair: Pair, device: str) -> list[str] | None:
    """The backends for a pair on a device type, in priority order (None: no kernel for the pair)."""
    gated = PRIORITY_BY_DEVICE.get(device, {}).get(kind, {}).get(pair)
    return gated if gated is not None else CANDIDATES[kind].get(pair)


# Backends the oracle never picks on its own on a device type (a user may still name them):
# Triton on CPU runs only under the interpreter, ~6 ms per program per K step (docs/design.md §7).
NOT_AUTO_ON = {"cpu": {"triton"}}

# A `supports` reason starting with this word marks an emulated path (e.g. Triton's tl.dot_scaled
# upcasting MX operands to bf16 on sm90): ranked after every other runnable candidate but `reference`.
EMULATED = "emulated"

# ROCm builds of torch report AMD GPUs as "cuda" with a capability (MI300: 9.4) that would pass the
# NVIDIA checks, and quantpass's FP8 data is e4m3fn where MI300 computes e4m3fnuz.
HIP_REFUSAL = (
    "HIP (ROCm) device: quantpass's GPU kernels assume NVIDIA GPUs (SM numbers, e4m3fn FP8; MI300 needs "
    "e4m3fnuz) and are not supported there yet; only the reference backend runs"
)
HIP_BACKENDS = frozenset({"reference"})


@dataclass(frozen=True)
class Capability:
    """What a device offers: its type, CUDA SM (e.g. 90, 100), importable libraries. `hip`: an AMD GPU
    under a ROCm build of torch (device type "cuda", no SM)."""

    device: str
    sm: int | None = None
    libs: frozenset[str] = frozenset()
    triton_interpret: bool = False
    hip: bool = False

    @classmethod
    def detect(cls, device: torch.device | str) -> Capability:
        return _detect(torch.device(device).type, torch.device(device).index)


@functools.cache
def _detect(device_type: str, index: int | None) -> Capability:
    libs = frozenset(lib for lib in ("triton", "flashinfer") if importlib.util.find_spec(lib) is not None)
    sm = None
    hip = device_type == "cuda" and torch.version.hip is not None
    if device_type == "cuda" and not hip:
        major, minor = torch.cuda.get_device_capability(index)
        sm = major * 10 + minor
    return Capability(device_type, sm, libs, envs.triton_interpret(), hip)


@dataclass(frozen=True)
class Selection:
    backend: str
    reason: str
    rejected: dict[str, str] = field(default_factory=dict, hash=False, compare=False)


class NoKernelError(ValueError):
    """No backend can run a site (named one refused, or auto found none)."""


def variants(kind: str, backend: str, weight: QuantKey) -> list[QuantKey | None]:
    """A backend family's activation variants for a weight key (e.g. MXFP4 x {BF16, MXFP8})."""
    return [a for (w, a), backends in CANDIDATES[kind].items() if w == weight and backend in backends]


def resolve_activation_key(user: QuantKey | None, declared: QuantKey | None) -> QuantKey | None:
    """The user's activation override wins; a conflicting checkpoint-declared one is an error."""
    if user is not None and declared is not None and user != declared:
        raise ValueError(
            f"activation {user} requested, but the checkpoint declares activation {declared}; "
            "drop the override or use a checkpoint quantized for it"
        )
    return user if user is not None else declared


def select(
    kind: str,
    weight: QuantKey,
    activation: QuantKey | None,
    capability: Capability,
    problem: Problem,
    backend: str | None = None,
) -> Selection:
    """Choose the backend for one site. Cached: the same question gets the same answer cheaply."""
    if kind not in KINDS:
        raise ValueError(f"invalid kind {kind!r}; valid: {', '.join(KINDS)}")
    if backend is not None and backend not in BACKEND_NAMES:
        raise ValueError(f"invalid backend {backend!r}; valid: {', '.join(sorted(BACKEND_NAMES))}")
    return _select(kind, weight, activation, capability, problem, None if backend == "auto" else backend, _disabled())


def _disabled() -> frozenset[str]:
    names = envs.disabled_backends()
    unknown = names - set(BACKENDS)
    if unknown:
        raise ValueError(
            f"invalid backend {sorted(unknown)[0]!r} in QUANTPASS_DISABLED_BACKENDS; valid: {', '.join(BACKENDS)}"
        )
    return names


@functools.lru_cache(maxsize=4096)
def _select(kind, weight, activation, capability, problem, named, disabled) -> Selection:
    pair = (weight, activation)
    ordered = candidates(kind, pair, capability.device)
    if ordered is None:
        supported = sorted(f"{w}/{a}" for w, a in CANDIDATES[kind])
        raise NoKernelError(
            f"no {kind} kernel for weight {weight} with activation {activation}; supported pairs: {supported}"
        )
    if named is not None:
        if named not in ordered:
            offered = [str(a) for a in variants(kind, named, weight)]
            raise NoKernelError(
                f"backend {named!r} has no {kind} kernel for weight {weight} with activation {activation}"
                + (f"; it takes activations {offered} with this weight" if offered else "")
                + f"; backends for this pair: {', '.join(ordered)}"
            )
        ok, why = _supports(named, kind, capability, weight, activation, problem)
        if not ok:
            raise NoKernelError(
                f"backend {named!r} can't run {kind} {weight}/{activation} on {_where(capability)}: {why}"
            )
        return _chosen(kind, pair, Selection(named, "named by the user"))
    rejected, emulated = {}, None
    for name in ordered:
        if name == "reference" and emulated is not None:
            break  # an emulated kernel still beats the fp32 ground truth
        if name in disabled:
            rejected[name] = "disabled by QUANTPASS_DISABLED_BACKENDS"
            continue
        if name in NOT_AUTO_ON.get(capability.device, ()):
            rejected[name] = f"not chosen automatically on {capability.device} (name it to use it)"
            continue
        try:
            ok, why = _supports(name, kind, capability, weight, activation, problem)
        except ImportError as e:  # a broken optional dependency must not take the others down
            rejected[name] = f"could not be imported: {e}"
            continue
        if ok and why.startswith(EMULATED):
            emulated = emulated or (name, why)
            rejected[name] = f"{why} (ranked after the other backends: emulation is slower by design)"
        elif ok:
            return _chosen(kind, pair, Selection(name, why or f"first supported of {ordered}", rejected))
        else:
            rejected[name] = why
    if emulated is not None:
        rejected.pop(emulated[0])
        return _chosen(kind, pair, Selection(*emulated, rejected))
    listing = "; ".join(f"{b}: {r}" for b, r in rejected.items())
    raise NoKernelError(f"no backend can run {kind} {weight}/{activation} on {_where(capability)}: {listing}")


def _supports(name, kind, capability, weight, activation, problem) -> tuple[bool, str]:
    """A backend's own answer, after the device rules every backend shares (HIP)."""
    if capability.hip and name not in HIP_BACKENDS:
        return False, HIP_REFUSAL
    return backend_module(name).supports(kind, capability, weight, activation, problem)


def _where(capability: Capability) -> str:
    if capability.hip:
        return f"{capability.device} (HIP)"
    return capability.device if capability.sm is None else f"{capability.device} sm{capability.sm}"


_logged: set = set()


def _chosen(kind: str, pair: Pair, selection: Selection) -> Selection:
    token = (kind, pair, selection.backend)
    if token not in _logged:
        _logged.add(token)
        logger.info("%s %s/%s -> %s (%s)", kind, pair[0], pair[1], selection.backend, selection.reason)
        for name, why in selection.rejected.items():
            logger.debug("%s %s/%s: %s rejected: %s", kind, pair[0], pair[1], name, why)
    return selection


# Reference machines for the "what runs where" table: a CPU, an H100/H200, a B200.
REFERENCE_CAPABILITIES = {
    "cpu": Capability("cpu"),
    "cuda sm90": Capability("cuda", 90, frozenset({"triton"})),
    "cuda sm100": Capability("cuda", 100, frozenset({"triton", "flashinfer"})),
}


def ranked(kind: str, pair: Pair, capability: Capability, problem: Problem) -> list[str]:
    """The backends that can run the pair here, in the order auto selection tries them: the table's,
    with emulated ones moved to just before `reference` (or to the end)."""
    out, emulated = [], []
    for name in candidates(kind, pair, capability.device):
        ok, why = _supports(name, kind, capability, *pair, problem)
        if name == "reference":
            out, emulated = out + emulated, []
        if ok:
            (emulated if why.startswith(EMULATED) else out).append(name)
    return out + emulated


def kernel_table(problem: Problem = Problem(n=4096, k=4096)) -> list[dict]:
    """What runs where: per (kind, pair), for each reference device, the backends whose own
    `supports` says yes, in the order auto selection tries them there (`ranked`)."""
    rows = []
    for kind, table in CANDIDATES.items():
        for weight, activation in table:
            pair = (weight, activation)
            backends = {where: ranked(kind, pair, capability, problem) for where, capability in REFERENCE_CAPABILITIES.items()}  # fmt: skip
            rows.append({"kind": kind, "weight": weight, "activation": activation, "backends": backends})
    return rows
