"""MoE sites in Dynamo graphs of real models: what is found, that the region is computed right, and
that the rewrite leaves one `quantpass::fused_moe` per layer with logits close to the original.

Graphs come from a capture backend that copies Dynamo's graph (and runs nothing else); the rewrite
is wired by hand here (quantized weights as extra placeholders), the way the quantize pass does it.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from tiny_models import tiny_llama, token_ids
from tiny_moe_models import GatherEinsumMoE, ModuleListMoE, OneLayer, SortedExperts, moe_op_count, tiny_moe

from quantpass.metrics import cosine, sqnr
from quantpass.passes.fx_utils import (
    add_placeholders,
    copy_graph_module,
    op_counts,
    set_placeholder_values,
    target_name,
)
from quantpass.passes.lower import lowering_for
from quantpass.passes.quantize import quantize_site
from quantpass.patterns.moe import find_moe_sites
from quantpass.patterns.moe_expert_gemms import ExpertMatmul, expert_gemm_site
from quantpass.patterns.site import param_refs
from quantpass.quant_registry.spec import QuantSpec

SPEC = QuantSpec.from_name("int8_per_channel")  # W8A8: weights per channel, activations per token
EXPERT_MATMULS = ("torch._grouped_mm", "transformers.grouped_mm_fallback", "torch.bmm", "torch.functional.einsum")
REGION_OPS = ("torch.sort", "torch.histc", "_operator.setitem", "add_", "repeat_interleave")

# model: (MoE layers, experts, activation, gate/up layout, weights stored [E, in, out], biases). Qwen2-MoE's
# layer 0 and DeepSeek-V3's are dense MLPs; shared experts and routers stay ordinary linears.
EXPECTED = {
    "mixtral": ([0, 1], 4, "silu", "concat", False, False),
    "qwen2_moe": ([1], 4, "silu", "concat", False, False),
    "qwen3_moe": ([0, 1], 4, "silu", "concat", False, False),
    "olmoe": ([0, 1], 4, "silu", "concat", False, False),
    "deepseek_v3": ([1], 8, "silu", "concat", False, False),
    "gpt_oss": ([0, 1], 4, "swigluoai", "interleaved", True, True),
    "deepseek_v4": ([0, 1], 4, "silu_clamped", "concat", False, False),  # layer 0 hash-routed
}
# grouped_mm in bf16 captures torch._grouped_mm; in fp32 transformers calls its opaque
# transformers::grouped_mm_fallback under compile. batched_mm is the same graph in any dtype.
CASES = [(name, "grouped_mm", torch.bfloat16) for name in EXPECTED]
CASES += [(name, "batched_mm", torch.float32) for name in EXPECTED]
CASES += [(name, "grouped_mm", torch.float32) for name in ("mixtral", "gpt_oss")]


def capture(model, *args, dynamic=None, kwargs=None, **dynamo_config) -> list[tuple[torch.fx.GraphModule, list]]:
    """(graph copy, example inputs) of every graph Dynamo captures; copied inside the backend,
    where placeholders still carry their parameter sources."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((copy_graph_module(gm), list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    with torch._dynamo.config.patch(**dynamo_config), torch.no_grad():
        torch.compile(model, backend=backend, dynamic=dynamic)(*args, **(kwargs or {}))
    return graphs


def capture_one(model, *args, **kwargs):
    graphs = capture(model, *args, **kwargs)
    assert len(graphs) == 1, f"expected one graph, Dynamo captured {len(graphs)}"
    return graphs[0]


def rewrite_all(gm, example_inputs, spec=SPEC, corrupt=None):
    """Find and rewrite every MoE site with reference-backend weights as new placeholders."""
    matches = find_moe_sites(gm.graph, example_inputs)
    extra = []
    for site in matches.sites:
        if corrupt is not None:
            corrupt(site)
        qtensors = quantize_site(site, [example_inputs[p.index] for p in site.params], spec, "reference")
        tensors = [t for qt in qtensors for t in qt.tensors() if t is not None]
        placeholders = add_placeholders(gm.graph, [f"quantized_{len(extra) + i}" for i in range(len(tensors))])
        set_placeholder_values(gm.graph, placeholders, tensors)
        nodes = iter(placeholders)
        weights = [[next(nodes), next(nodes), next(nodes) if qt.scale2 is not None else None, None] for qt in qtensors]
        lowering_for(site).rewrite(site, gm.graph, weights, spec, "reference", "cpu")
        extra += tensors
    gm.graph.lint()
    gm.recompile()
    return matches, extra


