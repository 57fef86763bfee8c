"""transformers' own tensor-parallel plans through quantpass, 2 ranks on gloo (issue #17).

The test saves a tiny seeded model (nothing is downloaded); each rank loads it unmodified with
`from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"))` (transformers
shards the weights into DTensors and, at inference, runs each linear on its local shard with an
all-reduce after the row-split ones), compiles it with quantpass and compares it with the same
checkpoint loaded whole, eager and quantized.
"""

from __future__ import annotations

import pytest
import torch
from test_distributed import _check_formats, compile_sharded, run_ranks

transformers = pytest.importorskip("transformers")
DistributedConfig = pytest.importorskip("transformers.distributed").DistributedConfig


def _hf_tp_case(rank, world, path: str, fmt: str, moe: bool = False, ep: str | None = None, plan="auto") -> dict:
    """Load the checkpoint whole and with transformers' TP plan (`plan`: "auto", or rules overriding it;
    with `ep`, also its expert-parallel plan with that `ep_implementation`); compile both with quantpass."""
    from tiny_models import token_ids

    import quantpass as qp
    from quantpass.metrics import cosine

    ids, load = token_ids(), {"experts_implementation": "grouped_mm"} if moe else {}  # experts Dynamo sees
    whole = transformers.AutoModelForCausalLM.from_pretrained(path, **load).eval()
    with torch.no_grad():
        reference = whole(ids).logits
        torch._dynamo.reset()
        single = torch.compile(whole, backend=qp.backend(linear=fmt, moe=fmt, lowering="aot_eager"))(ids).logits
    experts = {"ep_size": world, "ep_implementation": ep} if ep else {}
    config = DistributedConfig(tp_plan=plan, tp_size=world, **experts)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, distributed_config=config, **load).eval()
    run = compile_sharded(model, (ids,), linear=fmt, moe=fmt)
    out = run.pop("out").logits
    run.pop("compiled")
    return {fmt: {**run, "cosine": cosine(reference, out), "cosine_single": cosine(single, out)}}


@pytest.mark.parametrize("fmt", ["int8_weight_only", pytest.param("fp8_per_channel", marks=pytest.mark.slow)])
def test_transformers_tp_plan_auto_llama(tmp_path, fmt):
    from tiny_models import tiny_llama

    tiny_llama(layers=1).save_pretrained(tmp_path)
    results = run_ranks(_hf_tp_case, str(tmp_path), fmt)
    # lm_head is sharded too (colwise_gather_output) but left alone by default; its logits and the
    # embedding's output are the model's own all-gathers
    _check_formats(results, [fmt], expected_quantized=7, gathers=None)
    for rank, result in enumerate(results):
        rows = result[fmt]["rows"]
        assert f"rank {rank}/2, local [64, 80] of [64, 160] (K split)" in rows["model.layers.0.mlp.down_proj"][1]


# Qwen3-MoE's expert tensor parallelism, its default plan until transformers 5.25 (which deprecated the
# `moe_tp_experts` style for expert parallelism, removal announced for 5.28, and dropped these rules from
# the model's own plan): gate_up packed colwise (each rank: its half of gate and of up), down rowwise, the
# outputs all-reduced by transformers
EXPERTS_TP = {
    "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "model.layers.*.mlp.experts.down_proj": "rowwise",
    "model.layers.*.mlp.experts": "moe_tp_experts",
}


def _qwen3_moe_tp(tmp_path, plan) -> list[dict]:
    """Each rank's plan rows for a tiny Qwen3-MoE under this TP plan, INT8 weight-only; checked against
    the whole model: the expert site and 4 attention projections quantized."""
    from tiny_moe_models import tiny_moe

    fmt = "int8_weight_only"
    tiny_moe("qwen3_moe", "grouped_mm", dtype=torch.float32, num_hidden_layers=1).save_pretrained(tmp_path)
    results = run_ranks(_hf_tp_case, str(tmp_path), fmt, True, None, plan)
    _check_formats(results, [fmt], expected_quantized=5, gathers=None)
    notes = [result[fmt]["rows"]["model.layers.0.mlp.experts"][1] for result in results]
    for note in notes:
        # the fused MoE op, not the one-by-one fallback: the in-place all-reduce after the experts
        # was made functional, so nothing writes into the region from outside
        assert "grouped_mm experts" in note and "one by one" not in note, note
    return notes


