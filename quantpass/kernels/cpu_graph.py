"""The cpu backend's graph ops: what a compiled graph calls for a linear or MoE site on the `cpu`
backend (`graph_linear_op`, `graph_moe_op`).

`quantpass::linear_cpu_cxx` and `quantpass::fused_moe_cpu_cxx` (C++, cpu_op.py) where they build, set
up with `graph_tables` (INT8/INT4 and the FP8/FP4 format kernels' pairs, for both); else
`quantpass::linear_cpu` and `quantpass::fused_moe_cpu`, defined here: `quantpass::linear`'s and
`quantpass::fused_moe`'s arguments as plain torch.library ops, which go straight to our kernel where
they can and through kernels/cpu.py's `linear` / `fused_moe` paths otherwise, as the generic ops would.
"""

from __future__ import annotations

import functools

import torch

from . import cpu, cpu_avx2, cpu_fp4, cpu_fp8, cpu_op, ops

_LIBRARY = torch.library.Library("quantpass", "FRAGMENT")
_LIBRARY.define(
    "linear_cpu(Tensor x, Tensor w_data, Tensor w_scale, Tensor? w_scale2, Tensor? bias, str weight_key, "
    "str activation_key, str backend, SymInt out_features, Tensor? input_scale=None) -> Tensor",
    tags=cpu_op.GRAPH_OP_TAGS,
)


@functools.cache
def graph_tables() -> cpu_op.Tables:
    """The C++ graph ops' tables: our INT kernels' (`cpu._FAST`) and each format kernel's pairs with its entry."""
    (fp8, rows8), (fp4, rows4) = cpu_fp8.graph_entry(), cpu_fp4.graph_entry()
    rows = {**(rows8 if fp8[0] else {}), **(rows4 if fp4[0] else {})}
    formats = tuple(
        sorted((f"{key}|{activation}", tuple(row[f] for f in cpu_op.FORMAT_FIELDS)) for (key, activation), row in rows.items())
    )  # fmt: skip
    return cpu_op.Tables(tuple(sorted(cpu._FAST.items())), formats, fp8, fp4)


def graph_linear_op(device_type: str):
    """On CPU, `quantpass::linear_cpu_cxx` (the same op in C++, cpu_op.py) where it builds, else
    `quantpass::linear_cpu` (a plain torch.library op: the generic `quantpass::linear` is a
    `custom_op`, ~20 us more per call, measured in bench/cpu_decode.py)."""
    if device_type != "cpu":
        return None
    fast = cpu_op.op(graph_tables()) if cpu_avx2.entry_point() is not None else None
    return fast or torch.ops.quantpass.linear_cpu.default


def graph_moe_op(device_type: str):
    """On CPU, `quantpass::fused_moe_cpu_cxx` (C++, cpu_op.py) where it builds, else
    `quantpass::fused_moe_cpu`: `quantpass::fused_moe`'s arguments as plain torch.library ops with the
    graph ops' tag (the generic `custom_op` costs more per call, and Inductor passed its defaulted input
    scales by keyword)."""
    if device_type != "cpu":
        return None
    fast = cpu_op.moe_op(graph_tables()) if cpu_avx2.entry_point() is not None else None
    return fast or torch.ops.quantpass.fused_moe_cpu.default