def logits_cosine(gm, example_inputs, corrupt=None) -> tuple[float, dict]:
    """Cosine of the graph's only output (logits: models run with use_cache=False) after the rewrite."""
    original = copy_graph_module(gm)
    _, extra = rewrite_all(gm, example_inputs, corrupt=corrupt)
    with torch.no_grad():
        (before,), (after,) = original(*example_inputs), gm(*example_inputs, *extra)
    return cosine(before, after), op_counts(gm)


def capture_model(model, **kwargs):
    return capture_one(model, token_ids(length=8), kwargs={"use_cache": False}, **kwargs)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{str(c[2])[6:]}")
def test_transformers_moe(case):
    """One capture per case (each costs ~2 s): the sites found, their regions, the rewrite."""
    check_model(*case)


def check_model(name, implementation, dtype, topk=2):
    model = tiny_moe(name, implementation, dtype, num_experts_per_tok=topk)
    gm, example_inputs = capture_model(model)
    matches = find_moe_sites(gm.graph, example_inputs)
    check_sites(name, matches, topk)
    for site in matches.sites:
        check_region(model, site, [example_inputs[p.index] for p in site.params])
    outside = Counter(  # outside the MLPs: DeepSeek-V4's attention has its own bmm, repeat_interleave, setitem
        target_name(n.target) for n in gm.graph.nodes if n.op.startswith("call_") and not _in_mlp(n)
    )
    similarity, ops = logits_cosine(gm, example_inputs)
    assert moe_op_count(ops) == len(EXPECTED[name][0])
    left = {op: n - outside[op] for op, n in ops.items() if op in EXPERT_MATMULS or op in REGION_OPS}
    assert not any(left.values()), f"left of the experts regions: {left}"
    assert similarity >= 0.99, f"{name}: logits cosine {similarity:.4f} after an 8-bit MoE rewrite"


def _in_mlp(node) -> bool:
    return any(".mlp" in path for path, _ in node.meta.get("nn_module_stack", {}).values())


def check_sites(name, matches, topk=2):
    layers, experts, activation, layout, transposed, biases = EXPECTED[name]
    assert [s.fqn for s in matches.sites] == [f"model.layers.{i}.mlp.experts" for i in layers]
    assert matches.unproven == [] and matches.expert_linears == {} and matches.expert_gemms == []
    for site in matches.sites:
        assert (site.activation, site.gate_up_layout, site.apply_router_weight_on_input) == (activation, layout, False)
        assert [p.name.rsplit(".", 1)[1] for p in site.params] == ["gate_up_proj", "down_proj"]
        assert [p.transposed for p in site.params] == [transposed, transposed]
        assert (site.b13 is not None, site.b2 is not None) == (biases, biases)
        if activation == "swigluoai":
            assert (site.alpha, site.limit) == (pytest.approx(1.702), 7.0)
        if activation == "silu_clamped":
            assert site.limit == 1.0
        assert (site.problem.experts, site.problem.topk, site.problem.k, site.tokens) == (experts, topk, 64, 16)
    claimed_linears = [n for n in matches.claimed if "linear" in str(n.target)]
    assert claimed_linears == [], "routers, shared experts and dense MLPs must stay linear sites"


