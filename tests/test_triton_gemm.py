"""Triton GEMM family (dense) against the reference backend, plus `supports`, the graph ops and tuning.

CPU tier: Triton's interpreter on tiny odd shapes (M in {1, 7, 33}; K = 96, 160, 100: not multiples
of 128; N = 48, 80), outputs poisoned. GPU tier: M = N = K = 4096 on CUDA and an Inductor compile.
"""

import json

import pytest
import torch
from _triton_support import LINEAR_PAIRS, device, on_interpreter, pair_id, poison_empty, triton

import quantpass.kernels.triton as triton_backend
from quantpass.kernels import oracle, reference
from quantpass.kernels.ops import key_arg
from quantpass.metrics import sqnr
from quantpass.quant_registry import formats, keys
from quantpass.quant_registry.keys import INT8

SHAPES = [(1, 48, 96), (7, 80, 160), (33, 80, 100)]  # (M, N, K)

# Against the reference: the kernels see the same quantized operands, so they agree to rounding.
# Measured (3 seeds, these shapes): >= 78 dB (bf16 output ulp flips; often bit-identical), except
# fp32 activations into tl.dot_scaled, which takes them as bf16: 52 dB.
REFERENCE_FLOOR_DB = 45


def unquantized_floor(pair) -> float:
    """Against the unquantized fp32 product (Gaussian data): the format's own error. Measured minima:
    INT8 W8A8 39.2, INT8 weight-only 41.3, FP8 26.6, MXFP4 / NVFP4 / INT4 15.5 dB."""
    weight, _ = pair
    if weight.bits == 4:
        return 13.0
    return 35.0 if weight.dtype == INT8 else 24.0


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    poison_empty(monkeypatch)


def check_linear(pair, m, n, k, dtype, dev, floor=REFERENCE_FLOOR_DB):
    weight_key, activation_key = pair
    x = torch.randn(m, k, dtype=dtype, device=dev)
    w = torch.randn(n, k, device=dev)
    bias = torch.randn(n, dtype=dtype, device=dev)
    qw = formats.quantize(w, weight_key)
    out = triton_backend.linear(x, qw, activation_key, bias)
    assert out.shape == (m, n) and out.dtype == dtype
    assert torch.isfinite(out).all(), "unwritten (poisoned) or non-finite outputs"
    want = reference.linear(x, qw, activation_key, bias)
    assert sqnr(want.float(), out.float()) >= floor
    assert sqnr(x.float() @ w.t() + bias.float(), out.float()) >= unquantized_floor(pair)


