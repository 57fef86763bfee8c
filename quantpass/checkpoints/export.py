"""Which rows a quantized model is written in.

A layer's candidates are the rows that store its weight key and keep the activations its graph runs
(`exact_rows`), a loaded checkpoint's own row first. One checkpoint holds one producer's rows, so the
first producer with a candidate for every layer writes them all: the loaded checkpoint's, then
ModelOpt's, transformers' fine-grained FP8 (one row for the whole model), compressed-tensors'.
"""

from __future__ import annotations

from ..quant_registry.keys import QuantKey, needs_input_scale
from .algos import ALGOS, HF_FP8, Algo, algo_for
from .compressed_tensors import export_row

ORDER = ("modelopt", "transformers", "compressed-tensors")
SINGLE_ROW = ("transformers", "gpt-oss")  # their configs declare one format for every layer


def exact_rows(weight: QuantKey, activation: QuantKey | None, has_input_scale: bool) -> list[Algo]:
    """Rows storing `weight` keys (and a calibrated input scale iff it has one) that load back running
    `activation`."""
    rows = [*ALGOS.values(), HF_FP8["float"], export_row(weight, activation)]
    return [
        row
        for row in rows
        if row is not None
        and (row.weight, row.activation) == (weight, activation)
        and ("input_scale" in row.tensors) == has_input_scale == needs_input_scale(activation)
    ]


def choose(candidates: dict[str, list[Algo]]) -> dict[str, Algo] | None:
    """Each layer's row from the first producer that has one for every layer; None if none has."""
    first = [rows[0].producer for rows in candidates.values() if rows]
    for producer in dict.fromkeys([*first, *ORDER]):
        chosen = {layer: next((a for a in rows if a.producer == producer), None) for layer, rows in candidates.items()}
        if None in chosen.values() or (producer in SINGLE_ROW and len(set(chosen.values())) > 1):
            continue
        return chosen
    return None


def modelopt_row(weight: QuantKey, has_input_scale: bool, where: str) -> Algo:
    """ModelOpt's row for `weight` keys (`algos.algo_for`), for layers no one producer keeps as they
    run; none raises, naming `where` and what each producer stores."""
    try:
        return algo_for(weight, has_input_scale)
    except ValueError as error:
        raise ValueError(
            f"{where}: {error}; neither transformers' fp8 (fp8_per_block) nor compressed-tensors (the weight and "
            "activation formats of its FP8, INT8, W4A16 and NVFP4 schemes) stores it as it runs"
        ) from None
