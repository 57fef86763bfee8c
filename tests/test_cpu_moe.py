"""The cpu backend's fused MoE (the reference's per-expert loop with the cpu kernels per expert)
against the reference: every MoE pair the oracle gives it (FP4 weight-only and FP8 included), both INT4 kernels, T in {1, 5, 33} with
H = 160 (INT4 pads K to 256), an expert map with non-local experts, biases, each activation and
gate/up layout; its stacked weight layout; and the oracle choosing it on CPU only."""

from dataclasses import replace

import pytest
import torch
from kernel_tiles import on_tiles

from quantpass.kernels import cpu, cpu_fp8, oracle, reference
from quantpass.kernels.oracle import Capability, Problem
from quantpass.metrics import sqnr
from quantpass.moe_problem import GatedActivation, MoEProblem
from quantpass.quant_registry import formats, keys

PAIRS = [pair for pair, backends in oracle.MOE_CANDIDATES.items() if "cpu" in backends]
# Same quantized weights on both sides; aten's kernels read activations as bf16, quantpass's as
# int16 (INT8) or int8 per 128 (INT4); outputs are bf16. Measured 2026-11-29 (aten's) and 2026-12-01
# (ours): weight-only >= 45.6 dB, ours for INT4 >= 36.0 dB; INT8 W8A8 on aten's 36.4-42.1 dB, because GEMM1's rounding differences flip some of the
# intermediate activation's int8 roundings by one step before GEMM2.
# FP4 weight-only (quantpass's FP4 kernel, int8 activations per 32 / 16): MXFP4 37.6-42.0 dB, NVFP4
# 39.2-43.0 dB over these cases (2026-12-01). FP8 (the FP8 kernel on the loop's activations, as the
# reference's): FLOOR_DB.
FLOORS_DB = {
    (keys.kInt8StaticChannelSym, keys.kInt8DynamicTokenSym): 32,
    (keys.kMxfp4Static, None): 32,
    (keys.kNvfp4Static, None): 32,
}
FLOOR_DB = 40
INT4_OURS_FLOOR_DB = 32
CASES = [  # tokens, local experts (None: all), bias, activation, layout, router weight on the input
    (1, None, False, "silu", "concat", False),
    (5, [0, 2], False, "gelu", "interleaved", False),
    (33, None, True, "swigluoai", "interleaved", True),
    (7, [1, 3], True, "silu_clamped", "concat", False),
]
LIMITS = {"silu_clamped": 0.5}  # clamps about half of the ~N(0, 1) projections; swigluoai's 7.0 few


def moe_args(pair, tokens, local, bias, activation, layout, on_input, experts=4, top_k=2, hidden=160, inter=48):
    gen = torch.Generator().manual_seed(tokens)
    routing = torch.randn(tokens, experts, generator=gen).softmax(-1)
    topk_weights, topk_ids = routing.topk(top_k, dim=-1)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    b13 = (torch.randn(experts, 2 * inter, generator=gen) / 4).bfloat16() if bias else None
    b2 = (torch.randn(experts, hidden, generator=gen) / 4).bfloat16() if bias else None
    expert_map = None
    if local is not None:  # expert parallelism: keep these experts, map the others to -1
        expert_map = torch.full((experts,), -1, dtype=torch.int32)
        expert_map[local] = torch.arange(len(local), dtype=torch.int32)
        w13, w2 = w13[local], w2[local]
        b13, b2 = (None, None) if b13 is None else (b13[local], b2[local])
    weight, activation_key = pair
    hidden_states = torch.randn(tokens, hidden, generator=gen).bfloat16()
    q13, q2 = formats.quantize(w13, weight), formats.quantize(w2, weight)
    if keys.needs_input_scale(activation_key):  # a checkpoint's calibrated scales, one per expert
        scales = torch.linspace(0.8, 1.2, w13.shape[0])
        q13 = replace(q13, input_scale=scales * hidden_states.float().abs().amax() / 448)
        q2 = replace(q2, input_scale=scales * 4 / 448)
    gated = GatedActivation(activation, layout, 1.702, LIMITS.get(activation, 7.0))
    problem = MoEProblem(hidden_states, topk_weights, topk_ids, q13, q2, gated, activation_key, b13, b2, expert_map)
    return replace(problem, apply_router_weight_on_input=on_input)


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-{p[1]}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}")
def test_cpu_moe_matches_reference(pair, case, int4_kernel):
    problem = moe_args(pair, *case)
    q13, q2 = problem.w13, problem.w2
    want = reference.fused_moe(problem).float()
    prepared = cpu.prepare_moe_weights(q13, q2, case[4])
    ours = pair[0] == keys.kInt4StaticGroup128Sym and int4_kernel == "avx2"
    floor = INT4_OURS_FLOOR_DB if ours else FLOORS_DB.get(pair, FLOOR_DB)
    for w13, w2 in (prepared, (q13, q2)):  # prepared once (the graph path), and per call
        got = cpu.fused_moe(replace(problem, w13=w13, w2=w2))
        assert got.shape == problem.hidden.shape and got.dtype == problem.hidden.dtype
        assert sqnr(want, got.float()) >= floor


