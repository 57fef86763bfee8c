"""Any model, any format (issue #11, items 1-8): shapes and habits the first tests never had.

Each test failed on the code before the fix it names (reproduced then): a crash, a silent skip or a
stale weight. Models are plain torch modules and transformers' ALBERT from a tiny config.
"""

import copy
import io
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from tiny_models import Block, tiny_llama

import quantpass as qp
from quantpass.metrics import cosine

FORMATS = ["int8_weight_only", "fp8_per_channel", "nvfp4"]  # cpu, reference-W8A8, reference-W4A4 paths
FLOOR = {"int8_weight_only": 0.999, "fp8_per_channel": 0.995, "nvfp4": 0.97}  # measured 0.9999 / 0.999 / 0.99


def compiled(model, fmt="int8_weight_only", how="module", **options):
    """The model compiled with quantpass `how`: as a module, or its forward method compiled in its place
    (`model.forward = torch.compile(model.forward)`, as transformers' docs do for generation)."""
    backend = qp.backend(linear=fmt, **{"lowering": "aot_eager", **options})
    backend.keep_graphs = True
    torch._dynamo.reset()
    if how == "module":
        return torch.compile(model, backend=backend), backend
    model.forward = torch.compile(model.forward, backend=backend)
    return model, backend


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(64, 64)

    def forward(self, x):
        return self.head(x) + self.head(2 * x)


class Shared(nn.Module):
    """ALBERT-style weight sharing: one block applied three times."""

    def __init__(self):
        super().__init__()
        self.block = nn.Linear(64, 64)

    def forward(self, x):
        for _ in range(3):
            x = x + self.block(x)
        return x


# ------------------------------------------------------------------ 1, 2: graph shapes
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("make", [lambda: nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64)), Twice, Shared])
def test_chained_and_repeated_linears(make, fmt):
    """1: the second linear's input was the first's erased node; 2: one weight, two sites, two
    placeholders of the same name (`SyntaxError: duplicate argument`)."""
    model, x = make(), torch.randn(5, 64)
    with torch.no_grad():
        expected = model(x)
        model_c, backend = compiled(model, fmt)
        out = model_c(x)
    assert cosine(expected, out) >= FLOOR[fmt]
    rows = backend.plan.quantized()
    assert len(rows) == {"Sequential": 2, "Twice": 2, "Shared": 3}[type(model).__name__]


def test_repeated_linear_is_one_set_of_weights():
    model, x = Shared(), torch.randn(5, 64)
    with torch.no_grad():
        model_c, backend = compiled(model)
        model_c(x)
    ((_, after),) = backend.graphs
    quantized_inputs = [n for n in after.graph.find_nodes(op="placeholder") if n.name.startswith("quantpass_")]
    assert len(quantized_inputs) == 2  # one weight: one data + one scale input, read by three sites


@pytest.mark.parametrize("lowering", ["aot_eager", "inductor"])
def test_transformers_albert_shares_its_layer(lowering):
    config = transformers.AlbertConfig(
        vocab_size=64, embedding_size=32, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=96, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.AlbertModel(config).eval()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).last_hidden_state
        model_c, backend = compiled(model, lowering=lowering)
        out = model_c(ids).last_hidden_state
    assert cosine(expected, out) >= 0.999
    assert len(backend.plan.quantized()) >= 6 * 3  # the shared layer's linears, once per use
    # the summary counts the model's 8 Linears, not its 20 calls (it said "20 quantized")
    assert backend.plan.summary() == "linear: 8 quantized (int8_weight_only; cpu 8; 20 calls) | 0 skipped"


# ------------------------------------------------------------------ 3: writes through .data
def _updates():
    def copy_(p):
        p.data.copy_(torch.randn_like(p))

    def normal_(p):
        p.data.normal_()

    def ema(p):
        p.data.mul_(0.5).add_(torch.randn_like(p), alpha=0.5)

    return [copy_, normal_, ema]


@pytest.mark.parametrize("update", _updates(), ids=lambda f: f.__name__)
def test_writes_through_data_with_refresh_weights(update):
    """`.data` writes bump no version counter: `qp.refresh_weights(model)` is the documented call."""
    model, x = Block(), torch.randn(4, 64)
    with torch.no_grad():
        model_c, _ = compiled(model, keep_original_weights=True)
        model_c(x)
        update(model.up.weight)
        qp.refresh_weights(model_c)
        assert cosine(model(x), model_c(x)) >= 0.999


def test_vector_to_parameters_is_picked_up_without_refresh():
    model, x = Block(), torch.randn(4, 64)
    with torch.no_grad():
        model_c, _ = compiled(model, keep_original_weights=True)
        model_c(x)
        vector = torch.randn_like(torch.nn.utils.parameters_to_vector(model.parameters()))
        torch.nn.utils.vector_to_parameters(vector, model.parameters())  # `param.data = view of vector`
        assert cosine(model(x), model_c(x)) >= 0.999


@pytest.mark.parametrize("keep", [True, False])
def test_data_assignment_is_never_stale(keep):
    """`p.data = new` went stale whenever the allocator handed back the old address (8 of 20)."""
    model, x = nn.Sequential(nn.Linear(64, 64)), torch.randn(4, 64)
    with torch.no_grad():
        model_c, _ = compiled(model, keep_original_weights=keep)
        for _ in range(20):
            model_c(x)
            new = torch.randn(64, 64)
            model[0].weight.data = new.clone()
            expected = x @ new.T + model[0].bias
            assert cosine(expected, model_c(x)) >= 0.999


