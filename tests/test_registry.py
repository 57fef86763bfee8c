"""QuantKey, names, QuantSpec and QuantizationConfig: parsing, merging, resolution, errors."""

import json

import pytest
import torch

from quantpass.quant_registry import QuantizationConfig, QuantSpec, keys, parse_cli, quant_key
from quantpass.quant_registry.keys import GroupShape, QuantKey, ScaleDesc, key_name
from quantpass.quant_registry.spec import DEFAULT_ACTIVATION, ROLE_NAMES, SHORTHANDS

# -- keys ---------------------------------------------------------------------------------------


def test_keys_hash_equal_and_str():
    rebuilt = QuantKey(torch.float8_e4m3fn, ScaleDesc(torch.float32, True, GroupShape(1, -1)))
    assert rebuilt == keys.kFp8StaticChannelSym
    assert hash(rebuilt) == hash(keys.kFp8StaticChannelSym)
    assert {rebuilt: 1}[keys.kFp8StaticChannelSym] == 1
    assert str(rebuilt) == "kFp8StaticChannelSym" == key_name(rebuilt)
    assert keys.kFp8StaticChannelSym != keys.kFp8DynamicTokenSym
    assert len(set(keys.KEYS.values())) == len(keys.KEYS)  # every constant is a distinct key


def test_unregistered_key_str_is_structural_and_never_fails():
    odd = QuantKey(torch.float8_e5m2, ScaleDesc(torch.float32, False, GroupShape(1, 64)), symmetric=False)
    assert str(odd) == "QuantKey(float8_e5m2, scale=float32 dynamic 1x64, asym)"
    broken = QuantKey("not a dtype", None)  # built wrong by hand: printing must still work
    assert "QuantKey" in str(broken)


def test_nvfp4_has_a_second_level_scale():
    assert keys.kNvfp4Static.scale2 == ScaleDesc(torch.float32, True, GroupShape(-1, -1))
    assert keys.kNvfp4Static.scale.dtype == torch.float8_e4m3fn
    assert keys.kNvfp4Static.group_shape == GroupShape(1, 16)


def test_group_shape_convention():
    assert keys.kFp8StaticChannelSym.group_shape == keys.kFp8DynamicTokenSym.group_shape == GroupShape(1, -1)
    assert keys.kFp8Static128BlockSym.group_shape == GroupShape(128, 128)
    assert keys.kFp8Dynamic128Sym.group_shape == GroupShape(1, 128)
    assert all(k.static for n, k in keys.KEYS.items() if "Static" in n)
    assert not any(k.static for n, k in keys.KEYS.items() if "Dynamic" in n)


# -- names --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ROLE_NAMES))
def test_every_name_resolves_in_both_roles(name):
    weight, activation = ROLE_NAMES[name]
    assert quant_key(name, "weight") == weight and weight.static
    if activation is None:
        with pytest.raises(ValueError, match="invalid activation quantization 'int4_per_group'"):
            quant_key(name, "activation")
    else:
        assert quant_key(name, "activation") == activation and not activation.static


def test_role_aware_names():
    assert quant_key("mxfp8", role="weight") == keys.kMxfp8Static
    assert quant_key("mxfp8", role="activation") == keys.kMxfp8Dynamic
    assert quant_key("kMxfp8Dynamic", role="activation") == keys.kMxfp8Dynamic


def test_unknown_name_lists_sorted_valid_choices():
    with pytest.raises(ValueError) as err:
        quant_key("fp7", "weight")
    message = str(err.value)
    assert "'fp7'" in message and "weight" in message
    listed = message.split("valid: ")[1].split(", ")
    assert listed == sorted(listed) and "mxfp8" in listed
    with pytest.raises(ValueError, match="invalid role 'bias'"):
        quant_key("mxfp8", "bias")


def test_wrong_role_for_constant_name():
    with pytest.raises(ValueError, match="must have dynamic scales"):
        quant_key("kMxfp8Static", "activation")
    with pytest.raises(ValueError, match="must have static scales"):
        QuantSpec(weight=keys.kFp8DynamicTokenSym)


# -- QuantSpec ----------------------------------------------------------------------------------


