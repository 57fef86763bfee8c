"""Kernels and the oracle that picks them.

Every backend module (`reference`, `native`, `cpu`, `triton`, `flashinfer`) implements
`registry.Backend` (`supports`, `prepare_weight` / `prepare_moe_weights`, `dequantize_prepared`,
`linear`, `fused_moe`, `graph_linear_op` / `graph_moe_op`) and is listed once, in
`registry.BACKEND_MODULES`: the only list of backend names. `oracle.py` picks a backend per site
from its candidate tables; `ops.py` holds the `quantpass::` graph ops that call the chosen one.

No module imports triton or flashinfer at import time.
"""
