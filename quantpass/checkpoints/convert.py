"""A checkpoint's tensors <-> quantpass QTensors, both ways, derived from the weight key.

quantpass's layout (formats.py): data `[..., N, K']` with K' = K padded to the key's column group
(packed two per byte, low nibble first, for 4-bit elements), scale `[..., ceil(N/gr), ceil(K/gc)]`,
NVFP4's global scale2 `[..., 1, 1]`. Checkpoints store data unpadded and drop the scale dims a
whole-extent group makes trivial (per-tensor `[]`, per-channel `[N]`); NVFP4's block scales
`[N, K/16]` e4m3, MX scales `[N, K/32]` uint8 e8m0 bytes (2^(b - 127)) and FP4 nibbles are already
ours. Only an algo's named hooks (algos.HOOKS) see anything else.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from ..quant_registry.formats import ELEMENTS, dequantize, padded_cols, quantize, scale_shape
from ..quant_registry.keys import QuantKey
from ..quant_registry.qtensor import QTensor
from .algos import EXTRA_ROLES, HOOKS, Algo

logger = logging.getLogger("quantpass")


def stored_scale_shape(key: QuantKey, shape: torch.Size) -> tuple[int, ...]:
    """The scale's shape in a checkpoint: ours without the dims of whole-extent groups."""
    full = list(scale_shape(key, shape))
    if key.group_shape.col == -1:
        full.pop(-1)
    if key.group_shape.row == -1:
        full.pop(-2 if key.group_shape.col != -1 else -1)
    return tuple(full)


def _stored_cols(key: QuantKey, cols: int) -> int:
    return cols // 2 if ELEMENTS[key.dtype].packed else cols


def roles(algo: Algo) -> tuple[str, ...]:
    """Tensor roles to read for one weight: the algo's own, plus those a hook reads to drop."""
    extra = tuple(role for hook in algo.hooks for role in EXTRA_ROLES.get(hook, ()))
    return (*algo.tensors, *extra)


def to_qtensor(algo: Algo, tensors: dict, shape: torch.Size, dtype: torch.dtype, name: str) -> QTensor:
    """One weight's checkpoint tensors (role -> tensor) as a QTensor of logical `shape` `[..., N, K]`."""
    key, shape = algo.weight, torch.Size(shape)
    want = {"data": (*shape[:-1], _stored_cols(key, shape[-1])), "scale": scale_shape(key, shape)}
    for hook in algo.hooks:
        tensors = {role: HOOKS[hook](role, t, want.get(role)) for role, t in tensors.items()}
        tensors = {role: t for role, t in tensors.items() if t is not None}
    missing = [role for role in algo.tensors if role not in tensors]
    if missing:
        raise ValueError(f"{name}: {algo.name} needs its {', '.join(missing)} tensor(s); the checkpoint has none")
    _check_dtypes(key, tensors, name, algo.name)
    data = tensors["data"]
    if tuple(data.shape) != want["data"]:
        raise ValueError(f"{name}: {algo.name} data has shape {tuple(data.shape)}, expected {want['data']}")
    pad = _stored_cols(key, padded_cols(key, shape[-1])) - data.shape[-1]
    if pad:  # a partial last column group (e.g. 128x128 blocks over K = 200): zero columns, as formats.py pads
        data = F.pad(data.view(torch.uint8), (0, pad)).view(data.dtype)
    scale = tensors["scale"]
    if scale.numel() != torch.Size(want["scale"]).numel():
        raise ValueError(f"{name}: {algo.name} scale has shape {tuple(scale.shape)}, expected {want['scale']}")
    if _storage_dtypes(key)[1] == torch.float32:  # bf16 scales (compressed-tensors'): the same values in fp32
        scale = scale.float()
    scale2, input_scale = tensors.get("scale2"), tensors.get("input_scale")
    return QTensor(
        data=data.contiguous(),
        scale=scale.reshape(want["scale"]).contiguous(),
        scale2=None if scale2 is None else scale2.float().reshape(*shape[:-2], 1, 1),
        key=key,
        shape=shape,
        dtype=dtype,
        input_scale=None if input_scale is None else input_scale.float(),
    )


@functools.cache
def _storage_dtypes(key: QuantKey) -> tuple[torch.dtype, torch.dtype]:
    """The data and scale dtypes quantpass holds the key's weights in (formats.quantize's)."""
    qt = quantize(torch.ones(128, 128), key)
    return qt.data.dtype, qt.scale.dtype


def _check_dtypes(key: QuantKey, tensors: dict, name: str, algo: str) -> None:
    """Stored bytes read as the key's elements only in its own dtype: FP8 data stored as int8, say, would
    load as garbage that verify then blames on the kernel. fp32 scales may come in any float dtype."""
    data, scale = _storage_dtypes(key)
    found = {"data": tensors["data"].dtype, "scale": tensors["scale"].dtype}
    allowed = {
        "data": {data},
        "scale": {scale, torch.float8_e8m0fnu} if scale == torch.uint8 else {scale} if scale.itemsize == 1 else None,
    }
    for role, dtype in found.items():
        ok = dtype.is_floating_point and dtype.itemsize >= 2 if allowed[role] is None else dtype in allowed[role]
        if not ok:
            want = "a float dtype" if allowed[role] is None else " or ".join(sorted(map(str, allowed[role])))
            raise ValueError(f"{name}: {algo} {role} is stored as {dtype}; {key} reads it as {want}")