def check_region(model, site, values):
    """run_original (the graph's own nodes, extracted) == the model's experts module, on sample routing;
    the quantized op agrees with it to INT8 accuracy."""
    hidden, topk_weights, topk_ids = lowering_for(site).sample_inputs(site, None, "cpu", None)
    with torch.no_grad():
        expected = model.get_submodule(site.fqn)(hidden, topk_ids, topk_weights)
    torch.testing.assert_close(
        lowering_for(site).run_original(site, [hidden, topk_weights, topk_ids], values), expected, rtol=1e-5, atol=1e-6
    )
    quantized = quantize_site(site, values, SPEC, "reference")
    experts, intermediate, hidden_size = site.problem.experts, site.problem.n, site.problem.k
    shapes = [(experts, 2 * intermediate, hidden_size), (experts, hidden_size, intermediate)]
    assert [tuple(q.shape) for q in quantized] == shapes  # [E, 2I, H], [E, H, I] whatever the storage
    result = lowering_for(site).run_quantized(
        site, [hidden, topk_weights, topk_ids], quantized, SPEC, "reference", "cpu"
    )
    assert sqnr(expected, result) > 25.0, site.fqn  # INT8 W8A8 experts measure ~35-40 dB


@pytest.mark.parametrize("case", [CASES[0], CASES[-1], CASES[len(EXPECTED) + 2]], ids=lambda c: f"{c[0]}-{c[1]}")
def test_top1_routing(case):
    """k = 1: the gathered [T*k, 1] router column looks like [T, k]; the region is still proven from
    the [T, k] router weights, with the same rewrite and accuracy as at k = 2."""
    check_model(*case, topk=1)


def test_a_wrong_layout_is_visible_in_the_logits():
    """The logits check can fail: the same rewrite with gate/up read interleaved instead of concatenated."""
    gm, example_inputs = capture_model(tiny_moe("mixtral", "grouped_mm", torch.float32))
    similarity, _ = logits_cosine(
        gm, example_inputs, corrupt=lambda site: setattr(site, "gate_up_layout", "interleaved")
    )
    assert similarity < 0.99


@pytest.mark.parametrize("gate", ["w1", "w3"])
def test_gather_einsum_experts(gate):
    torch.manual_seed(0)
    model = OneLayer(GatherEinsumMoE(gate)).eval()
    gm, example_inputs = capture_one(model, torch.randn(2, 8, 64))
    (site,) = find_moe_sites(gm.graph, example_inputs).sites
    up = "w3" if gate == "w1" else "w1"
    assert (site.fqn, site.form, site.activation) == ("layers.0.mlp", "einsum", "silu")
    assert [p.name for p in site.params] == [f"layers.0.mlp.{gate}", f"layers.0.mlp.{up}", "layers.0.mlp.w2"]
    inputs = lowering_for(site).sample_inputs(site, None, "cpu", None)
    expected = model.layers[0]["mlp"].experts(*inputs)
    torch.testing.assert_close(
        lowering_for(site).run_original(site, inputs, [example_inputs[p.index] for p in site.params]), expected
    )
    similarity, ops = logits_cosine(gm, example_inputs)
    assert moe_op_count(ops) == 1 and ops["torch.functional.einsum"] == 0 and similarity >= 0.99


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "where-loop"])
def test_module_list_experts_go_to_the_linear_pass(dense):
    torch.manual_seed(0)
    dynamo_config = {} if dense else {"capture_dynamic_output_shape_ops": True, "capture_scalar_outputs": True}
    gm, example_inputs = capture_one(OneLayer(ModuleListMoE(dense)).eval(), torch.randn(2, 8, 64), **dynamo_config)
    matches = find_moe_sites(gm.graph, example_inputs)
    assert matches.sites == [] and matches.claimed == set() and matches.expert_gemms == []
    params = param_refs(gm.graph, example_inputs)
    names = sorted(params[n].name for n in matches.expert_linears)  # the 12 expert weights, not the router's
    assert names == [f"layers.0.mlp.experts.{e}.{w}.weight" for e in range(4) for w in ("w1", "w2", "w3")]
    assert set(matches.expert_linears.values()) == {"layers.0.mlp.experts"}
    assert [fqn for fqn, _ in matches.unproven] == ["layers.0.mlp.experts"]


def test_module_list_loop_without_dynamic_capture_is_invisible():
    """The `torch.where` loop graph-breaks and Dynamo compiles each expert MLP alone: nothing says MoE."""
    torch.manual_seed(0)
    for gm, example_inputs in capture(OneLayer(ModuleListMoE(dense=False)).eval(), torch.randn(2, 8, 64)):
        matches = find_moe_sites(gm.graph, example_inputs)
        assert (matches.sites, matches.expert_gemms, matches.expert_linears, matches.unproven) == ([], [], {}, [])