def test_prepared_moe_layout(int4_kernel):
    """One copy: quantpass's kernels read the stacked quantized experts as they are; aten's INT4
    layout replaces them, expert by expert."""
    pair = next(p for p in PAIRS if p[0] == keys.kInt4StaticGroup128Sym)
    problem = moe_args(pair, 1, None, False, "silu", "concat", False)
    q13, q2 = problem.w13, problem.w2
    w13, w2 = cpu.prepare_moe_weights(q13, q2, "concat")
    if int4_kernel == "avx2":
        assert (w13, w2) == (q13, q2) and w13.data is q13.data and w2.scale is q2.scale
    else:
        assert w13.data.shape[0] == 4 and w13.shape == q13.shape and w13.nbytes <= q13.nbytes + 4 * 96 * 2 * 8
        assert cpu._is_aten_layout(w13[3]) and cpu._is_aten_layout(w2[0])
    assert cpu.prepare_moe_weights(w13, w2, "concat") == (w13, w2)  # idempotent


def test_oracle_picks_cpu_moe_on_cpu_only():
    problem = Problem(n=48, k=160, experts=4, topk=2, activation="silu")
    for weight, activation in PAIRS:
        on_cpu = oracle.select("moe", weight, activation, Capability("cpu", None, frozenset({"triton"})), problem)
        on_gpu = oracle.select("moe", weight, activation, Capability("cuda", 90, frozenset({"triton"})), problem)
        gpu = "triton" if "triton" in oracle.MOE_CANDIDATES[weight, activation] else "reference"
        assert (on_cpu.backend, on_gpu.backend) == ("cpu", gpu), (weight, on_cpu, on_gpu)
        assert on_gpu.rejected.get("cpu", "").startswith("aten's weight-only CPU kernels run on cpu") or (
            "cpu" not in on_gpu.rejected
        )


# the MoE pairs the oracle gives the cpu backend that run in one C call per layer (qp_moe, qp_moe_fp8,
# qp_moe_fp4): all of them (weight-only, FP8 and MXFP8 W8A8, INT8 W8A8)
FAST_PAIRS = [pair for pair in PAIRS if cpu.moe_in_one_call(*pair)]
FAST_CASES = [  # tokens, local experts, bias, activation, layout, router on input, hidden dtype, top k of 8, scale
    (1, None, False, "silu", "concat", False, torch.bfloat16, 6, 1),
    (1, [1, 3], True, "gelu_tanh", "interleaved", True, torch.float16, 2, 1),
    (5, [0, 2, 5], False, "gelu", "interleaved", False, torch.bfloat16, 3, 1),
    (33, None, True, "swigluoai", "interleaved", True, torch.float32, 4, 1),
    (9, None, False, "silu", "concat", True, torch.float32, 8, 1),
    (4, None, False, "silu", "interleaved", False, torch.bfloat16, 4, 300),
    (4, None, True, "swigluoai", "concat", False, torch.float32, 4, 300),
    (6, [0, 2, 5], False, "silu_clamped", "interleaved", True, torch.bfloat16, 3, 1),
]


needs_ours = pytest.mark.skipif(not cpu.cpu_avx2.available()[0], reason="quantpass's CPU kernels can't run here")