# ------------------------------------------------------------------ 4: copies of decorated instances
@qp.compile(linear="int8_weight_only", lowering="aot_eager")
class Decorated(Block):
    pass


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copies_of_a_decorated_instance_stay_quantized(how):
    torch._dynamo.reset()
    original, x = Decorated(), torch.randn(4, 64)
    with torch.no_grad():
        unquantized = Block.forward(original, x)
        quantized = original(x)
        if how == "deepcopy":
            twin = copy.deepcopy(original)
        else:
            buffer = io.BytesIO()
            torch.save(original, buffer)
            buffer.seek(0)
            twin = torch.load(buffer, weights_only=False)
        out = twin(x)
    assert twin.quantpass_plan is not None and len(twin.quantpass_plan.quantized()) == 2
    # the copy holds the dequantized weights and quantizes them again: the same codes, not the originals
    assert torch.allclose(out, quantized, atol=1e-5) and not torch.allclose(out, unquantized, atol=1e-5)


# ------------------------------------------------------------------ 5: grad mode
def test_grad_mode_still_quantizes_with_one_warning(caplog):
    model, x = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)), torch.randn(4, 64)
    expected = model(x)  # grad mode on, weights require grad: README's snippets, as written
    model_c, backend = compiled(model)
    with caplog.at_level(logging.WARNING, logger="quantpass"):
        out = model_c(x)
        model_c(x)
    assert len(backend.plan.quantized()) == 2 and cosine(expected, out) >= 0.999
    assert sum("weights require grad" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        torch.autograd.grad(out.sum(), model[0].weight)  # quantized weights get no gradient: asking raises


@pytest.mark.parametrize("fmt", ["int8_weight_only", "int4_weight_only", "fp8_per_channel", "nvfp4"])
def test_gradients_reach_inputs_through_a_frozen_quantized_base(fmt):
    """LoRA-style: frozen base weights, an input that requires grad ("no autograd formula" before)."""
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).requires_grad_(False)
    x = torch.randn(6, 64, requires_grad=True)
    (expected,) = torch.autograd.grad(model(x).square().sum(), x)
    model_c, _ = compiled(model, fmt)
    (grad,) = torch.autograd.grad(model_c(x).square().sum(), x)
    assert cosine(expected, grad) >= {"nvfp4": 0.95, "int4_weight_only": 0.98}.get(fmt, 0.995)


# ------------------------------------------------------------------ 6: integer and empty inputs
def test_integer_activations_are_left_to_eager():
    model = nn.Sequential(nn.Linear(64, 64))
    model_c, backend = compiled(model)
    with torch.no_grad(), pytest.raises(RuntimeError, match="same dtype"):  # what eager raises too
        model_c(torch.ones(4, 64, dtype=torch.int64))
    (row,) = backend.plan.rows
    assert row.backend is None and "torch.int64, not floating point" in row.reason


@pytest.mark.parametrize(
    ("fmt", "backend"),
    [("fp8_per_tensor", "auto"), ("nvfp4", "auto"), ("fp8_per_channel", "native"), ("int8_per_channel", "auto")],
)
@pytest.mark.parametrize("lowering", ["aot_eager", "inductor"])
def test_zero_token_calls(fmt, backend, lowering):
    model = nn.Sequential(nn.Linear(64, 48))
    with torch.no_grad():
        model_c, _ = compiled(model, fmt, backend=backend, lowering=lowering)
        model_c(torch.randn(3, 64))
        out = model_c(torch.randn(0, 64))
    assert out.shape == (0, 48)


# ------------------------------------------------------------------ 7: inference-mode parameters
def test_parameters_created_under_inference_mode():
    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
        x = torch.randn(4, 64)
        expected = model(x)
    model_c, backend = compiled(model)
    with torch.inference_mode():
        out = model_c(x)
    assert cosine(expected, out) >= 0.999 and len(backend.plan.quantized()) == 2


# ------------------------------------------------------------------ 8: verify sees real activations
class Masked(nn.Module):
    """The first float input that is not a parameter is a mask buffer of finfo.min: verify used to
    take its statistics for the activations' and report a correct layer as `SQNR nan dB`."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.full((4, 64), torch.finfo(torch.float32).min).triu(1))
        self.proj = nn.Linear(64, 64)

    def forward(self, x):
        bias = self.mask.clamp(min=-1.0)  # read first: the buffer is the graph's first input
        return self.proj(x) + bias


def test_verify_feeds_each_site_its_real_activations():
    model, x = Masked(), torch.randn(4, 64)
    with torch.no_grad():
        expected = model(x)
        model_c, backend = compiled(model, "fp8_per_channel")
        out = model_c(x)
    (row,) = backend.plan.quantized()
    verified = float(row.reason.split("verified ")[1].split(" dB")[0])
    assert 25.0 < verified < 60.0 and cosine(expected, out) >= 0.999


def test_verify_runs_the_graph_without_disturbing_its_inputs():
    """The graph writes into a buffer (a KV-cache-like counter): verify's run works on a copy."""

    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(1))
            self.proj = nn.Linear(64, 64)

        def forward(self, x):
            self.calls.add_(1)
            return self.proj(x) * self.calls

    model = Counter()
    with torch.no_grad():
        compiled(model)[0](torch.randn(4, 64))
    assert model.calls.item() == 1.0


