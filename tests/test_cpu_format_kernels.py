"""What quantpass's two format-family CPU kernels (kernels/cpu_fp4.py: MXFP4, NVFP4; kernels/cpu_fp8.py:
every FP8 format) share through the cpu backend (`cpu.FORMAT_KERNELS`): 1 vs 2 threads bit-equal for
every pair each runs, on each set of its kernel's tiles; the backend's routing (the kernel up to its
MAX_M, the reference above, no prepared copy); and the oracle choosing them for a compiled model whose
output matches the reference backend's. Each family's numerics: tests/test_cpu_fp4.py,
tests/test_cpu_fp8.py."""

import pytest
import torch
import torch.nn.functional as F
from kernel_tiles import on_tiles

import quantpass as qp
from quantpass.kernels import cpu, cpu_fp4, cpu_fp8, reference
from quantpass.quant_registry import formats, keys

FAMILIES = [m for m in (cpu_fp4, cpu_fp8) if m.available()[0]]
PAIRS = [(m, w, a) for m in FAMILIES for w, acts in m.MODES.items() for a in acts]
# name -> cosine floor against the reference backend: FP8 and NVFP4 W4A4 multiply the reference's own
# quantized activations; MXFP4 / NVFP4 weight-only quantize them to int8 per block (44-47 dB)
COMPILED = {
    "mxfp4": (cpu_fp4, 0.999),
    "nvfp4_weight_only": (cpu_fp4, 0.999),
    "nvfp4": (cpu_fp4, 0.9999),
    "fp8_per_tensor": (cpu_fp8, 0.9999),
    "fp8_per_channel": (cpu_fp8, 0.9999),
    "fp8_per_block": (cpu_fp8, 0.9999),
    "mxfp8": (cpu_fp8, 0.9999),
    "fp8_weight_only": (cpu_fp8, 0.9999),
}


def pair_id(case):
    return f"{case[1]}-{case[2]}"


def operands(weight_key, activation, M, N, K, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = formats.quantize(torch.randn(N, K, generator=gen).bfloat16(), weight_key)
    x = torch.randn(M, K, generator=gen).bfloat16()
    if keys.needs_input_scale(activation):  # a checkpoint's calibrated scale
        weight.input_scale = x.float().abs().amax() / 448
    return x, weight, torch.randn(N, generator=gen).bfloat16()


# each pair on each of its kernel's sets of tiles
TILED = [pytest.param(case, tiles, id=f"{pair_id(case)}-{tiles}") for case in PAIRS for tiles in case[0].TILES]


@pytest.mark.parametrize(("case", "tiles"), TILED)
def test_one_and_two_threads_are_bit_equal(case, tiles):
    module, weight_key, activation = case
    x, weight, bias = operands(weight_key, activation, 3, 1024, 1024)  # 2^20 weights: 2 threads (one below 2^18 each)
    threads = torch.get_num_threads()
    with on_tiles(module.tiles, tiles):
        try:
            torch.set_num_threads(1)
            one = module.linear(x, weight, activation, bias)
            torch.set_num_threads(2)
            two = module.linear(x, weight, activation, bias)
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("case", PAIRS, ids=pair_id)
def test_the_cpu_backend_routes_to_the_kernel_and_large_m_to_the_reference(case):
    module, weight_key, activation = case
    x, weight, bias = operands(weight_key, activation, module.MAX_M + 1, 32, 200)
    assert cpu.FORMAT_KERNELS[weight_key] is module
    assert cpu.prepare_weight("linear", weight) is weight  # no copy: the kernel reads the quantized weight
    assert cpu.kernel_max_m(weight) == module.MAX_M
    above = cpu.linear(x, weight, activation, bias)
    assert torch.equal(above, reference.linear(x, weight, activation, bias))
    below = cpu.linear(x[:3], weight, activation, bias)
    assert torch.equal(below, module.linear(x[:3], weight, activation, bias))


@pytest.fixture
def fresh_dynamo():
    """Compiled nn modules share code objects across tests: start clean and leave no cache entries
    (six compiles here pushed a later fullgraph test in the same process past Dynamo's recompile limit)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("fmt", COMPILED)
def test_a_compiled_model_runs_on_the_kernel(fmt, fresh_dynamo):
    module, floor = COMPILED[fmt]
    if module not in FAMILIES:
        pytest.skip(f"{module.__name__}: {module.available()[1]}")

    def run(backend):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(96, 80), torch.nn.GELU(), torch.nn.Linear(80, 48)).bfloat16()
        compiler = qp.backend(linear=fmt, backend=backend, lowering="aot_eager")
        with torch.no_grad():
            out = torch.compile(model, backend=compiler)(
                torch.randn(3, 96, generator=torch.Generator().manual_seed(1)).bfloat16()
            )
        return out, compiler.plan

    (want, _), (got, plan) = run("reference"), run("auto")
    assert [row.backend for row in plan.quantized()] == ["cpu", "cpu"], plan.summary()
    assert F.cosine_similarity(want.float().flatten(), got.float().flatten(), dim=0) >= floor
