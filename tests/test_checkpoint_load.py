"""Loading without full precision (issues #12, #13): gpt-oss MXFP4, quantize-on-load, export.

- a gpt-oss-style MXFP4 checkpoint (`*_blocks` / `*_scales`, `quant_method: mxfp4`) built here
  from a tiny GptOss model by an MXFP4 encoder written from the OCP MX description, checked
  against transformers' own MXFP4 dequantizer, with the activation override to MXFP8;
- quantize-on-load of a bf16 checkpoint gives the same outputs as load-then-quantize (dense and
  MoE), computed in chunks bit for bit, and its peak memory (a fresh process) stays within the
  quantized model plus the largest layer;
- an online-quantized model exported with save_pretrained loads back to the same outputs.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import fresh_process
import pytest
import torch
import transformers
from test_checkpoints import run as compile_and_run
from tiny_models import tiny_llama, token_ids
from tiny_moe_models import tiny_moe

import quantpass as qp
from quantpass.checkpoints import load, shards
from quantpass.metrics import cosine
from quantpass.quant_registry import keys
from quantpass.weight_cache import WEIGHTS

IDS = token_ids(length=9)


def run(model, **options):
    return compile_and_run(model, IDS, **options)


# ---------------------------------------------------------------------------- gpt-oss MXFP4
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])


def encode_mxfp4(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> blocks [..., N, K/32, 16] uint8 (low nibble first), scales [..., N, K/32] e8m0:
    shared exponent floor(log2(amax)) - 2 (e2m1's largest exponent), elements rounded to nearest."""
    groups = matrix.float().unflatten(-1, (-1, 32))
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=2**-126)
    exponent = torch.floor(torch.log2(amax)) - 2
    scaled = (groups / torch.exp2(exponent)).clamp(-6, 6)
    magnitude = (scaled.abs().unsqueeze(-1) - E2M1).abs().argmin(-1)
    codes = (magnitude | ((scaled < 0) & (magnitude > 0)).to(torch.long) << 3).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent.squeeze(-1) + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def gpt_oss_checkpoint(tmp_path_factory):
    model = tiny_moe("gpt_oss", "grouped_mm")
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    tensors = {}
    for name, value in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # stored [E, K, N]
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = encode_mxfp4(value.transpose(-2, -1))
        else:
            tensors[name] = value
    shards.write(str(path / "model.safetensors"), tensors, {"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_gpt_oss_mxfp4_checkpoint(gpt_oss_checkpoint, tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    reference = tiny_moe("gpt_oss", "grouped_mm")
    entries = shards.index(str(gpt_oss_checkpoint))
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if f"{name}_blocks" in entries:  # transformers' own dequantizer: [E, K, N] as its parameters
                blocks, scales = shards.read(entries[f"{name}_blocks"]), shards.read(entries[f"{name}_scales"])
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
        expected = reference(IDS).logits.float()

    model = qp.from_pretrained(gpt_oss_checkpoint)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # its config names no dtype: the stored one
    logits, plan = run(model)
    moe = [row for row in plan.rows if row.kind == "moe"]
    assert len(moe) == 2 and all(row.quantized and row.reason.startswith("checkpoint: MXFP4") for row in moe), plan
    assert {(row.weight, row.activation) for row in moe} == {("kMxfp4Static", None)}
    assert not any(row.quantized for row in plan.rows if row.kind == "linear"), plan  # not converted
    assert cosine(expected, logits) >= 0.999
    for fqn in ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts"):
        for param in (model.get_submodule(fqn).gate_up_proj, model.get_submodule(fqn).down_proj):
            assert param.untyped_storage().nbytes() == 0 and WEIGHTS.declared(param)[1] == "checkpoint: MXFP4"

    # the activation override (gpt-oss run with MXFP8 activations), and a weight conflict
    mxfp8, plan = run(model, moe={"activation": "mxfp8"})
    assert {(row.weight, row.activation) for row in plan.rows if row.kind == "moe"} == {
        ("kMxfp4Static", "kMxfp8Dynamic")
    }
    assert cosine(expected, mxfp8) >= 0.99
    with pytest.raises(Exception, match="checkpoint: MXFP4 weights are kMxfp4Static; config.moe asks for"):
        run(model, moe="int8_weight_only")

    qp.save_pretrained(model, tmp_path / "saved")
    saved = shards.index(str(tmp_path / "saved"))
    assert set(saved) == set(entries)
    for name, entry in entries.items():
        assert torch.equal(shards.read(entry).view(torch.uint8), shards.read(saved[name]).view(torch.uint8)), name
    with open(tmp_path / "saved" / "config.json") as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "mxfp4"


# ---------------------------------------------------------------------------- quantize on load
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "fmt", ["int8_weight_only", pytest.param("nvfp4", marks=SLOW), pytest.param("fp8_per_tensor", marks=SLOW)]
)
def test_quantize_on_load_matches_load_then_quantize(fmt, tmp_path):
    tiny_llama(dtype=torch.bfloat16).save_pretrained(tmp_path)
    on_load = qp.from_pretrained(tmp_path, linear=fmt)
    logits, plan = run(on_load)  # no options: the formats declared on load
    quantized = [row for row in plan.rows if row.quantized]
    assert len(quantized) == 14 and all(row.reason.startswith(f"quantized on load: {fmt}") for row in quantized)
    assert all(on_load.get_submodule(row.fqn).weight.untyped_storage().nbytes() == 0 for row in quantized)
    assert on_load.lm_head.weight.untyped_storage().nbytes() > 0  # the output head stays, as in the pass
    after = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    expected, _ = run(after, linear=fmt)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])  # Mixtral: transformers saves legacy names