def fast_problem(pair, tokens, local, bias, activation, layout, on_input, dtype, top_k, hidden=160):
    problem = moe_args(pair, tokens, local, bias, activation, layout, on_input, experts=8, top_k=top_k, hidden=hidden)
    w13, w2 = cpu.prepare_moe_weights(problem.w13, problem.w2, layout)
    return replace(problem, hidden=problem.hidden.to(dtype), w13=w13, w2=w2)


def loop(problem):
    """The loop the cpu backend runs where a layer is not one C call (`cpu._per_expert_loop`)."""
    return cpu._per_expert_loop(problem)


# NVFP4 W4A4: its loop is the reference's dequantize + fp32 matmul, which rounds each product; the one
# call's are exact integer ones
REFERENCE_LOOP = [(keys.kNvfp4Static, keys.kNvfp4Dynamic)]


def pair_id(pair) -> str:
    return str(pair[0]) if pair[1] is None else f"{pair[0]}-{pair[1]}"


@needs_ours
@pytest.mark.parametrize("pair", FAST_PAIRS, ids=pair_id)
@pytest.mark.parametrize("case", FAST_CASES, ids=lambda c: f"T{c[0]}-{c[3]}-{c[6]}-x{c[8]}")
def test_one_call_gives_the_loops_result(pair, case, monkeypatch):
    """Every pair in one call: the whole layer in one C call (csrc/moe_layer.h), into an output
    poisoned with NaN, against the per-expert loop on the same kernels (FP8 W8A8: the loop quantizes
    the activations in torch, the one call in the kernel; FP8 here on its fp32 tiles, as the loop's W8A8
    GEMMs, the bf16 ones in the next test): experts shared by several tokens (T >= 5), up
    to every expert per token, non-local experts, biases, each activation and layout, the router weight
    on the input, each activation dtype, and activations large enough (x 300) that exp saturates. The
    same but for the gated activation's exp/erf/tanh (moe_layer.h's, not torch's vectorized ones):
    measured 2026-12-02, bf16/fp16 outputs equal bit for bit, fp32 ones at >= 146 dB with >= 80% of them
    equal (FP8's products are exact fp32 ones, so a last-bit difference in the activation carries
    through; the integer kernels' int8/int16 activations absorb most: >= 96% equal). NVFP4 W4A4
    against the reference's loop (`REFERENCE_LOOP`): bf16/fp16 equal, fp32 at 137.8-139.1 dB with 23-31%
    equal."""
    with on_tiles(cpu_fp8.tiles, "avx2" if pair[0] in cpu_fp8.MODES else None):  # as the loop's W8A8 GEMMs
        want, got = one_call_and_loop(pair, case, monkeypatch)
    floor, equal = (140, 0.99) if got.dtype != torch.float32 else (130, 0.15) if pair in REFERENCE_LOOP else (140, 0.75)
    assert sqnr(want.float(), got.float()) >= floor and (got == want).float().mean() >= equal


def one_call_and_loop(pair, case, monkeypatch):
    """(the loop's output, the one call's into an output poisoned with NaN) for a FAST_CASES case."""
    problem = fast_problem(pair, *case[:-1])
    problem = replace(problem, hidden=problem.hidden * case[-1])
    want = loop(problem)
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t: empty_like(t).fill_(float("nan")))
    got = cpu.fused_moe(problem)
    monkeypatch.undo()
    assert got.dtype == want.dtype and got.shape == want.shape and not got.isnan().any()
    return want, got


@needs_ours
@pytest.mark.parametrize("pair", [p for p in FAST_PAIRS if p[0] in cpu_fp8.MODES and p[1]], ids=pair_id)
@pytest.mark.parametrize("case", FAST_CASES, ids=lambda c: f"T{c[0]}-{c[3]}-{c[6]}-x{c[8]}")
def test_one_call_on_the_fp8_bf16_tiles(pair, case, monkeypatch):
    """FP8 W8A8 in one call on the bf16 tiles (the activations' FP8 codes, each weight group's sum times
    its activation scale) against the loop, which multiplies the dequantized activations on the fp32
    tiles: the same products, rounded in other places (MXFP8's power-of-two scales excepted). Measured
    2026-12-02: fp32 outputs at 134.5-141.1 dB, bf16/fp16 ones at >= 98.8 dB with >= 99.8% equal (a last
    bit of one bf16 output is 99 dB)."""
    with on_tiles(cpu_fp8.tiles, "avx512-bf16"):
        want, got = one_call_and_loop(pair, case, monkeypatch)
    floor, equal = (130, 0.0) if got.dtype == torch.float32 else (90, 0.99)
    assert sqnr(want.float(), got.float()) >= floor and (got == want).float().mean() >= equal


