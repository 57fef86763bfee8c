"""`quantpass::linear_cpu_cxx` and `quantpass::fused_moe_cpu_cxx`: the cpu backend's graph ops as C++
torch.library ops (csrc/linear_op.cpp), so a compiled graph reaches quantpass's C kernels with no
Python body and no ctypes call in between.

At decode each linear's op runs right after the previous kernel streamed megabytes of weights
through the caches, so every interpreted step of a Python op body is a cache miss: the C++ ops do
the same checks and call the kernels' entry points directly (bench/README.md, "CPU decode at the
bandwidth limit", "MoE at decode" and "FP8 and FP4 linears in the C++ graph op" have the
measurements): INT8/INT4 (qp_linear, qp_moe) and the FP8 and FP4 kernels (qp_linear_fp8, qp_moe_fp8,
qp_linear_fp4, qp_moe_fp4). Their schemas are
`quantpass::linear_cpu`'s and `quantpass::fused_moe_cpu`'s, and anything off their fast paths goes to
those ops, so both always agree.

Built on first use with the system C++ compiler against the running torch's headers (~10 s, once
per torch version; cached next to the C kernels, whose FP8 and FP4 libraries it has built too, ~5-8 s
each, once per version of their source). Where it can't be built (no C++ compiler, no torch
headers, the C kernels unavailable, `QUANTPASS_CPU_KERNEL=0`), `op()` and `moe_op()` are None, with
the reason in the log, and graphs call the Python ops.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils.cpp_extension as cpp_extension

from ..moe_problem import ACTIVATIONS as MOE_ACTIVATIONS
from ..moe_problem import GATE_UP_LAYOUTS
from ..quant_registry.formats import AMAX_EPS
from . import cpu_avx2

logger = logging.getLogger("quantpass")

SOURCE = cpu_avx2.CSRC / "linear_op.cpp"
# Both graph ops' tags. Inductor's default for a custom op (exact strides) normalizes each call
# against the schema, so its wrapper passed `input_scale=None` by keyword: on caches the previous
# kernel flushed, a keyword costs a call 25-40 us more (bench/README.md, "A keyword argument per
# call"). Both ops take any strides (off the fast path they call the generic op), so fixing the
# stride order is enough.
GRAPH_OP_TAGS = (torch.Tag.needs_fixed_stride_order,)
FLAGS = ("-O2", "-std=c++20", "-shared", "-fPIC")


def fake_linear(
    x, w_data, w_scale, w_scale2, bias, weight_key, activation_key, backend, out_features, input_scale=None
):
    """Both graph ops' output, for tracing."""
    return x.new_empty((*x.shape[:-1], out_features))


def fake_moe(hidden, *args):
    """Both MoE graph ops' output, for tracing."""
    return torch.empty_like(hidden)


# csrc/linear_op.cpp's `Format`: a row of `Tables.formats`
FORMAT_FIELDS = ("family", "most", "srows", "group", "lut", "act", "act_group", "codes", "input_scale", "moe")


@dataclass(frozen=True)
class Tables:
    """What the C++ ops are set up with (kernels/cpu_graph.py's `graph_tables`). `fast`: (weight key, (bits,
    mode, most rows, the activation key a MoE layer quantizes per token or "")) for qp_linear and
    qp_moe; `formats`: ("weight key|activation key", a row in FORMAT_FIELDS' order) for the format
    kernels, whose entry points are `fp8` (qp_linear_fp8, qp_moe_fp8) and `fp4` (qp_linear_fp4,
    qp_moe_fp4), addresses (0: not built)."""

    fast: tuple[tuple[str, tuple[int, int, int, str]], ...]
    formats: tuple[tuple[str, tuple[int, ...]], ...] = ()
    fp8: tuple[int, int] = (0, 0)
    fp4: tuple[int, int] = (0, 0)


def op(tables: Tables):
    """The C++ linear op, set up with `tables`, or None where it can't be built here (see `reason()`)."""
    return _load(tables)[0] and torch.ops.quantpass.linear_cpu_cxx.default


def moe_op(tables: Tables):
    """The C++ MoE op (`quantpass::fused_moe_cpu`'s arguments), set up as `op` is, or None."""
    return _load(tables)[0] and torch.ops.quantpass.fused_moe_cpu_cxx.default


def reason(tables: Tables) -> str:
    return _load(tables)[1]


@functools.cache
def _load(tables: Tables):
    entry = cpu_avx2.entry_point()
    if entry is None:
        return None, f"quantpass's C kernels are not available: {cpu_avx2.available()[1]}"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return None, "no C++ compiler (c++, g++ or $CXX) to build it"
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    includes = [f"-I{path}" for path in cpp_extension.include_paths()[:1]]
    libraries = [f"-L{path}" for path in cpp_extension.library_paths()]
    after = (*libraries, "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{cpp_extension.library_paths()[0]}")
    flags = (*FLAGS, abi, *includes)
    try:
        path = cpu_avx2.build(compiler, SOURCE, flags=flags, variants=((),), after=after, depends=torch.__version__)
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        detail = (getattr(error, "stderr", "") or str(error)).strip()
        logger.warning("building quantpass's C++ graph op failed, graphs use the Python one: %s", detail[-500:])
        return None, f"building csrc/{SOURCE.name} with {compiler} failed"
    keys = [key for key, _ in tables.fast]
    bits, modes, most, per_token, linear_most = ([row[i] for _, row in tables.fast] for i in range(5))
    address, moe_address = cpu_avx2.addresses(cpu_avx2.library(), "qp_linear", "qp_moe")
    layouts = [str(layout) for layout in GATE_UP_LAYOUTS]
    activations = [str(activation) for activation in MOE_ACTIVATIONS]
    format_keys, format_rows = [key for key, _ in tables.formats], [v for _, row in tables.formats for v in row]
    args = (address, moe_address, keys, bits, modes, most, per_token, linear_most, AMAX_EPS, activations, layouts, tables.fp8[0],
            tables.fp4[0], tables.fp8[1], tables.fp4[1], format_keys, format_rows)  # fmt: skip
    torch.ops.quantpass._cpu_op_setup(*args)
    torch.library.register_fake("quantpass::linear_cpu_cxx")(fake_linear)
    torch.library.register_fake("quantpass::fused_moe_cpu_cxx")(fake_moe)
    return True, f"C++ ops ({Path(path).name})"