def test_quantize_on_load_moe_experts(arch, tmp_path):
    tiny_moe(arch, "grouped_mm").save_pretrained(tmp_path)  # experts stored one tensor each
    on_load = qp.from_pretrained(tmp_path, moe="int8_weight_only")
    logits, plan = run(on_load)
    assert [row.fqn for row in plan.rows if row.quantized] == [
        "model.layers.0.mlp.experts",
        "model.layers.1.mlp.experts",
    ]
    after = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16, experts_implementation="grouped_mm"
    ).eval()
    expected, _ = run(after, moe="int8_weight_only")
    assert torch.equal(logits, expected)


@pytest.mark.parametrize(("stored", "asked"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_loads_in_the_dtype_asked_for(stored, asked, tmp_path):
    """A checkpoint stored in another dtype than the one asked for (an fp32 save loaded as bf16, as
    `quantpass run --quantize-on-load` does by default, and the reverse): every full-precision tensor
    comes in the model's dtype, as transformers loads it (norms and embeddings in another dtype made
    the first matmul raise), and quantize-on-load equals load-then-quantize."""
    tiny_llama(dtype=stored).save_pretrained(tmp_path)
    on_load = qp.from_pretrained(tmp_path, dtype=asked, linear="int8_weight_only")
    assert {p.dtype for p in on_load.parameters()} == {asked}
    logits, plan = run(on_load)
    assert sum(row.quantized for row in plan.rows) == 14
    after = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=asked).eval()
    expected, _ = run(after, linear="int8_weight_only")
    assert torch.equal(logits, expected)


@pytest.mark.parametrize(
    ("name", "stored", "message"),
    [
        ("model.norm.weight", torch.ones(63), r"model.norm.weight: stored shape \(63,\), the model expects \(64,\)"),
        ("model.embed_tokens.weight", torch.ones(120, 64), r"stored shape \(120, 64\), the model expects \(128, 64\)"),
        ("model.norm.weight", torch.ones(64, dtype=torch.uint8), "model.norm.weight is stored as torch.uint8"),
    ],
)
def test_a_stored_tensor_unlike_the_model_names_itself(name, stored, message, tmp_path):
    """A full-precision tensor whose shape or dtype is not the model's raises at load, naming it (it
    loaded, then failed in tracing, or an embedding short of the vocabulary on the first token past it)."""
    tiny_llama(dtype=torch.bfloat16).save_pretrained(tmp_path)
    entries = shards.index(str(tmp_path))
    tensors = {n: shards.read(e) for n, e in entries.items()}
    shards.write(str(tmp_path / "model.safetensors"), {**tensors, name: stored}, {"format": "pt"})
    with pytest.raises(ValueError, match=message):
        qp.from_pretrained(tmp_path)


def test_quantized_bytes_in_another_dtype_name_themselves(tmp_path):
    """An FP8 weight's bytes stored as int8 loaded as garbage and verify blamed the kernel (0.2 dB)."""
    model = tiny_llama(dtype=torch.bfloat16)
    run(model, linear="fp8_per_channel")
    qp.save_pretrained(model, tmp_path)
    tensors = {n: shards.read(e) for n, e in shards.index(str(tmp_path)).items()}
    name = "model.layers.0.mlp.down_proj.weight"
    shards.write(str(tmp_path / "model.safetensors"), {**tensors, name: tensors[name].view(torch.int8)}, {})
    with pytest.raises(ValueError, match=f"{name}: FP8_PER_CHANNEL_PER_TOKEN data is stored as torch.int8"):
        qp.from_pretrained(tmp_path)


def test_broken_checkpoint_directories_say_what_is_wrong(tmp_path):
    """Each named the problem only indirectly: a JSON or struct error with no file, a missing shard as
    a layer's missing scale, a bare KeyError, transformers' "Repo id must be in the form ..."."""
    tiny_llama(dtype=torch.bfloat16).save_pretrained(tmp_path / "ok")
    with pytest.raises(FileNotFoundError, match="'.*no-such-dir' is not a checkpoint directory"):
        qp.from_pretrained(tmp_path / "no-such-dir")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty/model.safetensors: not a readable safetensors file"):
        shards.index(str(tmp_path / "empty"))
    index = {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "ok" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"lists shard\(s\) not there: \['model-00002-of-00002"):
        qp.from_pretrained(tmp_path / "ok")
    quantization = {"quant_algo": "MIXED_PRECISION", "quantized_layers": {"lm_head": {"group_size": 16}}}
    with pytest.raises(ValueError, match="quantized_layers entry 'lm_head' has no quant_algo"):
        qp.checkpoints.algos.parse_quantization(quantization, "modelopt", "hf_quant_config.json")


def test_saving_says_when_the_checkpoint_changes_the_activations(tmp_path, caplog):
    """NVFP4 quantized on load runs W4A4 (dynamic NVFP4 activations); ModelOpt's only NVFP4 algo without a
    calibrated input scale is W4A16_NVFP4, which loads back weight-only: saving says so, and how to keep
    them. MXFP8's algo stores its activations: nothing to say."""
    tiny_llama(dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    with caplog.at_level(logging.WARNING, logger="quantpass"):
        qp.save_pretrained(qp.from_pretrained(tmp_path / "bf16", linear="mxfp8"), tmp_path / "mxfp8")
        assert not [r for r in caplog.records if "activations" in r.getMessage()]
        qp.save_pretrained(qp.from_pretrained(tmp_path / "bf16", linear="nvfp4"), tmp_path / "nvfp4")
    (message,) = [r.getMessage() for r in caplog.records if "activations" in r.getMessage()]
    assert "14 layer(s)" in message and "written as W4A16_NVFP4, which declares unquantized activations" in message
    _, plan = run(qp.from_pretrained(tmp_path / "nvfp4", linear={"activation": "kNvfp4Dynamic"}))
    assert {row.activation for row in plan.rows if row.quantized} == {"kNvfp4Dynamic"}


@pytest.mark.parametrize("name", sorted(n for n, k in keys.KEYS.items() if k.static))
def test_chunked_quantize_is_bit_identical(name, monkeypatch):
    monkeypatch.setattr(load, "QUANTIZE_CHUNK", 500)  # many chunks, partial last ones
    key = keys.KEYS[name]
    for shape in [(300, 70), (257, 33), (129, 200), (2, 3000)]:
        x = (torch.randn(shape) * torch.rand(shape[0], 1) * 3).to(torch.bfloat16)
        whole, chunked = qp.quantize(x, key), load._quantize_streaming(x, key, "w")
        for a, b in zip(whole.tensors(), chunked.tensors()):
            assert (a is None and b is None) or torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (name, shape)


MEMORY_SCRIPT = """
import gc, json, sys, torch
import quantpass as qp
from quantpass.checkpoints import load, shards
from quantpass.weight_cache import WEIGHTS

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

path, fmt = sys.argv[1:3]
load._build(path, None)  # imports the model's modules and sets torch up: not part of loading
qp.quantize(torch.randn(64, 256), qp.QuantSpec.from_name(fmt).weight)
gc.collect()
baseline = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from here
model = qp.from_pretrained(path, linear=fmt)
peak = status("VmHWM:") - baseline
unquantized = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])
layers = {}
for name, entry in shards.index(path).items():
    if ".layers." in name:
        layer = name.split(".layers.")[1].split(".")[0]
        layers[layer] = layers.get(layer, 0) + entry.nbytes
print(json.dumps({"peak": peak, "held": WEIGHTS.nbytes() + unquantized, "largest_layer": max(layers.values())}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to reset the RSS peak")
@pytest.mark.parametrize("fmt", ["int8_weight_only", pytest.param("nvfp4", marks=SLOW)])
def test_quantize_on_load_peak_memory(fmt, tmp_path):
    """Fresh process: peak RSS above the process before loading <= what the loaded model holds plus
    its largest decoder layer at full precision (measured 2026-12-01 under `fresh_process.MALLOC`: INT8
    18.5 MB for 17.9 MB held + 6.8 MB; NVFP4 12.1 MB for 11.9 MB + 6.8 MB; a 31.5 MB bf16 checkpoint)."""
    config = transformers.LlamaConfig(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=2048, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    command = [sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path), fmt]
    out = subprocess.run(command, env=fresh_process.env(), capture_output=True, text=True, timeout=600, check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    assert measured["peak"] <= measured["held"] + measured["largest_layer"], measured


# ---------------------------------------------------------------------------- export
def test_online_quantized_model_exports_and_loads_back(tmp_path):
    model = tiny_llama(dtype=torch.bfloat16)
    logits, _ = run(model, linear="fp8_per_channel")
    qp.save_pretrained(model, tmp_path)
    with open(tmp_path / "hf_quant_config.json") as f:
        quantization = json.load(f)["quantization"]
    assert quantization["quant_algo"] == "FP8_PER_CHANNEL_PER_TOKEN" and quantization["exclude_modules"] == [
        "model.embed_tokens", "lm_head"]  # fmt: skip
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"  # tiny_llama's config names none: the model's dtype
    loaded = qp.from_pretrained(tmp_path)
    reloaded, plan = run(loaded)
    assert all(row.reason.startswith("checkpoint: FP8_PER_CHANNEL_PER_TOKEN") for row in plan.rows if row.quantized)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    online, back = qp.state_dict(model, quantized=True), qp.state_dict(loaded, quantized=True)
    for name, value in online.items():
        if isinstance(value, qp.QTensor):
            assert all(
                torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in zip(value.tensors()[:2], back[name].tensors()[:2])
            ), name
    # not bit-equal: tiny_llama's .to(bfloat16) also rounds its rotary table, from_config keeps it fp32
    assert cosine(logits, reloaded) > 0.9999
    model = tiny_llama(dtype=torch.bfloat16)
    run(model, linear="fp8_per_tensor")  # dynamic per-tensor activations: no producer has a layout for them
    with pytest.raises(ValueError, match="q_proj.weight: no ModelOpt quant_algo stores kFp8StaticTensorSym weights "
                                         "without a calibrated input scale.*nor compressed-tensors"):  # fmt: skip
        qp.save_pretrained(model, tmp_path / "fp8_per_tensor")


def test_static_activation_scale_reaches_the_kernel():
    """qp.linear with a checkpoint's calibrated scale: FP8 W8A8 with the static scale, and an error
    naming the key when the weight has none."""
    w, x = torch.randn(48, 160), torch.randn(5, 160)
    qt = qp.quantize(w, keys.kFp8StaticTensorSym)
    spec = qp.QuantSpec(keys.kFp8StaticTensorSym, keys.kFp8StaticTensorSym)
    with pytest.raises(ValueError, match="activation kFp8StaticTensorSym needs a calibrated input scale"):
        qp.linear(x, qt, spec)
    qt.input_scale = x.abs().amax() / 448
    out = qp.linear(x, qt, spec)
    x_q = (x / qt.input_scale).to(torch.float8_e4m3fn).float() * qt.input_scale
    assert torch.allclose(out, x_q @ qp.dequantize(qt, torch.float32).t(), rtol=1e-5, atol=1e-5)
    qt.input_scale = qt.input_scale / 100  # a scale calibrated for smaller activations clips these
    assert cosine(x @ w.t(), qp.linear(x, qt, spec)) < 0.9