@needs_ours
def test_one_call_where_it_applies():
    """Every activation key the cpu backend takes for a MoE layer runs in one call (FP8 with a
    per-tensor dynamic scale too: one scale over all routed rows, as the loop takes it); the loop runs
    where an expert GEMM of it would not be our kernel's: more tokens than the kernel's largest M
    (INT4's, FP8's), experts not stored contiguously: the one-call path answers None."""
    calls = []
    real = cpu._moe_on_our_kernels

    def spy(*args):
        calls.append(real(*args))
        return calls[-1]

    def long(problem, tokens):
        rows = (problem.hidden, problem.topk_ids, problem.topk_weights)
        hidden, ids, weights = (t.expand(tokens, -1) for t in rows)
        return replace(problem, hidden=hidden, topk_ids=ids, topk_weights=weights)

    int4 = fast_problem((keys.kInt4StaticGroup128Sym, None), *FAST_CASES[0][:-1])
    fp8 = fast_problem((keys.kFp8StaticChannelSym, None), *FAST_CASES[0][:-1])
    nvfp4 = fast_problem((keys.kNvfp4Static, None), *FAST_CASES[0][:-1])
    fp8_w8a8 = fast_problem((keys.kFp8Static128BlockSym, keys.kFp8Dynamic128Sym), *FAST_CASES[0][:-1])
    mxfp8 = fast_problem((keys.kMxfp8Static, keys.kMxfp8Dynamic), *FAST_CASES[0][:-1])
    int8_w8a8 = fast_problem((keys.kInt8StaticChannelSym, keys.kInt8DynamicTokenSym), *FAST_CASES[0][:-1])
    fp8_tensor = fast_problem((keys.kFp8StaticTensorSym, keys.kFp8DynamicTensorSym), *FAST_CASES[0][:-1])
    strided = replace(nvfp4, w13=replace(nvfp4.w13, data=nvfp4.w13.data.transpose(1, 2).contiguous().transpose(1, 2)))
    loops = [long(int4, cpu.OURS_MAX_M[int4.w13.key] + 1), long(fp8, cpu.cpu_fp8.MAX_M + 1), strided]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu, "_moe_on_our_kernels", spy)
        for problem in (int4, fp8, nvfp4, fp8_w8a8, mxfp8, int8_w8a8, fp8_tensor, *loops):
            cpu.fused_moe(problem)
    assert all(c is not None for c in calls[:7]) and calls[7:] == [None] * len(loops), calls


@needs_ours
@pytest.mark.parametrize("pair", FAST_PAIRS, ids=pair_id)
def test_one_call_refuses_bad_expert_ids_and_skips_other_ranks(pair):
    """An expert id outside [0, E) or the expert map, or a map entry past the local experts, is refused
    before any weight is read; a token whose experts all live on other ranks (a negative local id, mapped
    or given) gets zeros, as in the loop."""
    problem = fast_problem(pair, 3, [1, 4], False, "silu", "concat", False, torch.bfloat16, 2)
    ids = torch.tensor([[0, 2], [1, 4], [5, 4]])  # token 0: neither expert is local
    ok = replace(problem, topk_ids=ids)
    got = cpu.fused_moe(ok)
    assert (got[0] == 0).all() and torch.equal(got, loop(ok))
    bad_map = problem.expert_map.clone()
    bad_map[3] = 2  # only experts 0 and 1 are local
    for change in ({"topk_ids": ids + 4}, {"expert_map": bad_map, "topk_ids": torch.tensor([[3, 1]] * 3)}):
        with pytest.raises(IndexError, match="outside the expert map or"):
            cpu.fused_moe(replace(problem, **change))
    with pytest.raises(IndexError, match=r"outside the expert map or \[0, 2\)"):  # 2 local experts
        cpu.fused_moe(replace(problem, expert_map=None, topk_ids=torch.tensor([[2, 0]] * 3)))
    unmapped = replace(problem, expert_map=None, topk_ids=torch.tensor([[-1, 0], [1, -1], [-1, -1]]))
    assert torch.equal(cpu.fused_moe(unmapped), loop(unmapped))  # a negative local id: another rank's