@on_interpreter
@pytest.mark.parametrize("pair", LINEAR_PAIRS, ids=pair_id)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES, ids=["m1", "m7", "m33"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_linear_matches_reference(pair, m, n, k, dtype):
    check_linear(pair, m, n, k, dtype, "cpu")


@on_interpreter
@pytest.mark.parametrize("activation", reference.ACTIVATIONS)
@pytest.mark.parametrize("layout", reference.GATE_UP_LAYOUTS)
def test_gated_activation_epilogue(activation, layout):
    """GEMM1's fused epilogue: w [2I, K] gate and up rows -> act(gate) * up, [M, I] (I = 40: odd tiles)."""
    from quantpass.kernels.triton.gemm import quantized_matmul

    x = torch.randn(7, 96, dtype=torch.bfloat16)
    qw = formats.quantize(torch.randn(80, 96) / 4, keys.kFp8StaticChannelSym)
    bias = torch.randn(80, dtype=torch.bfloat16)
    out = quantized_matmul(x, qw, bias, activation=activation, gate_up_layout=layout, alpha=1.5, limit=2.0)
    h = x.float() @ formats.dequantize(qw, torch.float32).t() + bias.float()
    want = reference.gated_activation(h, activation, layout, 1.5, 2.0)
    assert out.shape == (7, 40) and sqnr(want, out.float()) >= 45  # measured 55 dB: bf16 output rounding


def test_launcher_errors_name_the_problem():
    from quantpass.kernels.triton.gemm import quantized_matmul

    qw = formats.quantize(torch.randn(32, 64), keys.kFp8StaticChannelSym)
    with pytest.raises(ValueError, match="K=48"):
        quantized_matmul(torch.randn(4, 48), qw)
    with pytest.raises(ValueError, match="kNvfp4Dynamic"):
        triton_backend.linear(
            torch.randn(4, 64), formats.quantize(torch.randn(32, 64), keys.kNvfp4Static), keys.kNvfp4Dynamic, None
        )
    with pytest.raises(ValueError, match="invalid gated activation 'relu'"):
        quantized_matmul(torch.randn(4, 64), qw, activation="relu")
    with pytest.raises(ValueError, match=r"bias of shape \(31,\)"):
        quantized_matmul(torch.randn(4, 64), qw, torch.randn(31))
    with pytest.raises(ValueError, match="A is torch.int8"):
        quantized_matmul(torch.zeros(4, 64, dtype=torch.int8), qw)


CPU = oracle.Capability("cpu", libs=frozenset({"triton"}))
INTERPRETER = oracle.Capability("cpu", libs=frozenset({"triton"}), triton_interpret=True)
PROBLEM = oracle.Problem(n=4096, k=4096)


@pytest.mark.parametrize(
    ("capability", "pair", "ok", "reason"),
    [
        (CPU, (keys.kFp8StaticChannelSym, keys.kFp8DynamicTokenSym), False, "TRITON_INTERPRET=1"),
        (INTERPRETER, (keys.kFp8StaticChannelSym, keys.kFp8DynamicTokenSym), True, "interpreter"),
        (oracle.Capability("cpu"), (keys.kInt8StaticChannelSym, None), False, "not installed"),
        (
            oracle.Capability("cuda", 90, frozenset({"triton"})),
            (keys.kFp8Static128BlockSym, keys.kFp8Dynamic128Sym),
            True,
            "dot",
        ),
        (oracle.Capability("cuda", 80, frozenset({"triton"})), (keys.kFp8StaticChannelSym, None), False, "SM89"),
        (oracle.Capability("cuda", 80, frozenset({"triton"})), (keys.kNvfp4Static, None), False, "SM89"),
        (oracle.Capability("cuda", 80, frozenset({"triton"})), (keys.kInt4StaticGroup128Sym, None), True, "dequant"),
        (oracle.Capability("cuda", 75, frozenset({"triton"})), (keys.kInt4StaticGroup128Sym, None), False, "SM80"),
        (
            oracle.Capability("cuda", 90, frozenset({"triton"})),
            (keys.kMxfp8Static, keys.kMxfp8Dynamic),
            True,
            "emulated: tl.dot_scaled on sm90",
        ),
        (
            oracle.Capability("cuda", 100, frozenset({"triton"})),
            (keys.kMxfp4Static, None),
            True,
            "emulated: MX weights x float",
        ),
        (
            oracle.Capability("cuda", 100, frozenset({"triton"})),
            (keys.kMxfp8Static, keys.kMxfp8Dynamic),
            True,
            "native MX MMA",
        ),
        (INTERPRETER, (keys.kNvfp4Static, keys.kNvfp4Dynamic), False, "kNvfp4Dynamic"),
        (INTERPRETER, (keys.kMxfp8Static, keys.kFp8DynamicTokenSym), False, "MX weights"),
    ],
)
def test_supports(capability, pair, ok, reason):
    got, why = triton_backend.supports("linear", capability, *pair, PROBLEM)
    assert got is ok and reason in why, why


def test_every_triton_table_row_is_supported_on_hopper_and_the_interpreter():
    hopper = oracle.Capability("cuda", 90, frozenset({"triton"}))
    for kind, pairs in oracle.CANDIDATES.items():
        for pair, backends in pairs.items():
            if "triton" in backends:
                assert triton_backend.supports(kind, hopper, *pair, PROBLEM)[0], (kind, pair)
                assert triton_backend.supports(kind, INTERPRETER, *pair, PROBLEM)[0], (kind, pair)
    assert not triton_backend.supports("attention", INTERPRETER, keys.kFp8StaticChannelSym, None, PROBLEM)[0]
    relu = oracle.Problem(n=512, k=1024, activation="relu")
    ok, why = triton_backend.supports("moe", INTERPRETER, keys.kFp8StaticChannelSym, None, relu)
    assert not ok and "'relu'" in why


def test_oracle_runs_triton_when_named_and_never_picks_it_on_cpu_itself():
    pair = (keys.kInt4StaticGroup128Sym, None)
    assert oracle.select("linear", *pair, INTERPRETER, PROBLEM, backend="triton").backend == "triton"
    assert oracle.select("linear", *pair, INTERPRETER, PROBLEM).backend != "triton"
    with pytest.raises(oracle.NoKernelError, match="TRITON_INTERPRET=1"):
        oracle.select("linear", *pair, CPU, PROBLEM, backend="triton")


@on_interpreter
def test_custom_op_and_triton_op_run_the_same_kernels():
    """`quantpass::linear` with backend "triton" calls `linear`; the CUDA graph op (a triton_op, run
    eagerly here) has the same schema and result. On CPU the oracle's graph op is the custom op."""
    weight_key, activation_key = keys.kFp8Static128BlockSym, keys.kFp8Dynamic128Sym
    x = torch.randn(2, 3, 160, dtype=torch.bfloat16)
    qw = formats.quantize(torch.randn(48, 160), weight_key)
    args = (x, qw.data, qw.scale, qw.scale2, None, key_arg(weight_key), key_arg(activation_key), "triton", 48)
    via_custom_op = torch.ops.quantpass.linear(*args)
    assert via_custom_op.shape == (2, 3, 48)
    assert torch.equal(
        via_custom_op, triton_backend.linear(x.reshape(6, 160), qw, activation_key, None).reshape(2, 3, 48)
    )
    assert triton_backend.graph_linear_op("cpu") is None and triton_backend.graph_moe_op("cpu") is None
    linear_op, moe_op = triton_backend._graph_ops()
    assert torch.equal(linear_op(*args), via_custom_op)
    for graph_op, op in ((linear_op, torch.ops.quantpass.linear), (moe_op, torch.ops.quantpass.fused_moe)):
        assert str(graph_op._schema).split("(", 1)[1] == str(op.default._schema).split("(", 1)[1]


@on_interpreter
@pytest.mark.parametrize("pair", [(keys.kFp8Static128BlockSym, keys.kFp8Dynamic128Sym), (keys.kInt4StaticGroup128Sym, None), (keys.kInt8StaticChannelSym, keys.kInt8DynamicTokenSym)], ids=pair_id)  # fmt: skip
def test_split_k_matches_one_program_per_tile(pair):
    """Decode's split-K: K = 416 (3.25 K steps of 128) over 3 programs (2 steps each: the last gets
    none) and 4 (the last gets a partial step); bias added once, fp32 partials summed: the unsplit GEMM."""
    from quantpass.kernels.triton.gemm import quantized_matmul
    from quantpass.kernels.triton.quant import quantize_activation

    weight_key, activation_key = pair
    x = torch.randn(5, 416, dtype=torch.bfloat16)
    qw = formats.quantize(torch.randn(48, 416), weight_key)
    bias = torch.randn(48, dtype=torch.bfloat16)
    a = x if activation_key is None else quantize_activation(x, activation_key)
    whole = quantized_matmul(a, qw, bias, split_k=1)
    for split in (3, 4):
        parts = quantized_matmul(a, qw, bias, split_k=split)
        assert parts.dtype == whole.dtype and sqnr(whole.float(), parts.float()) >= 45  # bf16 output rounding
    with pytest.raises(ValueError, match="split-K is for dense GEMMs"):
        quantized_matmul(a, qw, bias, split_k=2, activation="silu")


def test_split_k_heuristic_fills_the_gpu_at_decode_only():
    from quantpass.kernels.triton import tuning

    cpu = torch.device("cpu")  # sm_count: an H100/H200's 132 SMs without a GPU
    assert tuning.split_k(1, 4096, 4096, cpu) == 4  # 64 tiles of 64 -> 256 programs
    assert tuning.split_k(16, 4096, 14336, cpu) == 8
    assert tuning.split_k(16, 14336, 4096, cpu) == 2
    assert tuning.split_k(17, 4096, 4096, cpu) == 1  # prefill: tiles enough
    assert tuning.split_k(1, 4096, 1024, cpu) == 1  # each split keeps >= 1024 of K


@on_interpreter
def test_offsets_past_2_31_elements_do_not_wrap():
    """B's row offsets are int64: row 2 of a weight whose rows are 2^31 - 64 elements apart sits past
    2^31 (as row 262144 of a K = 8192 output head does); in int32 it wraps to a wild address. The
    storage is ~4 GiB of virtual memory of which three rows are touched."""
    from quantpass.kernels.triton.gemm import quantized_matmul
    from quantpass.quant_registry.qtensor import QTensor

    qw = formats.quantize(torch.randn(3, 128), keys.kFp8StaticChannelSym)
    spread = torch.empty_strided((3, 128), (2**31 - 64, 1), dtype=qw.data.dtype)
    spread.copy_(qw.data)
    far = QTensor(spread, qw.scale, None, qw.key, qw.shape, qw.dtype)
    x = torch.randn(2, 128, dtype=torch.float32)
    assert torch.equal(quantized_matmul(x, far), quantized_matmul(x, qw))


def test_fp32_dots_follow_torchs_matmul_precision():
    from quantpass.kernels.triton.gemm import fp32_precision

    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert fp32_precision(False) == "ieee"
        torch.set_float32_matmul_precision("high")
        assert fp32_precision(False) == "tf32"
        assert fp32_precision(True) == "ieee"  # the interpreter computes in fp32 anyway
    finally:
        torch.set_float32_matmul_precision(before)


def test_plans_are_cached_per_weight_and_tuned_configs_launch_directly(monkeypatch):
    """Host overhead: the scheme, flags and strides are built once per (weight, call options), and a
    dense GEMM the autotuner has tuned is launched with its config, not through the autotuner again."""
    from quantpass.kernels.triton import gemm, scheme, tuning

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CUDA path, with the launch stubbed out below
    launched = []

    class Launcher:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((self.kernel, kwargs))

    class Autotuner:  # what triton.autotune returns, after its first run
        best_config = triton.Config(dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1), num_warps=4, num_stages=3)

    calls = []
    real_scheme = scheme.gemm_scheme
    monkeypatch.setattr(gemm, "gemm_scheme", lambda *a: calls.append(a) or real_scheme(*a))
    monkeypatch.setattr(gemm, "wrap_triton", Launcher)
    monkeypatch.setattr(tuning, "autotuned", lambda *key: Autotuner)
    monkeypatch.setattr(tuning, "TUNED", {})
    qw = formats.quantize(torch.randn(64, 256), keys.kInt4StaticGroup128Sym)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    for _ in range(3):
        gemm.quantized_matmul(x, qw, split_k=1)
    assert len(calls) == 1, "the plan is cached per weight"
    assert [kernel for kernel, _ in launched] == [Autotuner, gemm.gemm_kernel, gemm.gemm_kernel]
    assert launched[1][1]["BLOCK_N"] == 32 and launched[1][1]["num_warps"] == 4
    gemm.quantized_matmul(x, qw, torch.randn(64, dtype=torch.bfloat16), split_k=1)  # new options: new plan
    assert len(calls) == 2


