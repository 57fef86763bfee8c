"""QTensor: a quantized tensor as plain tensors plus the key that says how to read them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .keys import QuantKey


@dataclass
class QTensor:
    """`data` and `scale` (and NVFP4's global `scale2`) of a tensor quantized with `key`.

    Layout (formats.py): `data` keeps the rows of the original `[..., R, C]` and pads the last dim
    to a multiple of the key's column group (packed two per byte for 4-bit elements); `scale` is
    `[..., ceil(R / group_rows), ceil(C / group_cols)]` with whole-extent groups giving size 1.
    `shape` and `dtype` are the original tensor's, restored by `dequantize`.

    `input_scale`: a weight from a pre-quantized checkpoint may carry its layer's calibrated static
    activation scale (fp32, `[]`, or `[E]` per expert), used by activation keys that need one
    (`keys.needs_input_scale`); it is not part of the weight's own numbers.
    """

    data: torch.Tensor
    scale: torch.Tensor
    scale2: torch.Tensor | None
    key: QuantKey
    shape: torch.Size
    dtype: torch.dtype
    input_scale: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return (self.data, self.scale, self.scale2)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors() if t is not None)

    def __getitem__(self, index: int) -> QTensor:
        """One matrix of a batched `[E, N, K]` tensor (one expert)."""
        input_scale = self.input_scale
        return QTensor(
            self.data[index],
            self.scale[index],
            None if self.scale2 is None else self.scale2[index],
            key=self.key,
            shape=self.shape[1:],
            dtype=self.dtype,
            input_scale=input_scale[index] if input_scale is not None and input_scale.dim() else input_scale,
        )

    def rows(self, start: int, stop: int) -> QTensor:
        """Rows `start:stop` of a `[..., R, C]` tensor with their own scales; `start` must begin a
        row group (a scale spanning every row, per-tensor or NVFP4's second level, is shared)."""
        group_rows = self.key.group_shape.row
        stop = min(stop, self.shape[-2])
        if group_rows != -1 and start % group_rows:
            raise ValueError(f"rows {start}:{stop} split a group of {group_rows} rows of {self.key}")
        scale = self.scale if group_rows == -1 else self.scale[..., start // group_rows : -(-stop // group_rows), :]
        shape = torch.Size((*self.shape[:-2], stop - start, self.shape[-1]))
        return QTensor(self.data[..., start:stop, :], scale, self.scale2, self.key, shape, self.dtype, self.input_scale)

    def contiguous(self) -> QTensor:
        """Itself where data and scale are contiguous, else a QTensor with contiguous copies of them."""
        data, scale = self.data.contiguous(), self.scale.contiguous()
        if data is self.data and scale is self.scale:
            return self
        return QTensor(data, scale, self.scale2, self.key, self.shape, self.dtype, self.input_scale)

    def to(self, device) -> QTensor:
        moved = [None if t is None else t.to(device) for t in (*self.tensors(), self.input_scale)]
        return QTensor(*moved[:3], key=self.key, shape=self.shape, dtype=self.dtype, input_scale=moved[3])

    def __repr__(self) -> str:
        scale2 = "" if self.scale2 is None else f", scale2={tuple(self.scale2.shape)}"
        return (
            f"QTensor({self.key}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"data={tuple(self.data.shape)}:{self.data.dtype}, scale={tuple(self.scale.shape)}:{self.scale.dtype}"
            f"{scale2})"
        )
