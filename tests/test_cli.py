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

from quantpass.cli import main
from quantpass.envs import ENV_VARS
from quantpass.report import formats_table

README = Path(__file__).resolve().parents[1] / "README.md"


def test_run_on_the_default_preset_under_two_minutes(capsys, tmp_path):
    started = time.perf_counter()
    assert main(["run", "--json", str(tmp_path / "run.json")]) == 0  # the default: moe preset, Inductor
    elapsed = time.perf_counter() - started
    out = capsys.readouterr().out
    assert elapsed < 120, f"quantpass run took {elapsed:.0f} s"
    assert "== default: linear fp8_per_channel, moe mxfp8 ==" in out
    for row in ("layers quantized", "kernels", "weight bytes", "logits cosine similarity", "top-1 token agreement"):
        assert re.search(rf"^{row} ", out, re.M), row
    assert re.search(r"^compile time \(first call\) .* s ", out, re.M)
    assert re.search(r"^generate tokens/s \(8 greedy\) ", out, re.M)
    assert re.search(r"^linear: 8 quantized \(fp8_per_channel; reference 8\)", out, re.M)  # the plan's summary
    result = json.loads((tmp_path / "run.json").read_text())
    (default,) = result["formats"]
    assert default["config"]["linear"]["weight"] == "kFp8StaticChannelSym"
    assert default["cosine"] > 0.99 and default["weight_bytes_ratio"] < 0.5
    assert result["baseline"]["compile_seconds"] > 0 and default["generate_tokens_per_second"] > 0


def test_run_compare_writes_every_format(capsys, tmp_path):
    argv = ["run", "--model", "dense", "--compare", "int8_weight_only,fp8_per_channel", "--lowering", "aot_eager"]
    argv += ["--new-tokens", "2", "--prompt-length", "8", "--json", str(tmp_path / "compare.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "== int8_weight_only: int8_weight_only ==" in out and "== summary (vs unquantized, dense) ==" in out
    formats = json.loads((tmp_path / "compare.json").read_text())["formats"]
    assert [f["name"] for f in formats] == ["int8_weight_only", "fp8_per_channel"]
    assert all(f["cosine"] > 0.99 and f["summary"].startswith("linear: 14 quantized") for f in formats)


def test_explain_in_a_subprocess_logs_the_oracle_rejections():
    env = {**os.environ, "QUANTPASS_LOG": "debug"}
    argv = ["explain", "--model", "dense", "--quantization", "fp8_per_block", "--prompt-length", "8"]
    done = subprocess.run([sys.executable, "-m", "quantpass", *argv], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert re.search(r"^model\.layers\.0\.mlp\.down_proj +linear +kFp8Static128BlockSym", done.stdout, re.M)
    assert "linear: 14 quantized (fp8_per_block; reference 14) | 1 skipped" in done.stdout
    assert re.search(r"\[quantpass DEBUG\] linear .*: triton rejected: not chosen automatically on cpu", done.stderr)


def test_explain_loads_a_local_checkpoint_directory(capsys, tmp_path):
    from quantpass.presets import load_model

    load_model("dense", device="cpu").model.save_pretrained(tmp_path)  # config.json + model.safetensors
    argv = ["explain", "--model", str(tmp_path), "--quantization", "int8_per_channel", "--prompt-length", "8"]
    assert main([*argv, "--json", str(tmp_path / "plan.json")]) == 0
    assert "linear: 14 quantized (int8_per_channel; cpu 14) | 1 skipped" in capsys.readouterr().out
    assert json.loads((tmp_path / "plan.json").read_text())["model"] == str(tmp_path)


def test_formats_lists_names_keys_and_backends(capsys):
    assert main(["formats"]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"^fp8_per_channel +kFp8StaticChannelSym +kFp8DynamicTokenSym +linear +reference, native", out, re.M
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
        (["run", "--lowering", "tvm"], "invalid choice: 'tvm'"),
        (["run", "--quantization-config.backend.moe", "cuda"], "invalid backend for moe 'cuda'; valid: auto, cpu,"),
        (["explain", "--model", "no/such/dir"], "invalid model 'no/such/dir': not a preset (moe, dense)"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "missing command; valid: explain, formats, run"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("[quantpass] ")]  # progress lines
    assert len(lines) == 1 and lines[0].startswith("quantpass: error: ") and message in lines[0], err


def test_bad_flag_in_a_subprocess_has_no_traceback():
    argv = [sys.executable, "-m", "quantpass", "run", "--quantization", "fp9"]
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().startswith("quantpass: error: invalid quantization 'fp9'")
    assert len(done.stderr.strip().splitlines()) == 1