class VmapAfterLinear(nn.Module):
    """A linear, then `torch.vmap` over its output (Jamba's selective scan maps its state update)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def forward(self, x):
        y = self.proj(x)
        return torch.vmap(lambda a, b: a * b)(y, y + 1)


def test_vmap_in_the_graph_keeps_its_nesting_calls():
    """Dynamo spells `torch.vmap` as calls nothing reads (`_vmap_increment_nesting` /
    `_vmap_decrement_nesting`); the pass's dead-code elimination after the rewrite removed them and
    every op inside the vmap raised (Jamba crashed in every format)."""
    torch.manual_seed(0)
    model, x = VmapAfterLinear().eval(), torch.randn(4, 64)
    m, backend = compiled(model)
    with torch.no_grad():
        got, want = m(x), model(x)
    assert backend.plan.summary().startswith("linear: 1 quantized")
    assert cosine(want, got) >= FLOOR["int8_weight_only"]


class AttentionOutThenRouter(nn.Module):
    """Llama 4's shape: the attention's output projection, the residual add and a norm, then the router
    whose scores go to `topk` (the experts themselves left out)."""

    def __init__(self):
        super().__init__()
        self.o_proj, self.norm, self.router = nn.Linear(64, 64), nn.RMSNorm(64), nn.Linear(64, 8, bias=False)

    def forward(self, x):
        h = x + self.o_proj(x)
        weights, ids = torch.topk(self.router(self.norm(h)).softmax(-1), 2)
        return h, weights, ids


class CastRouter(nn.Module):
    """DeepSeek-V2's router: the weight cast to fp32 in the forward, then topk."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(64, 8, bias=False)

    def forward(self, x):
        return torch.topk(nn.functional.linear(x.float(), self.gate.weight.float()).softmax(-1), 2)


def test_a_router_whose_weight_is_cast_is_named_a_router():
    """It was reported as a layer whose weight is not a parameter (an eligible layer left unquantized)."""
    m, backend = compiled(CastRouter().eval())
    with torch.no_grad():
        m(torch.randn(4, 64))
    (row,) = backend.plan.rows
    assert not row.quantized and row.reason.startswith("MoE router"), row.reason


def test_only_the_linear_next_to_topk_is_a_router():
    """The router search stops at the next linear: o_proj reached the router's topk within the hop
    limit and was left alone as an MoE router."""
    torch.manual_seed(0)
    model, x = AttentionOutThenRouter().eval(), torch.randn(4, 64)
    m, backend = compiled(model)
    with torch.no_grad():
        m(x)
    rows = {row.fqn: row for row in backend.plan.rows}
    assert rows["o_proj"].quantized and not rows["router"].quantized, backend.plan
    assert "MoE router" in rows["router"].reason


class BranchyBlock(nn.Module):
    """A data-dependent branch in the forward: Dynamo compiles this forward as frames of its own."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x):
        h = self.up(x)
        if h.sum() > 0:  # a graph break
            h = h * 2
        return self.down(h)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([BranchyBlock(), BranchyBlock()])
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("how", ["module", "forward"])
def test_layers_keep_their_model_names_after_a_graph_break(caplog, how):
    """A graph break in a block's forward makes Dynamo compile that forward on its own, and its graph
    named layers from the block (`up`, `down` for every block: DBRX, JetMoE, Switch, NLLB-MoE,
    Longformer): full-path `ignore` / `targets` matched nothing, silently. Names are now the model's, a
    full-path pattern applies where the graph is compiled for that instance, and a config that treats
    instances differently is said to be at Dynamo's mercy. Also where the model's forward method is
    what was compiled: its frames' layers were named `up`, `down` there."""
    torch.manual_seed(0)
    model, x = Branchy().eval(), torch.randn(4, 64)
    m, backend = compiled(copy.deepcopy(model), how=how, ignore=["layers.1.down"])
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="quantpass"):
        got = m(x)
        want = model(x)
    rows = {row.fqn: row for plan in backend.plans for row in plan.rows}
    assert {"layers.0.up", "layers.0.down"} <= set(rows) and all(f.startswith("layers.") for f in rows), sorted(rows)
    assert rows["layers.0.up"].quantized and "in a graph of layers.0's forward" in rows["layers.0.up"].reason
    assert "layers.1.down" not in rows or not rows["layers.1.down"].quantized  # where compiled for layers.1
    assert any("the config gives layers.1.down another spec" in r.getMessage() for r in caplog.records)
    assert cosine(want, got) >= FLOOR["int8_weight_only"]


