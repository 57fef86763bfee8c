"""A model quantized online is saved in a format that loads back running what it ran.

Each format is compiled on a tiny bf16 Llama, saved with `qp.save_pretrained` and read by the
producer's own reader: transformers (its fine-grained FP8 reader, and compressed-tensors' through
the real `compressed-tensors` package, both decompressing on CPU) must see the weights quantpass
quantized, and `qp.from_pretrained` must run every layer with the same weight and activation keys
and give the same logits. Where no one producer stores every layer with its activations, the
ModelOpt rows for the weights are written and a warning names what changes.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers

import quantpass as qp
from quantpass.checkpoints import shards
from quantpass.metrics import cosine

pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme
from compressed_tensors.utils.match import match_name

VOCAB = 256
IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))


def tiny(moe: bool = False) -> transformers.PreTrainedModel:
    common = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=1,
                  vocab_size=VOCAB, max_position_embeddings=64, initializer_range=0.05)  # fmt: skip
    if moe:
        config = transformers.Qwen3MoeConfig(intermediate_size=384, moe_intermediate_size=128, num_experts=4,
                                             num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                                             norm_topk_prob=True, **common)  # fmt: skip
    else:
        config = transformers.LlamaConfig(intermediate_size=384, **common)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()  # as a load makes it


def run(model, **options):
    backend = qp.backend(lowering="eager", **options)
    torch._dynamo.reset()
    with torch.no_grad():
        logits = torch.compile(model, backend=backend)(IDS).logits.float()
    return logits, {row.fqn: (str(row.weight), str(row.activation)) for row in backend.plan.rows if row.quantized}


# format -> (config.json's quant_method, ModelOpt quant_algo or compressed-tensors' preset scheme of the same keys)
CASES = {
    "fp8_per_block": ("fp8", None),  # transformers' fine-grained FP8 (ModelOpt's FP8_PB_WO is weight-only)
    "fp8_per_channel": ("modelopt", "FP8_PER_CHANNEL_PER_TOKEN"),
    "int8_per_channel": ("compressed-tensors", "W8A8"),
    "int4_weight_only": ("compressed-tensors", "W4A16"),
    "fp8_weight_only": ("compressed-tensors", None),  # fp8 channel weights, bf16 activations: no preset
    "int8_weight_only": ("compressed-tensors", None),  # per channel: the W8A16 preset's are groups of 128
}


@pytest.mark.parametrize("fmt", list(CASES))
def test_saved_formats_load_back_running_what_ran(fmt, tmp_path, caplog):
    model = tiny()
    logits, ran = run(model, linear=fmt)
    assert len(ran) == 7, ran
    with caplog.at_level(logging.WARNING, logger="quantpass"):
        qp.save_pretrained(model, tmp_path)
    assert "load back so" not in caplog.text
    quant = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    method, scheme = CASES[fmt]
    assert quant["quant_method"] == method, quant
    if method == "modelopt":
        assert quant["quant_algo"] == scheme, quant
    if method == "compressed-tensors":
        (group,) = quant["config_groups"].values()
        assert group["targets"] == ["Linear"] and "lm_head" in quant["ignore"], quant
        # the format compressed-tensors' own writer picks for these arguments (int8 weight-only: packed)
        written = infer_module_format(torch.nn.Linear, QuantizationScheme(**group)).value
        assert quant["format"] == group["format"] == written, (quant, written)
        if scheme is not None:  # the arguments compressed-tensors' own preset writes
            preset = preset_name_to_scheme(scheme, ["Linear"]).model_dump(exclude_none=True)
            for role in ("weights", "input_activations"):
                ours = {k: v for k, v in (group[role] or {}).items() if k != "observer"}
                assert ours == {k: v for k, v in preset.get(role, {}).items() if k != "observer"}, role
    if method != "modelopt":  # the producer's own reader (decompressing on CPU at the first call)
        reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        with torch.no_grad():
            expected = reference(IDS).logits.float()
        assert cosine(expected, logits) >= 0.99, cosine(expected, logits)
        theirs = reference.state_dict()  # quantpass's weights, dequantized, are what it read
        for name, value in qp.checkpoints.dequantized(qp.from_pretrained(tmp_path)).state_dict().items():
            assert torch.allclose(value.float(), theirs[name].float(), rtol=2**-7, atol=0), name
    loaded = qp.from_pretrained(tmp_path)
    again, ran_again = run(loaded)
    assert ran_again == ran
    assert torch.equal(again, logits)


def test_without_one_producer_for_every_layer_modelopt_rows_are_written_and_the_change_named(tmp_path, caplog):
    model = tiny(moe=True)
    _, ran = run(model, linear="fp8_per_block", moe="mxfp8")
    with caplog.at_level(logging.WARNING, logger="quantpass"):
        qp.save_pretrained(model, tmp_path)
    quant = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert quant["quant_algo"] == "MIXED_PRECISION", quant
    algos = {layer: row["quant_algo"] for layer, row in quant["quantized_layers"].items()}
    assert algos["model.layers.0.mlp.experts"] == "MXFP8" and algos["model.layers.0.self_attn.q_proj"] == "FP8_PB_WO"
    assert "run with kFp8Dynamic128Sym activations; they are written as FP8_PB_WO" in caplog.text
    _, ran_again = run(qp.from_pretrained(tmp_path))
    assert ran_again["model.layers.0.mlp.experts"] == ran["model.layers.0.mlp.experts"]
    assert ran_again["model.layers.0.self_attn.q_proj"] == ("kFp8Static128BlockSym", "None")


def test_modelopt_export_lists_every_unquantized_module_where_its_readers_look(tmp_path):
    """A reader quantizes what the list leaves out: the router (transformers 5's `TopKRouter`, no
    nn.Linear) is listed as ModelOpt's own export lists it, and config.json's flat form carries the list
    as `ignore` too, where vLLM's ModelOpt configs read it (`exclude_modules` is hf_quant_config.json's)."""
    model = tiny(moe=True)
    logits, ran = run(model, linear="fp8_per_channel", moe="fp8_per_channel")
    qp.save_pretrained(model, tmp_path)
    quant = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    listed = json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert quant["quant_algo"] == "FP8_PER_CHANNEL_PER_TOKEN", quant
    assert quant["ignore"] == quant["exclude_modules"] == listed, quant
    assert listed == ["model.embed_tokens", "model.layers.0.mlp.gate", "lm_head"], listed
    routers = getattr(
        pytest.importorskip("modelopt.torch.export.quant_utils"), "_get_unquantized_moe_router_names", None
    )
    if routers is not None:  # ModelOpt's own rule (0.47), private
        assert routers(model) == ["model.layers.0.mlp.gate"]
    again, ran_again = run(qp.from_pretrained(tmp_path))
    assert ran_again == ran and torch.equal(again, logits)


@pytest.mark.parametrize("moe", ["int4_weight_only", "int8_per_channel", "int8_weight_only"])
def test_compressed_tensors_moe_models_load_back(moe, tmp_path):
    """One group targeting `Linear` when experts and linears share a format, else one group per
    format naming its modules (the experts by their module)."""
    model = tiny(moe=True)
    logits, ran = run(model, linear="int8_per_channel", moe=moe)
    qp.save_pretrained(model, tmp_path)
    quant = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    targets = {group["format"]: group["targets"] for group in quant["config_groups"].values()}
    if moe == "int8_per_channel":
        assert quant["format"] == "int-quantized" and targets == {"int-quantized": ["Linear"]}, quant
    else:
        assert quant["quant_method"] == "compressed-tensors" and quant["format"] == "mixed-precision", quant
        assert "model.layers.0.self_attn.q_proj" in targets["int-quantized"], targets
        # vLLM looks the experts' scheme up by their first expert's projections; nothing else matches them
        for projection in ("gate_proj", "up_proj", "down_proj"):
            name = f"model.layers.0.mlp.experts.0.{projection}"
            found = {fmt for fmt, names in targets.items() if any(match_name(name, t) for t in names)}
            assert found == {"pack-quantized"}, (name, targets)
        assert not any(match_name("model.layers.0.self_attn.q_proj", t) for t in targets["pack-quantized"])
    suffix = "weight_packed" if moe.endswith("weight_only") else "weight"
    assert any(name.endswith(f"experts.3.down_proj.{suffix}") for name in shards.index(str(tmp_path)))
    again, ran_again = run(qp.from_pretrained(tmp_path))
    assert ran_again == ran
    assert torch.equal(again, logits)


def test_fp8_per_block_moe_model_saves_as_transformers_fp8(tmp_path):
    """Experts one tensor per expert and projection, as transformers' own FP8 MoE checkpoints store them;
    transformers reads the directory (dequantizing on CPU) to quantpass's weights."""
    model = tiny(moe=True)
    logits, ran = run(model, linear="fp8_per_block", moe="fp8_per_block")
    qp.save_pretrained(model, tmp_path)
    quant = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["weight_block_size"] == [128, 128], quant
    assert "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv" in shards.index(str(tmp_path))
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert cosine(reference(IDS).logits.float(), logits) >= 0.99
    theirs = reference.state_dict()
    for name, value in qp.checkpoints.dequantized(qp.from_pretrained(tmp_path)).state_dict().items():
        assert torch.equal(value, theirs[name]), name
    again, ran_again = run(qp.from_pretrained(tmp_path))
    assert ran_again == ran and torch.equal(again, logits)