def test_tuning_configs_and_files(tmp_path):
    from quantpass.kernels.triton import tuning
    from quantpass.kernels.triton.scheme import gemm_scheme

    block = gemm_scheme(keys.kFp8Static128BlockSym, keys.kFp8Dynamic128Sym)
    mx = gemm_scheme(keys.kMxfp4Static, None)
    assert tuning.fit_block_k(dict(BLOCK_K=256), block)["BLOCK_K"] == 128  # a K step inside one block
    assert tuning.fit_block_k(dict(BLOCK_K=16), mx)["BLOCK_K"] == 32  # whole e8m0 groups
    for bucket in tuning.M_BUCKETS:
        assert tuning.dense_gemm_configs(4096, 4096, bucket)
    assert [tuning.m_bucket(m) for m in (1, 16, 17, 5000)] == [16, 16, 64, 4096]

    name = tuning.config_file_name(8, 512, "GPU_X", block.name, (128, 128))
    assert name == "E=8,N=512,device_name=GPU_X,dtype=fp8_w8a8,block_shape=[128,128].json"
    configs = {1: dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256), 64: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64)}
    tuning.write_moe_configs(tmp_path / name, configs, source="test")
    pick = lambda m: tuning.moe_config(m, 8, 2, 512, block, device="GPU_X", config_dir=tmp_path)  # noqa: E731
    assert pick(2)["BLOCK_N"] == 32 and pick(2)["BLOCK_K"] == 128  # nearest M; clamped to the block
    assert pick(40)["BLOCK_M"] == 64  # 64 is nearer than 1
    assert pick(1000)["BLOCK_N"] == 64
    assert tuning.moe_config(1, 8, 2, 512, block, device="other") == tuning.default_moe_config(1, 8, 2, block)

    shipped = sorted(tuning.CONFIG_DIR.glob("*.json"))
    assert shipped, "at least one config file ships (a labelled defaults file)"
    for path in shipped:
        table = json.loads(path.read_text())
        assert table["source"] and all(m.isdigit() for m in table["configs"])