class BatchedExperts(nn.Module):
    """Llama 4's experts: one 3-D weight, a bmm over every expert (no top-k ids to route by)."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(4, 64, 32) / 8)
        self.proj = nn.Linear(64, 64)

    def forward(self, x):
        h = torch.bmm(self.proj(x).expand(4, -1, -1), self.gate_up_proj)
        return h.sum(0)


def test_dense_bmm_experts_have_a_plan_row_and_quantize_one_by_one():
    """Llama 4's experts were missing from the plan, silently, then left unquantized: a bmm on the 3-D
    parameter itself is an experts region with no expert ids, its weight held quantized (moe slot)."""
    model, x = BatchedExperts().eval(), torch.randn(3, 64)
    m, backend = compiled(model)
    with torch.no_grad():
        m(x)
    rows = {row.fqn: row for row in backend.plan.rows}
    assert rows["proj"].quantized and not rows["gate_up_proj"].quantized, sorted(rows)
    assert rows["gate_up_proj"].reason == "no moe quantization configured"
    m, backend = compiled(model, moe="int8_weight_only")
    with torch.no_grad():
        got, want = m(x), model(x)
    (row,) = [row for row in backend.plan.rows if row.fqn == "gate_up_proj"]
    assert row.quantized and "experts quantized one by one" in row.reason, row
    assert "a bmm of every expert's weight with its own slice of an [E, T, H] batch" in row.reason, row
    assert cosine(want, got) >= FLOOR["int8_weight_only"]


def test_experts_sliced_per_expert_are_quantized_one_by_one():
    """JetMoE loops over its experts calling F.linear(x, self.weight[i]) on a 3-D parameter: each call
    was a linear row "weight is not a parameter", named without its module path, and no expert weight
    was quantized. They are an experts region now (moe slot), held quantized per expert."""
    from quantpass.weight_cache import WEIGHTS

    torch.manual_seed(0)
    config = transformers.JetMoeConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_key_value_heads=2, kv_channels=16,
        intermediate_size=32, max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2,
        initializer_range=0.1,
    )  # fmt: skip
    model = transformers.JetMoeForCausalLM(config).eval()
    ids = torch.randint(3, 128, (2, 9))
    m, backend = compiled(model, moe="int8_weight_only")
    with torch.no_grad():
        want, got = model(ids, use_cache=False).logits, m(ids, use_cache=False).logits
    experts = [name for name, p in model.named_parameters() if p.dim() == 3]
    assert len(experts) == 8  # input_linear and output_linear of the attention's and the MLP's experts
    rows = {row.fqn: row for row in backend.plan.rows}
    for name in experts:
        row = rows[name.removesuffix(".weight")]
        assert row.quantized and "F.linear on one expert's weight W[i] at a time" in row.reason, row
        assert WEIGHTS.is_released(model.get_parameter(name))
    assert not [row for row in backend.plan.rows if "not a parameter" in row.reason]
    assert cosine(want, got) >= FLOOR["int8_weight_only"]


def test_a_router_without_topk_is_found_by_the_layer_it_routes():
    """PhiMoE's sparsemixer picks experts with max and masked_fill, not topk: its router linear was
    quantized like any linear (a proven MoE layer's routing now marks the linear feeding it)."""
    from tiny_moe_models import tiny_moe

    model = tiny_moe("phimoe", "grouped_mm")
    m, backend = compiled(model)
    with torch.no_grad():
        m(torch.randint(0, model.config.vocab_size, (1, 9)))
    routers = [row for row in backend.plan.rows if row.fqn.endswith("mlp.router")]
    assert len(routers) == 2 and all(row.reason.startswith("MoE router") for row in routers), backend.plan


class BreakingBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        torch._dynamo.graph_break()
        return self.lin(x).relu()


class BlocksInALoop(nn.Module):
    """Blocks that break the graph, called in a loop: Dynamo compiles one block's forward and runs the
    others on it, and runs the loop (and the head after it) eagerly."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([BreakingBlock() for _ in range(3)])
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_every_linear_of_the_model_has_a_row():
    """The plan named only blocks.0.lin: blocks 1-2 ran on its graph (quantized, unreported) and the
    head, never in a graph, stayed unquantized without a word."""
    from quantpass.weight_cache import WEIGHTS

    torch.manual_seed(0)
    model, x = BlocksInALoop().eval(), torch.randn(4, 32)
    m, backend = compiled(model)
    with torch.no_grad():
        expected, out = model(x), m(x)
    rows = {row.fqn: row for row in backend.plan.rows}
    assert list(rows) == ["blocks.0.lin", "blocks.1.lin", "blocks.2.lin", "head"]
    for i in (1, 2):
        row = rows[f"blocks.{i}.lin"]
        assert (row.weight, row.backend) == (rows["blocks.0.lin"].weight, rows["blocks.0.lin"].backend)
        assert row.reason.startswith("as blocks.0.lin: runs on the graph of blocks.0's forward")
        assert WEIGHTS.is_released(model.blocks[i].lin.weight)  # quantized on that graph indeed
    assert not rows["head"].quantized and rows["head"].reason.startswith("in no compiled graph")
    assert cosine(expected, out) > 0.999
    planned = qp.explain(BlocksInALoop().eval(), x, linear="int8_weight_only")
    assert [(r.fqn, r.quantized) for r in planned.rows] == [(fqn, r.quantized) for fqn, r in rows.items()]


class WeightOnTheLeft(nn.Module):
    """Linears written with the weight on the left: Mamba's `dt_proj.weight @ x.transpose(1, 2)`, the
    same with a weight stored [K, N] (`w.T @ x`), and a matrix-vector product."""

    def __init__(self):
        super().__init__()
        self.dt = nn.Linear(48, 32)
        self.kn = nn.Parameter(torch.randn(32, 40) / 6)
        self.vec = nn.Parameter(torch.randn(24, 40) / 6)

    def forward(self, x):  # [B, L, 48]
        h = self.dt.weight @ x.transpose(1, 2)  # [B, 32, L]
        h = torch.matmul(self.kn.T, torch.relu(h))  # [B, 40, L]
        return h.sum(-1) @ self.vec.T + self.vec @ h[0, :, 0]  # the vector: [24]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lowering", ["aot_eager", "inductor"])
def test_a_weight_on_the_left_is_a_linear(fmt, lowering):
    """`W @ x` was no linear site: Mamba's dt_proj stayed unquantized, "read by no linear the pass
    knows". Now it is the linear of x's last two dims swapped; outputs match eager at two lengths."""
    model = WeightOnTheLeft().eval()
    eager = copy.deepcopy(model)  # quantizing frees the compiled model's original weights
    m, backend = compiled(model, fmt, lowering=lowering)
    with torch.no_grad():
        for length in (7, 12):  # the second length recompiles with a dynamic L
            x = torch.randn(3, length, 48)
            assert cosine(eager(x), m(x)) > FLOOR[fmt]
    rows = {(row.fqn, row.quantized) for row in backend.plan.rows}
    assert rows == {("dt", True), ("kn", True), ("vec", True)}


class GroupedLinear(nn.Linear):
    """DeepSeek-V4's grouped output projection (`DeepseekV4GroupedLinear`, its forward as written there):
    each group of the input times its block of the weight's rows."""

    def __init__(self, in_per_group, out_features, groups):
        super().__init__(in_per_group, out_features, bias=False)
        self.n_groups = groups

    def forward(self, x):
        input_shape, hidden_dim = x.shape[:-2], x.shape[-1]
        w = self.weight.view(self.n_groups, -1, hidden_dim).transpose(1, 2)
        x = x.reshape(-1, self.n_groups, hidden_dim).transpose(0, 1)
        y = torch.bmm(x, w).transpose(0, 1)
        return y.reshape(*input_shape, self.n_groups, -1)


class GroupedThenMixed(nn.Module):
    def __init__(self, groups=4, rows=24):
        super().__init__()
        self.o_a_proj = GroupedLinear(128, groups * rows, groups)
        self.o_b_proj = nn.Linear(groups * rows, 16)

    def forward(self, x):  # [B, L, groups, 128]
        return self.o_b_proj(self.o_a_proj(x).flatten(2))


@pytest.mark.parametrize("fmt", [*FORMATS, "fp8_per_block", "int4_weight_only"])
@pytest.mark.parametrize("lowering", ["aot_eager", "inductor"])
def test_a_grouped_linear_is_quantized_group_by_group(fmt, lowering):
    """DeepSeek-V4's o_a_proj (a bmm on a view of the weight) was left unquantized: now one quantized
    weight, G linears on its row slices. 24 rows a group split FP8's 128-row blocks (requantized per group)."""
    model = GroupedThenMixed().eval()
    eager = copy.deepcopy(model)
    m, backend = compiled(model, fmt, lowering=lowering)
    with torch.no_grad():
        for length in (5, 9):
            x = torch.randn(2, length, 4, 128)
            assert cosine(eager(x), m(x)) > FLOOR.get(fmt, 0.99)
    rows = {row.fqn: row for row in backend.plan.rows}
    assert rows["o_a_proj"].quantized and rows["o_b_proj"].quantized
    assert "4 groups of 24 rows" in rows["o_a_proj"].reason
    assert rows["o_a_proj"].bytes < rows["o_a_proj"].original_bytes / 1.5


class SharedExperts(nn.Module):
    """Inkling's shared experts (`InklingSharedExperts`, its forward as written there): 3-D weights
    under torch.bmm, every token through each expert, weighted by its gamma."""

    def __init__(self, experts=2, hidden=64, inner=48):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.randn(experts, inner, hidden) / 8)
        self.up_proj = nn.Parameter(torch.randn(experts, inner, hidden) / 8)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inner) / 7)

    def forward(self, x, gammas):  # [B, L, H], [B, L, experts]
        shape, experts = x.shape, self.gate_proj.shape[0]
        x = x.reshape(1, -1, shape[-1]).expand(experts, -1, -1)
        gammas = gammas.reshape(-1, experts, 1).transpose(0, 1)
        gate = torch.bmm(x, self.gate_proj.transpose(1, 2))
        up = torch.bmm(x, self.up_proj.transpose(1, 2))
        down = torch.bmm(F.silu(gate) * up, self.down_proj.transpose(1, 2))
        return (down * gammas).sum(0).reshape(shape)


