"""The flashinfer backend: layouts against FlashInfer's own algorithms written as plain loops,
`supports` decisions, exact fakes, and the whole linear / MoE path through an emulated `flashinfer`
module on CPU. The GPU tier runs the real kernels (SM100/SM103 with flashinfer installed)."""

import importlib.util
import re
import sys
import types
from dataclasses import replace
from enum import IntEnum

import pytest
import torch

from quantpass.kernels import flashinfer as fi
from quantpass.kernels import ops, oracle, reference
from quantpass.kernels.flashinfer_layout import (
    local_topk_ids,
    pack_routing,
    prepare_moe_tensor,
    quantize_activation,
    restore_moe_tensor,
    shuffle_index,
    swizzle_128x4,
    swizzled_scale_len,
    unswizzle_128x4,
    w13_row_index,
)
from quantpass.kernels.oracle import Capability, Problem
from quantpass.metrics import sqnr
from quantpass.moe_problem import GatedActivation, MoEProblem
from quantpass.quant_registry import quantize
from quantpass.quant_registry.keys import kFp8Dynamic128Sym, kFp8Static128BlockSym, kMxfp8Dynamic, kMxfp8Static

# torchao's swizzle is the direct reference for ours; without torchao (the GPU image lacks it unless a
# wheel is carried) this module skips instead of failing collection.
_mx_utils = pytest.importorskip("torchao.prototype.mx_formats.utils", reason="needs torchao (the swizzle's reference)")
from_blocked, to_blocked = _mx_utils.from_blocked, _mx_utils.to_blocked

FP8 = torch.float8_e4m3fn
# flashinfer/utils.py (and TRT-LLM fp4_utils.py) srcToDstBlk32RowMap: old row q of a 32-row block
# goes to new row BLOCK32[q].
BLOCK32 = [0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27, 4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31]  # fmt: skip


# --- FlashInfer's algorithms, written plainly (the direct references) ---