@pytest.mark.gpu
@pytest.mark.parametrize("pair", LINEAR_PAIRS, ids=pair_id)
def test_linear_on_cuda_at_real_size(pair):
    """M = N = K = 4096, plus a ragged M = 33, K = 4000. Floor 40 dB: on CUDA the weight-only path
    rounds the dequantized tile to bf16 for the tensor cores (the interpreter computes in fp32)."""
    check_linear(pair, 4096, 4096, 4096, torch.bfloat16, device(), floor=40)
    check_linear(pair, 33, 4096, 4000, torch.bfloat16, device(), floor=40)


@pytest.mark.gpu
def test_triton_op_compiles_with_inductor():
    """On CUDA the oracle's graph op is the triton_op, and Inductor compiles through it."""
    weight_key, activation_key = keys.kFp8StaticChannelSym, keys.kFp8DynamicTokenSym
    op = triton_backend.graph_linear_op("cuda")
    assert op is not None
    qw = formats.quantize(torch.randn(1024, 512, device="cuda"), weight_key)
    meta = (key_arg(weight_key), key_arg(activation_key), "triton", 1024)

    def f(x):
        return op(torch.relu(x), qw.data, qw.scale, qw.scale2, None, *meta) * 2

    x = torch.randn(64, 512, dtype=torch.bfloat16, device="cuda")
    compiled = torch.compile(f, backend="inductor", fullgraph=True)
    assert sqnr(f(x).float(), compiled(x).float()) >= 40