@pytest.mark.parametrize("fmt", FORMATS)
def test_shared_experts_on_3d_weights_are_grouped_linears(fmt):
    """Inkling's shared experts were left unquantized ("outside the MoE forms"): each 3-D weight is now
    G linears, one per matrix; outputs match eager at two lengths, on Inductor."""
    model = SharedExperts().eval()
    eager = copy.deepcopy(model)
    m, backend = compiled(model, fmt, lowering="inductor")
    with torch.no_grad():
        for length in (5, 8):
            x, gammas = torch.randn(2, length, 64), torch.rand(2, length, 2)
            assert cosine(eager(x, gammas), m(x, gammas)) > FLOOR[fmt]
    rows = {row.fqn: row for row in backend.plan.rows}
    assert set(rows) == {"gate_proj", "up_proj", "down_proj"}
    assert all(row.quantized and row.kind == "linear" for row in rows.values())
    assert "2 matrices of 48 rows" in rows["gate_proj"].reason


@pytest.mark.parametrize("how", ["module", "forward"])
def test_a_head_tied_across_a_graph_break_is_left_alone(caplog, how):
    """XLM's LM head is tied to its input embedding, and a graph break puts them in separate graphs:
    the head's graph saw no embedding, so the head was quantized against the default, the embedding's
    storage freed, and every later graph read the embedding back from INT8 values (with a warning a
    call). The tie is now read from the compiled model, also where its forward method is what was
    compiled (XLM's `generate()` with `model.forward = torch.compile(model.forward)` quantized the head)."""
    from quantpass.weight_cache import WEIGHTS

    torch.manual_seed(0)
    config = transformers.XLMConfig(vocab_size=128, emb_dim=64, n_layers=2, n_heads=4, init_std=0.1)
    model = transformers.XLMWithLMHeadModel(config).eval()
    embedding = model.transformer.embeddings.weight
    assert model.pred_layer.proj.weight is embedding
    eager = copy.deepcopy(model)
    m, backend = compiled(model, how=how)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="quantpass"):
        for length in (9, 10):
            ids = torch.randint(3, 128, (2, length))
            assert cosine(eager(ids).logits, m(ids).logits) > FLOOR["int8_weight_only"]
    heads = [row for row in backend.plan.rows if row.fqn == "pred_layer.proj"]
    assert heads and all(not row.quantized and row.reason.startswith("weight tied to an embedding") for row in heads)
    assert sum(row.quantized for row in backend.plan.rows) >= 12  # every other linear
    assert not WEIGHTS.is_released(embedding)
    assert not [r.getMessage() for r in caplog.records if "restoring it" in r.getMessage()]


