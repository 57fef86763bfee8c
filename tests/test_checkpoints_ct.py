"""compressed-tensors checkpoints (`quant_method: compressed-tensors`: llm-compressor's releases).

Written by the real `compressed-tensors` package as llm-compressor writes them: its preset scheme
applied to a tiny bf16 Llama (`apply_quantization_config`), the weight scales from its own
`calculate_qparams` over each weight's min/max (what llm-compressor's min-max observer feeds it),
`ModelCompressor.compress_model`, transformers' `save_pretrained` and the compressor's
`update_config`. The reference is transformers' own reader of the same directory, which
decompresses the weights on CPU.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import transformers

import quantpass as qp
from quantpass.checkpoints import shards
from quantpass.checkpoints.algos import _ct_matches
from quantpass.metrics import cosine
from quantpass.weight_cache import WEIGHTS

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStrategy,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam  # noqa: E402

VOCAB = 256
IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
FLOOR = {"FP8_DYNAMIC": 0.99, "FP8": 0.99, "FP8_BLOCK": 0.99, "W8A8": 0.99, "W4A16": 0.999, "W8A16_CHANNEL": 0.999, "MIXED": 0.99,
         "NVFP4": 0.97, "NVFP4A16": 0.999}  # fmt: skip


def tiny() -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=384, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=64, num_hidden_layers=1, vocab_size=VOCAB,
                                      max_position_embeddings=64, initializer_range=0.05)  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()


def _min_max(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    if args.strategy == QuantizationStrategy.TENSOR:
        return weight.amin().reshape(1), weight.amax().reshape(1)
    if args.strategy == QuantizationStrategy.CHANNEL:
        return weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    if args.strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP):
        groups = weight.unflatten(-1, (-1, args.group_size))
        return groups.amin(-1), groups.amax(-1)
    rows, cols = args.block_structure  # BLOCK
    blocks = weight.unflatten(0, (-1, rows)).unflatten(-1, (-1, cols))
    return blocks.amin((1, 3)), blocks.amax((1, 3))


# schemes no preset names: INT8 weights per channel without activations (the W8A16 preset's are in groups
# of 128), which compressed-tensors packs four to an int32 word (`pack-quantized`)
SCHEMES = {"W8A16_CHANNEL": {"weights": QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")}}


def write_ct(groups: dict, out, ignore=("lm_head",)) -> str:
    """A compressed-tensors checkpoint of `tiny()`: `groups` maps a preset scheme name (or one of
    SCHEMES) to its targets."""
    model = tiny()
    config_groups = {
        f"group_{i}": QuantizationScheme(targets=targets, **SCHEMES[name])
        if name in SCHEMES
        else preset_name_to_scheme(name, targets)
        for i, (name, targets) in enumerate(groups.items())
    }
    apply_quantization_config(model, QuantizationConfig(config_groups=config_groups, ignore=list(ignore)))
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        weight, top = module.weight.detach().float(), None
        if scheme.weights.strategy == QuantizationStrategy.TENSOR_GROUP:  # NVFP4: the global scale first
            top = generate_gparam(weight.amin(), weight.amax())
            module.weight_global_scale.data.copy_(top.reshape(module.weight_global_scale.shape))
        scale, _ = calculate_qparams(*_min_max(weight, scheme.weights), scheme.weights, global_scale=top)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "input_scale"):  # a static activation scale, as calibration would leave it
            module.input_scale.data.fill_(0.02)
        if hasattr(module, "input_global_scale"):  # NVFP4's: 448 * 6 / the inputs' calibrated amax
            module.input_global_scale.data.fill_(448 * 6 / 4.0)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    path = os.path.join(out, "ct")
    model.save_pretrained(path)
    compressor.update_config(path)
    return path


def run(model):
    backend = qp.backend(lowering="eager")
    torch._dynamo.reset()
    with torch.no_grad():
        return torch.compile(model, backend=backend)(IDS).logits.float(), backend.plan


CASES = {  # name -> ({preset scheme: targets}, ignore)
    "FP8_DYNAMIC": ({"FP8_DYNAMIC": ["Linear"]}, ("lm_head",)),
    "FP8": ({"FP8": ["Linear"]}, ("lm_head",)),  # static per-tensor activations: `input_scale`
    "FP8_BLOCK": ({"FP8_BLOCK": ["Linear"]}, ("lm_head",)),
    "W8A8": ({"W8A8": ["Linear"]}, ("lm_head",)),
    "W4A16": ({"W4A16": ["Linear"]}, ("lm_head",)),  # pack-quantized: eight nibbles per int32 word
    "W8A16_CHANNEL": ({"W8A16_CHANNEL": ["Linear"]}, ("lm_head",)),  # pack-quantized: four bytes per word
    "NVFP4": ({"NVFP4": ["Linear"]}, ("lm_head",)),  # nvfp4-pack-quantized: ModelOpt's NVFP4, inverse global scales
    "NVFP4A16": ({"NVFP4A16": ["Linear"]}, ("lm_head",)),
    # two groups by regex, a layer ignored by regex
    "MIXED": ({"FP8_DYNAMIC": ["re:.*self_attn.*"], "W8A8": ["re:.*mlp.*"]}, ("lm_head", "re:.*down_proj$")),
}
STATIC_KEYS = {
    "FP8": ("kFp8StaticTensorSym", "kFp8StaticTensorSym"),  # the calibrated input scale's formats
    "NVFP4": ("kNvfp4Static", "kNvfp4CalibratedGlobal"),
    "NVFP4A16": ("kNvfp4Static", "None"),
}
EXPECTED_FORMAT = {"FP8_DYNAMIC": "fp8_per_channel", "FP8_BLOCK": "fp8_per_block", "W8A8": "int8_per_channel",
                   "W4A16": "int4_weight_only", "W8A16_CHANNEL": "int8_weight_only"}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_compressed_tensors_checkpoint(case, tmp_path):
    groups, ignore = CASES[case]
    path = write_ct(groups, tmp_path, ignore)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    model = qp.from_pretrained(path)
    logits, plan = run(model)
    with torch.no_grad():
        expected = reference(IDS).logits.float()
    assert cosine(expected, logits) >= FLOOR[case], (case, cosine(expected, logits))

    # every linear the checkpoint stores quantized runs its format; nothing else is quantized
    entries = shards.index(path)
    stored = {name.removesuffix(".weight_scale") for name in entries if name.endswith(".weight_scale")}
    if case in (
        "W4A16",
        "W8A16_CHANNEL",
        "NVFP4",
        "NVFP4A16",
    ):  # no 16-bit copy of a packed weight: `weight_packed` is its data
        assert not any(name.endswith(".weight") and name.rsplit(".", 1)[0] in stored for name in entries)
    quantized = {row.fqn: row for row in plan.rows if row.quantized}
    assert set(quantized) == stored, plan
    if case == "MIXED":
        assert "model.layers.0.mlp.down_proj" not in stored
    for row in plan.rows:  # the ignored layers and lm_head say why they stay bf16
        assert row.quantized or row.reason.startswith("checkpoint: stored unquantized (a "), row
    for fqn, row in quantized.items():
        scheme = next(
            name for name, targets in groups.items() if any(t == "Linear" or re.match(t[3:], fqn) for t in targets)
        )
        if scheme in EXPECTED_FORMAT:
            assert row.format == EXPECTED_FORMAT[scheme], row
        if scheme in STATIC_KEYS:
            assert (str(row.weight), str(row.activation)) == STATIC_KEYS[scheme], row
        assert row.reason.startswith("checkpoint: compressed-tensors"), row
        weight = model.get_submodule(fqn).weight
        assert WEIGHTS.declared(weight) is not None and weight.untyped_storage().nbytes() == 0, fqn

    # the weights are the checkpoint's: dequantized, what transformers decompresses (bf16)
    twin, theirs = qp.checkpoints.dequantized(qp.from_pretrained(path)).state_dict(), reference.state_dict()
    assert set(twin) <= set(theirs)  # theirs keeps the scales beside the decompressed weights
    for name, value in twin.items():
        assert torch.allclose(value.float(), theirs[name].float(), rtol=2**-7, atol=0), name

    # written back in its own format, byte for byte, with its config; transformers reads it to the same logits
    qp.save_pretrained(model, tmp_path / "saved")
    saved = shards.index(str(tmp_path / "saved"))
    assert set(saved) == set(entries)
    for name, entry in entries.items():
        a, b = shards.read(entry), shards.read(saved[name])
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    with open(os.path.join(path, "config.json")) as f, open(tmp_path / "saved" / "config.json") as g:
        assert json.load(f)["quantization_config"] == json.load(g)["quantization_config"]
    with torch.no_grad():
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()(IDS).logits.float()
    assert torch.equal(again, expected)


@pytest.mark.parametrize(
    "scheme, message",
    [
        ("W4A16_ASYM", r"weights: asymmetric \(zero points\) is not supported; quantpass reads symmetric: 8-bit float"),
        ("W8A16", r"weights: 8-bit int group 128 static is not supported"),
    ],
)
def test_formats_without_a_layout_here_are_refused_naming_them(scheme, message, tmp_path):
    path = write_ct({scheme: ["Linear"]}, tmp_path)
    with pytest.raises(ValueError, match=message):
        qp.from_pretrained(path)


@pytest.mark.parametrize(
    "fmt, weights, message",
    [
        ("mxfp4-pack-quantized", {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32},
         "format 'mxfp4-pack-quantized' is not supported; quantpass reads: float-quantized, int-quantized, "
         "naive-quantized, pack-quantized, nvfp4-pack-quantized"),
        ("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "actorder": "group"},
         r"weights: actorder 'group' \(GPTQ's permuted groups, `weight_g_idx`\) is not supported"),
        ("pack-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"},
         "kFp8StaticChannelSym weights in format 'pack-quantized'; quantpass reads packed: 'pack-quantized': "
         "kInt4StaticGroup128Sym, kInt8StaticChannelSym; 'nvfp4-pack-quantized': kNvfp4Static"),
    ],
)  # fmt: skip
def test_arguments_without_a_key_are_refused_naming_them(fmt, weights, message, tmp_path):
    group = {"targets": ["Linear"], "format": fmt, "weights": weights}
    config = {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"group_0": group}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config_groups\['group_0'\]: |config_groups\['group_0'\] weights: "):
        qp.checkpoints.detect(str(tmp_path))
    with pytest.raises(ValueError, match=message):
        qp.checkpoints.detect(str(tmp_path))


def test_describe_lists_each_group(tmp_path):
    path = write_ct(CASES["MIXED"][0], tmp_path, CASES["MIXED"][1])
    assert qp.checkpoints.describe(path) == [
        f"{path}: compressed-tensors checkpoint, quant_algo MIXED_PRECISION",
        "  compressed-tensors float-quantized fp8_per_channel: weight kFp8StaticChannelSym, activation "
        "kFp8DynamicTokenSym",
        "  compressed-tensors int-quantized int8_per_channel: weight kInt8StaticChannelSym, activation "
        "kInt8DynamicTokenSym",
        "  left unquantized: model.layers.0.mlp.down_proj, lm_head",  # compressed-tensors writes the names it matched
    ]


def test_targets_and_ignore_match_as_compressed_tensors_matches_them():
    assert _ct_matches("Linear", "model.layers.0.mlp.up_proj")
    assert _ct_matches("re:.*mlp.gate$", "model.layers.3.mlp.gate")
    assert not _ct_matches("re:.*mlp.gate$", "model.layers.3.mlp.gate_proj")
    assert _ct_matches("lm_head", "lm_head") and not _ct_matches("lm_head", "model.lm_head_norm")
