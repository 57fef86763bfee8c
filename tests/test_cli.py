"""The `quantpass` command: run, explain, formats, bad input (issue #6).

Most commands run in-process through `main(argv)` (no interpreter start-up per test); one runs
as `python -m quantpass` in a subprocess, with QUANTPASS_LOG=debug.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from plan_text import printed_reason

from quantpass import cli, cli_checks
from quantpass.cli import main
from quantpass.envs import ENV_VARS
from quantpass.report import formats_table

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU defaults (CUDA gets FP8 + MXFP8, moe preset)")
def test_run_on_the_default_preset_under_two_minutes(capsys, tmp_path):
    started = time.perf_counter()
    assert main(["run", "--json", str(tmp_path / "run.json")]) == 0  # CPU defaults: dense preset, INT8 + INT4, bf16
    elapsed = time.perf_counter() - started
    captured = capsys.readouterr()
    out = captured.out
    assert "[quantpass] no format given: comparing int8_weight_only and int4_weight_only in bfloat16" in captured.err
    assert "== int8_weight_only: int8_weight_only ==" in out and "== int4_weight_only: int4_weight_only ==" in out
    for row in ("layers quantized", "kernels", "weight bytes", "resident weight memory", "logits cosine similarity"):
        assert re.search(rf"^{row} ", out, re.M), row
    assert re.search(r"^compile time \(first call\) .* s", out, re.M)
    assert re.search(r"^generate tokens/s \(8 greedy\) +[0-9.]+ \([0-9.]+-[0-9.]+\) ", out, re.M)  # median (range)
    assert "the dense preset is the default model on cpu" in captured.err
    assert re.search(r"^linear: 14 quantized \(int8_weight_only; cpu 14\) \| 1 skipped$", out, re.M)  # plan summary
    result = json.loads((tmp_path / "run.json").read_text())
    int8, int4 = result["formats"]
    assert int8["config"]["linear"] == {"weight": "kInt8StaticChannelSym", "activation": None}
    # a trained preset: quantization keeps its confident predictions
    assert int8["cosine"] > 0.999 and int8["top1_agreement"] == 1.0 and int8["generated_tokens_same"] == 8
    assert int4["cosine"] > 0.99 and int4["top1_agreement"] >= 0.9
    assert int8["weight_bytes_ratio"] < 0.6 and int4["weight_bytes_ratio"] < 0.35
    assert len(int8["prefill_seconds"]) == len(int8["baseline_timings"]["prefill_seconds"]) == 5
    assert result["baseline"]["compile"]["seconds"] > 0 and int8["generate_tokens_per_second"] > 0
    assert elapsed < 120, f"quantpass run took {elapsed:.0f} s"  # on a quiet 2-core machine; load slows it


def test_run_compare_writes_every_format(capsys, tmp_path):
    argv = ["run", "--model", "dense", "--compare", "int8_weight_only,fp8_per_channel", "--lowering", "aot_eager"]
    argv += ["--new-tokens", "2", "--prompt-length", "8", "--rounds", "2", "--json", str(tmp_path / "compare.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "== int8_weight_only: int8_weight_only ==" in out and "== summary (vs unquantized, dense) ==" in out
    assert "compile times not compared" not in out  # aot_eager: no Inductor caches to differ
    formats = json.loads((tmp_path / "compare.json").read_text())["formats"]
    assert [f["name"] for f in formats] == ["int8_weight_only", "fp8_per_channel"]
    assert all(f["cosine"] > 0.99 and f["summary"].startswith("linear: 14 quantized") for f in formats)
    for f in formats:
        low, high = f["prefill_speedup_range"]
        assert low <= f["prefill_speedup"] <= high and f["prefill_speedup_within_noise"] == (low <= 1 <= high)
        assert f["resident_bytes"] > 0 and f["compile_time_ratio"] > 0


@pytest.mark.parametrize("flags, keep", [([], False), (["--keep-original-weights"], True)])
def test_run_flags_become_backend_options(flags, keep):
    args = cli._parser().parse_args(["run", "--lowering", "aot_eager", "--no-verify", *flags])
    assert cli.backend_options(args) == {
        "lowering": "aot_eager", "verify": False, "keep_original_weights": keep, "requantize": False
    }  # fmt: skip


@pytest.mark.parametrize(
    "flags, labels",
    [
        ([], ["int8_weight_only", "int4_weight_only"]),  # the device's formats
        (["--quantization", "fp8_per_block"], ["fp8_per_block"]),
        (["--quantization-config.linear", "fp8_per_block"], ["linear fp8_per_block"]),  # as options= would
        (["--quantization-config", '{"moe": "mxfp4"}'], ["moe mxfp4"]),
        (["--quantization-config.ignore", "*.o_proj"], ["int8_weight_only", "int4_weight_only"]),  # on top of each
        (["--quantization-config.linear.activation", "none"], ["int8_weight_only", "int4_weight_only"]),
    ],
)
def test_which_formats_a_command_line_runs(flags, labels):
    """A config flag that gives linear or MoE layers a weight format names the one run, as the same
    options to torch.compile would (it ran on top of each default format, labelled as them); flags
    that change activations, patterns or backends apply on top of each format."""
    argv = ["run", *flags]
    config, _ = cli.parse_cli(argv)
    runs, _ = cli_checks.configs_to_run(config, None, cli_checks.format_flag(argv, config), "cpu")
    assert [label for label, _ in runs] == labels
    assert all(run.ignore == config.ignore for _, run in runs)


@pytest.mark.parametrize(
    "device, sm, libs, labels",
    [
        ("cpu", None, (), ["int8_weight_only", "int4_weight_only"]),  # the cpu backend's kernels
        ("cuda", 90, ("triton",), ["linear fp8_per_channel, moe mxfp8"]),
        ("cuda", 100, ("triton", "flashinfer"), ["linear fp8_per_channel, moe mxfp8"]),
        ("cuda", 80, ("triton",), ["int8_weight_only"]),  # no FP8 on sm80: the next format with a kernel
    ],
)
def test_device_defaults_are_the_formats_with_a_fast_kernel(monkeypatch, device, sm, libs, labels):
    from quantpass.kernels import oracle

    capability = oracle.Capability(device, sm, frozenset(libs))
    monkeypatch.setattr(oracle.Capability, "detect", classmethod(lambda cls, _: capability))
    runs, why = cli_checks.device_defaults(device)
    assert [label for label, _ in runs] == labels
    assert why.startswith(f"no format given: comparing {' and '.join(labels)} in bfloat16 with the unquantized model")
    assert "\n" not in why


def test_explain_in_a_subprocess_logs_the_oracle_rejections():
    env = {**os.environ, "QUANTPASS_LOG": "debug", "QUANTPASS_DISABLED_BACKENDS": "cpu"}  # the FP8 kernel: first
    argv = ["explain", "--model", "dense", "--quantization", "fp8_per_block", "--prompt-length", "8"]
    done = subprocess.run([sys.executable, "-m", "quantpass", *argv], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert re.search(r"^model\.layers\.0\.mlp\.down_proj +linear +kFp8Static128BlockSym", done.stdout, re.M)
    assert "linear: 14 quantized (fp8_per_block; reference 14) | 1 skipped" in done.stdout
    assert re.search(
        r"\[quantpass DEBUG\] linear .*: cpu rejected: disabled by QUANTPASS_DISABLED_BACKENDS", done.stderr
    )
    assert re.search(r"\[quantpass DEBUG\] linear .*: triton rejected: not chosen automatically on cpu", done.stderr)


def test_explain_loads_a_local_checkpoint_directory(capsys, tmp_path):
    from quantpass.presets import load_model

    load_model("dense", device="cpu").model.save_pretrained(tmp_path)  # config.json + model.safetensors
    argv = ["explain", "--model", str(tmp_path), "--quantization", "int8_per_channel", "--prompt-length", "8"]
    assert main([*argv, "--json", str(tmp_path / "plan.json")]) == 0
    assert "linear: 14 quantized (int8_per_channel; cpu 14) | 1 skipped" in capsys.readouterr().out
    assert json.loads((tmp_path / "plan.json").read_text())["model"] == str(tmp_path)


def test_run_quantizes_a_full_precision_checkpoint_as_it_loads(capsys, tmp_path):
    from quantpass.presets import load_model

    load_model("dense", device="cpu", trained=False).model.save_pretrained(tmp_path)
    argv = ["run", "--model", str(tmp_path), "--quantize-on-load", "--quantization", "int8_weight_only"]
    argv += ["--lowering", "aot_eager", "--new-tokens", "2", "--prompt-length", "8", "--rounds", "1"]
    assert main([*argv, "--json", str(tmp_path / "run.json")]) == 0
    out = capsys.readouterr()
    assert "quantized as it loads), against its dequantized self" in out.err
    assert "linear: 14 quantized (int8_weight_only; cpu 14) | 1 skipped" in out.out
    assert "quantized on load: int8_weight_only" in printed_reason(out.out, "model.layers.0.mlp.down_proj")
    (result,) = json.loads((tmp_path / "run.json").read_text())["formats"]
    assert result["cosine"] > 0.999  # against its own dequantized weights: only the kernels differ
    # resident: the quantized weights loaded before the compile count too (INT8: ~half of bf16)
    assert 0.4 < result["resident_bytes_ratio"] < 0.6


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "--quantize-on-load needs the format to apply: --quantization NAME"),
        (["--compare", "int8_weight_only,int4_weight_only"], "--compare needs a full-precision model"),
        (
            ["--quantization", "fp8_per_tensor", "--save", "out"],
            "--save: no ModelOpt quant_algo stores kFp8StaticTensorSym",
        ),
    ],
)
def test_quantize_on_load_usage_errors(capsys, tmp_path, extra, message):
    (tmp_path / "config.json").write_text(json.dumps(load_config_dict()))
    assert main(["run", "--model", str(tmp_path), "--quantize-on-load", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert main(["run", "--quantize-on-load", "--quantization", "int8_weight_only"]) == 2
    assert "--quantize-on-load needs a checkpoint directory; 'dense' is a preset" in capsys.readouterr().err


def load_config_dict() -> dict:
    from quantpass.presets import model_config

    return model_config("dense").to_dict()


def test_formats_lists_names_keys_and_backends(capsys):
    assert main(["formats"]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"^fp8_per_channel +kFp8StaticChannelSym +kFp8DynamicTokenSym +linear +(cpu, )?reference, native", out, re.M
    )
    assert re.search(r"^int4_weight_only +kInt4StaticGroup128Sym +- +linear +cpu, ", out, re.M)


def test_readme_formats_table_is_generated_from_the_tables():
    text = README.read_text()
    begin, end = "<!-- formats:begin (quantpass formats --markdown) -->\n", "<!-- formats:end -->"
    assert begin in text and end in text
    in_readme = text.split(begin)[1].split(end)[0].strip()
    assert in_readme == formats_table(markdown=True), (
        "README formats table is stale: paste `quantpass formats --markdown`"
    )


def test_readme_lists_every_env_flag():
    text = README.read_text()
    missing = [name for name in ENV_VARS if f"| `{name}` |" not in text]
    assert not missing, f"README's environment table lacks {missing}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "--bogus", "1"], "unrecognized arguments: --bogus 1"),
        (["run", "--quantization", "fp9"], "invalid quantization 'fp9'; valid: fp8_per_block, "),
        (["run", "--quantization-config.linear.weigth", "mxfp8"], "invalid flag '--quantization-config.linear.weigth'"),
        (["run", "--compare", "mxfp8,fp9"], "invalid quantization 'fp9'"),
        (
            ["run", "--compare", "mxfp8", "--quantization-config.linear", "int8_weight_only"],
            "--compare and --quantization-config.linear both choose formats; use one of them",
        ),
        (["run", "--lowering", "tvm"], "invalid choice: 'tvm'"),
        (["run", "--quantization-config.backend.moe", "cuda"], "invalid backend for moe 'cuda'; valid: auto, cpu,"),
        (["explain", "--model", "no/such/dir"], "invalid model 'no/such/dir': not a preset (moe, dense)"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "missing command; valid: explain, formats, run"),
        (["run", "--device", "foo"], "invalid device 'foo'; valid here: cpu"),
        (["run", "--device", "mps"], "invalid device 'mps': quantpass runs on cpu and cuda; valid here: cpu"),
        (["run", "--prompt-length", "100000"], "invalid --prompt-length 100000: the model 'dense' has 512 positions"),
        (["run", "--prompt-length", "510"], "(--prompt-length + --new-tokens 8 must fit)"),
        (["explain", "--model", "dense", "--prompt-length", "513"], "the model 'dense' has 512 positions"),
        (
            ["run", "--model", "moe", "--quantization", "mxfp8", "--quantization-config.moe.activation", "none"],
            "no moe kernel for weight kMxfp8Static with activation none (see `quantpass formats`",
        ),
        (
            ["run", "--json", "/no/such/dir/out.json"],
            "invalid --json '/no/such/dir/out.json': directory '/no/such/dir'",
        ),
        (["run", "--debug-dir", "/proc/quantpass-dump"], "invalid --debug-dir '/proc/quantpass-dump': "),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("[quantpass] ")]  # progress lines
    assert len(lines) == 1 and lines[0].startswith("quantpass: error: ") and message in lines[0], err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a CPU-only torch gives")
def test_cuda_on_a_cpu_only_torch_is_one_line_and_exit_code_2(capsys):
    assert main(["run", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"quantpass: error: invalid device 'cuda': this torch ({torch.__version__}) sees no CUDA device; valid here: cpu"
    )


@pytest.mark.parametrize("flag", ["--json", "--debug-dir"])
def test_unusable_output_paths_fail_before_any_work(capsys, tmp_path, flag):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    bad = {"--json": str(tmp_path), "--debug-dir": str(a_file / "dump")}[flag]  # a directory; a path through a file
    started = time.perf_counter()
    assert main(["run", flag, bad]) == 2
    assert time.perf_counter() - started < 10  # nothing was loaded or compiled
    (line,) = capsys.readouterr().err.strip().splitlines()
    expected = {"--json": "it is a directory; give a file path", "--debug-dir": "is a file, not a directory"}[flag]
    assert line.startswith(f"quantpass: error: invalid {flag} ") and line.endswith(expected), line


def test_import_prints_nothing_and_neither_does_torchao_through_it():
    code = "import quantpass as qp, torch; qp.quantize(torch.randn(32, 64), 'mxfp4'); import transformers"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == "", done.stderr


def test_bad_flag_in_a_subprocess_has_no_traceback():
    argv = [sys.executable, "-m", "quantpass", "run", "--quantization", "fp9"]
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().startswith("quantpass: error: invalid quantization 'fp9'")
    assert len(done.stderr.strip().splitlines()) == 1
