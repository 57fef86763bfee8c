"""MoE end to end through the quantpass backend on tiny transformers models (issue #5).

Each (model, experts implementation) is captured by Dynamo once; the backend then compiles that
same graph once per MoE format. That is exactly what `torch.compile(backend="quantpass")` does
after tracing, without paying Dynamo's trace 96 times. One test goes through torch.compile itself.
"""

import functools

import pytest
import torch
from tiny_models import token_ids
from tiny_moe_models import eager_and_compiled_logits, moe_op_count, tiny_moe

import quantpass as qp
from quantpass.backend import experts_warning
from quantpass.kernels import cpu_fp8
from quantpass.kernels.oracle import MOE_CANDIDATES
from quantpass.metrics import cosine
from quantpass.passes.fx_utils import copy_graph_module, op_counts
from quantpass.quant_registry.keys import needs_input_scale

MODELS = ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"]
MOE_LAYERS = {"mixtral": 2, "qwen3_moe": 2, "gpt_oss": 2, "deepseek_v3": 1}  # DeepSeek: first layer dense
IMPLEMENTATIONS = {"grouped_mm": torch.bfloat16, "batched_mm": torch.float32}  # grouped_mm compiles in bf16 only
# static activation keys need a checkpoint's calibrated input scale: tests/test_checkpoints.py
PAIRS = sorted((pair for pair in MOE_CANDIDATES if not needs_input_scale(pair[1])), key=str)
EXPERT_MATMULS = ("torch._grouped_mm", "transformers.grouped_mm_fallback", "torch.bmm", "torch.functional.einsum")


@functools.cache
def captured(name, implementation):
    """(Dynamo's graph, its example inputs, the model's logits) for one tiny model."""
    model = tiny_moe(name, implementation, dtype=IMPLEMENTATIONS[implementation])
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((copy_graph_module(gm), list(example_inputs)))  # the copy keeps Dynamo's metadata
        return gm.forward

    ids = token_ids(length=9)
    torch._dynamo.reset()
    with torch.no_grad():
        logits = model(ids).logits
        torch.compile(model, backend=capture, fullgraph=True)(ids)
    ((gm, example_inputs),) = graphs
    return gm, example_inputs, logits


def logits_of(outputs, like):
    return next(o for o in outputs if isinstance(o, torch.Tensor) and o.shape == like.shape)


@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("pair", PAIRS, ids=[f"{w}-{a}" for w, a in PAIRS])
def test_every_moe_format_on_real_models(name, implementation, pair):
    gm, example_inputs, reference_logits = captured(name, implementation)
    spec = {"weight": str(pair[0]), "activation": None if pair[1] is None else str(pair[1])}
    backend = qp.backend(moe=spec, lowering="eager")  # MoE only: linears stay as they are
    backend.keep_graphs = True
    with torch.no_grad():
        logits = logits_of(backend(gm, example_inputs)(*example_inputs), reference_logits)
    moe_rows = [row for row in backend.plan.rows if row.kind == "moe"]
    assert len(moe_rows) == MOE_LAYERS[name] and all(row.quantized for row in moe_rows), backend.plan
    assert all(row.fqn.endswith("mlp.experts") for row in moe_rows), backend.plan
    assert "verified" in moe_rows[0].reason  # once per (spec, backend, shape): the first layer
    ((_, after),) = backend.graphs
    counts = op_counts(after)
    assert moe_op_count(counts) == MOE_LAYERS[name]
    assert not any(counts[op] for op in EXPERT_MATMULS), counts
    floor = 0.96 if 4 in (pair[0].bits, getattr(pair[1], "bits", 16)) else 0.99
    assert cosine(reference_logits, logits) >= floor


def test_through_torch_compile_with_linears_too():
    model = tiny_moe("qwen3_moe", "grouped_mm", dtype=torch.bfloat16)
    backend = qp.backend(linear="fp8_per_channel", moe="mxfp8", lowering="aot_eager")
    reference_logits, logits = eager_and_compiled_logits(model, token_ids(length=9), backend)
    summary = backend.plan.summary()
    on = "cpu" if cpu_fp8.available()[0] else "reference"  # quantpass's FP8 CPU kernel, where it builds
    assert f"moe: 2 quantized (mxfp8; {on} 2)" in summary, summary
    routers = [row for row in backend.plan.rows if row.fqn.endswith("mlp.gate")]
    assert routers and all(not row.quantized and "router" in row.reason for row in routers)
    assert cosine(reference_logits, logits) >= 0.99


def test_eager_experts_implementation_is_called_out(caplog):
    model = tiny_moe("mixtral", "eager", dtype=torch.float32)
    caplog.set_level("WARNING", logger="quantpass")
    plan = qp.explain(model, token_ids(length=5), moe="mxfp8")
    assert not [row for row in plan.rows if row.kind == "moe"]  # the experts never reach a graph
    assert any("set_experts_implementation('grouped_mm')" in r.message for r in caplog.records)


def test_an_expert_loop_with_nothing_to_switch_to_is_called_out_as_such():
    """Switch Transformers loops over its experts in its own code: set_experts_implementation raises
    there, so the warning must not suggest it."""
    import transformers

    model = transformers.SwitchTransformersForConditionalGeneration(switch_config()).eval()
    with pytest.raises(ValueError, match="does not support setting experts implementation"):
        model.set_experts_implementation("grouped_mm")
    warning = experts_warning(model)
    assert "runs its experts in a loop of its own" in warning and "set_experts_implementation" not in warning


def switch_config():
    import transformers

    return transformers.SwitchTransformersConfig(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
        num_experts=4, expert_capacity=64, encoder_sparse_step=1, decoder_sparse_step=1,
        relative_attention_num_buckets=8, decoder_start_token_id=0,
    )  # fmt: skip


def test_a_router_that_picks_experts_by_argmax_is_left_alone():
    """Switch Transformers' router picks each token's expert with argmax + one_hot, no topk: it was
    quantized as a plain linear (its rounding flips which expert a token gets)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.SwitchTransformersEncoderModel(switch_config()).eval()
    plan = qp.explain(model, token_ids(length=5), linear="int8_weight_only")
    rows = {row.fqn: row for row in plan.rows}
    router = rows["encoder.block.0.layer.1.mlp.router.classifier"]
    assert router.weight is None and "MoE router" in router.reason
    assert rows["encoder.block.0.layer.1.mlp.experts.expert_0.wi"].weight is not None