def test_both_backends_follow_one_fp8_accumulation_policy(monkeypatch):
    """`scheme.FP8_ACCUMULATION` is the policy: native passes it to torch._scaled_mm (here on CPU,
    where the argument is accepted and ignored), Triton's sm90 dot promotes every FP8_PROMOTE_K
    (tests/test_triton_aot.py reads the compiled kernel)."""
    from quantpass.kernels import torch_ops as native
    from quantpass.kernels.triton import scheme

    assert scheme.FP8_ACCUMULATION == "precise" and native.USE_FAST_ACCUM is False
    seen = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    qw = formats.quantize(torch.randn(32, 64), keys.kFp8StaticChannelSym)
    native.linear(torch.randn(4, 64), qw, keys.kFp8DynamicTokenSym, None)
    assert seen and seen[0]["use_fast_accum"] is False


def exact_product(x, qw, activation_key):
    """fp64 product of the operands the kernels see: x through the activation quantizer, the weight dequantized."""
    xq = reference.fake_quantize(x, activation_key).double()
    return xq @ formats.dequantize(qw, torch.float64).t()


@pytest.mark.gpu
@pytest.mark.parametrize("k", [8192, 14336])
@pytest.mark.parametrize(
    "pair",
    [(keys.kFp8StaticChannelSym, keys.kFp8DynamicTokenSym), (keys.kFp8Static128BlockSym, keys.kFp8Dynamic128Sym)],
    ids=pair_id,
)
def test_fp8_accumulation_long_k(pair, k):
    """Precise FP8 accumulation at long K, both backends, fp32 output (no bf16 rounding hides it). The
    floor is an estimate, to be replaced by the first GPU run's numbers: partial sums promoted every
    128 K keep ~78 dB at K = 14336; an FP8 accumulator over all of K (fast accumulation) ~58 dB."""
    weight_key, activation_key = pair
    x = torch.randn(256, k, device="cuda")
    qw = formats.quantize(torch.randn(512, k, device="cuda") / k**0.5, weight_key)
    want = exact_product(x, qw, activation_key)
    got = {
        name: sqnr(want, module.linear(x, qw, activation_key, None).double())
        for name, module in (("triton", triton_backend), ("native", oracle.backend_module("native")))
        if module.supports("linear", oracle.Capability.detect("cuda"), *pair, oracle.Problem(512, k))[0]
    }
    print(f"K={k} {pair_id(pair)}: SQNR vs fp64 {got}")
    assert got and all(db >= 70 for db in got.values()), got
    assert max(got.values()) - min(got.values()) <= 10, f"the backends accumulate differently: {got}"