def test_dense_model_has_no_moe():
    gm, example_inputs = capture_one(tiny_llama(), token_ids(), kwargs={"use_cache": False})
    matches = find_moe_sites(gm.graph, example_inputs)
    assert (matches.sites, matches.expert_gemms, matches.expert_linears, matches.unproven) == ([], [], {}, [])


def test_near_miss_is_not_proven():
    """Rows left in expert-sorted order (no un-permute) look like MoE but compute something else:
    not a fused site; its two weights are quantized GEMM by GEMM instead, in [E, N, K] layout."""
    for unpermute, proven in ((True, True), (False, False)):
        torch.manual_seed(0)
        model = OneLayer(SortedExperts(unpermute)).to(torch.bfloat16).eval()
        gm, example_inputs = capture_one(model, torch.randn(2, 8, 64, dtype=torch.bfloat16))
        matches = find_moe_sites(gm.graph, example_inputs)
        assert len(matches.sites) == int(proven) and matches.unproven == []
        assert [s.fqn for s in matches.expert_gemms] == ([] if proven else ["layers.0.mlp"])
    (site,) = matches.expert_gemms
    assert [(p.name, p.transposed) for p in site.params] == [
        ("layers.0.mlp.gate_up_proj", False),  # stored [E, 2I, H], transposed by the graph for grouped_mm
        ("layers.0.mlp.down_proj", False),
    ]
    assert site.forms == ("grouped_mm",) and "no sum over the top-k experts" in site.why, site.why
    assert site.skip_reason is None and site.notes == []
    params = param_refs(gm.graph, example_inputs)  # were both weights quantized elsewhere: nothing left, said why
    matmuls = [n for n in gm.graph.nodes if "grouped_mm" in str(n.target)]
    anchors = [ExpertMatmul(n, p.node, n.args[0], False) for n, p in zip(matmuls, site.params)]
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    skipped = expert_gemm_site(site.fqn, anchors, params, site.why, {p.node for p in site.params}, order)
    assert skipped.params == [] and "layers.0.mlp.down_proj: quantized by a proven" in skipped.skip_reason


@pytest.mark.parametrize(
    ("hidden_act", "activation"),
    [("gelu", "gelu"), ("gelu_pytorch_tanh", "gelu_tanh"), ("gelu_new", "gelu_tanh"), ("relu", None)],
)
def test_activation_is_read_from_the_graph(hidden_act, activation):
    model = tiny_moe("mixtral", "grouped_mm", torch.float32, hidden_act=hidden_act)
    gm, example_inputs = capture_model(model)
    matches = find_moe_sites(gm.graph, example_inputs)
    if activation is None:  # not gated by a supported activation: quantized GEMM by GEMM, saying why
        assert matches.sites == [] and len(matches.expert_gemms) == 2
        assert all("gated activation" in s.why for s in matches.expert_gemms), matches.expert_gemms
    else:
        assert [s.activation for s in matches.sites] == [activation, activation]


def test_dynamic_token_count():
    model = tiny_moe("mixtral", "grouped_mm", torch.bfloat16)
    gm, example_inputs = capture_model(model, dynamic=True)
    sites = find_moe_sites(gm.graph, example_inputs).sites
    assert len(sites) == 2 and all(s.tokens is None and s.problem.m is None for s in sites)
    generator = torch.Generator().manual_seed(0)
    for tokens in (1, 5, 16):  # the extracted region reads T and T*k from its inputs
        hidden = torch.randn(tokens, 64, generator=generator, dtype=torch.bfloat16)
        topk_ids = torch.rand(tokens, 4, generator=generator).argsort(dim=-1)[:, :2]
        topk_weights = torch.rand(tokens, 2, generator=generator).softmax(dim=-1)
        values = [example_inputs[p.index] for p in sites[0].params]
        with torch.no_grad():
            expected = model.get_submodule(sites[0].fqn)(hidden, topk_ids, topk_weights)
        torch.testing.assert_close(
            lowering_for(sites[0]).run_original(sites[0], [hidden, topk_weights, topk_ids], values), expected
        )