def loop_shuffle(x):
    """`shuffle_matrix_a(x, 128)`: row_indices[new] = old, result = x[row_indices]."""
    out = torch.empty_like(x)
    for old in range(x.shape[0]):
        out[(old // 32) * 32 + BLOCK32[old % 32]] = x[old]
    return out


def loop_gated_reorder(x):
    """`reorder_rows_for_gated_act_gemm`: [r0, rN/2, r1, rN/2+1, ...]."""
    half = x.shape[0] // 2
    out = torch.empty_like(x)
    for j in range(half):
        out[2 * j], out[2 * j + 1] = x[j], x[half + j]
    return out


def loop_up_gate(x, gate_up_layout):
    """Our w13 rows -> [up; gate] (vLLM `swap_w13_to_w31` for concat)."""
    half = x.shape[0] // 2
    out = torch.empty_like(x)
    for j in range(half):
        gate, up = (x[j], x[half + j]) if gate_up_layout == "concat" else (x[2 * j], x[2 * j + 1])
        out[j], out[half + j] = up, gate
    return out


def loop_interleave_128x4(sf):
    """`block_scale_interleave`: TRT-LLM `get_sf_out_offset_128x4`, flat, rows/cols padded with 0."""
    rows, cols = sf.shape
    col_tiles = -(-cols // 4)
    out = torch.zeros(-(-rows // 128) * 128 * col_tiles * 4, dtype=sf.dtype)
    for m in range(rows):
        for k in range(cols):
            offset = (m // 128) * col_tiles * 512 + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4
            out[offset] = sf[m, k]
    return out


def flashinfer_quantize_model(x):
    """FlashInfer `cvt_warp_fp16_to_mxfp8` (quantization.cuh) as bits: scale = amax * RN(1/448)
    rounded up to e8m0 (satfinite), data = RNE_sat(x * 2^-(e-127)); all-zero block -> scale 0."""
    rows, cols = x.shape
    blocks = x.float().reshape(rows, cols // 32, 32)
    scale = blocks.abs().amax(-1) * torch.tensor(1 / 448, dtype=torch.float32)
    bits = scale.view(torch.int32)
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    e = exponent + ((mantissa != 0) & ~((exponent == 0) & (mantissa <= 0x400000))).to(torch.int32)
    e = torch.where(exponent == 0xFF, 255, e.clamp(max=254))
    inverse = torch.where(e == 0, torch.ones_like(scale), ((254 - e) << 23).view(torch.float32))
    inverse = torch.where(scale == 0, torch.zeros_like(scale), inverse)
    data = (blocks * inverse[..., None]).clamp(-448, 448).to(FP8).reshape(rows, cols)
    return data, e.to(torch.uint8)


# --- layouts ---


@pytest.mark.parametrize("rows, cols", [(128, 4), (130, 5), (1, 1), (300, 37), (7, 128), (256, 8), (256, 3), (130, 6)])
def test_swizzle_is_trtllm_offsets_and_round_trips(rows, cols):
    """`swizzle_128x4` is torchao's `to_blocked`; TRT-LLM's offsets written as a loop check it (odd
    shapes pad), per matrix of a batch too (rows % 128 == 0 takes one call on the stacked rows)."""
    scale = torch.randint(0, 255, (rows, cols), dtype=torch.uint8)
    swizzled = swizzle_128x4(scale)
    assert torch.equal(swizzled, loop_interleave_128x4(scale))
    assert torch.equal(unswizzle_128x4(swizzled, rows, cols), scale)
    batch = torch.randint(0, 255, (2, 2, rows, cols), dtype=torch.uint8)
    swizzled = swizzle_128x4(batch)
    assert swizzled.shape == (2, 2, swizzled_scale_len(rows, cols))
    assert all(torch.equal(s, loop_interleave_128x4(b)) for s, b in zip(swizzled.flatten(0, 1), batch.flatten(0, 1)))
    assert torch.equal(unswizzle_128x4(swizzled, rows, cols), batch)
    assert torch.equal(swizzle_128x4(batch.transpose(-1, -2).contiguous().transpose(-1, -2)), swizzled)  # strided in
    assert swizzle_128x4(batch[:0]).shape == (0, 2, swizzled_scale_len(rows, cols))
    assert unswizzle_128x4(swizzled[:0], rows, cols).shape == (0, 2, rows, cols)


@pytest.mark.parametrize("rows", [1, 7, 83, 128])
def test_our_activation_quantization_gives_flashinfer_bytes(rows):
    x = (torch.randn(rows, 256) * torch.logspace(-4, 4, 256)).to(torch.bfloat16)
    x[0, :32] = 448.0  # amax exactly 448 * 2^k: the RCEIL boundary
    x[0, 32:64] = 0.0  # all-zero block: FlashInfer writes scale 0
    if rows > 1:
        x[1, :32] = 896.0
    data, scale = quantize_activation(x)
    expected_data, expected_scale = flashinfer_quantize_model(x)
    assert torch.equal(data.view(torch.uint8), expected_data.view(torch.uint8))
    assert torch.equal(scale, loop_interleave_128x4(expected_scale))


@pytest.mark.parametrize("gate_up_layout", ["concat", "interleaved"])
def test_moe_preparation_equals_direct_loops_and_round_trips(gate_up_layout):
    experts, intermediate, hidden = 2, 128, 256
    w13 = torch.randint(0, 255, (experts, 2 * intermediate, hidden), dtype=torch.uint8)
    s13 = torch.randint(0, 255, (experts, 2 * intermediate, hidden // 32), dtype=torch.uint8)
    w2 = torch.randint(0, 255, (experts, hidden, intermediate), dtype=torch.uint8)
    s2 = torch.randint(0, 255, (experts, hidden, intermediate // 32), dtype=torch.uint8)
    rows13 = w13_row_index(2 * intermediate, gate_up_layout)
    data13, scale13 = prepare_moe_tensor(w13, s13, rows13)
    data2, scale2 = prepare_moe_tensor(w2, s2, shuffle_index(hidden))
    for e in range(experts):
        # vLLM `prepare_fp8_moe_layer_for_fi` + `_shuffle_mxfp8_moe_weights`, expert by expert
        assert torch.equal(data13[e], loop_shuffle(loop_gated_reorder(loop_up_gate(w13[e], gate_up_layout))))
        expected_s13 = loop_interleave_128x4(loop_shuffle(loop_gated_reorder(loop_up_gate(s13[e], gate_up_layout))))
        assert torch.equal(scale13[e].flatten(), expected_s13)
        assert torch.equal(data2[e], loop_shuffle(w2[e]))
        assert torch.equal(scale2[e].flatten(), loop_interleave_128x4(loop_shuffle(s2[e])))
    assert scale13.shape == s13.shape and scale2.shape == s2.shape
    assert all(torch.equal(a, b) for a, b in zip(restore_moe_tensor(data13, scale13, rows13), (w13, s13)))
    assert all(torch.equal(a, b) for a, b in zip(restore_moe_tensor(data2, scale2, shuffle_index(hidden)), (w2, s2)))


def test_gemm1_rows_hold_up_then_gate_before_the_shuffle():
    rows = torch.arange(256)  # row r of our concat [gate; up] holds value r
    unshuffled = rows[w13_row_index(256, "concat")][torch.argsort(shuffle_index(256))]
    assert unshuffled[:4].tolist() == [128, 0, 129, 1]  # up_0, gate_0, up_1, gate_1


def test_moe_preparation_refuses_unaligned_sizes():
    data, scale = torch.zeros(1, 96, 256, dtype=torch.uint8), torch.zeros(1, 96, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"rows % 128 == 0"):
        prepare_moe_tensor(data, scale, torch.arange(96))


def test_pack_routing_round_trips_including_negative_weights():
    ids = torch.tensor([[0, 3], [7, 1]])
    weights = torch.tensor([[0.75, 0.25], [-0.5, 1.0]])
    packed = pack_routing(ids, weights)
    assert packed.dtype == torch.int32
    assert torch.equal(packed >> 16, ids.int())
    low = (packed & 0xFFFF).to(torch.int16).view(torch.bfloat16)  # wraps to the same 16 bits
    assert torch.equal(low.float(), weights)


def test_local_topk_ids_sends_remote_experts_out_of_range():
    expert_map = torch.tensor([-1, -1, 0, 1])  # this rank holds global experts 2 and 3
    assert local_topk_ids(torch.tensor([[2, 0], [3, 1]]), expert_map, 2).tolist() == [[0, 2], [1, 2]]


# --- supports ---

FI = frozenset({"triton", "flashinfer"})
MX = (kMxfp8Static, kMxfp8Dynamic)
LINEAR_CASES = [
    (Capability("cuda", 100, FI), MX, Problem(4096, 4096), True, "mm_mxfp8"),
    (Capability("cuda", 103, FI), MX, Problem(256, 128, m=None), True, "mm_mxfp8"),
    (Capability("cpu"), MX, Problem(4096, 4096), False, "needs a CUDA GPU .* got device 'cpu'"),
    (Capability("cuda", 90, FI), MX, Problem(4096, 4096), False, "needs SM100 or SM103 .* got sm90"),
    (Capability("cuda", 120, FI), MX, Problem(4096, 4096), False, "got sm120"),
    (Capability("cuda", 100, frozenset({"triton"})), MX, Problem(4096, 4096), False, "flashinfer is not installed"),
    (Capability("cuda", 100, FI), MX, Problem(64, 4096), False, r"N, K >= 128 .* got N=64, K=4096"),
    (Capability("cuda", 100, FI), MX, Problem(4096, 96), False, r"got N=4096, K=96"),
    (Capability("cuda", 100, FI), MX, Problem(4096, 1000), False, r"K % 32 == 0 .* got K=1000"),
    (Capability("cuda", 100, FI), MX, Problem(4100, 4096), False, r"N % 8 == 0\), got N=4100"),
    (Capability("cuda", 100, FI), MX, Problem(4096, 4096, m=1), False, "M=1 is decode-sized"),
    (Capability("cuda", 100, FI), MX, Problem(4096, 4096, m=17), True, "mm_mxfp8"),
    (Capability("cuda", 100, FI), (kFp8Static128BlockSym, kFp8Dynamic128Sym), Problem(4096, 4096), False, "runs only"),
    (Capability("cuda", 100, FI), (kMxfp8Static, None), Problem(4096, 4096), False, r"got .*/None"),
]


@pytest.mark.parametrize("capability, pair, problem, ok, reason", LINEAR_CASES)
def test_supports_linear(capability, pair, problem, ok, reason):
    got_ok, got_reason = fi.supports("linear", capability, *pair, problem)
    assert got_ok is ok
    assert re.search(reason, got_reason), got_reason


MOE_CASES = [
    (Problem(n=1536, k=4096, experts=64, topk=8), True, "TRT-LLM MXFP8 fused MoE"),
    (Problem(n=1536, k=4096), True, "TRT-LLM"),  # experts / top-k not known yet
    (Problem(n=1440, k=2048, experts=64, topk=6), False, r"% 128 == 0, got I=1440, H=2048"),
    (Problem(n=1536, k=2880, experts=32, topk=4), False, r"got I=1536, H=2880"),
    (Problem(n=1536, k=4096, experts=62, topk=4), False, r"experts % 4 == 0 and <= 512, got 62"),
    (Problem(n=1536, k=4096, experts=1024, topk=4), False, "got 1024"),
    (Problem(n=1536, k=4096, experts=64, topk=10), False, r"top_k <= 8, got 10"),
]


@pytest.mark.parametrize("problem, ok, reason", MOE_CASES)
def test_supports_moe(problem, ok, reason):
    got_ok, got_reason = fi.supports("moe", Capability("cuda", 100, FI), *MX, problem)
    assert got_ok is ok
    assert re.search(reason, got_reason), got_reason


def test_supports_rejects_moe_off_sm100_and_unknown_kinds():
    assert fi.supports("moe", Capability("cuda", 120, FI), *MX, Problem(1536, 4096))[1].endswith("got sm120")
    assert fi.supports("attention", Capability("cuda", 100, FI), *MX, Problem(1, 1)) == (
        False,
        "invalid kind 'attention'; valid: linear, moe",
    )


# --- preparation and fakes ---


def mx_weight(*shape):
    return quantize(torch.randn(*shape) * 0.05, kMxfp8Static)


def test_prepare_weight_swizzles_scales_only():
    weight = mx_weight(200, 160)
    prepared = fi.prepare_weight("linear", weight)
    assert prepared.data is weight.data or torch.equal(prepared.data, weight.data)
    assert torch.equal(prepared.scale, to_blocked(weight.scale))
    assert prepared.shape == weight.shape and prepared.key == weight.key
    with pytest.raises(ValueError, match="kind 'linear', got 'moe'"):
        fi.prepare_weight("moe", weight)
    with pytest.raises(ValueError, match="takes weight key"):
        fi.prepare_weight("linear", quantize(torch.randn(128, 128), kFp8Static128BlockSym))


def test_fakes_give_exact_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.ops.quantpass.flashinfer_mm_mxfp8(
            torch.empty(7, 256, dtype=torch.float16),
            torch.empty(384, 256, dtype=FP8),
            torch.empty(3072, dtype=torch.uint8),
        )
        assert (out.shape, out.dtype) == ((7, 384), torch.float16)
        moe_out = torch.ops.quantpass.flashinfer_mxfp8_moe(
            torch.empty(5, 256, dtype=torch.bfloat16),
            torch.empty(5, 2, dtype=torch.int32),
            torch.empty(4, 256, 256, dtype=FP8),
            torch.empty(4, 256, 8, dtype=torch.uint8),
            torch.empty(4, 256, 128, dtype=FP8),
            torch.empty(4, 256, 4, dtype=torch.uint8),
            4,
        )
        assert (moe_out.shape, moe_out.dtype) == ((5, 256), torch.bfloat16)


# --- the whole path on CPU through an emulated flashinfer module ---


def emulated_flashinfer():
    """A stand-in `flashinfer` that checks the input contract and computes what the real kernels
    compute, undoing the layouts with torchao's `from_blocked` and the loops above (not ours)."""

    def mxfp8_quantize(x, is_sf_swizzled_layout=True, alignment=32, enable_pdl=None):
        assert x.dtype in (torch.bfloat16, torch.float16) and x.shape[-1] % 32 == 0
        data, scale = flashinfer_quantize_model(x)
        return data, (to_blocked(scale) if is_sf_swizzled_layout else scale.flatten())

    def dequantize(data, scale):
        return (data.float().unflatten(-1, (-1, 32)) * torch.exp2(scale.float() - 127)[..., None]).flatten(-2)

    def mm_mxfp8(a, b, a_descale, b_descale, out=None, out_dtype=torch.bfloat16, backend="auto"):
        (m, k), n = a.shape, b.shape[1]
        assert backend == "cutlass" and a.dtype == b.dtype == FP8 and b.stride(0) == 1  # b column-major
        assert min(n, k) >= 128 and a_descale.dtype == b_descale.dtype == torch.uint8
        assert a_descale.numel() == -(-m // 128) * 128 * -(-k // 128) * 4 == to_blocked(torch.empty(m, k // 32)).numel()
        weight = dequantize(b.t(), from_blocked(b_descale, n, k // 32))
        return (dequantize(a, from_blocked(a_descale, m, k // 32)) @ weight.t()).to(out_dtype)

    def unshuffle(rows):  # inverse of loop_shuffle on [R, ...]
        return rows[[(old // 32) * 32 + BLOCK32[old % 32] for old in range(rows.shape[0])]]

    def trtllm_fp8_block_scale_routed_moe(**kw):
        assert kw["fp8_quantization_type"] == Fp8QuantizationType.MxFp8 and kw["use_shuffled_weight"]
        assert kw["weight_layout"] == 0 and kw["do_finalize"] and kw["local_expert_offset"] == 0
        x, packed, tokens = kw["hidden_states"], kw["topk_ids"], kw["hidden_states"].shape[0]
        x = dequantize(x, kw["hidden_states_scale"])  # linear [T, H/32]
        inter, local = kw["intermediate_size"], kw["local_num_experts"]
        out = torch.zeros(tokens, x.shape[1])
        for e in range(local):
            w13, s13 = kw["gemm1_weights"][e], kw["gemm1_weights_scale"][e]
            w2, s2 = kw["gemm2_weights"][e], kw["gemm2_weights_scale"][e]
            g1 = dequantize(unshuffle(w13), unshuffle(from_blocked(s13.flatten(), *s13.shape)))
            g2 = dequantize(unshuffle(w2), unshuffle(from_blocked(s2.flatten(), *s2.shape)))
            up_gate = torch.cat([g1[0::2], g1[1::2]])  # undo reorder_rows_for_gated_act_gemm
            for t, slot in (packed >> 16 == e).nonzero().tolist():
                weight = (packed[t, slot] & 0xFFFF).to(torch.int16).view(torch.bfloat16).float()
                h = x[t] @ up_gate.t()
                act = (torch.nn.functional.silu(h[inter:]) * h[:inter]).to(torch.bfloat16)[None]
                out[t] += weight * (dequantize(*flashinfer_quantize_model(act)) @ g2.t())[0]
        return out.to(torch.bfloat16)

    class Fp8QuantizationType(IntEnum):
        DeepSeekFp8 = 1
        MxFp8 = 2

    module = types.ModuleType("flashinfer")
    module.mxfp8_quantize, module.mm_mxfp8 = mxfp8_quantize, mm_mxfp8
    module.fused_moe = types.ModuleType("flashinfer.fused_moe")
    module.fused_moe.Fp8QuantizationType = Fp8QuantizationType
    module.fused_moe.trtllm_fp8_block_scale_routed_moe = trtllm_fp8_block_scale_routed_moe
    return module


@pytest.fixture
def emulated(monkeypatch):
    module = emulated_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setitem(sys.modules, "flashinfer.fused_moe", module.fused_moe)


@pytest.mark.parametrize("rows", [1, 7, 130])
def test_linear_through_emulated_flashinfer_matches_reference(emulated, rows):
    x, bias = torch.randn(rows, 256, dtype=torch.bfloat16), torch.randn(160)
    weight = mx_weight(160, 256)
    out = fi.linear(x, fi.prepare_weight("linear", weight), kMxfp8Dynamic, bias)
    assert out.shape == (rows, 160) and out.dtype == torch.bfloat16
    assert sqnr(reference.linear(x, weight, kMxfp8Dynamic, bias).float(), out.float()) > 40


@pytest.mark.parametrize("gate_up_layout", ["concat", "interleaved"])
@pytest.mark.parametrize("use_expert_map", [False, True])
def test_moe_through_emulated_flashinfer_matches_reference(emulated, gate_up_layout, use_expert_map):
    experts, intermediate, hidden, tokens = 4, 128, 128, 9
    w13, w2 = mx_weight(experts, 2 * intermediate, hidden), mx_weight(experts, hidden, intermediate)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    topk_weights, topk_ids = torch.rand(tokens, 2).softmax(-1), torch.randint(0, experts, (tokens, 2))
    expert_map = torch.tensor([0, -1, 1, -1]) if use_expert_map else None
    local = [0, 2] if use_expert_map else list(range(experts))
    w13_local, w2_local = (type(w)(w.data[local], w.scale[local], None, w.key, w.shape, w.dtype) for w in (w13, w2))
    gated = GatedActivation("silu", gate_up_layout, 1.702, 7.0)
    problem = MoEProblem(x, topk_weights, topk_ids, w13_local, w2_local, gated, kMxfp8Dynamic, expert_map=expert_map)
    expected = reference.fused_moe(problem)
    w13_prepared, w2_prepared = fi.prepare_moe_weights(w13_local, w2_local, gate_up_layout)
    out = fi.fused_moe(replace(problem, w13=w13_prepared, w2=w2_prepared))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert sqnr(expected.float(), out.float()) > 30


def test_moe_refuses_what_the_kernel_cannot_run(emulated):
    w13, w2 = mx_weight(4, 256, 128), mx_weight(4, 128, 128)
    x, weights, ids = (
        torch.randn(3, 128, dtype=torch.bfloat16),
        torch.ones(3, 2) / 2,
        torch.zeros(3, 2, dtype=torch.long),
    )
    base = MoEProblem(x, weights, ids, w13, w2, GatedActivation("silu", "concat", 1.702, 7.0), kMxfp8Dynamic)
    for change, message in [
        ({"gated": GatedActivation("swigluoai", "concat", 1.702, 7.0)}, "'silu' .* got 'swigluoai'"),
        ({"b13": torch.zeros(4, 256)}, "no expert biases"),
        ({"apply_router_weight_on_input": True}, "top_k == 1 on flashinfer, got 2"),
    ]:
        with pytest.raises(ValueError, match=message):
            fi.fused_moe(replace(base, **change))


def test_oracle_and_graph_op_reach_this_backend(emulated):
    sm100, sm90 = Capability("cuda", 100, FI), Capability("cuda", 90, frozenset({"triton"}))
    assert oracle.select("linear", *MX, sm100, Problem(256, 512)).backend == "flashinfer"
    assert oracle.select("moe", *MX, sm100, Problem(1536, 4096, experts=64, topk=8)).backend == "flashinfer"
    with pytest.raises(oracle.NoKernelError, match="backend 'flashinfer' can't run .* got sm90"):
        oracle.select("linear", *MX, sm90, Problem(256, 512), backend="flashinfer")
    x, weight = torch.randn(2, 3, 256, dtype=torch.bfloat16), mx_weight(160, 256)
    prepared = ops.prepare_weight("flashinfer", "linear", weight)
    keys = ops.key_arg(kMxfp8Static), ops.key_arg(kMxfp8Dynamic)
    out = ops.linear(x, prepared.data, prepared.scale, None, None, *keys, "flashinfer", 160)
    expected = reference.linear(x.reshape(6, 256), weight, kMxfp8Dynamic, None).reshape(2, 3, 160)
    assert sqnr(expected.float(), out.float()) > 40


def test_opcheck_with_emulated_flashinfer(emulated):
    # test_schema is left out: its mutation check multiplies the inputs, which CPU fp8 can't do.
    checks = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    x, weight = torch.randn(7, 256, dtype=torch.bfloat16), fi.prepare_weight("linear", mx_weight(128, 256))
    torch.library.opcheck(
        torch.ops.quantpass.flashinfer_mm_mxfp8.default, (x, weight.data, weight.scale), test_utils=checks
    )
    w13, w2 = fi.prepare_moe_weights(mx_weight(4, 256, 128), mx_weight(4, 128, 128), "concat")
    packed = pack_routing(torch.randint(0, 4, (3, 2)), torch.full((3, 2), 0.5))
    moe_args = (x[:3, :128].contiguous(), packed, w13.data, w13.scale, w2.data, w2.scale, 4)
    torch.library.opcheck(torch.ops.quantpass.flashinfer_mxfp8_moe.default, moe_args, test_utils=checks)


# --- GPU tier: the real kernels ---


def _sm100_with_flashinfer() -> bool:
    if not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None:
        return False
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor in fi.SUPPORTED_SM


needs_blackwell = pytest.mark.skipif(
    not _sm100_with_flashinfer(), reason="FlashInfer MXFP8 kernels need an SM100/SM103 GPU with flashinfer installed"
)


@pytest.mark.gpu
@needs_blackwell
def test_gpu_flashinfer_quantizer_bytes_equal_ours():
    import flashinfer

    x = (torch.randn(83, 1024, device="cuda") * torch.logspace(-4, 4, 1024, device="cuda")).bfloat16()
    data, scale = flashinfer.mxfp8_quantize(x, True)
    ours_data, ours_scale = quantize_activation(x)
    assert torch.equal(data.view(torch.uint8), ours_data.view(torch.uint8))
    assert torch.equal(scale.view(torch.uint8).flatten(), ours_scale)


@pytest.mark.gpu
@needs_blackwell
@pytest.mark.parametrize("rows", [1, 7, 83, 256])
@pytest.mark.parametrize("n, k", [(256, 512), (4096, 4096), (384, 1056)])
def test_gpu_linear_matches_reference(rows, n, k):
    x, bias = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16), torch.randn(n, device="cuda")
    weight = quantize(torch.randn(n, k, device="cuda") * 0.02, kMxfp8Static)
    out = fi.linear(x, fi.prepare_weight("linear", weight), kMxfp8Dynamic, bias)
    assert sqnr(reference.linear(x, weight, kMxfp8Dynamic, bias).float(), out.float()) > 35


@pytest.mark.gpu
@needs_blackwell
@pytest.mark.parametrize("gate_up_layout", ["concat", "interleaved"])
@pytest.mark.parametrize("tokens", [1, 37, 300])
def test_gpu_moe_matches_reference(gate_up_layout, tokens):
    experts, intermediate, hidden, topk = 8, 384, 1024, 2
    w13 = quantize(torch.randn(experts, 2 * intermediate, hidden, device="cuda") * 0.02, kMxfp8Static)
    w2 = quantize(torch.randn(experts, hidden, intermediate, device="cuda") * 0.02, kMxfp8Static)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = torch.randn(tokens, experts, device="cuda").softmax(-1).topk(topk)
    problem = MoEProblem(x, weights, ids, w13, w2, GatedActivation("silu", gate_up_layout, 1.702, 7.0), kMxfp8Dynamic)
    expected = reference.fused_moe(problem)
    w13_prepared, w2_prepared = fi.prepare_moe_weights(w13, w2, gate_up_layout)
    out = fi.fused_moe(replace(problem, w13=w13_prepared, w2=w2_prepared))
    assert sqnr(expected.float(), out.float()) > 25
