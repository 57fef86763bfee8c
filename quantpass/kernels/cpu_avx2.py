"""quantpass's INT4 (group-128) and INT8 (per-channel) weight-only CPU kernels (csrc/linear_avx2.c),
built on first use.

They read quantpass's own quantized layout (no prepared copy), take x, bias and out in fp32, bf16 or
fp16, and multiply in one of three ways (`mode`): "exact" (fp32 activations), "int8" for INT4 weights
(llama.cpp-style: each 128 activations quantized once per call to int8, integer multiply-adds) and
"int16" for INT8 weights (activations to int16: exact integer products). The cpu backend chooses per
format (`cpu.ACTIVATION_MODES`, measured). Where the CPU has AVX-512 VNNI, INT4's "int8" mode runs on
512-bit tiles instead of the AVX2 ones (`int4_tiles`, measured faster); one activation row meets 8
weight rows at a time, or 4 on CPUs where that was measured faster (`decode_tiles`). Speed and accuracy:
bench/README.md, "CPU decode at the bandwidth limit".

The C source needs no Python or torch headers: the system C compiler builds it in about a second
into a cache folder, ctypes loads it (and releases the GIL while it runs), and its OpenMP threads
come from the libgomp torch already loaded. Not available, with the reason, when: not an x86-64
CPU with AVX2 (torch's capability AVX2 or AVX512; measured faster than aten's kernels on both), a
CPU with AMX (aten's kernels use it; unmeasured here), `QUANTPASS_CPU_KERNEL=0`, or no C compiler
(the cpu backend then uses aten's kernels).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from .. import envs
from ..moe_problem import ACTIVATIONS as MOE_ACTIVATIONS
from ..moe_problem import GATE_UP_LAYOUTS
from ..quant_registry.formats import AMAX_EPS

logger = logging.getLogger("quantpass")

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "linear_avx2.c"
GROUP = 128  # INT4 weights per scale
MODES = {"exact": 0, "int8": 1, "int16": 2}  # csrc's EXACT, INT8, INT16
FORMAT_MODES = {4: ("exact", "int8"), 8: ("exact", "int16")}  # by weight bits
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # csrc's F32, BF16, F16
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-shared", "-fPIC")
OPENMP = "-fopenmp"  # tried first; without it the kernels build single-threaded
# INT4 x int8 tiles (csrc's qp_int4_vnni 0, 1): AVX-512 VNNI wherever the CPU has it (measured faster on
# Ice Lake at M = 1, 2, 4: bench/README.md, "CPU decode at the bandwidth limit"), AVX2 elsewhere.
INT4_TILES = ("avx2", "avx512-vnni")
# INT8 x int16 tiles (csrc's qp_int8_vnni 0, 1): AVX-512 VNNI wherever the CPU has it (the same outputs, bit
# for bit; measured faster on a Zen 5: bench/README.md, "INT8 tiles on AVX-512 VNNI"), AVX2 elsewhere.
INT8_TILES = INT4_TILES
# Tiles for one activation row (csrc's qp_decode_rows 0, 1): 8 weight rows at a time (measured faster than
# fewer on a Zen 4), or 4, which reads half as many weight streams at once: measured 5-19% faster
# on a Zen 5 at 1 and 2 threads (bench/README.md, "Zen 5"). The same sums either way.
DECODE_TILES = ("8-row", "4-row")
DECODE_TILES_BY_CPU = {("AuthenticAMD", 26): "4-row"}  # (vendor, family) where measured; else the first
CAPABILITIES = ("AVX2", "AVX512")  # torch's names for x86-64 CPUs with AVX2 + FMA
P, I64, I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_ARGS = (P, I64, I32, I64, I64, P, P, I64, I64, I32, P, I32, P, I64, I32, I32, I32)  # qp_linear's C signature
F32 = ctypes.c_float
# csrc/moe_layer.h's MOE_PARAMS: what every MoE entry (qp_moe, qp_moe_fp8, qp_moe_fp4) takes first
MOE_LAYER_ARGS = (P, I32, I64, I64, P, I64, P, I32, I64, P, I32, I32, I64, I64, P, P, I32, I32, I32, F32, F32, P, I32, I64)  # fmt: skip
_MOE_ARGS = (*MOE_LAYER_ARGS, P, P, I64, P, P, I64, I32, I32, I32, F32)  # qp_moe's C signature


def available() -> tuple[bool, str]:
    """(ok, reason): whether this process can run the kernels; builds them on the first call."""
    return _library()[1:]


def linear(
    x: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    mode: str = "exact",
) -> torch.Tensor:
    """x [M, K] @ dequantize(data, scale).T (+ bias) -> [M, N] in x.dtype (or `out`'s). INT4: data
    uint8 [N, Kp/2] as `formats.quantize` packs it (Kp % 128 == 0, K <= Kp), scale fp32 [N, Kp/128].
    INT8: data int8 [N, K], scale fp32 [N] or [N, 1]. `mode`: one of FORMAT_MODES[bits]. `out`: a
    contiguous [M, N] fp32/bf16/fp16 tensor to write into (tests pass one poisoned with NaN). Checks
    everything; the cpu backend's graph op calls `run`."""
    lib, ok, reason = _library()
    if not ok:
        raise RuntimeError(f"quantpass's CPU kernels can't run: {reason}")
    int4 = data.dtype == torch.uint8
    name = "int4" if int4 else "int8"
    if data.dtype not in (torch.uint8, torch.int8) or scale.dtype != torch.float32:
        raise ValueError(f"the kernels want uint8 (INT4) or int8 data and fp32 scales; got {data.dtype}, {scale.dtype}")
    rows, cols = data.shape
    kp, scale_shapes = (cols * 2, [(rows, cols * 2 // GROUP)]) if int4 else (cols, [(rows,), (rows, 1)])
    if x.dim() != 2 or x.shape[1] > kp or (int4 and kp % GROUP) or tuple(scale.shape) not in scale_shapes:
        raise ValueError(
            f"{name} kernel shapes: x {tuple(x.shape)}, data {tuple(data.shape)}, scale {tuple(scale.shape)}"
        )
    modes = FORMAT_MODES[4 if int4 else 8]
    if mode not in modes:
        raise ValueError(f"invalid {name} kernel mode {mode!r}; valid: {', '.join(modes)}")
    if x.dtype not in DTYPES or (bias is not None and bias.dtype not in DTYPES):
        dtypes = ", ".join(map(str, DTYPES))
        raise ValueError(f"x and bias must be one of {dtypes}; got {x.dtype}, {None if bias is None else bias.dtype}")
    if bias is not None and bias.shape != (rows,):
        raise ValueError(f"{name} kernel bias must be [{rows}]; got {tuple(bias.shape)}")
    out = output(out, x.shape[0], rows, x.dtype, name)
    if x.stride(-1) != 1:
        x = x.contiguous()
    data, scale = data.contiguous(), scale.contiguous()
    bias = None if bias is None else bias.contiguous()
    run(lib, x, data, scale, bias, out, 4 if int4 else 8, MODES[mode], torch.get_num_threads())
    return out


def dequantize(data: torch.Tensor, scale: torch.Tensor, first: int, out: torch.Tensor) -> torch.Tensor:
    """Rows `first` .. `first + len(out) - 1` of the weight `linear` reads (data, scale as there, contiguous),
    dequantized into `out` [rows, Kp] (fp32/bf16/fp16, contiguous): each value times its scale in fp32,
    rounded once. Returns `out`."""
    lib, ok, reason = _library()
    if not ok:
        raise RuntimeError(f"quantpass's CPU kernels can't run: {reason}")
    bits = 4 if data.dtype == torch.uint8 else 8
    kp = data.shape[1] * 2 if bits == 4 else data.shape[1]
    rows = out.shape[0]
    if out.shape != (rows, kp) or out.dtype not in DTYPES or not out.is_contiguous() or not 0 <= first <= first + rows <= data.shape[0]:  # fmt: skip
        raise ValueError(
            f"dequantize: rows {first}..{first + rows} of data {tuple(data.shape)} into out {out.dtype} {tuple(out.shape)}"
        )
    if not (data.is_contiguous() and scale.is_contiguous() and scale.dtype == torch.float32):
        raise ValueError(f"dequantize wants contiguous data and fp32 scales; got {scale.dtype}")
    lib.qp_dequantize(data.data_ptr(), scale.data_ptr(), first, rows, kp, bits, out.data_ptr(), DTYPES[out.dtype],
                      torch.get_num_threads())  # fmt: skip
    return out


def output(out: torch.Tensor | None, m: int, n: int, dtype: torch.dtype, name: str) -> torch.Tensor:
    """A kernel's destination: `out` checked (contiguous [m, n] fp32/bf16/fp16), or a new [m, n] of `dtype`."""
    if out is None:
        return torch.empty(m, n, dtype=dtype)
    if out.shape != (m, n) or out.dtype not in DTYPES or not out.is_contiguous():
        raise ValueError(
            f"{name} kernel out must be contiguous fp32/bf16/fp16 {(m, n)}; got {out.dtype} {tuple(out.shape)}"
        )
    return out


def run(lib, x, data, scale, bias, out, bits: int, mode: int, threads: int) -> torch.Tensor:
    """The C call, unchecked: x [M, K] with unit column stride, contiguous data/scale/bias/out."""
    kp = data.shape[1] * 2 if bits == 4 else data.shape[1]
    status = lib.qp_linear(
        x.data_ptr(), x.stride(0), DTYPES[x.dtype], x.shape[0], x.shape[1],
        data.data_ptr(), scale.data_ptr(), data.shape[0], kp, bits,
        None if bias is None else bias.data_ptr(), 0 if bias is None else DTYPES[bias.dtype],
        out.data_ptr(), out.shape[-1], DTYPES[out.dtype], mode, threads,
    )  # fmt: skip
    if status:
        raise scratch_error(status)
    return out


def stacked(*tensors: torch.Tensor) -> bool:
    """Whether these are per-expert stacks ([E, ...], 3-D) the kernels read as they are (contiguous)."""
    return all(t.dim() == 3 and t.is_contiguous() for t in tensors)


def moe_experts(fast, activation_key: str, w13_data, w13_scale, w2_data, w2_scale):
    """(qp_moe, its arguments after the layer's, the tensors they point into) for a MoE layer's stacked
    INT8/INT4 experts as the kernels read them (contiguous, fp32 scales), weight-only or with the
    activation key `fast` names (INT8 W8A8: qp_moe quantizes each GEMM's rows per token first); None
    where these kernels can't run them. `fast`: the weight key's row of the cpu backend's kernels' table
    (bits, mode, most rows, the activation key quantized per token or "")."""
    lib = library()
    bits, mode, _, per_token_key, _ = fast
    if lib is None or (activation_key and activation_key != per_token_key):
        return None
    if not stacked(w13_data, w13_scale, w2_data, w2_scale):
        return None
    if w13_scale.dtype != torch.float32 or w2_scale.dtype != torch.float32:
        return None
    kp13, kp2 = (w.shape[2] * (2 if bits == 4 else 1) for w in (w13_data, w2_data))
    args = (w13_data.data_ptr(), w13_scale.data_ptr(), kp13, w2_data.data_ptr(), w2_scale.data_ptr(), kp2, bits,
            mode, bool(activation_key), AMAX_EPS)  # fmt: skip
    return lib.qp_moe, args, ()


def moe_layer(
    entry, weights, most, experts, intermediate, hidden, topk_weights, topk_ids, b13, b2, expert_map, activation,
    gate_up_layout, on_input, alpha, limit,
) -> torch.Tensor | None:  # fmt: skip
    """A MoE layer of `experts` local experts of `intermediate` (hidden [T, H] -> [T, H]) in one call of
    a kernel library's MoE entry: `entry` with csrc/moe_layer.h's MOE_PARAMS from these arguments, then
    `weights` (the format's, from its `moe_experts`), at most `most` rows per expert GEMM; None where the
    layer's own arguments are ones the entry can't take (dtypes, shapes, T above `most`, non-contiguous
    biases or expert map)."""
    htype, rtype = DTYPES.get(hidden.dtype), DTYPES.get(topk_weights.dtype)
    btype = 0 if b13 is None else DTYPES.get(b13.dtype)
    if (
        htype is None
        or rtype is None
        or btype is None
        or (b13 is None) != (b2 is None)
        or (b2 is not None and b2.dtype != b13.dtype)
        or hidden.dim() != 2
        or hidden.shape[0] > most
        or topk_ids.numel() != topk_weights.numel()
        or topk_ids.numel() != hidden.shape[0] * topk_ids.shape[-1]
        or (expert_map is not None and expert_map.dtype not in (torch.int32, torch.int64))
        or not all(t is None or t.is_contiguous() for t in (b13, b2, expert_map))
    ):
        return None
    hidden, topk_weights = hidden.contiguous(), topk_weights.contiguous()
    topk_ids = topk_ids.to(torch.int64).contiguous()
    out = torch.empty_like(hidden)
    status = entry(
        hidden.data_ptr(), htype, hidden.shape[0], hidden.shape[1], topk_ids.data_ptr(), topk_ids.shape[-1],
        None if expert_map is None else expert_map.data_ptr(), 0 if expert_map is None else expert_map.element_size(),
        0 if expert_map is None else expert_map.numel(), topk_weights.data_ptr(), rtype, bool(on_input), experts,
        intermediate, None if b13 is None else b13.data_ptr(), None if b2 is None else b2.data_ptr(), btype,
        MOE_ACTIVATIONS.index(activation), GATE_UP_LAYOUTS.index(gate_up_layout), alpha, limit, out.data_ptr(),
        torch.get_num_threads(), most, *weights,
    )  # fmt: skip
    if status == -3:
        raise IndexError(f"an expert id outside the expert map or [0, {experts}) in {topk_ids.tolist()}")
    if status:
        raise scratch_error(status)
    return out


def scratch_error(status: int) -> MemoryError:
    return MemoryError(f"quantpass's CPU kernel could not allocate its scratch (status {status})")


def int4_tiles(name: str | None = None) -> str:
    """The INT4 x int8 tiles the kernels use (one of INT4_TILES); with `name`, switch to those first
    ("avx512-vnni" only on a CPU with AVX-512 BW, VL and VNNI). Both give the reference's integer sums;
    their fp32 sums differ in the last bits (8 vs 16 lanes)."""
    return _tiles("qp_int4_vnni", INT4_TILES, name, "INT4", "AVX-512 BW, VL or VNNI")


def int8_tiles(name: str | None = None) -> str:
    """The INT8 x int16 tiles the kernels use (one of INT8_TILES); with `name`, switch to those first
    ("avx512-vnni" only on a CPU with AVX-512 BW, VL and VNNI). Both give the same outputs, bit for bit."""
    return _tiles("qp_int8_vnni", INT8_TILES, name, "INT8", "AVX-512 BW, VL or VNNI")


def decode_tiles(name: str | None = None) -> str:
    """The tiles that multiply one activation row (one of DECODE_TILES); with `name`, switch to those
    first. Both give the same outputs, bit for bit."""
    return _tiles("qp_decode_rows", DECODE_TILES, name, "decode", "nothing")


def _tiles(entry: str, names: tuple[str, ...], name: str | None, what: str, lacks: str) -> str:
    lib = library()
    if lib is None:
        raise RuntimeError(f"quantpass's CPU kernels can't run: {available()[1]}")
    return switch_tiles(getattr(lib, entry), names, name, what, lacks)


def cpu_family() -> tuple[str, int] | None:
    """(vendor_id, cpu family) from /proc/cpuinfo, None where it can't be read."""
    try:
        with open("/proc/cpuinfo") as f:
            fields = dict(map(str.strip, line.split(":", 1)) for line in f.read(8192).splitlines() if ":" in line)
        return fields["vendor_id"], int(fields["cpu family"])
    except (OSError, KeyError, ValueError):
        return None


def format_tiles(library, entry: str, names: tuple[str, ...], name: str | None, what: str, lacks: str) -> str:
    """`switch_tiles` for a format family's kernel library (`format_kernel`'s loader `library`, C switch
    `entry`): raises where the kernel can't run."""
    lib, ok, reason = library()
    if not ok:
        raise RuntimeError(f"quantpass's {what} CPU kernel can't run: {reason}")
    return switch_tiles(getattr(lib, entry), names, name, what, lacks)


def switch_tiles(entry, names: tuple[str, ...], name: str | None, what: str, lacks: str) -> str:
    """The tiles a kernel library uses, one of `names`, switched to `name` first if given; `entry` is its C
    switch (index or -1 -> the index in use); `what` and `lacks` ("AVX-512 BF16") for errors."""
    if name is not None:
        if name not in names:
            raise ValueError(f"invalid {what} tiles {name!r}; valid: {', '.join(names)}")
        if names[entry(names.index(name))] != name:
            raise ValueError(f"this CPU can't run the {name} tiles (it lacks {lacks})")
    return names[entry(-1)]


def library():
    """The loaded library (ctypes), or None where `available()` says no."""
    return _library()[0] if available()[0] else None


def entry_point():
    """`qp_linear` itself (ctypes, arguments as `run` passes them), or None where `available()` says no."""
    lib = library()
    return None if lib is None else lib.qp_linear


def addresses(lib: ctypes.CDLL | None, *names: str) -> tuple[int, ...]:
    """The addresses of these entry points of a loaded kernel library (0 each where `lib` is None), for
    the C++ graph ops."""
    return tuple(0 if lib is None else ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in names)


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, bool, str]:
    if not envs.cpu_kernel_enabled():
        return None, False, "QUANTPASS_CPU_KERNEL=0"
    machine, capability = platform.machine().lower(), torch.backends.cpu.get_cpu_capability()
    if machine not in ("x86_64", "amd64") or capability not in CAPABILITIES:
        return None, False, f"built for x86-64 CPUs with AVX2; this is {machine} with {capability}"
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return None, False, "this CPU has AMX, which aten's kernels use; ours were never measured against them there"
    lib, reason = load(SOURCE, "using aten's")
    if lib is None:
        return None, False, reason
    with_signatures(lib).qp_int4_vnni(1)  # where the CPU has them (INT4_TILES)
    lib.qp_int8_vnni(1)  # (INT8_TILES)
    lib.qp_decode_rows(DECODE_TILES.index(DECODE_TILES_BY_CPU.get(cpu_family(), DECODE_TILES[0])))
    return lib, True, f"quantpass's AVX2 kernels ({reason})"


def with_signatures(lib: ctypes.CDLL) -> ctypes.CDLL:
    """A build of csrc/linear_avx2.c with its functions' C signatures set (also for bench/kernel_ab.py's
    builds of other versions of the source)."""
    lib.qp_linear.argtypes, lib.qp_linear.restype = _ARGS, ctypes.c_int
    lib.qp_moe.argtypes, lib.qp_moe.restype = _MOE_ARGS, ctypes.c_int
    lib.qp_scratch_bytes.argtypes, lib.qp_scratch_bytes.restype = (I64, I64, I32, I32), I64
    if hasattr(lib, "qp_dequantize"):  # not in builds of older sources (bench/kernel_ab.py)
        lib.qp_dequantize.argtypes, lib.qp_dequantize.restype = (P, P, I64, I64, I64, I32, P, I32, I32), I32
    lib.qp_int4_vnni.argtypes, lib.qp_int4_vnni.restype = (I32,), I32
    if hasattr(lib, "qp_int8_vnni"):  # not in builds of older sources (bench/kernel_ab.py)
        lib.qp_int8_vnni.argtypes, lib.qp_int8_vnni.restype = (I32,), I32
    if hasattr(lib, "qp_decode_rows"):  # not in builds of older sources (bench/kernel_ab.py)
        lib.qp_decode_rows.argtypes, lib.qp_decode_rows.restype = (I32,), I32
    return lib


def format_kernel(source: Path, signatures: dict[str, tuple], name: str):
    """The loader of one format family's kernel library (cpu_fp4.py, cpu_fp8.py): a cached function
    returning (library, ok, reason), the library built on its first call with its functions' C
    signatures set (`signatures`: name -> argument types); `name` ("FP8") for messages. It runs where
    this module's kernels run."""

    @functools.cache
    def library() -> tuple[ctypes.CDLL | None, bool, str]:
        ok, reason = available()  # the same CPUs, settings and compiler
        if not ok:
            return None, False, reason
        lib, reason = load(source, f"{name} runs on the reference")
        if lib is None:
            return None, False, reason
        for function, argtypes in signatures.items():
            entry = getattr(lib, function)
            entry.argtypes, entry.restype = argtypes, ctypes.c_int
        return lib, True, f"quantpass's {name} CPU kernel ({reason})"

    return library


def load(source: Path, fallback: str) -> tuple[ctypes.CDLL | None, str]:
    """(the library built from `source` with the system C compiler, its file name), or (None, why
    not), with a warning saying what runs instead (`fallback`) when the build fails."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler (cc, gcc or $CC) to build it"
    try:
        path = build(compiler, source, after=("-lm",))
        return ctypes.CDLL(str(path)), path.name
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        logger.warning("building csrc/%s failed, %s: %s", source.name, fallback, detail.strip()[-500:])
        return None, f"building csrc/{source.name} with {compiler} failed"


def build(compiler: str, source: Path, flags=FLAGS, variants=((OPENMP,), ()), after=(), depends: str = "") -> Path:
    """The shared library for this source, compiler and flags: from the cache, or compiled into it
    (written under a temporary name, then renamed, so concurrent builders never load half a file).
    `variants`: extra flags tried in order (the first that builds wins); `after`: linker arguments;
    `depends`: anything else the library is built against (a library's version), for the cache key."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    recipe = " ".join((compiler, *flags, *(f for v in variants for f in v), *after, version, depends))
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what it may include
    digest = hashlib.sha256(source.read_bytes() + headers + recipe.encode()).hexdigest()[:16]
    folder = _cache_folder()
    target = folder / f"{source.stem}-{digest}.so"
    if target.exists():
        return target
    start = time.perf_counter()
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so")
    os.close(fd)
    try:
        for extra in variants:
            done = subprocess.run(
                [compiler, *flags, *extra, str(source), "-o", tmp, *after], capture_output=True, text=True
            )
            if done.returncode == 0:
                break
        done.check_returncode()
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built %s in %.1f s (%s): %s", source.name, time.perf_counter() - start, " ".join(extra), target)
    return target


def _cache_folder() -> Path:
    """`$XDG_CACHE_HOME/quantpass` (default ~/.cache/quantpass); if that can't be written, a private
    temporary folder for this process (never a shared one: we load code from it)."""
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "quantpass"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="quantpass-"))