def test_transformers_tp_plan_auto_qwen3_moe(tmp_path):
    """The model's own plan: its experts sharded where the installed transformers' plan shards them
    (before 5.25), else whole on every rank."""
    notes = _qwen3_moe_tp(tmp_path, "auto")
    sharded = {f"model.{rule}" for rule in transformers.Qwen3MoeConfig.base_model_tp_plan} >= set(EXPERTS_TP)
    for note in notes:
        assert ("(N split and K split)" in note) == sharded, note


def test_transformers_experts_tensor_parallel_qwen3_moe(tmp_path):
    from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES

    if "moe_tp_experts" not in ALL_PARALLEL_STYLES:
        pytest.skip("this transformers has no `moe_tp_experts` parallel style (removed in 5.28)")
    shards = "gate_up_proj local [4, 32, 64] of [4, 64, 64], down_proj local [4, 64, 16] of [4, 64, 32]"
    for rank, note in enumerate(_qwen3_moe_tp(tmp_path, EXPERTS_TP)):
        assert f"rank {rank}/2, {shards} (N split and K split)" in note, note


@pytest.mark.parametrize(
    "fmt", ["int8_weight_only", *(pytest.param(f, marks=pytest.mark.slow) for f in ("fp8_per_channel", "mxfp8"))]
)
def test_transformers_expert_parallel_qwen3_moe_all_reduce(tmp_path, fmt):
    """ep_implementation="all_reduce": every rank runs its 2 of the 4 experts on the whole batch
    (transformers masks the other ranks' routes), an all-reduce sums the outputs. quantpass runs the
    local experts in its fused MoE op from the global expert ids, with an expert_map."""
    from tiny_moe_models import tiny_moe

    tiny_moe("qwen3_moe", "grouped_mm", dtype=torch.float32, num_hidden_layers=1).save_pretrained(tmp_path)
    results = run_ranks(_hf_tp_case, str(tmp_path), fmt, True, "all_reduce")
    _check_formats(results, [fmt], expected_quantized=5, gathers=None)
    for rank, result in enumerate(results):
        note = result[fmt]["rows"]["model.layers.0.mlp.experts"][1]
        shards = "gate_up_proj local [2, 64, 64] of [4, 64, 64], down_proj local [2, 64, 32] of [4, 64, 32]"
        assert f"rank {rank}/2, {shards} (experts split)" in note, note
        assert f"expert parallel: rank {rank}/2 runs experts [{2 * rank}, {2 * rank + 2}) of 4" in note, note
        assert "one by one" not in note, note


@pytest.mark.slow
def test_transformers_expert_parallel_qwen3_moe_all_to_all(tmp_path):
    """ep_implementation="all_to_all" reads its split sizes back to the host: Dynamo breaks the
    graph there, and the experts' own graph (received tokens, local ids, sentinel masks) is not a
    provable fused MoE: quantpass quantizes its expert GEMMs one by one, and the output still matches."""
    from tiny_moe_models import tiny_moe

    fmt = "int8_weight_only"
    tiny_moe("qwen3_moe", "grouped_mm", dtype=torch.float32, num_hidden_layers=1).save_pretrained(tmp_path)
    results = run_ranks(_hf_tp_case, str(tmp_path), fmt, True, "all_to_all")
    _check_formats(results, [fmt], expected_quantized=None, gathers=None)
    for result in results:
        fmt_row, note = result[fmt]["rows"]["model.layers.0.mlp.experts.gate_up_proj"]  # the experts graph's parameter
        assert fmt_row == fmt and "experts quantized one by one" in note, note
