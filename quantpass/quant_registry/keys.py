"""QuantKey: what a quantized operand is made of (element dtype, scales, grouping).

Convention (docs/design.md §4): a group shape is (rows, cols) in the operand's own layout, `-1` meaning
the whole extent. Activations are `[M, K]`, weights `[N, K]` as in `nn.Linear`, so per-token
activations and per-output-channel weights are both `(1, -1)`. Weights use static keys (scales
computed once from the weight), activations dynamic keys (scales computed per call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Element dtypes. fp4 e2m1 is stored two per byte (`uint8`) and int4 likewise, but the key names
# the logical element type so that names and messages say what the numbers are.
FP8 = torch.float8_e4m3fn
FP4 = torch.float4_e2m1fn_x2
E8M0 = torch.float8_e8m0fnu
INT8 = torch.int8
INT4 = torch.int4


@dataclass(frozen=True)
class GroupShape:
    """(rows, cols) sharing one scale; -1 means the whole extent of that dim."""

    row: int
    col: int

    def __str__(self) -> str:
        named = {(-1, -1): "per-tensor", (1, -1): "per-row"}
        return named.get((self.row, self.col), f"{self.row}x{self.col}")

    def size(self, rows: int, cols: int) -> tuple[int, int]:
        """The concrete group size for an operand of `rows x cols`."""
        return (rows if self.row == -1 else self.row, cols if self.col == -1 else self.col)


PER_TENSOR = GroupShape(-1, -1)
PER_ROW = GroupShape(1, -1)  # per-token activations, per-output-channel weights


@dataclass(frozen=True)
class ScaleDesc:
    dtype: torch.dtype
    static: bool
    group_shape: GroupShape

    def __str__(self) -> str:
        kind = "static" if self.static else "dynamic"
        return f"{_dtype_name(self.dtype)} {kind} {self.group_shape}"


@dataclass(frozen=True)
class QuantKey:
    dtype: torch.dtype
    scale: ScaleDesc
    scale2: ScaleDesc | None = None
    symmetric: bool = True

    def __str__(self) -> str:
        name = KEY_NAMES.get(self)
        return name if name is not None else self.describe()

    def describe(self) -> str:
        """A structural description; never fails, registered or not."""
        try:
            parts = [_dtype_name(self.dtype), f"scale={self.scale}"]
            if self.scale2 is not None:
                parts.append(f"scale2={self.scale2}")
            parts.append("sym" if self.symmetric else "asym")
            return "QuantKey(" + ", ".join(parts) + ")"
        except Exception:  # a malformed key built by hand must still print
            return object.__repr__(self)

    __repr__ = __str__

    @property
    def static(self) -> bool:
        return self.scale.static

    @property
    def group_shape(self) -> GroupShape:
        return self.scale.group_shape

    @property
    def bits(self) -> int:
        return 4 if self.dtype in (FP4, INT4) else 8


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _key(dtype, scale_dtype, static, group, scale2=None) -> QuantKey:
    return QuantKey(dtype, ScaleDesc(scale_dtype, static, group), scale2)


F32 = torch.float32
BLOCK_128 = GroupShape(128, 128)
GROUP_1x128 = GroupShape(1, 128)
GROUP_1x32 = GroupShape(1, 32)
GROUP_1x16 = GroupShape(1, 16)

kFp8StaticTensorSym = _key(FP8, F32, True, PER_TENSOR)
kFp8DynamicTensorSym = _key(FP8, F32, False, PER_TENSOR)
kFp8StaticChannelSym = _key(FP8, F32, True, PER_ROW)
kFp8DynamicTokenSym = _key(FP8, F32, False, PER_ROW)
kFp8Static128BlockSym = _key(FP8, F32, True, BLOCK_128)
kFp8Dynamic128Sym = _key(FP8, F32, False, GROUP_1x128)
kMxfp8Static = _key(FP8, E8M0, True, GROUP_1x32)
kMxfp8Dynamic = _key(FP8, E8M0, False, GROUP_1x32)
kMxfp4Static = _key(FP4, E8M0, True, GROUP_1x32)
kMxfp4Dynamic = _key(FP4, E8M0, False, GROUP_1x32)
# NVFP4: e4m3 scale per 1x16 times an fp32 per-tensor global scale (the second level).
kNvfp4Static = _key(FP4, FP8, True, GROUP_1x16, ScaleDesc(F32, True, PER_TENSOR))
kNvfp4Dynamic = _key(FP4, FP8, False, GROUP_1x16, ScaleDesc(F32, False, PER_TENSOR))
kInt8StaticChannelSym = _key(INT8, F32, True, PER_ROW)
kInt8DynamicTokenSym = _key(INT8, F32, False, PER_ROW)
kInt4StaticGroup128Sym = _key(INT4, F32, True, GROUP_1x128)
# Activations with a static (calibrated) scale, read from a pre-quantized checkpoint's `input_scale`:
# FP8 per-tensor is the weight key's numeric description used for activations; NVFP4 keeps per-call
# block scales under a static global scale (ModelOpt's NVFP4 `input_scale`).
kNvfp4CalibratedGlobal = QuantKey(FP4, ScaleDesc(FP8, False, GROUP_1x16), ScaleDesc(F32, True, PER_TENSOR))

# Every registered key by its constant name (unique). Role-aware format names live in spec.py.
KEYS: dict[str, QuantKey] = {
    name: value for name, value in dict(globals()).items() if name.startswith("k") and isinstance(value, QuantKey)
}
KEY_NAMES: dict[QuantKey, str] = {key: name for name, key in KEYS.items()}


def register_key(name: str, key: QuantKey) -> QuantKey:
    """Name a new key (graph ops carry keys by name): `k<Name>`, unique, the key not yet named."""
    if not name.startswith("k") or name in KEYS or key in KEY_NAMES:
        taken = KEY_NAMES.get(key, name if name in KEYS else None)
        raise ValueError(f"invalid key name {name!r}: names start with 'k' and are unique (taken: {taken})")
    KEYS[name], KEY_NAMES[key] = key, name
    return key


def unregister_key(name: str) -> None:
    if name not in KEYS:
        raise ValueError(f"invalid key name {name!r}; valid: {', '.join(KEYS)}")
    del KEY_NAMES[KEYS.pop(name)]


STATIC_ACTIVATION_KEYS = frozenset({kFp8StaticTensorSym, kNvfp4CalibratedGlobal})


def needs_input_scale(activation: QuantKey | None) -> bool:
    """An activation key whose (global) scale is static: the layer must carry its `input_scale`."""
    return activation in STATIC_ACTIVATION_KEYS


def key_name(key: QuantKey | None) -> str | None:
    """Reverse lookup: the registered constant name of a key (None for None)."""
    if key is None:
        return None
    return KEY_NAMES.get(key, key.describe())