@pytest.mark.parametrize("fmt", FORMATS)
def test_einsum_projections_are_quantized(fmt):
    """XLNet projects with `einsum("ibh,hnd->ibnd", x, q)` and `einsum("ibnd,hnd->ibh", attn, o)` on
    [H, n, d] weights: 10 of its 14 linears stayed unquantized (labelled "3-D weight read by einsum";
    before that, counted as MoE layers). They are linears of the weight viewed as a matrix: quantized,
    released, restored and reloaded in the parameter's own [H, n, d] layout."""
    from quantpass.passes.fx_utils import op_counts
    from quantpass.weight_cache import WEIGHTS

    torch.manual_seed(0)
    config = transformers.XLNetConfig(vocab_size=128, d_model=64, n_layer=2, n_head=4, d_inner=128)
    model = transformers.XLNetLMHeadModel(config).eval()
    eager = copy.deepcopy(model)
    m, backend = compiled(model, fmt)
    ids = [torch.randint(3, 128, (2, n), generator=torch.Generator().manual_seed(n)) for n in (9, 12)]
    with torch.no_grad():
        for x in ids:
            expected, out = eager(x).logits, m(x).logits
            assert cosine(expected, out) >= FLOOR[fmt] and not torch.equal(expected, out)
    rows = {row.fqn: row for row in backend.plan.rows}
    for name in [f"transformer.layer.{i}.rel_attn.{p}" for i in range(2) for p in "qkvor"]:
        assert rows[name].quantized and "einsum 'ib" in rows[name].reason, rows[name]
    assert backend.plan.summary().startswith("linear: 14 quantized")
    before, after = backend.graphs[0]
    assert op_counts(before)["torch.functional.einsum"] - op_counts(after)["torch.functional.einsum"] == 10
    q = model.transformer.layer[0].rel_attn.q
    assert WEIGHTS.is_released(q)
    dense = qp.state_dict(model)["transformer.layer.0.rel_attn.q"]
    assert dense.shape == (64, 4, 16) and cosine(dense, eager.transformer.layer[0].rel_attn.q) >= FLOOR[fmt]
    new = torch.randn(64, 4, 16) * 0.05
    qp.load_weights(model, {"transformer.layer.0.rel_attn.q": new})  # quantized straight into the cache
    eager.transformer.layer[0].rel_attn.q.data.copy_(new)
    with torch.no_grad():
        assert cosine(eager(ids[0]).logits, m(ids[0]).logits) >= FLOOR[fmt]
    assert cosine(qp.state_dict(model)["transformer.layer.0.rel_attn.q"], new) >= FLOOR[fmt]