def test_unset_vs_explicit_none_activation():
    unset = QuantSpec(weight="fp8_per_channel")
    explicit = QuantSpec(weight="fp8_per_channel", activation=None)
    assert unset.fields_set == {"weight"} and explicit.fields_set == {"weight", "activation"}
    assert unset.activation == keys.kFp8DynamicTokenSym  # the format's default
    assert explicit.activation is None
    assert unset != explicit


def test_strings_coerced_to_keys():
    spec = QuantSpec(weight="mxfp4", activation="mxfp8")
    assert spec.pair == (keys.kMxfp4Static, keys.kMxfp8Dynamic)
    assert QuantSpec(keys.kMxfp4Static, keys.kMxfp8Dynamic) == spec


@pytest.mark.parametrize("shorthand", sorted(SHORTHANDS))
def test_every_shorthand_expands_to_both_keys(shorthand):
    spec = QuantizationConfig(linear=shorthand).linear
    assert spec.pair == SHORTHANDS[shorthand]
    assert spec.fields_set == {"weight", "activation"}
    assert spec.name() == shorthand or SHORTHANDS[spec.name()] == SHORTHANDS[shorthand]


def test_weight_only_and_w4a16_shorthands():
    assert QuantSpec.from_name("mxfp4").pair == (keys.kMxfp4Static, None)
    assert QuantSpec.from_name("int4_weight_only").pair == (keys.kInt4StaticGroup128Sym, None)
    assert QuantSpec.from_name("nvfp4").pair == (keys.kNvfp4Static, keys.kNvfp4Dynamic)


def test_bare_key_name_is_a_weight_key_with_default_activation():
    spec = QuantizationConfig(linear="fp8_per_token").linear
    assert spec.fields_set == {"weight"}
    assert spec.pair == (keys.kFp8StaticChannelSym, DEFAULT_ACTIVATION[keys.kFp8StaticChannelSym])
    assert QuantizationConfig(linear="kInt4StaticGroup128Sym").linear.activation is None


def test_spec_dict_and_errors():
    spec = QuantSpec.coerce({"weight": "mxfp4", "activation": "none"})
    assert spec.pair == (keys.kMxfp4Static, None) and "activation" in spec.fields_set
    with pytest.raises(ValueError, match="invalid moe field 'act'; valid: activation, weight"):
        QuantizationConfig(moe={"act": "mxfp8"})
    with pytest.raises(ValueError, match="invalid quantization 'fp9'"):
        QuantizationConfig(linear="fp9")


def test_spec_merge_only_set_fields_win():
    base = QuantSpec.from_name("mxfp4")  # activation explicitly None
    merged = base.merged_with(QuantSpec(activation="mxfp8"))
    assert merged.pair == (keys.kMxfp4Static, keys.kMxfp8Dynamic)
    assert base.merged_with(QuantSpec()) == base


# -- QuantizationConfig -------------------------------------------------------------------------


def test_config_merge_field_by_field():
    base = QuantizationConfig(linear="fp8_per_block", moe="mxfp8", ignore=["lm_head"])
    override = QuantizationConfig(moe={"activation": None}, backend="triton")
    merged = base.merged_with(override)
    assert merged.linear == base.linear
    assert merged.moe.pair == (keys.kMxfp8Static, None)
    assert merged.ignore == ("lm_head",)
    assert merged.backend == {"linear": "triton", "moe": "triton"}


def test_resolve_ignore_wins_then_targets_then_kind():
    cfg = QuantizationConfig(
        linear="fp8_per_block",
        moe="mxfp8",
        targets={"re:.*shared_expert.*": "fp8_per_channel", "model.layers.0.mlp.experts": "mxfp4"},
        ignore=["lm_head", "*.gate", "re:.*shared_expert.down_proj"],
    )
    assert cfg.resolve("lm_head", "linear") is None
    assert cfg.resolve("model.layers.3.mlp.gate", "linear") is None
    assert cfg.resolve("model.layers.3.mlp.shared_expert.down_proj", "linear") is None  # ignore beats target
    assert cfg.resolve("model.layers.3.mlp.shared_expert.up_proj", "linear").name() == "fp8_per_channel"
    assert cfg.resolve("model.layers.0.mlp.experts", "moe").name() == "mxfp4"
    assert cfg.resolve("model.layers.1.mlp.experts", "moe").name() == "mxfp8"
    assert cfg.resolve("model.layers.1.self_attn.q_proj", "linear").name() == "fp8_per_block"
    spec, reason = cfg.resolve_with_reason("model.lm_head", "linear")  # a plain name matches a dotted suffix
    assert spec is None and reason == "ignored by 'lm_head'"


