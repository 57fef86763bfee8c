"""transformers' fine-grained FP8 checkpoints (`quant_method: fp8`: DeepSeek-V3/R1, Qwen3 FP8 releases).

The checkpoints are written the way such a release is: transformers' own `save_pretrained` of a tiny
bf16 model (per-expert names, Mixtral's legacy ones), then each decoder linear's weight quantized by
transformers' own `Fp8Quantize` (128x128 blocks, `weight_scale_inv`), the config's
`quantization_config` from transformers' `FineGrainedFP8Config`. The reference is transformers'
own reader of the same directory: on a machine without a GPU it loads an FP8 checkpoint dequantized
to bf16. DeepSeek's releases also quantize weights whose sides are not multiples of 128 (partial
last blocks), which transformers' quantizer leaves in bf16 and its CPU reader refuses; that
checkpoint is written by the plain-torch block quantizer below and checked against its plain-torch
dequantization loaded by transformers as a bf16 model.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.integrations.finegrained_fp8 import Fp8Quantize
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
from transformers.utils.quantization_config import FineGrainedFP8Config

import quantpass as qp
from quantpass.checkpoints import shards
from quantpass.checkpoints.algos import HF_FP8, _skipped
from quantpass.metrics import cosine
from quantpass.weight_cache import WEIGHTS

VOCAB = 256
IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
FLOOR = 0.99  # W8A8 (FP8 weights, FP8 activations per 1x128 group) against the dequantized weights
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def tiny(kind: str) -> transformers.PreTrainedModel:
    common = dict(num_hidden_layers=1, vocab_size=VOCAB, max_position_embeddings=64, initializer_range=0.05)
    if kind == "llama":  # every side a multiple of 128
        config = transformers.LlamaConfig(hidden_size=256, intermediate_size=384, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=64, **common)  # fmt: skip
    elif kind == "llama_partial":  # 128x128 blocks with partial last blocks
        config = transformers.LlamaConfig(hidden_size=160, intermediate_size=224, num_attention_heads=5,
                                          num_key_value_heads=1, head_dim=32, **common)  # fmt: skip
    elif kind == "mixtral":  # stored under Mixtral's legacy names (block_sparse_moe, w1/w3/w2)
        config = transformers.MixtralConfig(hidden_size=128, intermediate_size=128, num_attention_heads=4,
                                            num_key_value_heads=1, head_dim=32, num_local_experts=4,
                                            num_experts_per_tok=2, **common)  # fmt: skip
    else:
        config = transformers.Qwen3MoeConfig(hidden_size=256, intermediate_size=384, moe_intermediate_size=128,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4,
                                             num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                                             norm_topk_prob=True, **common)  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()


def block_quantize(weight: torch.Tensor) -> dict:
    """DeepSeek's recipe in plain torch: e4m3 per 128x128 block (ceil blocks), `scale_inv` = amax / 448."""
    rows, cols = weight.shape
    padded = torch.zeros(-(-rows // 128) * 128, -(-cols // 128) * 128)
    padded[:rows, :cols] = weight.float()
    blocks = padded.unflatten(0, (-1, 128)).unflatten(-1, (-1, 128))  # [Nb, 128, Kb, 128]
    scale_inv = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    data = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": data.flatten(2).flatten(0, 1)[:rows, :cols].contiguous(), "weight_scale_inv": scale_inv}


def block_dequantize(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    rows, cols = data.shape
    scale = scale_inv.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    return data.float() * scale


def write_fp8(kind: str, out, scale_fmt: str = "float", skip: tuple[str, ...] = ()) -> str:
    """`kind` saved by transformers, its decoder linears quantized by transformers' Fp8Quantize (by
    `block_quantize` for `llama_partial`), routers and the `skip` modules left in bf16."""
    bf16 = os.path.join(out, "bf16")
    tiny(kind).save_pretrained(bf16)
    quant = FineGrainedFP8Config(scale_fmt=scale_fmt, modules_to_not_convert=["lm_head", *skip] if skip else None)
    transformers_quantize = Fp8Quantize(FineGrainedFP8HfQuantizer(quant))._quantize_one
    tensors = {}
    for name, value in load_file(os.path.join(bf16, "model.safetensors")).items():
        module = name.removesuffix(".weight")
        router = module.endswith((".gate", ".router"))
        if not name.endswith(".weight") or value.dim() != 2 or ".layers." not in name or router or module in skip:
            tensors[name] = value
        elif kind == "llama_partial":
            tensors.update({f"{module}.{k}": v for k, v in block_quantize(value).items()})
        else:
            tensors.update(transformers_quantize(name, value))
    path = os.path.join(out, "fp8")
    os.makedirs(path)
    save_file(tensors, os.path.join(path, "model.safetensors"), {"format": "pt"})
    with open(os.path.join(bf16, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {**quant.to_dict(), "quant_method": "fp8"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


def transformers_reference(path: str, tmp_path) -> transformers.PreTrainedModel:
    """transformers' own reader (dequantizing to bf16 without a GPU); for partial blocks, which it
    refuses, the plain-torch dequantization of every quantized weight loaded as a bf16 checkpoint."""
    entries = shards.index(path)
    if not any(e.shape[-1] % 128 for e in entries.values() if e.dtype == torch.float8_e4m3fn):
        return transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    dense = {}
    for name, entry in entries.items():
        if name.endswith("_scale_inv"):
            continue
        scale = entries.get(f"{name}_scale_inv")
        dense[name] = shards.read(entry) if scale is None else block_dequantize(shards.read(entry), shards.read(scale))
    directory = tmp_path / "dequantized"
    directory.mkdir()
    save_file({k: v.to(torch.bfloat16) for k, v in dense.items()}, str(directory / "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config")
    (directory / "config.json").write_text(json.dumps(config))
    return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()


def run(model):
    backend = qp.backend(lowering="eager")
    torch._dynamo.reset()
    with torch.no_grad():
        return torch.compile(model, backend=backend)(IDS).logits.float(), backend.plan


def assert_same_tensors(a, b) -> None:
    left, right = shards.index(str(a)), shards.index(str(b))
    assert set(left) == set(right), set(left) ^ set(right)
    for name in left:
        x, y = shards.read(left[name]), shards.read(right[name])
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name


CASES = {  # name -> (model, scale_fmt, modules the checkpoint leaves in bf16)
    "llama": ("llama", "float", ()),
    "llama_ue8m0": ("llama", "ue8m0", ()),
    "llama_partial": ("llama_partial", "float", ("model.layers.0.self_attn.o_proj",)),
    "qwen3_moe": ("qwen3_moe", "float", ()),
    "mixtral": ("mixtral", "float", ()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fine_grained_fp8_checkpoint(case, tmp_path):
    kind, scale_fmt, skip = CASES[case]
    path = write_fp8(kind, tmp_path, scale_fmt, skip)
    reference = transformers_reference(path, tmp_path)
    model = qp.from_pretrained(path)
    logits, plan = run(model)
    with torch.no_grad():
        expected = reference(IDS).logits.float()
    assert cosine(expected, logits) >= FLOOR, (case, cosine(expected, logits))

    # the layers the checkpoint stores in FP8 run as fp8_per_block W8A8, holding no full-precision copy;
    # the routers, lm_head and `skip` stay bf16
    stored = {name.removesuffix(".weight_scale_inv") for name in shards.index(path) if name.endswith("_scale_inv")}
    expected_layers = {fqn for fqn, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    expected_layers = {
        fqn for fqn in expected_layers if fqn.replace(".mlp.", ".block_sparse_moe.") in stored or fqn in stored
    }
    if kind in ("qwen3_moe", "mixtral"):
        expected_layers.add("model.layers.0.mlp.experts")
    quantized = {row.fqn for row in plan.rows if row.quantized}
    assert quantized == expected_layers, plan
    algo = HF_FP8[scale_fmt].name
    for row in plan.rows:
        if row.quantized:
            assert row.reason.startswith(f"checkpoint: {algo}"), row
            assert (str(row.weight), str(row.activation)) == ("kFp8Static128BlockSym", "kFp8Dynamic128Sym"), row
        else:  # why it stays bf16
            assert row.reason == f"checkpoint: stored unquantized (a {algo} checkpoint)", row
    for fqn in quantized:
        module = model.get_submodule(fqn)
        for param in (module.gate_up_proj, module.down_proj) if fqn.endswith("experts") else (module.weight,):
            assert WEIGHTS.declared(param) is not None and param.untyped_storage().nbytes() == 0, fqn

    # the weights are the checkpoint's: dequantized, transformers' own values (bf16, bit for bit)
    twin = qp.checkpoints.dequantized(qp.from_pretrained(path))
    ours, theirs = twin.state_dict(), reference.state_dict()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name

    # saved back in the same format, byte for byte, and transformers reads what quantpass wrote
    qp.save_pretrained(model, tmp_path / "saved")
    assert_same_tensors(path, tmp_path / "saved")
    assert qp.checkpoints.detect(str(tmp_path / "saved")) == qp.checkpoints.detect(path)
    if kind != "llama_partial":
        with torch.no_grad():
            again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()(IDS).logits.float()
        assert torch.equal(again, expected)


def test_describe_names_the_format_and_what_stays_unquantized(tmp_path):
    path = write_fp8("llama_partial", tmp_path, skip=("model.layers.0.self_attn.o_proj",))
    assert qp.checkpoints.describe(path) == [
        f"{path}: transformers checkpoint, quant_algo FP8_BLOCK",
        "  FP8_BLOCK: weight kFp8Static128BlockSym, activation kFp8Dynamic128Sym",
        "  left unquantized: lm_head, model.layers.0.self_attn.o_proj",
    ]


@pytest.mark.parametrize(
    "setting, value, valid",
    [
        ("weight_block_size", [64, 64], "[128, 128]"),
        ("activation_scheme", "static", "dynamic"),
        ("scale_fmt", "e4m3", "float, ue8m0"),
        ("expert_dtype", "fp4", "fp8"),
    ],
)
def test_settings_without_a_kernel_layout_are_refused_naming_them(setting, value, valid, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8", setting: value}}))
    message = f"fp8 {setting} {value!r} is not supported; quantpass reads: {valid}"
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        qp.checkpoints.detect(str(tmp_path))


def test_modules_to_not_convert_match_as_transformers_matches_them():
    assert _skipped("lm_head", "lm_head")
    assert _skipped("model.layers.1", "model.layers.1.mlp.down_proj")
    assert not _skipped("model.layers.1", "model.layers.11.mlp.down_proj")
    assert _skipped(r"model.layers.*.mlp.gate", "model.layers.3.mlp.gate")
    assert not _skipped(r"model.layers.*.mlp.gate", "model.layers.3.mlp.gate_proj")
    assert _skipped("down_proj", "model.layers.3.mlp.down_proj")  # a suffix