def test_moe_configs_shipped_for_the_h200_target_shape():
    """E=64, I=1536 (the H200 MoE target): many rows per expert get 128x128x128, 8 warps, 4 stages
    (vLLM's 128x256 spills here under precise FP8 accumulation); the file says it was not swept."""
    from quantpass.kernels.triton import tune_moe, tuning
    from quantpass.kernels.triton.scheme import gemm_scheme

    scheme = gemm_scheme(keys.kFp8StaticChannelSym, keys.kFp8DynamicTokenSym)
    name = tuning.config_file_name(64, 1536, "NVIDIA_H200", scheme.name, None)
    assert "NOT swept" in json.loads((tuning.CONFIG_DIR / name).read_text())["source"]
    big = tuning.moe_config(4096, 64, 8, 1536, scheme, device="NVIDIA_H200")
    assert [big[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")] == [128, 128, 128, 16, 8, 4]  # fmt: skip
    assert tuning.moe_config(1, 64, 8, 1536, scheme, device="NVIDIA_H200")["BLOCK_M"] == 16
    many = dict(tokens=4096, num_experts=64, top_k=8)  # 512 rows per expert
    rows = lambda pair, sm=None: tuning.default_moe_config(**many, scheme=gemm_scheme(*pair), sm=sm)["BLOCK_M"]  # noqa: E731
    assert rows((keys.kFp8StaticChannelSym, keys.kFp8DynamicTokenSym)) == 128
    assert rows((keys.kFp8Static128BlockSym, keys.kFp8Dynamic128Sym)) == 64  # per-step scales: 128 rows spill
    assert rows((keys.kMxfp8Static, keys.kMxfp8Dynamic), 90) == 64  # emulated dot_scaled spills at 128 (3.6)
    assert rows((keys.kMxfp8Static, keys.kMxfp8Dynamic), 100) == 128  # SM100's MX MMA wants 128-row tiles
    for tokens in (1, 64, 4096):  # the sweep's candidates fit the scheme and stay near the rows per expert
        found = tune_moe.candidates(tokens, 64, 8, gemm_scheme(keys.kFp8Static128BlockSym, keys.kFp8Dynamic128Sym))
        assert found and all(c["BLOCK_K"] == 128 and c["BLOCK_M"] <= max(16, 2 * tokens * 8 / 64) for c in found)
    if not torch.cuda.is_available():
        assert tune_moe.main(["--tokens", "1"]) == 2  # says it needs CUDA
