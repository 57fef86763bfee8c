"""Launch configs for the GEMM kernel: tuned JSON for the fused MoE, named heuristics, autotune lists.

A config is a dict of BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages.

- Fused MoE: `moe_config` reads `configs/E={E},N={N},device_name={device},dtype={dtype}[,block_shape=[r,c]].json`
  (N = the intermediate size, dtype = `GemmScheme.name`), `{"source": how it was made, "configs":
  {M: config}}`, and takes the entry whose M is nearest the token count. Without a file it falls back
  to `default_moe_config`. Produce a file with `write_moe_configs` (a tuning sweep on the target GPU).
- Dense GEMM on CUDA: `triton.autotune` over `dense_gemm_configs(N, K, bucketed M)`.
- Under the interpreter: `interpreter_config` (its cost is per program and per K step: few, big blocks).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from .scheme import Element, GemmMode, GemmScheme, ScaleMode

CONFIG_DIR = Path(__file__).parent / "configs"
M_BUCKETS = (16, 64, 256, 1024, 4096)  # decode, small batch, ..., prefill: one autotune run per bucket
META = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")  # a config's constexprs
LAUNCH = ("num_warps", "num_stages")  # and its launch options
DEFAULT_SMS = 132  # H100 / H200 SXM; what split_k assumes without a CUDA device (compile-only checks)


def m_bucket(m: int) -> int:
    return next((bucket for bucket in M_BUCKETS if m <= bucket), M_BUCKETS[-1])


def _config(block_m, block_n, block_k, group_m=8, num_warps=4, num_stages=3) -> dict:
    return dict(
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=num_warps, num_stages=num_stages
    )


def fit_block_k(config: dict, scheme: GemmScheme) -> dict:
    """Clamp BLOCK_K to what the scheme allows: a K step must sit inside one scale group when scales are
    applied per step (1x128 activations, 128x128 blocks), and cover whole e8m0 groups for MX."""
    limits = [
        scheme.a_group_k if scheme.a_scale == ScaleMode.GROUP else 0,
        scheme.b_group[1] if scheme.b_scale == ScaleMode.BLOCK else 0,
    ]
    if scheme.mode == GemmMode.DOT and any(limits):
        config["BLOCK_K"] = min([config["BLOCK_K"], *[limit for limit in limits if limit]])
    if scheme.mode == GemmMode.DOT_SCALED:
        config["BLOCK_K"] = max(config["BLOCK_K"], 32)
    return config


def interpreter_config(m: int, n: int) -> dict:
    """TRITON_INTERPRET=1: ~5 ms per program per K step almost regardless of tile size (numpy on
    tiles), so cover small test shapes with few programs; BLOCK_M 16 keeps tl.dot's GPU minimum."""
    block_m = min(max(16, 1 << max(m - 1, 0).bit_length()), 64)
    block_n = min(max(16, 1 << max(n - 1, 0).bit_length()), 128)
    return _config(block_m, block_n, 128, group_m=1)


def dense_gemm_configs(n: int, k: int, m_bucket: int, scheme: GemmScheme | None = None) -> list[dict]:
    """Autotune candidates for a dense GEMM on CUDA, keyed on (N, K, bucketed M) and the scheme.

    Decode (M <= 16) is bound by weight bytes: narrow BLOCK_M, long K steps, several N widths. Larger
    M is compute bound: 128x128 and 64x256 tiles with 8 warps (untuned: no GPU was available). Left
    out because they spill registers (`ptxas -v` via tests/triton_aot.py, sm90 and sm100, 2026-12-01):
    128x256 tiles (the fp32 accumulator plus the precise-FP8 partial one need > 255 registers per
    thread; INT8's int32 one alone fits: kept for INT8), 128x128 with 4 warps, and for tl.dot_scaled
    (MX, sm90) 16x128x256 decode and 64x128 4-warp tiles (12-116 B each).
    """
    mx = scheme is not None and scheme.mode == GemmMode.DOT_SCALED
    if m_bucket <= 16:
        shapes = [(bn, bk) for bn in (32, 64, 128) for bk in (128, 256) if not (mx and bn * bk > 128 * 128)]
        configs = [_config(16, bn, bk, 1, 4, stages) for bn, bk in shapes for stages in (3, 5)]
    elif m_bucket <= 64:
        shapes = [(bm, bn) for bm in (32, 64) for bn in (64, 128) if not (mx and bm * bn >= 64 * 128)]
        configs = [_config(bm, bn, 128, 8, 4, stages) for bm, bn in shapes for stages in (3, 4)]
    else:
        configs = [_config(128, 128, 64, 8, 8, 3), _config(128, 128, 128, 8, 8, 3), _config(128, 128, 128, 8, 8, 4)]
        configs += [_config(64, 256, 128, 8, 8, 3)] + [_config(64, 128, 128, 8, 4, 4)] * (not mx)
        if scheme is not None and scheme.a_format == Element.INT8:
            configs += [_config(128, 256, 128, 8, 8, 3)]
    if n < 128:  # no tile wider than the matrix
        configs = [c for c in configs if c["BLOCK_N"] <= max(32, n)] or configs[:1]
    return configs


