"""The quantpass Dynamo backend on linear layers, end to end on CPU (issue #3)."""

import json
import logging
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from plan_text import printed_reason
from tiny_models import Block, tiny_llama, token_ids

import quantpass as qp
from quantpass.backend import QuantpassBackend
from quantpass.kernels import ops, reference
from quantpass.metrics import cosine, sqnr
from quantpass.passes.fx_utils import op_counts
from quantpass.passes.quantize_pass import QuantizePass
from quantpass.quant_registry.spec import SHORTHANDS
from quantpass.weight_cache import WEIGHTS

# Logits cosine floors vs the unquantized model (issue #3); simulated quantization of this
# model gives about 0.998 (8-bit), 0.979 (4-bit weight-only) and 0.971 (NVFP4 W4A4).
FLOORS = {"nvfp4": 0.94, **{name: 0.96 for name in ("mxfp4", "int4_weight_only", "nvfp4_weight_only")}}


@pytest.fixture(scope="module")
def llama():
    model = tiny_llama()
    ids = token_ids()
    with torch.no_grad():
        return model, ids, model(ids).logits


def compile_logits(model, ids, **options):
    # the module-scoped model is compiled again and again: keep its originals (release has its own tests)
    backend = qp.backend(**{"lowering": "aot_eager", "keep_original_weights": True, **options})
    backend.keep_graphs = True
    torch._dynamo.reset()
    with torch.no_grad():
        logits = torch.compile(model, backend=backend)(ids).logits
    return backend, logits


@pytest.mark.parametrize("shorthand", sorted(SHORTHANDS))
def test_every_linear_shorthand_on_tiny_llama(llama, shorthand):
    model, ids, reference_logits = llama
    backend, logits = compile_logits(model, ids, linear=shorthand)
    similarity = cosine(reference_logits, logits)
    assert similarity >= FLOORS.get(shorthand, 0.99), f"{shorthand}: cosine {similarity:.4f}"
    ((before, after),) = backend.graphs
    linears_before = op_counts(before)["torch._C._nn.linear"]
    counts = op_counts(after)
    assert linears_before == 15  # 7 per layer + lm_head
    quantized = sum(n for name, n in counts.items() if name.startswith("quantpass") or "linear_graph" in name)
    assert quantized == 14 and counts["torch._C._nn.linear"] == 1  # only lm_head is left
    rows = {row.fqn: row for row in backend.plan.rows}
    assert rows["lm_head"].backend is None and "lm_head" in rows["lm_head"].reason
    assert rows["model.layers.1.mlp.down_proj"].format == shorthand or shorthand in ("fp8_weight_only",)
    assert "verified" in rows["model.layers.0.self_attn.q_proj"].reason


@pytest.mark.parametrize("shorthand", ["fp8_per_channel", "int8_per_channel"])
def test_inductor_lowering(llama, shorthand):
    model, ids, reference_logits = llama
    backend, logits = compile_logits(model, ids, linear=shorthand, lowering="inductor")
    assert cosine(reference_logits, logits) >= 0.99
    assert backend.plan.summary().startswith("linear: 14 quantized")


def test_inductor_cpp_wrapper(llama):
    """Inductor's C++ wrapper (`torch._inductor.config.cpp_wrapper`) takes every graph input's fake value
    from the placeholders' `val` once any placeholder has one: the quantized-weight inputs quantpass adds
    carry what Dynamo's carry, so the model's own inputs are not read as None."""
    model, ids, reference_logits = llama
    _, expected = compile_logits(model, ids, linear="int8_weight_only", lowering="inductor")
    with torch._inductor.config.patch(cpp_wrapper=True):
        backend, logits = compile_logits(model, ids, linear="int8_weight_only", lowering="inductor")
    assert backend.plan.summary().startswith("linear: 14 quantized")
    assert cosine(reference_logits, logits) >= 0.99
    torch.testing.assert_close(logits, expected, rtol=1e-3, atol=1e-3)


