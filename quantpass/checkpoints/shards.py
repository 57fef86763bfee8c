"""Safetensors shards read one tensor at a time with plain reads, and written the same way.

Not memory-mapped: the pages of a mapped file count in the process's RSS once touched, so reading a
checkpoint through a mapping holds all of it in RSS until the mapping closes; quantize-on-load
must hold only one layer's full-precision values at a time. The format is an 8-byte little-endian
header length, a JSON header (name -> dtype, shape, data_offsets), then the raw bytes.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import torch

DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class Entry:
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: str) -> tuple[dict[str, Entry], dict]:
    """name -> Entry for every tensor of one shard, and the shard's metadata."""
    with open(path, "rb") as f:
        try:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        except (struct.error, ValueError) as error:  # empty, truncated or not safetensors
            raise ValueError(f"{path}: not a readable safetensors file ({error})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a readable safetensors file (its header is no JSON object)")
    metadata = header.pop("__metadata__", {}) or {}
    entries = {}
    for name, info in header.items():
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}; readable: {', '.join(DTYPES)}")
        begin, end = info["data_offsets"]
        entries[name] = Entry(path, DTYPES[info["dtype"]], tuple(info["shape"]), 8 + length + begin, end - begin)
    return entries, metadata


def index(directory: str) -> dict[str, Entry]:
    """Every tensor of a checkpoint directory (`*.safetensors`, one shard or many), by name."""
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors files")
    entries: dict[str, Entry] = {}
    for name in files:
        entries.update(read_header(os.path.join(directory, name))[0])
    listed = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(listed):  # a sharded checkpoint: every shard its index names must be here
        with open(listed) as f:
            weight_map = json.load(f).get("weight_map") or {}
        missing = sorted({shard for shard in weight_map.values() if shard not in files})
        if missing:
            raise FileNotFoundError(f"{directory}: model.safetensors.index.json lists shard(s) not there: {missing}")
    return entries


def read(entry: Entry) -> torch.Tensor:
    """One tensor, read into fresh memory (never a mapping of the file)."""
    out = torch.empty(entry.nbytes, dtype=torch.uint8)
    with open(entry.path, "rb") as f:
        f.seek(entry.start)
        if f.readinto(memoryview(out.numpy())) != entry.nbytes:
            raise OSError(f"{entry.path}: truncated tensor data")
    return out.view(entry.dtype).reshape(entry.shape)


def write(path: str, tensors: Iterator[tuple[str, torch.Tensor]] | dict, metadata: dict | None = None) -> None:
    """Write tensors (name -> CPU tensor) as one safetensors file, names sorted as safetensors does."""
    items = sorted(dict(tensors).items())
    header, offset = {}, 0
    for name, tensor in items:
        if tensor.dtype not in NAMES:
            raise ValueError(f"cannot write {name!r}: dtype {tensor.dtype}; writable: {', '.join(map(str, NAMES))}")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for _, tensor in items:
            f.write(memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