def split_k(rows: int, n: int, k: int, device: torch.device) -> int:
    """Programs along K for a dense GEMM: decode (M <= 16) reads the weight once, and N = 4096 in
    64-wide tiles is 64 programs for 132 SMs. Split K (each split keeping >= 1024 of it) until there
    are at least two programs per SM at BLOCK_N = 64; larger M has enough tiles already."""
    if rows > M_BUCKETS[0]:
        return 1
    target = 2 * sm_count(device)
    tiles = -(-n // 64)
    split = 1
    while tiles * split < target and k // (2 * split) >= 1024:
        split *= 2
    return split


@functools.cache
def sm_count(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SMS


@functools.cache
def autotuned(kernel, scheme: GemmScheme, n: int, k: int, bucket: int, split: int = 1):
    """`triton.autotune` over `dense_gemm_configs`, one tuner per (scheme, N, K, M bucket, split-K)."""
    import triton

    configs, seen = [], set()
    for config in dense_gemm_configs(n, k, bucket, scheme):
        config = fit_block_k(config, scheme)
        meta = {key: config[key] for key in META}
        token = (*meta.values(), config["num_warps"], config["num_stages"])
        if token not in seen:
            seen.add(token)
            configs.append(triton.Config(meta, num_warps=config["num_warps"], num_stages=config["num_stages"]))
    return triton.autotune(configs=configs, key=[])(kernel)


# (scheme, N, K, M bucket, split-K, A dtype, C dtype) -> the config the autotuner chose: later calls
# launch the kernel with it directly (an autotuner's own dispatch costs tens of microseconds per call).
TUNED: dict[tuple, dict] = {}


def remember(key: tuple, autotuner) -> None:
    """Record the config `autotuner` chose on its first run (nothing if it never ran a config)."""
    best = getattr(autotuner, "best_config", None)
    if best is not None:
        TUNED[key] = {**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages}


def default_moe_config(tokens: int, num_experts: int, top_k: int, scheme: GemmScheme, sm: int | None = None) -> dict:
    """Heuristic fused-MoE config (untuned: no GPU here when written); `sm` the target (None: assume sm90).

    Rows per expert ~ tokens * top_k / E sets BLOCK_M: decode gets 16-row blocks (tl.dot's minimum),
    a few dozen rows 32. Many rows per expert get 128x128x128, 8 warps, 4 stages: 64x128 tiles with
    8 warps are bound by shared-memory bandwidth on sm90 (compile-only review), and 128x256 ones spill
    with the precise FP8 accumulation (~400 B, ptxas, tests/triton_aot.py). Where 128 rows spill too,
    64x128x128 (8 warps, 4 stages): per-step scales (block FP8, 1x128 activation groups: a second fp32
    tile; sm90 52-88 B, sm100 444 B) and tl.dot_scaled's upcast below SM100 (8-16 B, triton 3.6).
    Block-FP8 keeps BLOCK_K = 128.
    """
    rows_per_expert = tokens * top_k / max(num_experts, 1)
    emulated_mx = scheme.mode == GemmMode.DOT_SCALED and (sm or 90) < 100
    if rows_per_expert <= 16:
        config = _config(16, 64, 128, 1, 4, 4)
    elif rows_per_expert <= 128:
        config = _config(32, 64, 128, 8, 4, 3)
    elif scheme.b_scale == ScaleMode.BLOCK or scheme.a_scale == ScaleMode.GROUP or emulated_mx:
        config = _config(64, 128, 128, 16, 8, 4)
    else:
        config = _config(128, 128, 128, 16, 8, 4)
    return fit_block_k(config, scheme)


def target_sm() -> int | None:
    """The CUDA arch Triton compiles for now (a stand-in driver's in compile-only checks), or None."""
    try:
        from triton.runtime import driver

        target = driver.active.get_current_target()
    except Exception:  # no driver: CPU without the interpreter's stand-in
        return None
    return target.arch if target.backend == "cuda" and isinstance(target.arch, int) else None


@functools.cache
def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name().replace(" ", "_")
    return "cpu"


def config_file_name(num_experts: int, n: int, device: str, dtype: str, block_shape: tuple[int, int] | None) -> str:
    block = "" if block_shape is None else f",block_shape=[{block_shape[0]},{block_shape[1]}]"
    return f"E={num_experts},N={n},device_name={device},dtype={dtype}{block}.json"


@functools.cache
def _load(path: Path) -> dict[int, dict] | None:
    if not path.is_file():
        return None
    table = json.loads(path.read_text())
    return {int(m): config for m, config in table["configs"].items()}


def moe_config(
    tokens: int,
    num_experts: int,
    top_k: int,
    intermediate_size: int,
    scheme: GemmScheme,
    device: str | None = None,
    config_dir: Path | None = None,
) -> dict:
    """The tuned config of the nearest M in this shape's JSON file, else `default_moe_config`."""
    block_shape = scheme.b_group if scheme.b_scale == ScaleMode.BLOCK else None
    name = config_file_name(num_experts, intermediate_size, device or device_name(), scheme.name, block_shape)
    table = _load((config_dir or CONFIG_DIR) / name)
    if table:
        nearest = min(table, key=lambda m: (abs(m - tokens), m))
        return fit_block_k({**default_moe_config(tokens, num_experts, top_k, scheme), **table[nearest]}, scheme)
    return default_moe_config(tokens, num_experts, top_k, scheme, target_sm())


def write_moe_configs(path: Path, configs: dict[int, dict], source: str) -> None:
    """Write a config file; `source` says how the numbers were produced (a sweep, or defaults)."""
    table = {"source": source, "configs": {str(m): configs[m] for m in sorted(configs)}}
    path.write_text(json.dumps(table, indent=1) + "\n")