def test_instances_of_one_class_share_a_graph_but_not_weights():
    blocks = [Block() for _ in range(3)]
    backend = qp.backend(linear="int8_per_channel", lowering="aot_eager")
    x = torch.randn(4, 64)
    torch._dynamo.reset()
    with torch.no_grad():
        expected = [block(x) for block in blocks]
        outputs = [torch.compile(block, backend=backend)(x) for block in blocks]
    assert len(backend.plans) == 1  # one graph served all three instances
    for out, ref in zip(outputs, expected):
        assert cosine(ref, out) > 0.999
    assert cosine(outputs[0], outputs[1]) < 0.99  # each got its own weights


def test_in_place_weight_update_is_picked_up():
    block = Block()  # in-place writes need the originals: keep them
    backend = qp.backend(linear="fp8_per_channel", lowering="aot_eager", keep_original_weights=True)
    compiled = torch.compile(block, backend=backend)
    x = torch.randn(4, 64)
    torch._dynamo.reset()
    with torch.no_grad():
        compiled(x)
        builds = WEIGHTS.builds
        stale = compiled(x)
        assert WEIGHTS.builds == builds  # cached: nothing re-quantized
        block.up.weight.copy_(torch.randn_like(block.up.weight))  # RL-style weight sync
        out = compiled(x)
        assert WEIGHTS.builds == builds + 1  # only the updated weight
        assert cosine(block(x), out) > 0.99 > cosine(block(x), stale)


def test_quantized_once_however_many_compiles():
    block = Block()
    x = torch.randn(4, 64)
    builds = WEIGHTS.builds
    with torch.no_grad():
        for lowering in ("aot_eager", "eager"):
            torch._dynamo.reset()
            torch.compile(block, backend=qp.backend(linear="int8_weight_only", lowering=lowering))(x)
    assert WEIGHTS.builds == builds + 2  # two linears, quantized once each


def test_dynamic_sequence_lengths_do_not_recompile():
    model = tiny_llama(layers=1)
    torch._dynamo.reset()
    backend = qp.backend(linear="fp8_per_channel", lowering="aot_eager")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    compiles = []
    with torch.no_grad():
        for length in (5, 9, 13):
            ids = token_ids(length=length)
            assert cosine(model(ids).logits, compiled(ids).logits) > 0.99
            compiles.append(len(backend.plans))
    assert compiles[0] == compiles[1] == compiles[2]  # lengths 9 and 13 reused the first graphs


def test_mark_dynamic_does_not_recompile():
    block = Block()
    backend = qp.backend(linear="int8_per_channel", lowering="aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend)
    with torch.no_grad():
        for rows in (3, 7, 11):
            x = torch.randn(rows, 64)
            torch._dynamo.mark_dynamic(x, 0)
            assert cosine(block(x), compiled(x)) > 0.999
    assert len(backend.plans) == 1


def test_ignore_targets_and_backend_are_honoured(llama):
    model, ids, reference_logits = llama
    backend, logits = compile_logits(
        model,
        ids,
        linear="int8_per_channel",
        targets={"re:.*mlp.down_proj": "int4_weight_only", "lm_head": "fp8_per_channel"},
        ignore=["*.v_proj"],
        backend={"linear": "reference"},
    )
    rows = {row.fqn: row for row in backend.plan.rows}
    assert rows["model.layers.0.self_attn.v_proj"].backend is None
    assert rows["model.layers.0.self_attn.v_proj"].reason == "ignored by '*.v_proj'"
    assert rows["model.layers.1.mlp.down_proj"].weight == "kInt4StaticGroup128Sym"
    assert rows["lm_head"].weight == "kFp8StaticChannelSym"  # a target overrides the default ignore
    assert {row.backend for row in rows.values() if row.backend} == {"reference"}
    assert "named by the user" in rows["model.layers.0.self_attn.q_proj"].reason
    assert cosine(reference_logits, logits) > 0.97


def test_option_errors_are_one_line_and_list_valid_choices():
    with pytest.raises(ValueError) as err:
        qp.backend(lineer="fp8_per_block")
    assert "'lineer'" in str(err.value) and "linear" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="invalid quantpass option lowering='tvm'; valid: inductor, aot_eager, eager"):
        qp.backend(lowering="tvm")
    with pytest.raises(ValueError, match="invalid quantization 'fp8'"):
        qp.backend(linear="fp8")
    with pytest.raises(ValueError, match="invalid quantpass option verify='yes'"):
        qp.backend(verify="yes")


