"""Kernels and the oracle that picks them.

Every backend module (`reference`, `native`, `cpu`, `triton`, `flashinfer`) exposes the same
contract, which `oracle.py` and `ops.py` rely on:

- `DEVICES: str` - a human note of where it runs (the real answer is `supports`).
- `supports(kind, capability, weight_key, activation_key, problem) -> (ok, reason)` - `kind` is
  "linear" or "moe"; `capability` an `oracle.Capability`; `problem` an `oracle.Problem`. The reason
  says why not (or, when ok, a few words on what runs). Pure: no GPU needed to ask.
- `linear(x [M, K], weight: QTensor [N, K], activation_key, bias) -> [M, N]` in x.dtype.
- `fused_moe(hidden, topk_weights, topk_ids, w13, w2, b13, b2, expert_map, activation_key,
  activation, gate_up_layout, apply_router_weight_on_input, alpha, limit) -> [T, H]`, arguments as
  `reference.fused_moe` documents (only for backends listed in the oracle's `moe` table).
- optional `prepare_weight(kind, qtensor) -> QTensor` and `prepare_moe_weights(w13, w2,
  gate_up_layout) -> (w13, w2)`: the backend's own weight layout, computed once per weight and
  cached; the backend's `linear`/`fused_moe` then receive the prepared QTensors.
- optional `graph_linear_op(device_type)` / `graph_moe_op(device_type)`: a graph-visible op (e.g. a
  `triton_op` on CUDA) with `quantpass::linear`'s / `quantpass::fused_moe`'s arguments, or None.

No module imports triton or flashinfer at import time.
"""
