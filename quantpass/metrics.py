"""Accuracy measures shared by verify, the CLI report, benchmarks and tests."""

from __future__ import annotations

import torch


def sqnr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `actual` against `reference`, in dB (inf if equal)."""
    reference, actual = reference.detach().double(), actual.detach().double()
    noise = (reference - actual).pow(2).mean()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(reference.pow(2).mean() / noise))


def cosine(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """Cosine similarity of the two tensors, flattened."""
    return float(
        torch.nn.functional.cosine_similarity(
            reference.detach().double().flatten(), actual.detach().double().flatten(), dim=0
        )
    )