@needs_ours
@pytest.mark.parametrize("pair", FAST_PAIRS, ids=pair_id)
def test_one_call_threads_give_the_same_output(pair, monkeypatch):
    """Enough rows that the one call splits its gather, activation and sums over threads (64 tokens: within
    every kernel's largest M): 1 and 2 threads give the same output bit for bit."""
    problem = fast_problem(pair, 64, None, True, "swigluoai", "interleaved", False, torch.bfloat16, 6)
    monkeypatch.setattr(cpu, "_per_expert_loop", None)  # the one call, or a TypeError
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.fused_moe(problem)
        torch.set_num_threads(2)
        two = cpu.fused_moe(problem)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def graph_args(problem, weights=None):
    """`quantpass::fused_moe`'s arguments for `problem` (weights prepared for the cpu backend; a static
    activation key's input scales last)."""
    w13, w2 = weights or cpu.prepare_moe_weights(problem.w13, problem.w2, problem.gated.gate_up_layout)
    gated, activation = problem.gated, "" if problem.activation_key is None else str(problem.activation_key)
    scales = (problem.w13.input_scale, problem.w2.input_scale) if keys.needs_input_scale(problem.activation_key) else ()
    return (problem.hidden, problem.topk_weights, problem.topk_ids, w13.data, w13.scale, w13.scale2, w2.data,
            w2.scale, w2.scale2, problem.b13, problem.b2, problem.expert_map, str(w13.key), activation, "cpu",
            str(gated.activation), str(gated.gate_up_layout), problem.apply_router_weight_on_input,
            problem.w2.shape[-1], gated.alpha, gated.limit, *scales)  # fmt: skip


PYTHON_MOE = torch.ops.quantpass.fused_moe_cpu.default


def test_graph_ops_have_the_generic_ops_arguments():
    """Both cpu MoE graph ops take `quantpass::fused_moe`'s arguments (the rewrite passes the same ones
    to any of them), carry the graph ops' layout tag and give the generic op's result."""
    generic, cxx = torch.ops.quantpass.fused_moe.default, cpu.graph_moe_op("cpu")
    assert cpu.graph_moe_op("cuda") is None
    for op in {PYTHON_MOE, cxx}:
        assert str(op._schema).split("(", 1)[1] == str(generic._schema).split("(", 1)[1]
        assert torch.Tag.needs_fixed_stride_order in op.tags
        problem = moe_args((keys.kInt4StaticGroup128Sym, None), 3, [0, 2], True, "gelu", "interleaved", True)
        args = graph_args(replace(problem, hidden=problem.hidden.reshape(1, 3, -1)))
        assert torch.equal(op(*args), generic(*args))


def calls_the_python_op(op, args) -> tuple[torch.Tensor, bool]:
    """(op's output for args, whether the Python MoE op ran inside it), seen by the profiler."""
    with torch.profiler.profile() as prof:
        out = op(*args)
    return out, "quantpass::fused_moe_cpu" in [event.name for event in prof.events()]


