"""Every Triton kernel quantpass launches compiles for the GPUs the oracle targets, on this machine.

The interpreter tier checks the kernels' numerics but not what only compiled Triton rejects: a
global that isn't a constexpr (found this way: quant.py's AMAX_EPS), or a launch whose configs all
need more shared memory than the GPU has. `triton_aot.py` runs our launchers compile-only against
a stand-in driver: here `--quick` (every kernel variant: decode linears with their first autotune
config, prefill MoE); `python tests/triton_aot.py --sm 90 100` compiles every config of every shape
(~11 minutes here) and checks each config's shared memory. Triton's cache makes repeats take seconds.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="the compile check needs triton")

SCRIPT = Path(__file__).with_name("triton_aot.py")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason=f"Triton's NVIDIA backend has no ptxas here ({PTXAS})")
@pytest.mark.parametrize("sm", [90, 100], ids=["H100/H200", "B200"])
def test_every_kernel_compiles(sm):
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--sm", str(sm), "--quick"], capture_output=True, text=True, env=env, timeout=1200
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert f"sm{sm}: 0 failed" in done.stdout