def from_qtensor(algo: Algo, qt: QTensor, shapes: dict | None = None, dtypes: dict | None = None) -> dict:
    """The checkpoint tensors (role -> tensor) for one weight. `shapes` / `dtypes`: role -> the shape and
    float dtype a loaded checkpoint stored it in, where they differ from ours (byte-identical round trips)."""
    key, shape = qt.key, qt.shape
    out = {
        "data": qt.data[..., : _stored_cols(key, shape[-1])].contiguous(),
        "scale": qt.scale.reshape(stored_scale_shape(key, shape)),
    }
    if "scale2" in algo.tensors:
        out["scale2"] = qt.scale2.reshape(shape[:-2])
    if "input_scale" in algo.tensors:
        out["input_scale"] = qt.input_scale
    if "gpt_oss_blocks" in algo.hooks:
        out["data"] = out["data"].unflatten(-1, (-1, key.group_shape.col // 2))
    if "e8m0_scale" in algo.hooks:  # power-of-two scales: exact as e8m0 bytes again
        out["scale"] = out["scale"].to(torch.float8_e8m0fnu)
    if "inverse_global_scale" in algo.hooks:  # stored as reciprocals: the read hook is its own inverse
        out = {role: HOOKS["inverse_global_scale"](role, tensor, None) for role, tensor in out.items()}
    if "offset_128" in algo.hooks:  # its own inverse
        out["data"] = HOOKS["offset_128"]("data", out["data"], None)
    if "int32_words" in algo.hooks:  # the bytes as int32 words (a partial last word zero-padded), and the shape
        out["data"] = F.pad(out["data"], (0, -out["data"].shape[-1] % 4)).view(torch.int32)
        out["shape"] = torch.tensor(shape[-2:])
    for role, stored in (shapes or {}).items():
        if role in out and out[role].numel() == torch.Size(stored).numel():
            out[role] = out[role].reshape(stored)
    for role, stored in (dtypes or {}).items():
        if role in out and out[role].dtype.is_floating_point and stored.is_floating_point and stored.itemsize >= 2:
            out[role] = out[role].to(stored)
    return out


# ---------------------------------------------------------------------------- rows and experts
def _same(tensors) -> bool:
    tensors = [t for t in tensors if t is not None]
    return all(torch.equal(tensors[0], t) for t in tensors[1:])


def join_rows(parts: list[QTensor], name: str) -> QTensor:
    """Weights of one input stacked along rows (an expert's gate then up projection -> w13). Exact
    when their shared scales agree and row groups don't straddle parts (ModelOpt gives fused
    projections one scale); otherwise quantized again from the dequantized values, with a warning."""
    key, first = parts[0].key, parts[0]
    group_rows = key.group_shape.row
    exact = (
        (group_rows != -1 or _same([p.scale for p in parts]))
        and (group_rows in (-1, 1) or all(p.shape[-2] % group_rows == 0 for p in parts[:-1]))
        and _same([p.scale2 for p in parts])
    )
    input_scale = first.input_scale
    if not _same([p.input_scale for p in parts]):
        input_scale = torch.stack([p.input_scale for p in parts]).amax(0)
        logger.warning("quantpass: %s: the parts' input scales differ; using their maximum", name)
    rows = sum(p.shape[-2] for p in parts)
    shape = torch.Size((*first.shape[:-2], rows, first.shape[-1]))
    if not exact:
        logger.warning("quantpass: %s: parts quantized with different shared scales; quantizing them again", name)
        joined = quantize(torch.cat([dequantize(p, torch.float32) for p in parts], dim=-2), key, name)
        return QTensor(*joined.tensors(), key, shape, first.dtype, input_scale=input_scale)
    data = torch.cat([p.data for p in parts], dim=-2)
    scale = first.scale if group_rows == -1 else torch.cat([p.scale for p in parts], dim=-2)
    return QTensor(data, scale, first.scale2, key, shape, first.dtype, input_scale=input_scale)


def split_rows(qt: QTensor, sizes: list[int], name: str) -> list[QTensor]:
    """Inverse of `join_rows`: w13 -> gate, up (each keeps the shared scales)."""
    group_rows = qt.key.group_shape.row
    if group_rows not in (-1, 1) and any(size % group_rows for size in sizes[:-1]):
        dense = dequantize(qt, torch.float32).split(sizes, dim=-2)
        logger.warning("quantpass: %s: row groups straddle the split; quantizing the parts again", name)
        return [_with_input_scale(quantize(d.contiguous(), qt.key, name), qt) for d in dense]
    datas = qt.data.split(sizes, dim=-2)
    if group_rows == -1:
        scales = [qt.scale] * len(sizes)
    else:
        scales = qt.scale.split([size // group_rows for size in sizes], dim=-2)
    return [
        QTensor(d.contiguous(), s.contiguous(), qt.scale2, qt.key, torch.Size((*qt.shape[:-2], size, qt.shape[-1])),
                qt.dtype, input_scale=qt.input_scale)
        for d, s, size in zip(datas, scales, sizes)
    ]  # fmt: skip


def _with_input_scale(part: QTensor, like: QTensor) -> QTensor:
    return QTensor(*part.tensors(), part.key, part.shape, like.dtype, input_scale=like.input_scale)


def stack_experts(experts: list[QTensor]) -> QTensor:
    """One QTensor per expert `[N, K]` -> `[E, N, K]` (input scales `[E]`)."""
    first = experts[0]
    stack = lambda tensors: None if tensors[0] is None else torch.stack(tensors)  # noqa: E731
    return QTensor(
        torch.stack([e.data for e in experts]),
        torch.stack([e.scale for e in experts]),
        stack([e.scale2 for e in experts]),
        first.key,
        torch.Size((len(experts), *first.shape)),
        first.dtype,
        input_scale=stack([e.input_scale for e in experts]),
    )