def test_a_checkpoint_of_einsum_projections_stores_them_in_full_precision(tmp_path):
    """No checkpoint format has a layout for an [H, n, d] weight read as a matrix: once the einsum
    projections were quantized, save_pretrained wrote q's [64, 64] FP8 data under its 3-D name. It
    writes the dequantized weight instead."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    config = transformers.XLNetConfig(vocab_size=128, d_model=64, n_layer=2, n_head=4, d_inner=128)
    model = transformers.XLNetLMHeadModel(config).eval()
    eager, ids = copy.deepcopy(model), torch.randint(3, 128, (2, 9))
    m, _ = compiled(model, "fp8_per_channel")
    with torch.no_grad():
        m(ids)
    qp.save_pretrained(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    q = stored["transformer.layer.0.rel_attn.q"]
    assert q.shape == (64, 4, 16) and q.dtype == torch.float32
    assert stored["transformer.layer.0.ff.layer_1.weight"].dtype == torch.float8_e4m3fn  # the Linears: FP8
    loaded = qp.from_pretrained(tmp_path)
    with torch.no_grad():
        out = torch.compile(loaded, backend=qp.backend(lowering="aot_eager"))(ids).logits  # the checkpoint's formats
        assert cosine(eager(ids).logits, out) >= FLOOR["fp8_per_channel"]


@pytest.mark.parametrize(
    "equation, form",
    [
        ("ibh,hnd->ibnd", (1, True)),  # XLNet's q: [K, n, d]
        ("ibnd,hnd->ibh", (2, False)),  # XLNet's o: [N, n, d] contracting two dims
        ("bk,nk->bn", (1, False)),
        ("bk,kn->bn", (1, True)),
        ("ibnd,snd->ibns", None),  # a letter of the weight kept: batched, no linear
        ("bind,snd->bnis", None),  # Funnel's seg_embed
        ("bk,nk->nb", None),  # the output transposed
        ("bhk,khn->bn", None),  # contracted letters in another order
        ("...k,nk->...n", None),
        ("bk,nk", None),
    ],
)
def test_which_einsums_are_linears(equation, form):
    from quantpass.patterns.einsum_linear import einsum_linear

    assert einsum_linear(equation, weight_is_first=False) == form
    swapped = equation.split("->")[0].split(",")[::-1]
    if form is not None:
        assert einsum_linear(",".join(swapped) + "->" + equation.split("->")[1], weight_is_first=True) == form


class EinsumTiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.up = nn.Parameter(torch.randn(32, 4, 8) / 6)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + torch.einsum("bsd,dnk->bsnk", h, self.up).flatten(-2)
        return torch.einsum("bsd,vd->bsv", h, self.embed.weight)  # a head tied to the embedding


def test_an_einsum_head_tied_to_the_embedding_is_left_alone_by_default():
    """Einsum linears skipped the defaults every other linear gets: a head tied to the embedding was
    quantized (and its embedding's weight with it)."""
    plan = qp.explain(EinsumTiedHead().eval(), torch.randint(0, 64, (2, 5)), linear="int8_weight_only")
    rows = {row.fqn: row for row in plan.rows}
    assert rows["up"].quantized
    assert not rows["embed"].quantized and rows["embed"].reason.startswith("weight tied to an embedding")


def test_funnel_relative_kernels_are_linears_and_segment_embeddings_are_not():
    torch.manual_seed(0)
    config = transformers.FunnelConfig(
        vocab_size=128, d_model=64, n_head=4, d_head=16, d_inner=128, block_sizes=[1, 1], num_decoder_layers=1
    )
    plan = qp.explain(transformers.FunnelModel(config).eval(), torch.randint(3, 128, (2, 9)), linear="int8_weight_only")
    rows = {row.fqn: row for row in plan.rows}
    assert rows["encoder.blocks.0.0.attention.r_kernel"].quantized
    seg = rows["encoder.blocks.0.0.attention.seg_embed"]
    assert not seg.quantized and seg.reason.startswith("3-D weight read by einsum 'bind,snd->bnis'")


class EinsumLinear(nn.Linear):
    def forward(self, x):
        return torch.einsum("bk,nk->nb", x, self.weight).T  # the output transposed: a form no matcher takes


def test_a_linear_read_as_no_linear_says_so():
    model = nn.Sequential(EinsumLinear(32, 16), nn.Linear(16, 8)).eval()
    plan = qp.explain(model, torch.randn(4, 32), linear="int8_weight_only")
    rows = {row.fqn: row for row in plan.rows}
    assert rows["1"].quantized and not rows["0"].quantized
    assert rows["0"].reason.startswith("its weight is in a compiled graph, read by no linear the pass knows")


class BreakingCastRouter(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(32, 4, bias=False)

    def forward(self, x):
        torch._dynamo.graph_break()
        return torch.topk(nn.functional.linear(x.float(), self.gate.weight.float()).softmax(-1), 2).values


def test_a_frame_with_only_a_cast_router_is_named_from_the_model():
    """LongCat's router forward, compiled on its own after a graph break, holds one linear reading its
    weight cast: no site parameter to find the frame's path by, so its row was named `gate` (and the
    model's own routers then had no row)."""
    model = TwoRouters().eval()
    plan = qp.explain(model, torch.randn(4, 32), linear="int8_weight_only")
    rows = {row.fqn: row for row in plan.rows}
    assert sorted(rows) == ["first.gate", "second.gate"], plan
    assert rows["first.gate"].reason.startswith("MoE router"), plan
    assert rows["second.gate"].reason.startswith("as first.gate"), plan


class TwoRouters(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = BreakingCastRouter(), BreakingCastRouter()

    def forward(self, x):
        return self.first(x) + self.second(x)


def _tiny_clip():
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=16)
    config = transformers.CLIPConfig(text_config=text, vision_config={**vision, "patch_size": 8}, projection_dim=16)
    return transformers.CLIPModel(config), (torch.randint(0, 64, (2, 7)), torch.randn(2, 3, 16, 16))


def _tiny_squeezebert():
    groups = dict(q_groups=1, k_groups=1, v_groups=1, post_attention_groups=1, intermediate_groups=1, output_groups=1)
    config = transformers.SqueezeBertConfig(
        vocab_size=64, hidden_size=32, embedding_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64, **groups,
    )  # fmt: skip
    return transformers.SqueezeBertModel(config), (torch.randint(0, 64, (2, 7)),)


@pytest.mark.parametrize("make", [_tiny_clip, _tiny_squeezebert], ids=["clip", "squeezebert"])
def test_rows_name_layers_not_products_of_activations(make):
    """CLIP's `logits_per_text = text_embeds @ image_embeds.t()` had a row ("weight is not a
    parameter"), and SqueezeBERT's key Conv1d weight, whose *output* reaches `matmul(query, key)`, one
    saying "3-D weight read by matmul": rows for no linear layer. Every row now names a Linear."""
    torch.manual_seed(0)
    model, inputs = make()
    plan = qp.explain(model.eval(), *inputs, linear="int8_weight_only")
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    assert sorted(row.fqn for row in plan.rows) == sorted(linears), plan
    assert all(row.quantized for row in plan.rows), plan


def test_a_weight_that_is_no_parameter_says_what_it_is():
    """weight_norm's linear computes its weight in the graph: its row was named after the graph node
    (`input_1`: a Sequential's child `L['fn'][0]` lost its index) and the layer got a second row "in
    no compiled graph". A function's weight input made `explain` fail on the function's modules."""
    model = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(32, 16)), nn.Linear(16, 8)).eval()
    rows = {row.fqn: row for row in qp.explain(model, torch.randn(4, 32), linear="int8_weight_only").rows}
    assert sorted(rows) == ["0", "1"] and rows["1"].quantized
    left = "left as the model computes it"
    weights = "0.parametrizations.weight.original0, 0.parametrizations.weight.original1"
    assert rows["0"].reason == f"weight is not a parameter: computed in the graph from {weights}; {left}"
    plan = qp.explain(lambda x, w: x @ w.t(), torch.randn(4, 32), torch.randn(8, 32), linear="int8_weight_only")
    assert [row.reason for row in plan.rows] == ["weight is an input of the compiled function, not a parameter"]


class TwoOfThreeBlocks(BlocksInALoop):
    def forward(self, x):
        for block in self.blocks[:2]:
            x = block(x)
        return self.head(x)


def test_the_plan_says_which_layers_hold_other_weights_than_it_claims(caplog):
    """From tiny NLLB-MoE: experts no token was routed to had rows "quantized" (as expert_0's graph)
    while they held their full-precision weights, and layers in a frame Dynamo ran eagerly past its
    recompile limit ran on weights given back in full precision, their rows still plainly "quantized"."""
    torch.manual_seed(0)
    model = TwoOfThreeBlocks().eval()
    m, backend = compiled(model)
    with torch.no_grad():
        m(torch.randn(4, 32))
    rows = {row.fqn: row for row in backend.plan.rows}
    assert all(rows[f"blocks.{i}.lin"].quantized for i in range(3))
    assert rows["blocks.2.lin"].reason.endswith("; not run yet: its weights are quantized on its first call")
    assert not any(rows[f"blocks.{i}.lin"].reason.endswith(("call", "on them")) for i in range(2))
    with torch._dynamo.config.patch(recompile_limit=1), torch.no_grad(), caplog.at_level("DEBUG", "quantpass"):
        m(torch.randn(6, 32))  # a new length: a second entry for each frame, past the limit: run eagerly
    rows = {row.fqn: row for row in backend.plan.rows}
    restored = (
        "; its full-precision weights were restored since (runs outside the compiled model): eager calls run on them"
    )
    assert [fqn for fqn, row in rows.items() if row.reason.endswith(restored)] == ["blocks.0.lin", "blocks.1.lin"]
    assert any("torch._dynamo.config.recompile_limit" in r.getMessage() for r in caplog.records)
    summary = "linear: 3 quantized (int8_weight_only; cpu 3; 2 with weights restored for eager calls; 1 not run yet)"
    assert backend.plan.summary().startswith(summary)
    m, backend = compiled(TwoOfThreeBlocks().eval(), keep_original_weights=True)  # nothing released: no canonical
    with torch.no_grad():
        m(torch.randn(4, 32))
    assert backend.plan.summary().startswith("linear: 3 quantized (int8_weight_only; cpu 3; 1 not run yet)")