def test_conflicting_targets_name_both_patterns():
    cfg = QuantizationConfig(linear="fp8_per_block", targets={"*.q_proj": "int8_per_channel", "re:.*attn.*": "mxfp8"})
    with pytest.raises(ValueError, match=r"matches targets '\*\.q_proj' and 're:\.\*attn\.\*'"):
        cfg.resolve("model.layers.0.self_attn.q_proj", "linear")
    same = QuantizationConfig(targets={"*.q_proj": "mxfp8", "re:.*attn.*": {"weight": "mxfp8"}})
    assert same.resolve("model.layers.0.self_attn.q_proj", "linear").name() == "mxfp8"  # same pair: no conflict


def test_config_errors_name_value_field_and_choices():
    with pytest.raises(ValueError, match="invalid backend for linear 'cuda'; valid: auto, cpu, flashinfer, native"):
        QuantizationConfig(backend="cuda")
    with pytest.raises(ValueError, match="invalid backend kind 'attention'; valid: linear, moe"):
        QuantizationConfig(backend={"attention": "triton"})
    with pytest.raises(ValueError, match="invalid quantization config field 'lineer'; valid: backend, ignore"):
        QuantizationConfig.from_dict({"lineer": "mxfp8"})
    with pytest.raises(ValueError, match="invalid ignore pattern 're:\\(': "):
        QuantizationConfig(ignore=["re:("])
    with pytest.raises(ValueError, match="sets activation kMxfp8Dynamic but no weight format"):
        QuantizationConfig(moe={"activation": "mxfp8"}).resolve("experts", "moe")


def test_json_round_trip(tmp_path):
    cfg = QuantizationConfig(
        linear="fp8_per_block",
        moe={"weight": "mxfp4", "activation": "mxfp8"},
        targets={"re:.*shared_expert.*": "fp8_per_channel", "*.o_proj": None},
        ignore=["lm_head", "*.gate"],
        backend={"moe": "triton"},
    )
    text = cfg.to_json()
    assert QuantizationConfig.from_json(text) == cfg
    path = tmp_path / "q.json"
    path.write_text(text)
    again = QuantizationConfig.from_json(path)
    assert again == cfg and again.resolve("layers.0.o_proj", "linear") is None
    assert json.loads(text)["moe"] == {"weight": "kMxfp4Static", "activation": "kMxfp8Dynamic"}


def test_dotted_cli_flags():
    argv = [
        "--quantization",
        "fp8_per_block",
        "--quantization-config.moe.activation",
        "mxfp8",
        "--quantization-config.ignore",
        "lm_head",
        "--quantization-config.ignore=*.gate,*.router",
        "--quantization-config.targets.re:.*shared.*",
        "int8_per_channel",
        "--quantization-config.backend.moe",
        "triton",
        "--model",
        "tiny-moe",
    ]
    cfg, rest = parse_cli(argv)
    assert rest == ["--model", "tiny-moe"]
    assert cfg.linear.name() == "fp8_per_block"
    assert cfg.moe.pair == (keys.kFp8Static128BlockSym, keys.kMxfp8Dynamic)
    assert cfg.ignore == ("lm_head", "*.gate", "*.router")
    assert cfg.resolve("layers.0.shared_mlp", "linear").name() == "int8_per_channel"
    assert cfg.backend == {"moe": "triton"}
    json_flag = QuantizationConfig.from_cli(["--quantization-config", '{"linear": "mxfp8"}'])
    assert json_flag.linear.name() == "mxfp8" and json_flag.moe is None


def test_cli_errors():
    with pytest.raises(ValueError, match="invalid flag '--quantization-config.lineer'"):
        QuantizationConfig.from_cli(["--quantization-config.lineer", "mxfp8"])
    with pytest.raises(ValueError, match="flag --quantization needs a value"):
        QuantizationConfig.from_cli(["--quantization"])
    with pytest.raises(ValueError, match="unknown flag '--model'"):
        QuantizationConfig.from_cli(["--model", "x"])
    with pytest.raises(ValueError, match="invalid flag '--quantization-config.moe.scale'"):
        QuantizationConfig.from_cli(["--quantization-config.moe.scale", "x"])