@pytest.mark.parametrize(
    "scheme, fmt",
    [("FP8", "float-quantized"), ("FP8_DYNAMIC", "float-quantized"), ("FP8_BLOCK", "float-quantized"),
     ("W8A8", "int-quantized"), ("W4A16", "pack-quantized"), ("NVFP4", "nvfp4-pack-quantized"),
     ("NVFP4A16", "nvfp4-pack-quantized")],
)  # fmt: skip
def test_compressed_tensors_groups_are_written_as_its_presets_write_them(scheme, fmt):
    """Read into keys and written back from them: the arguments and format compressed-tensors' own
    preset and compressor have."""
    from quantpass.checkpoints import compressed_tensors as ct

    preset = preset_name_to_scheme(scheme, ["Linear"]).model_dump(exclude_none=True)
    row = ct.group_algo("g", preset, fmt, "preset")
    group = ct.group_for(row.weight, row.activation)
    assert group["format"] == fmt
    for role in ("weights", "input_activations"):
        ours = {k: v for k, v in (group[role] or {}).items() if k != "observer"}
        assert ours == {k: v for k, v in preset.get(role, {}).items() if k != "observer"}, role
    assert ct.group_algo("g", group, None, "written") == row


def test_cli_quantize_on_load_saves_int4_and_int8_as_compressed_tensors(tmp_path, capsys):
    """README's `quantpass run --model DIR --quantize-on-load --quantization FMT --save OUT`, for formats
    no ModelOpt algo stores: the saved directory loads back with every layer in that format."""
    from quantpass.cli import main

    tiny().save_pretrained(tmp_path / "bf16")
    for fmt, keys in (("int4_weight_only", ("kInt4StaticGroup128Sym", "None")),
                      ("int8_per_channel", ("kInt8StaticChannelSym", "kInt8DynamicTokenSym"))):  # fmt: skip
        out = tmp_path / fmt
        args = ["run", "--model", str(tmp_path / "bf16"), "--quantize-on-load", "--quantization", fmt, "--save"]
        assert main([*args, str(out), "--lowering", "eager", "--new-tokens", "2", "--prompt-length", "8",
                     "--rounds", "1"]) == 0  # fmt: skip
        assert qp.checkpoints.detect(str(out)).producer == "compressed-tensors"
        _, ran = run(qp.from_pretrained(out))
        assert len(ran) == 7 and set(ran.values()) == {keys}, ran
    capsys.readouterr()