def _tiny_mixtral():
    from tiny_moe_models import tiny_moe

    return tiny_moe("mixtral", "grouped_mm", dtype=torch.float32)


def _same_generation(eager, compiled, prompt: int) -> None:
    """Logits of every step up to the first differing token at cosine >= 0.999; a token differs only
    where eager's top two logits are within 2% of its logit range (a near-tie rounding flips)."""
    tokens = zip(eager.logits, compiled.logits, eager.sequences[0, prompt:], compiled.sequences[0, prompt:])
    for step, (a, b, x, y) in enumerate(tokens):
        assert cosine(a, b) >= 0.999, f"step {step}: cosine {cosine(a, b):.5f}"
        if x != y:
            top = a[0].topk(2).values
            assert top[0] - top[1] < 0.02 * (a.max() - a.min()), f"step {step}: a token flipped off a near-tie"
            return
    assert len(eager.logits) == len(compiled.logits)


def _int8_rows(model: nn.Module, plan: qp.Plan) -> nn.Module:
    """A copy of `model` whose weights the plan quantized are INT8 per row (absmax / 127), dequantized."""
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for row in plan.quantized():
            for param in copied.get_submodule(row.fqn).parameters(recurse=False):
                if param.dim() >= 2:
                    scale = param.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
                    param.copy_((param / scale).round().clamp(-127, 127) * scale)
    return copied


GENERATED = {  # model -> (its plan's summary, rows)
    "llama": ("linear: 14 quantized (int8_weight_only; cpu 14) | 1 skipped", 15),
    "mixtral": (
        "linear: 8 quantized (int8_weight_only; cpu 8) | 3 skipped | moe: 2 quantized (int8_weight_only; cpu 2) | 0 skipped",
        13,
    ),
}


@pytest.mark.parametrize("name, cache", [("llama", "dynamic"), ("llama", "static"), ("mixtral", "dynamic")])
def test_generate_with_a_compiled_forward(name, cache, caplog):
    """How LLM users run it: `model.forward = torch.compile(model.forward, ...)`, then `generate`. Each
    new length was another graph whose rows joined the plan: a 14-linear model read "70 quantized"
    (now: recompiles of a frame add no rows). Each step's logits and token are those of the model
    with its weights INT8-rounded in plain torch: against the unquantized model, a tiny MoE's
    generation parts at the step where rounding flips a near-tied expert choice (cosine 0.51 there
    for both, 1.0000 between them, measured)."""
    model = tiny_llama() if name == "llama" else _tiny_mixtral()
    original = copy.deepcopy(model)
    prompts = [torch.randint(3, 100, (1, n), generator=torch.Generator().manual_seed(n)) for n in (7, 11)]
    options = {
        "max_new_tokens": 10,
        "do_sample": False,
        "output_logits": True,
        "return_dict_in_generate": True,
        **({"cache_implementation": "static"} if cache == "static" else {}),
    }
    backend = qp.backend(linear="int8_weight_only", moe="int8_weight_only")
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=backend)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="quantpass"):
        generated = [model.generate(ids, **options) for ids in prompts]
    assert not caplog.records  # nothing restored, nothing re-quantized
    assert len(backend.plans) > 2  # prefill and decode lengths: several graphs
    assert (backend.plan.summary(), len(backend.plan.rows)) == GENERATED[name]
    rounded = _int8_rows(original, backend.plan)
    with torch.no_grad():
        for ids, out in zip(prompts, generated):
            _same_generation(rounded.generate(ids, **options), out, ids.shape[1])


class _CheckedStack(nn.Module):
    """Plain torch: a stack of Linears with a data-dependent check in its loop."""

    def __init__(self, hidden: int = 64, depth: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
            if x.abs().max() > 1e4:  # reads a value: a graph break inside the loop
                x = x / x.abs().max()
        return x


def test_a_model_dynamo_runs_eagerly_is_said_to_be_unquantized():
    """A graph break inside a loop makes Dynamo skip the whole frame: the model ran eagerly, quantpass
    never saw a graph and nothing was quantized, and the plan told the user to call the model they had
    just called."""
    torch.manual_seed(0)
    model, x = _CheckedStack().eval(), torch.randn(4, 64)
    m, backend = compiled(model)
    with torch.no_grad():
        reference = model(x)
        out = m(x)
    assert torch.equal(out, reference)  # eager, unquantized
    summary = backend.plan.summary()
    assert summary.startswith("nothing compiled yet") and "Dynamo ran it eagerly and nothing is quantized" in summary
    assert "a graph break inside a loop" in summary and "TORCH_LOGS=graph_breaks" in summary


def test_a_plan_before_any_graph_says_nothing_was_compiled():
    """`torch.compile(model).generate(...)` runs the uncompiled forward: the plan said "no linear or
    moe layers found" of a Llama."""
    backend = qp.backend(linear="int8_weight_only")
    torch._dynamo.reset()
    m, ids = torch.compile(tiny_llama(), backend=backend), torch.randint(3, 128, (1, 5))
    with torch.no_grad():
        m.generate(ids, max_new_tokens=2, do_sample=False)
        assert backend.plan.summary().startswith("nothing compiled yet: call the compiled model")
        m(ids)
    assert backend.plan.summary().startswith("linear: 14 quantized")