def test_named_backend_that_cannot_run_raises_with_the_layer():
    block = Block()
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception, match="layer 'up'.*'flashinfer' can't run"):
        torch.compile(block, backend=qp.backend(linear="mxfp8", backend="flashinfer", lowering="eager"))(
            torch.randn(2, 64)
        )


def test_verify_catches_a_broken_kernel(monkeypatch):
    monkeypatch.setattr(reference, "linear", lambda x, w, a, b: torch.randn(x.shape[0], w.shape[0], dtype=x.dtype))
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception) as err:
        torch.compile(Block(), backend=qp.backend(linear="fp8_per_channel", backend="reference", lowering="eager"))(
            torch.randn(2, 64)
        )
    message = str(err.value)
    assert "layer 'up'" in message and "fp8_per_channel" in message and "'reference'" in message and "dB" in message
    # ... and verify=False lets it through
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(
            Block(), backend=qp.backend(linear="fp8_per_channel", backend="reference", lowering="eager", verify=False)
        )(torch.randn(2, 64))


class CancellingHead(torch.nn.Module):
    """A 2-output head whose inputs are nearly orthogonal to its weight rows: each output is ~1/20 of the
    products it sums (CvT's 2-label classifier in FP8: 16.7 dB on its real activations, the kernel right)."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(384, 2, bias=False)

    def forward(self, x):
        return self.head(x)


def cancelling_inputs(head: torch.nn.Linear) -> torch.Tensor:
    x = torch.randn(4, 384, generator=torch.Generator().manual_seed(0))
    w = head.weight.detach()
    along = torch.linalg.lstsq(w.T, x.T).solution.T @ w  # the part of each row the outputs see
    return x - 0.95 * along


def _fp8_head(model, x, **options):
    torch._dynamo.reset()
    backend = qp.backend(linear="fp8_per_channel", lowering="eager", **options)
    with torch.no_grad():
        torch.compile(model, backend=backend)(x)
    return backend.plan.rows[0]


def test_verify_keeps_a_layer_whose_format_loses_as_much_as_the_kernel(caplog):
    """Below the floor on real activations, but the reference backend quantizing the same weights loses
    as much and the kernel matches it: a warning naming the layer and both numbers, not an error."""
    torch.manual_seed(0)
    model = CancellingHead().eval()
    x = cancelling_inputs(model.head)
    exact = model(x).detach()
    fake = F.linear(fake_fp8(x), fake_fp8(model.head.weight.detach()))
    assert 10 < sqnr(exact, fake) < 20  # the format itself: between the pattern floor and the FP8 floor
    with caplog.at_level(logging.WARNING, logger="quantpass"):
        row = _fp8_head(model, x)
    assert row.quantized and row.backend == "cpu"
    assert "below the 20 dB floor as the format itself: the reference" in row.reason
    assert any("layer 'head'" in r.getMessage() and "ignore" in r.getMessage() for r in caplog.records)


def test_verify_still_catches_a_kernel_that_disagrees_with_the_reference(monkeypatch):
    """The same layer with a kernel 30% off (above the pattern floor, far from the reference): raised."""
    torch.manual_seed(0)
    model = CancellingHead().eval()
    x = cancelling_inputs(model.head)
    call = ops.linear_call

    def off(backend, device_type, differentiable=False):  # the cpu kernel 30% high, the reference right
        op = call(backend, device_type, differentiable)
        return op if backend == "reference" else lambda *args: op(*args) * 1.3

    monkeypatch.setattr(ops, "linear_call", off)
    with pytest.raises(Exception, match="QuantizationError: layer 'head'"):
        _fp8_head(model, x)


def fake_fp8(t: torch.Tensor) -> torch.Tensor:
    """Per-row FP8 e4m3 fake quantization (the format's weights per channel, activations per token)."""
    scale = t.abs().amax(-1, keepdim=True) / 448
    return (t / scale).to(torch.float8_e4m3fn).float() * scale


def test_tied_head_router_and_non_parameter_weights_are_reported():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(32, 16)
            self.head = torch.nn.Linear(16, 32, bias=False)
            self.head.weight = self.embed.weight
            self.router = torch.nn.Linear(16, 4, bias=False)
            self.register_buffer("frozen", torch.randn(8, 16))
            self.mix = torch.nn.Parameter(torch.randn(8, 16).bfloat16())

        def forward(self, ids):
            h = self.embed(ids)
            top = torch.topk(self.router(h).softmax(-1), 2).values
            mixed = F.linear(h, self.mix.float())  # DeepSeek-V4's hyper-connections: a parameter cast first
            return self.head(h), top, h @ self.frozen.t(), mixed

    plan = qp.explain(Model(), torch.randint(0, 32, (2, 5)), linear="fp8_per_channel")
    reasons = {row.fqn: row.reason for row in plan.rows}
    assert "tied to an embedding" in reasons["head"]
    assert "MoE router" in reasons["router"]
    assert "weight is the buffer frozen, not a parameter" in reasons.values()
    assert "weight is mix cast to torch.float32 in the graph" in " ".join(reasons.values())
    assert plan.quantized() == []


def test_explain_plan_table_and_summary(llama, caplog):
    model, ids, _ = llama
    plan = qp.explain(model, ids, linear="fp8_per_block", ignore=["*.o_proj"])
    assert isinstance(plan, qp.Plan)
    row = next(r for r in plan.rows if r.fqn == "model.layers.0.self_attn.q_proj")
    assert (row.kind, row.weight, row.activation) == ("linear", "kFp8Static128BlockSym", "kFp8Dynamic128Sym")
    assert row.backend is not None and isinstance(row.rejected, dict)
    text = str(plan)
    assert text.splitlines()[0].split()[:3] == ["layer", "kind", "weight"]
    assert text.splitlines()[-1] == "linear: 12 quantized (fp8_per_block; " + text.splitlines()[-1].split("; ", 1)[1]
    assert "| 3 skipped" in text.splitlines()[-1]
    caplog.set_level("INFO", logger="quantpass")
    compile_logits(model, ids, linear="fp8_per_block")
    assert any(r.message.startswith("linear: 14 quantized") for r in caplog.records)


def test_plan_table_prints_a_shared_reason_once(llama):
    """Every row of a compiled Llama repeated the same ~250-character reason (the kernel, its
    activations, its M limit), so each line wrapped on a terminal and the verify figures, the one
    thing that differs, were lost in it. A shared reason is now a numbered note under the table;
    each row shows the number and what its own reason adds, and note + rest is the reason again."""
    model, ids, _ = llama
    backend, _ = compile_logits(model, ids, linear="int8_weight_only")
    plan, text = backend.plan, str(backend.plan)
    lines = text.splitlines()
    rows, below = lines[2 : 2 + len(plan.rows)], lines[2 + len(plan.rows) :]
    assert below[0] == "" and re.fullmatch(r"\[1\] config\.linear: .*", below[1]), text
    assert below[2:] == [plan.summary()]  # one note, then the summary, last
    for row, line in zip(plan.rows, rows):
        assert line.startswith(row.fqn) and printed_reason(text, row.fqn).endswith(row.reason), line
        assert len(line) < 120 or not row.quantized, line
    verified = [line for line in rows if line.endswith(" dB") and "  [1]; verified " in line]
    assert len(verified) >= 2  # rows that differ only in their verify figure share the note


def test_explain_takes_the_models_keyword_inputs(llama):
    """transformers models are called with keywords (`model(**tokenizer(...))`): `explain(model,
    input_ids=ids)` failed with "invalid quantpass option 'input_ids'" and no way to pass them."""
    model, ids, _ = llama
    with pytest.raises(
        ValueError, match=r"option 'input_ids'; valid: .*inputs go in kwargs: qp.explain\(model, kwargs="
    ):
        qp.explain(model, input_ids=ids, linear="int8_weight_only")
    mask = torch.ones_like(ids)
    plan = qp.explain(model, kwargs={"input_ids": ids, "attention_mask": mask}, linear="int8_weight_only")
    assert plan.summary() == qp.explain(model, ids, linear="int8_weight_only").summary()
    assert len(plan.quantized()) == 14


def test_summary_counts_layers_not_calls():
    """A layer called twice has two rows; it counts once, and as quantized only where every call is."""
    row = lambda fqn, backend: qp.PlanRow(fqn, "linear", None, None, backend, "why", format="int8")  # noqa: E731
    plan = qp.Plan([row("a", "cpu"), row("a", "cpu"), row("b", "cpu"), row("b", None), row("c", None)])
    assert plan.summary() == "linear: 1 quantized (int8; cpu 1; 2 calls) | 2 skipped"
    assert qp.Plan([row("a", "cpu")]).summary() == "linear: 1 quantized (int8; cpu 1) | 0 skipped"


def test_uuid_changes_with_the_config():
    a = QuantizePass(qp.QuantizationConfig(linear="fp8_per_block")).uuid()
    b = QuantizePass(qp.QuantizationConfig(linear="fp8_per_channel")).uuid()
    c = QuantizePass(qp.QuantizationConfig(linear="fp8_per_block"), verify=False).uuid()
    assert len({a, b, c}) == 3
    assert a == QuantizePass(qp.QuantizationConfig(linear="fp8_per_block")).uuid()


def test_uuid_covers_the_c_sources(tmp_path, monkeypatch):
    """The C++ graph op's schema and tags shape the compiled graph: its source is part of the hash."""
    from quantpass.passes import quantize_pass

    (tmp_path / "kernels").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    source = tmp_path / "kernels" / "op.cpp"
    monkeypatch.setattr(quantize_pass, "PACKAGE", tmp_path)
    hashes = []
    for text in ("// one\n", "// two\n"):
        source.write_text(text)
        hashes.append(quantize_pass.source_hash.__wrapped__())
    assert hashes[0] != hashes[1]


@pytest.mark.parametrize("linear", [None, "int8_per_channel"])
def test_each_compile_hands_its_freed_heap_back(linear, monkeypatch):
    """After lowering a graph, quantized or not, the heap the compile freed goes back to the OS (glibc
    keeps it otherwise: ~3 MiB after a cold Inductor compile of a small Llama, bench/README.md)."""
    backend_module = sys.modules["quantpass.backend"]  # `quantpass.backend` is also the function
    calls, lower = [], backend_module.lower
    monkeypatch.setattr(backend_module, "lower", lambda *a: calls.append("lower") or lower(*a))
    monkeypatch.setattr(backend_module, "return_freed_memory", lambda: calls.append("trim"))
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(Block(), backend=qp.backend(linear=linear, lowering="eager"))(torch.randn(2, 64))
    assert calls == ["lower", "trim"]


def test_no_quantization_behaves_like_plain_lowering():
    backend = qp.backend(lowering="aot_eager")
    torch._dynamo.reset()
    block = Block()
    x = torch.randn(2, 64)
    with torch.no_grad():
        assert torch.allclose(torch.compile(block, backend=backend)(x), block(x))
    assert isinstance(backend, QuantpassBackend)
    assert [plan.rows for plan in backend.plans] == [[]]  # a graph, nothing planned
    assert backend.plan.summary() == "no linear or moe layers found"


def test_debug_dir_holds_graphs_and_plan(tmp_path):
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(Block(), backend=qp.backend(linear="int8_per_channel", lowering="eager", debug_dir=tmp_path))(
            torch.randn(2, 64)
        )
    (folder,) = tmp_path.iterdir()
    assert "linear(" in (folder / "before.py").read_text()
    after = (folder / "after.py").read_text()
    assert "torch._C._nn.linear" not in after and ("quantpass.linear" in after or "linear_graph" in after)
    assert "linear: 2 quantized" in (folder / "plan.txt").read_text()


def test_entry_point_backend_in_a_fresh_process():
    script = textwrap.dedent(
        """
        import json, torch
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 32))
        x = torch.randn(4, 64)
        with torch.no_grad():
            out = torch.compile(block, backend="quantpass",
                                options={"linear": "int8_per_channel", "lowering": "aot_eager"})(x)
            ref = block(x)
        print(json.dumps({"cos": float(torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), 0))}))
        """
    )
    env = {**os.environ, "QUANTPASS_LOG": "info"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["cos"] > 0.999
    assert "linear: 2 quantized" in done.stderr
