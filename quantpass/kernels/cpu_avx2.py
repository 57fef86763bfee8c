"""Our INT4 (group-128) and INT8 (per-channel) weight-only CPU kernels (csrc/linear_avx2.c), built on
first use.

aten's `_weight_int4pack_mm_for_cpu` is compute-bound on AVX2 machines: batch-1 decode of a
4096x4096 linear measured 1.95-2.06x bf16 `F.linear` here, our INT4 kernel 2.87-3.27x (1 thread)
and 3.24x (2 threads) (AMD EPYC Zen 2, 2026-11-29; bench/README.md). The C source needs no Python or torch headers: the system C
compiler builds it in under a second into a cache folder, ctypes loads it (and releases the GIL
while it runs), and its OpenMP threads come from the libgomp torch already loaded.

Not available, with the reason, when: not an x86-64 AVX2 CPU (AVX-512 ones keep aten's kernel,
wider there and not measured against ours), `QUANTPASS_CPU_KERNEL=0`, or no C compiler (the cpu
backend then uses aten's INT4 kernel).
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

logger = logging.getLogger("quantpass")

SOURCE = Path(__file__).parent / "csrc" / "linear_avx2.c"
GROUP = 128  # INT4 weights per scale
INT8_STEP = 8  # the INT8 kernel reads 8 weights of a row at a time: K must be a multiple
FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC")
OPENMP = "-fopenmp"


def available() -> tuple[bool, str]:
    """(ok, reason): whether this process can run the kernel; builds it on the first call."""
    return _library()[1:]


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Codes (q + 8) uint8 [N, Kp] -> the kernel's "split16" bytes [N, Kp/2] (see the C source)."""
    rows, cols = codes.shape
    runs = codes.view(rows, cols // 16, 2, 8)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(rows, cols // 2).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack`: bytes [N, Kp/2] -> codes uint8 [N, Kp]."""
    rows, half = packed.shape
    runs = packed.view(rows, half // 8, 1, 8)
    return torch.cat([runs & 0xF, runs >> 4], dim=2).reshape(rows, half * 2)


def linear(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, Kp] @ dequantize(data, scale).T -> fp32 [M, N]. INT4: data uint8 [N, Kp/2] from `pack`,
    scale fp32 [N, Kp/128]. INT8: data int8 [N, Kp] (Kp % 8 == 0), scale fp32 [N]. `out`: a contiguous
    fp32 [M, N] to write into (tests pass one poisoned with NaN)."""
    lib, ok, reason = _library()
    if not ok:
        raise RuntimeError(f"quantpass's CPU kernels can't run: {reason}")
    rows, cols = data.shape
    int4 = data.dtype == torch.uint8
    kp, scale_shape = (cols * 2, (rows, cols * 2 // GROUP)) if int4 else (cols, (rows,))
    if x.shape[-1] != kp or kp % (GROUP if int4 else INT8_STEP) or scale.shape != scale_shape:
        raise ValueError(
            f"{'int4' if int4 else 'int8'} kernel shapes: x {tuple(x.shape)}, data {tuple(data.shape)}, "
            f"scale {tuple(scale.shape)}"
        )
    if (
        data.dtype not in (torch.uint8, torch.int8)
        or scale.dtype != torch.float32
        or not (data.is_contiguous() and scale.is_contiguous())
    ):
        raise ValueError(
            f"the kernels want contiguous uint8 (INT4) or int8 data and fp32 scales; got {data.dtype}, {scale.dtype}"
        )
    x = x.to(torch.float32).contiguous()
    if out is None:
        out = torch.empty(x.shape[0], rows, dtype=torch.float32)
    elif out.shape != (x.shape[0], rows) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(
            f"int4 kernel out must be contiguous fp32 {(x.shape[0], rows)}; got {out.dtype} {tuple(out.shape)}"
        )
    kernel = lib.qp_int4_linear if int4 else lib.qp_int8_linear
    kernel(
        x.data_ptr(), data.data_ptr(), scale.data_ptr(), out.data_ptr(), x.shape[0], rows, kp, torch.get_num_threads()
    )
    return out


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, bool, str]:
    if not envs.cpu_kernel_enabled():
        return None, False, "QUANTPASS_CPU_KERNEL=0"
    machine, capability = platform.machine().lower(), torch.backends.cpu.get_cpu_capability()
    if machine not in ("x86_64", "amd64") or capability != "AVX2":
        # AVX-512 machines keep aten's kernel: it runs 16 lanes wide there (and AMX where present),
        # and ours has only been measured against it on AVX2.
        return None, False, f"built for x86-64 AVX2 machines without AVX-512; this is {machine} with {capability}"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, False, "no C compiler (cc, gcc or $CC) to build it"
    try:
        path = _build(compiler)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        logger.warning("building quantpass's CPU kernels failed, using aten's: %s", detail.strip()[-500:])
        return None, False, f"building csrc/linear_avx2.c with {compiler} failed"
    for kernel in (lib.qp_int4_linear, lib.qp_int8_linear):
        kernel.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        kernel.restype = None
    return lib, True, f"quantpass's AVX2 kernels ({path.name})"


def _build(compiler: str) -> Path:
    """The shared library for this source, compiler and flags: from the cache, or compiled into it
    (written under a temporary name, then renamed, so concurrent builders never load half a file)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join((compiler, *FLAGS, version)).encode()).hexdigest()[:16]
    folder = _cache_folder()
    target = folder / f"linear_avx2-{digest}.so"
    if target.exists():
        return target
    start = time.perf_counter()
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so")
    os.close(fd)
    try:
        for extra in ((OPENMP,), ()):  # single-threaded if the compiler has no OpenMP
            done = subprocess.run([compiler, *FLAGS, *extra, str(SOURCE), "-o", tmp], capture_output=True, text=True)
            if done.returncode == 0:
                break
        done.check_returncode()
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    threads = "OpenMP" if extra else "single-threaded: the compiler has no OpenMP"
    logger.info("built quantpass's CPU kernels in %.1f s (%s): %s", time.perf_counter() - start, threads, target)
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