@pytest.mark.skipif(cpu.graph_moe_op("cpu") is PYTHON_MOE, reason="no C++ op here")
def test_cxx_op_is_the_python_op():
    """The C++ MoE op (csrc/linear_op.cpp) against the Python one, equal bit for bit: on its fast path
    (every pair the kernels run in one call, INT8/INT4 and the FP8 and FP4 formats, every case above,
    3-D hidden too) without calling the Python op, and off it (more tokens than the kernel's largest M,
    experts not stored contiguously, FP8 scales in another dtype) through it; and the same error for a
    bad expert id."""
    cxx = cpu.graph_moe_op("cpu")
    problems = [fast_problem(pair, *case[:-1]) for pair in FAST_PAIRS for case in FAST_CASES]
    problems.append(replace(problems[0], hidden=problems[0].hidden[None], topk_ids=problems[0].topk_ids[None]))
    for problem in problems:
        args = graph_args(problem)
        out, python = calls_the_python_op(cxx, args)
        assert torch.equal(out, PYTHON_MOE(*args)) and not python, (problem.w13.key, problem.activation_key)

    def long(pair, most):
        return fast_problem(pair, most + 1, None, False, "silu", "concat", False, torch.bfloat16, 2)

    int4, fp8 = (keys.kInt4StaticGroup128Sym, None), (keys.kFp8StaticChannelSym, None)
    nvfp4 = fast_problem((keys.kNvfp4Static, None), *FAST_CASES[1][:-1])
    strided = replace(nvfp4, w13=replace(nvfp4.w13, data=nvfp4.w13.data.transpose(1, 2).contiguous().transpose(1, 2)))
    fp8_problem = fast_problem(fp8, *FAST_CASES[2][:-1])
    half_scales = replace(fp8_problem, w2=replace(fp8_problem.w2, scale=fp8_problem.w2.scale.half()))
    for problem in (long(int4, cpu.OURS_MAX_M[int4[0]]), long(fp8, cpu_fp8.MAX_M), strided, half_scales):
        args = graph_args(problem, (problem.w13, problem.w2))  # as they are: not made contiguous
        out, python = calls_the_python_op(cxx, args)
        assert torch.equal(out, PYTHON_MOE(*args)) and python, (problem.w13.key, problem.hidden.shape)
    for problem in (problems[0], nvfp4, fp8_problem):
        bad = graph_args(replace(problem, topk_ids=problem.topk_ids + 8))
        for op in (cxx, PYTHON_MOE):
            with pytest.raises(IndexError, match=r"outside the expert map or \[0, \d\)"):
                op(*bad)


def test_compiled_moe_calls_the_graph_op_positionally():
    """A MoE model compiled on CPU under Inductor: each MoE layer one call of the cpu MoE graph op,
    with positional arguments only (the generic op got its defaulted input scales by keyword)."""
    from tiny_models import token_ids
    from tiny_moe_models import tiny_moe
    from torch._inductor.utils import run_and_get_code

    import quantpass as qp

    torch._dynamo.reset()
    model = tiny_moe("qwen3_moe", "grouped_mm")
    compiled = torch.compile(model, backend=qp.backend(linear=None, moe="int4_weight_only", lowering="inductor"))
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
        _, codes = run_and_get_code(compiled, token_ids(batch=1, length=1))
    calls = [line for code in codes for line in code.splitlines() if "= torch.ops.quantpass.fused_moe" in line]
    assert len(calls) == model.config.num_hidden_layers, calls
    op = str(cpu.graph_moe_op("cpu")).removeprefix("quantpass.")  # the C++ op where it builds
    assert all(f".{op}(" in line and "=None" not in line and "input_scale" not in line for line in calls), calls


@needs_ours
def test_a_compiled_gpt_oss_runs_its_mxfp4_experts_in_one_call(monkeypatch):
    """gpt-oss's own shape for MXFP4 experts (biases, SwiGLU-OAI, interleaved gate/up) compiled under
    Inductor: each MoE layer of a decode step is one qp_moe_fp4 call, and the logits match the same
    model on the reference backend."""
    from tiny_models import token_ids
    from tiny_moe_models import eager_and_compiled_logits, tiny_moe

    import quantpass as qp

    found = []  # the Python op's one-call arguments (where the C++ op can't be built, it runs the layer)
    moe_experts = cpu.cpu_fp4.moe_experts
    monkeypatch.setattr(cpu.cpu_fp4, "moe_experts", lambda *a: found.append(moe_experts(*a)) or found[-1])
    model, ids = tiny_moe("gpt_oss", "grouped_mm"), token_ids(batch=1, length=1)
    _, want = eager_and_compiled_logits(model, ids, qp.backend(linear=None, moe="mxfp4", backend="reference"))
    assert not found  # the reference backend never asks
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=qp.backend(linear=None, moe="mxfp4", lowering="inductor"))
    with torch.no_grad():
        compiled(ids)  # the compile
        found.clear()
        with torch.profiler.profile() as prof:
            got = compiled(ids).logits
    layers, names = model.config.num_hidden_layers, [event.name for event in prof.events()]
    if cpu.graph_moe_op("cpu") is PYTHON_MOE:
        assert len(found) == layers and all(f is not None for f in found), found
    else:  # the C++ op runs qp_moe_fp4 itself
        assert names.count("quantpass::fused_moe_cpu_cxx") == layers and "quantpass::fused_moe_cpu" not in names
    assert torch.nn.functional.cosine_similarity(want.float().flatten(), got.float().flatten(), dim=0) > 0.999
