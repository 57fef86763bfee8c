"""Pre-quantized ModelOpt checkpoints (issue #13), written by the real `nvidia-modelopt` on CPU.

`python tests/test_checkpoints.py DIR` writes them: a one-layer bf16 Llama (hidden 160, intermediate
224: 128x128 blocks with partial last blocks, K multiple of 32) through `mtq.quantize` +
`export_hf_checkpoint` for every algo, a mixed-precision one, and a Qwen3-MoE in FP8 and NVFP4
(ModelOpt exports its fused experts per expert), each with ModelOpt's own fake-quant logits. The
session fixture runs it once in a subprocess (ModelOpt patches transformers classes on import)
and caches the result under pytest's cache dir, keyed by ModelOpt's version and this file.

Each checkpoint is checked against (a) its weights dequantized by the independent reference below
(plain torch, its own e2m1 table) loaded by transformers itself, and (b) ModelOpt's fake-quant
forward; plus: no full-precision copies, every linear quantized but the excluded, byte-identical
save_pretrained, activation override and weight conflict.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import transformers
from plan_text import printed_reason

import quantpass as qp
from quantpass.checkpoints import shards
from quantpass.metrics import cosine
from quantpass.weight_cache import WEIGHTS

VOCAB = 256
EVAL_IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
CALIBRATION_IDS = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(3))
# checkpoint -> (ModelOpt config, model); MIXED: FP8 attention, NVFP4 MLP, o_proj left unquantized (its
# quantized_layers name a MoE model's experts module, not each projection); FP8_LM_HEAD: FP8 with the
# output head quantized too
EXPORTS = {
    "FP8": ("FP8_DEFAULT_CFG", "llama"),
    "FP8_PER_CHANNEL_PER_TOKEN": ("FP8_PER_CHANNEL_PER_TOKEN_CFG", "llama"),
    "FP8_PB_WO": ("FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG", "llama"),
    "NVFP4": ("NVFP4_DEFAULT_CFG", "llama"),
    "W4A16_NVFP4": ("W4A16_NVFP4_CFG", "llama"),
    "MXFP8": ("MXFP8_DEFAULT_CFG", "llama"),
    "MIXED_PRECISION": ("MIXED", "llama"),
    "MOE_FP8": ("FP8_DEFAULT_CFG", "qwen3_moe"),
    "MOE_NVFP4": ("NVFP4_DEFAULT_CFG", "qwen3_moe"),
    "MOE_MIXED_PRECISION": ("MIXED", "qwen2_moe"),
    "FP8_LM_HEAD": ("FP8_LM_HEAD", "llama"),
    "MOE_MIXTRAL_FP8": ("FP8_DEFAULT_CFG", "mixtral"),  # stored under Mixtral's legacy names (block_sparse_moe)
}
# cosine floors vs the dequantized reference (issue #13): weight-only, 8-bit W8A8, NVFP4 W4A4
FLOOR = {"FP8": 0.99, "FP8_PER_CHANNEL_PER_TOKEN": 0.99, "FP8_PB_WO": 0.999, "NVFP4": 0.97, "W4A16_NVFP4": 0.999,
         "MXFP8": 0.99, "MIXED_PRECISION": 0.97, "MOE_FP8": 0.99, "MOE_NVFP4": 0.97, "MOE_MIXED_PRECISION": 0.97,
         "FP8_LM_HEAD": 0.99, "MOE_MIXTRAL_FP8": 0.99}  # fmt: skip
MODELOPT_FLOOR = 0.995  # vs ModelOpt's own fake-quant forward, where it runs on CPU:
MODELOPT_CUDA_ONLY = {"NVFP4", "W4A16_NVFP4", "MXFP8", "MIXED_PRECISION", "MOE_NVFP4", "MOE_MIXED_PRECISION"}


def tiny(kind: str) -> transformers.PreTrainedModel:
    if kind == "llama":
        config = transformers.LlamaConfig(
            hidden_size=160, intermediate_size=224, num_hidden_layers=1, num_attention_heads=5,
            num_key_value_heads=1, head_dim=32, vocab_size=VOCAB, max_position_embeddings=64,
        )  # fmt: skip
        config.architectures = ["LlamaForCausalLM"]
    elif kind == "mixtral":
        config = transformers.MixtralConfig(
            hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=64,
            initializer_range=0.1,
        )  # fmt: skip
        config.architectures = ["MixtralForCausalLM"]
    elif kind == "qwen2_moe":  # a shared expert beside the routed ones
        config = transformers.Qwen2MoeConfig(
            hidden_size=64, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
            decoder_sparse_step=1, mlp_only_layers=[], vocab_size=VOCAB, max_position_embeddings=64,
            initializer_range=0.1,
        )  # fmt: skip
        config.architectures = ["Qwen2MoeForCausalLM"]
    else:
        config = transformers.Qwen3MoeConfig(
            hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
            mlp_only_layers=[], norm_topk_prob=True, vocab_size=VOCAB, max_position_embeddings=64,
            initializer_range=0.1,
        )  # fmt: skip
        config.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()


def export_all(out: str) -> None:
    """Run ModelOpt: one directory per EXPORTS entry, with `modelopt_logits.pt` beside it."""
    import copy

    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    for name, (config_name, kind) in EXPORTS.items():
        if config_name == "MIXED":
            config = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
            fp8 = {"num_bits": (4, 3), "axis": None}
            config["quant_cfg"] += [
                {"quantizer_name": "*self_attn*weight_quantizer", "cfg": fp8},
                {"quantizer_name": "*self_attn*input_quantizer", "cfg": fp8},
                {"quantizer_name": "*layers.0.self_attn.o_proj*", "enable": False},
            ]
        elif config_name == "FP8_LM_HEAD":
            config = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
            config["quant_cfg"] = [q for q in config["quant_cfg"] if q.get("quantizer_name") != "*lm_head*"]
        else:
            config = getattr(mtq, config_name)
        model = mtq.quantize(tiny(kind), config, lambda m: m(CALIBRATION_IDS))
        try:  # its fake-quant forward: dynamic block quantization (NVFP4, MXFP8 activations) needs CUDA
            with torch.no_grad():
                logits = model(EVAL_IDS).logits.float()
        except (AssertionError, RuntimeError) as error:
            logits = f"ModelOpt's fake-quant forward does not run on CPU: {error}"
        export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=os.path.join(out, name))
        torch.save(logits, os.path.join(out, name, "modelopt_logits.pt"))


@pytest.fixture(scope="session")
def checkpoints(request) -> str:
    """The ModelOpt checkpoints' parent directory (written once, then cached)."""
    try:
        from importlib.metadata import version

        modelopt_version = version("nvidia-modelopt")
    except Exception:
        pytest.skip("nvidia-modelopt is not installed (a dev dependency: pip install -e .[dev])")
    from filelock import FileLock

    with open(__file__, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    root = request.config.cache.mkdir("quantpass-modelopt-checkpoints")
    out = os.path.join(root, f"{modelopt_version}-{transformers.__version__}-{digest}")
    with FileLock(out + ".lock"):  # xdist workers: one writes, the others wait for it
        if not os.path.isfile(os.path.join(out, "done")):
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
            subprocess.run([sys.executable, __file__, out], check=True, env=env, timeout=900, capture_output=True)
            open(os.path.join(out, "done"), "w").close()
    return out


# ---------------------------------------------------------------------------- the independent reference
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> float [..., K]: low nibble first."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    return E2M1[codes.long()]


def dequantize_reference(algo: str, tensors: dict) -> torch.Tensor:
    """One ModelOpt weight from its stored tensors, written from the format descriptions alone."""
    w, scale = tensors["weight"], tensors.get("weight_scale")
    if algo == "FP8":
        return w.float() * scale.float()
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        return w.float() * scale.float()[:, None]
    if algo == "FP8_PB_WO":
        n, k = w.shape
        blocks = scale.float().reshape(math.ceil(n / 128), math.ceil(k / 128))
        return w.float() * blocks.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    if algo in ("NVFP4", "W4A16_NVFP4"):
        return unpack_e2m1(w) * scale.float().repeat_interleave(16, -1) * tensors["weight_scale_2"].float()
    if algo == "MXFP8":
        return w.float() * torch.exp2(scale.int() - 127.0).repeat_interleave(32, -1)
    raise AssertionError(algo)


def per_layer_algos(path: str) -> dict:
    with open(os.path.join(path, "hf_quant_config.json")) as f:
        quantization = json.load(f)["quantization"]
    if quantization["quant_algo"] == "MIXED_PRECISION":
        return {fqn: entry["quant_algo"] for fqn, entry in quantization["quantized_layers"].items()}
    return {None: quantization["quant_algo"].upper()}


def reference_model(path: str, tmp_path) -> transformers.PreTrainedModel:
    """transformers' own loader on the checkpoint's weights dequantized by `dequantize_reference`."""
    algos, entries = per_layer_algos(path), shards.index(path)
    dense = {}
    for name, entry in entries.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(("_scale", "_scale_2", ".input_scale")):
            continue
        named = (module, module.rsplit(".", 2)[0])  # an expert's projection: MIXED may name its experts module
        found = next((algos[m] for m in named if m in algos), algos.get(None))
        algo = found if f"{module}.weight_scale" in entries and name.endswith(".weight") else None  # not a bias
        if algo is None:
            dense[name] = shards.read(entry).float()
        else:
            stored = {k: shards.read(entries[f"{module}.{k}"]) for k in ("weight", "weight_scale", "weight_scale_2")
                      if f"{module}.{k}" in entries}  # fmt: skip
            dense[name] = dequantize_reference(algo, stored)
    directory = tmp_path / "dequantized"
    directory.mkdir()
    shards.write(str(directory / "model.safetensors"), dense, {"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config")
    (directory / "config.json").write_text(json.dumps(config))
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def run(model, ids=EVAL_IDS, **options):
    """(logits, plan) of `model` compiled with quantpass (eager lowering: compile time)."""
    backend = qp.backend(lowering="eager", **options)
    torch._dynamo.reset()
    with torch.no_grad():
        logits = torch.compile(model, backend=backend)(ids).logits.float()
    return logits, backend.plan


# ---------------------------------------------------------------------------- every algo
@pytest.mark.parametrize("name", list(EXPORTS))
def test_modelopt_checkpoint(name, checkpoints, tmp_path):
    path = os.path.join(checkpoints, name)
    model = qp.from_pretrained(path)
    logits, plan = run(model)
    with torch.no_grad():
        expected = reference_model(path, tmp_path)(EVAL_IDS).logits.float()
    assert cosine(expected, logits) >= FLOOR[name], (name, cosine(expected, logits))
    modelopt = torch.load(os.path.join(path, "modelopt_logits.pt"))
    if isinstance(modelopt, torch.Tensor):  # else why it could not run (on CPU)
        assert cosine(modelopt, logits) >= MODELOPT_FLOOR, (name, cosine(modelopt, logits))
    else:
        assert name in MODELOPT_CUDA_ONLY, modelopt

    # every linear and experts module is quantized except the excluded; no full-precision copy left
    with open(os.path.join(path, "hf_quant_config.json")) as f:
        quantization = json.load(f)["quantization"]
    layers = {fqn for fqn, m in model.named_modules() if isinstance(m, torch.nn.Linear) or fqn.endswith("experts")}
    if "quantized_layers" in quantization:  # MIXED_PRECISION: the listed layers, nothing else
        expected_layers = set(quantization["quantized_layers"]) & layers
        assert "model.layers.0.self_attn.o_proj" not in expected_layers
    else:  # Mixtral's exports name its MoE block by its legacy name, transformers' model `mlp`
        expected_layers = layers - {m.replace(".block_sparse_moe.", ".mlp.") for m in quantization["exclude_modules"]}
    quantized = {row.fqn for row in plan.rows if row.quantized}
    assert quantized == expected_layers, plan
    assert all(row.reason.startswith("checkpoint: ") for row in plan.rows if row.quantized), plan
    for fqn in quantized:
        module = model.get_submodule(fqn)
        for param in (module.weight,) if fqn.endswith(("proj", "head")) else (module.gate_up_proj, module.down_proj):
            assert WEIGHTS.declared(param) is not None and param.untyped_storage().nbytes() == 0, fqn
    if name.startswith("MOE"):
        assert {row.fqn for row in plan.rows if row.kind == "moe" and row.quantized} == {"model.layers.0.mlp.experts"}

    # save_pretrained writes the checkpoint's tensors back, byte for byte
    qp.save_pretrained(model, tmp_path / "saved")
    assert_same_tensors(path, tmp_path / "saved")
    assert qp.checkpoints.detect(str(tmp_path / "saved")) == qp.checkpoints.detect(path)


def assert_same_tensors(a, b) -> None:
    left, right = shards.index(str(a)), shards.index(str(b))
    assert set(left) == set(right), set(left) ^ set(right)
    for name, entry in left.items():
        x, y = shards.read(entry), shards.read(right[name])
        assert (x.dtype, x.shape) == (y.dtype, y.shape), name
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), name


# ---------------------------------------------------------------------------- override and conflict
def test_activation_override_wins_and_weight_conflict_raises(checkpoints):
    path = os.path.join(checkpoints, "FP8")
    model = qp.from_pretrained(path)
    static, _ = run(model)
    dynamic, plan = run(model, linear={"activation": "fp8_per_tensor"})
    rows = [row for row in plan.rows if row.quantized]
    assert {(row.weight, row.activation) for row in rows} == {("kFp8StaticTensorSym", "kFp8DynamicTensorSym")}
    assert all(row.reason.startswith("checkpoint: FP8, activation from config.linear") for row in rows), plan
    assert cosine(static, dynamic) > 0.99 and not torch.equal(static, dynamic)
    with pytest.raises(Exception, match=r"checkpoint: FP8 weights are kFp8StaticTensorSym; config.linear asks for "
                                        r"kInt8StaticChannelSym: drop it, or pass requantize=True"):  # fmt: skip
        run(model, linear="int8_weight_only")
    requantized, plan = run(model, linear="int8_weight_only", requantize=True)
    assert {row.weight for row in plan.rows if row.quantized} == {"kInt8StaticChannelSym"}
    assert cosine(static, requantized) > 0.99


def test_override_at_load_and_moe_activation(checkpoints):
    """Options given to from_pretrained become the layers' declared spec (MoE activation -> dynamic)."""
    model = qp.from_pretrained(os.path.join(checkpoints, "MOE_FP8"), moe={"activation": "fp8_per_tensor"})
    _, plan = run(model)
    moe = [row for row in plan.rows if row.kind == "moe"]
    assert [row.activation for row in moe] == ["kFp8DynamicTensorSym"], plan
    assert all("activation from config.moe" in row.reason for row in moe)
    with pytest.raises(ValueError, match="checkpoint: NVFP4 weights are kNvfp4Static; config.linear asks for"):
        qp.from_pretrained(os.path.join(checkpoints, "NVFP4"), linear="mxfp8")


def test_legacy_w4a16_input_scale_is_dropped_with_a_deprecation_warning(checkpoints, tmp_path):
    path = os.path.join(checkpoints, "W4A16_NVFP4")
    entries = shards.index(path)
    tensors = {name: shards.read(entry) for name, entry in entries.items()}
    for name in [n for n in tensors if n.endswith(".weight_scale_2")]:
        tensors[name.replace(".weight_scale_2", ".input_scale")] = torch.tensor(0.01)  # what old exports wrote
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    shards.write(str(legacy / "model.safetensors"), tensors)
    for file in ("config.json", "hf_quant_config.json"):
        shutil.copy(os.path.join(path, file), legacy / file)
    with pytest.warns(DeprecationWarning, match="W4A16_NVFP4 checkpoint has an input_scale"):
        model = qp.from_pretrained(legacy)
    logits, plan = run(model)
    assert {row.activation for row in plan.rows if row.quantized} == {None}
    expected, _ = run(qp.from_pretrained(path))
    assert torch.equal(logits, expected)


def test_dequantized_twin_runs_the_checkpoint_weights(checkpoints):
    """What `quantpass run --model DIR` compares with: the checkpoint's weights at full precision."""
    path = os.path.join(checkpoints, "W4A16_NVFP4")
    quantized, _ = run(qp.from_pretrained(path))
    twin = qp.checkpoints.dequantized(qp.from_pretrained(path))
    assert not any(WEIGHTS.declared(p) for p in twin.parameters())
    with torch.no_grad():
        assert cosine(twin(EVAL_IDS).logits.float(), quantized) > 0.9999  # weight-only: the same weights


def test_describe_and_detect(checkpoints, tmp_path):
    lines = qp.checkpoints.describe(os.path.join(checkpoints, "MIXED_PRECISION"))
    assert "modelopt checkpoint, quant_algo MIXED_PRECISION" in lines[0]
    assert any("FP8: weight kFp8StaticTensorSym" in line for line in lines)
    assert any("NVFP4: weight kNvfp4Static, activation kNvfp4CalibratedGlobal (input_scale)" in line for line in lines)
    assert "model.layers.0.self_attn.o_proj" not in " ".join(lines)  # unquantized: not listed
    assert qp.checkpoints.detect(str(tmp_path)) is None
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(
        ValueError,
        match="quant_method 'gptq' is not supported; quantpass reads: modelopt, mxfp4, fp8, compressed-tensors",
    ):
        qp.checkpoints.detect(str(tmp_path))


def test_a_graph_dynamo_reuses_from_a_plain_twin_never_reads_freed_weights(checkpoints, caplog):
    """Two equal backends: Dynamo serves the twin's graph (no sites) to the checkpoint model of the
    same class. It must restore the released weights (with a warning), not read freed storage."""
    path = os.path.join(checkpoints, "W4A16_NVFP4")
    twin = qp.checkpoints.dequantized(qp.from_pretrained(path))
    model = qp.from_pretrained(path)
    torch._dynamo.reset()
    with torch.no_grad():
        expected = torch.compile(twin, backend=qp.backend(lowering="eager"))(EVAL_IDS).logits.float()
        got = torch.compile(model, backend=qp.backend(lowering="eager"))(EVAL_IDS).logits.float()
    assert cosine(got, expected) > 0.9999
    assert "a graph Dynamo compiled for another instance of the class" in caplog.text


# ---------------------------------------------------------------------------- the command line
CLI_RUN = ["--lowering", "aot_eager", "--new-tokens", "2", "--prompt-length", "8", "--rounds", "1"]


def test_cli_runs_a_checkpoint_against_its_dequantized_self_and_saves_it(checkpoints, tmp_path, capsys):
    from quantpass.cli import main

    path = os.path.join(checkpoints, "FP8_PER_CHANNEL_PER_TOKEN")
    saved, report = tmp_path / "saved", tmp_path / "run.json"
    assert main(["run", "--model", path, *CLI_RUN, "--save", str(saved), "--json", str(report)]) == 0
    out = capsys.readouterr()
    assert "modelopt checkpoint (FP8_PER_CHANNEL_PER_TOKEN): running its own formats" in out.err
    assert "== checkpoint FP8_PER_CHANNEL_PER_TOKEN: the checkpoint's formats ==" in out.out
    assert "checkpoint: FP8_PER_CHANNEL_PER_TOKEN" in printed_reason(out.out, "model.layers.0.mlp.up_proj")
    (result,) = json.loads(report.read_text())["formats"]
    assert result["cosine"] > 0.99 and result["summary"].startswith("linear: 7 quantized")
    assert qp.checkpoints.detect(str(saved)).quant_algo == "FP8_PER_CHANNEL_PER_TOKEN"
    for name, entry in shards.index(path).items():  # the run wrote the checkpoint's tensors back
        assert shards.read(shards.index(str(saved))[name]).equal(shards.read(entry)), name


def test_cli_explains_a_checkpoint_and_refuses_another_weight_format(checkpoints, capsys):
    from quantpass.cli import main

    path = os.path.join(checkpoints, "FP8")
    assert main(["explain", "--model", path, "--prompt-length", "8"]) == 0
    row = printed_reason(capsys.readouterr().out, "model.layers.0.self_attn.q_proj")
    assert re.search(r" kFp8StaticTensorSym kFp8StaticTensorSym .*checkpoint: FP8", row), row
    assert main(["run", "--model", path, *CLI_RUN, "--quantization", "int8_weight_only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("quantpass: error: layer ") and "asks for kInt8StaticChannelSym" in err
    assert "pass --requantize to quantize again" in err


if __name__ == "__main__":
    export_all(sys.argv[1])
