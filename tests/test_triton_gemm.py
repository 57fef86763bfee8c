"""Triton GEMM family (dense) against the reference backend, plus `supports`, the graph ops and tuning.

CPU tier: Triton's interpreter on tiny odd shapes (M in {1, 7, 33}; K = 96, 160, 100: not multiples
of 128; N = 48, 80), outputs poisoned. GPU tier: M = N = K = 4096 on CUDA and an Inductor compile.
"""

import json

import pytest
import torch
from _triton_support import LINEAR_PAIRS, device, on_interpreter, pair_id, poison_empty

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
            "emulated",
        ),
        (oracle.Capability("cuda", 100, frozenset({"triton"})), (keys.kMxfp4Static, None), True, "dot_scaled"),
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