def _graph_linear(
    x, w_data, w_scale, w_scale2, bias, weight_key, activation_key, backend, out_features, input_scale=None
):
    """Our kernel straight from the graph where it applies (weight-only, our layout, M in range, dtypes
    the kernel reads); anything else through `linear`, as `quantpass::linear` would. At decode this
    body runs once per linear per token, right after the previous kernel streamed megabytes of weights
    through the caches: every tensor method it calls is a cache miss, so it calls as few as it can
    (each check once, the C entry point straight, not through `cpu_avx2.run`)."""
    fast = cpu._FAST.get(weight_key)
    entry = cpu_avx2.entry_point()
    if fast is not None and entry is not None and not activation_key:
        xtype, btype = cpu_avx2.DTYPES.get(x.dtype), 0 if bias is None else cpu_avx2.DTYPES.get(bias.dtype)
        if (
            xtype is not None
            and btype is not None
            and w_scale.dim() == 2
            and w_data.is_contiguous()
            and w_scale.is_contiguous()
            and (bias is None or bias.is_contiguous())
        ):
            bits, mode, _, _, most = fast
            shape = x.shape
            rows = x if len(shape) == 2 else x.reshape(-1, shape[-1])
            m, k = rows.shape
            if m <= most and rows.stride(1) == 1:
                out = torch.empty((*shape[:-1], out_features), dtype=x.dtype)
                kp = w_data.shape[1] * 2 if bits == 4 else w_data.shape[1]
                status = entry(
                    rows.data_ptr(), rows.stride(0), xtype, m, k, w_data.data_ptr(), w_scale.data_ptr(),
                    out_features, kp, bits, None if bias is None else bias.data_ptr(), btype, out.data_ptr(),
                    out_features, xtype, mode, torch.get_num_threads(),
                )  # fmt: skip
                if status:
                    raise cpu_avx2.scratch_error(status)
                return out
    return ops.run_linear(
        cpu.linear, x, w_data, w_scale, w_scale2, bias, weight_key, activation_key, out_features, input_scale
    )


_LIBRARY.impl("linear_cpu", _graph_linear, "CPU")


torch.library.register_fake("quantpass::linear_cpu")(cpu_op.fake_linear)

_LIBRARY.define(
    "fused_moe_cpu(Tensor hidden, Tensor topk_weights, Tensor topk_ids, Tensor w13_data, Tensor w13_scale, "
    "Tensor? w13_scale2, Tensor w2_data, Tensor w2_scale, Tensor? w2_scale2, Tensor? b13, Tensor? b2, "
    "Tensor? expert_map, str weight_key, str activation_key, str backend, str activation, str gate_up_layout, "
    "bool apply_router_weight_on_input, SymInt intermediate_size, float alpha, float limit, "
    "Tensor? w13_input_scale=None, Tensor? w2_input_scale=None) -> Tensor",
    tags=cpu_op.GRAPH_OP_TAGS,
)


def _graph_fused_moe(
    hidden, topk_weights, topk_ids, w13_data, w13_scale, w13_scale2, w2_data, w2_scale, w2_scale2, b13, b2,
    expert_map, weight_key, activation_key, backend, activation, gate_up_layout, apply_router_weight_on_input,
    intermediate_size, alpha, limit, w13_input_scale=None, w2_input_scale=None,
):  # fmt: skip
    """`_moe_on_our_kernels` straight from the graph's arguments where it applies, else the per-expert
    loop (what `fused_moe` would run after asking `_moe_on_our_kernels` the same question)."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    out = cpu._moe_on_our_kernels(
        rows, topk_weights.reshape(rows.shape[0], -1), topk_ids.reshape(rows.shape[0], -1), w13_data, w13_scale,
        w13_scale2, w2_data, w2_scale, w2_scale2, b13, b2, expert_map, weight_key, activation, gate_up_layout,
        apply_router_weight_on_input, alpha, limit, activation_key, (w13_input_scale, w2_input_scale),
    )  # fmt: skip
    if out is not None:
        return out.reshape(hidden.shape)
    return ops.run_fused_moe(
        cpu._per_expert_loop, hidden, topk_weights, topk_ids, w13_data, w13_scale, w13_scale2, w2_data, w2_scale, w2_scale2,
        b13, b2, expert_map, weight_key, activation_key, backend, activation, gate_up_layout,
        apply_router_weight_on_input, intermediate_size, alpha, limit, w13_input_scale, w2_input_scale,
    )  # fmt: skip


_LIBRARY.impl("fused_moe_cpu", _graph_fused_moe, "CPU")
torch.library.register_fake("quantpass::fused_moe_cpu")(cpu_op.fake_moe)
