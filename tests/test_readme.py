"""Every code block in README.md runs as written (issue #15).

- python blocks: each in a fresh interpreter (a subprocess with a time limit), with a check of what
  the block promises appended (`CHECKS`);
- bash blocks: each `quantpass ...` line goes through the command line's parsing and every check it
  makes before work (formats, kernels on this device, model, prompt length, paths): what a typo or
  a stale flag would break. The work itself is `quantpass run`'s own tests (tests/test_cli.py).
  `quantpass formats` runs for real. Install lines are not run (`NOT_RUN` says why);
- the plan sample under "Reading the plan" matches what `quantpass explain` prints on this CPU, up to
  each row's backend-specific reason text (which names this machine's kernel).
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantpass import cli
from quantpass.kernels import cpu_avx2

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
PYTHON_TIME_LIMIT = 300  # seconds per python block (two small Inductor compiles; ~40 s on a quiet 2-core CPU)

# A line that identifies a python block -> what its run must show (appended to the block).
CHECKS = {
    'options={"linear": "int8_weight_only"': "assert backend.plan.quantized(), backend.plan",
    "@qp.compile(": "assert model.quantpass_plan.quantized(), model.quantpass_plan",
}
# Lines of bash blocks that are not run, and why.
NOT_RUN = {
    "python3 -m venv": "creates a virtual environment and installs packages from the network",
}


def fenced(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(README.read_text()) if lang == language]


def python_blocks() -> list:
    params = []
    for body in fenced("python"):
        key = next((k for k in CHECKS if k in body), None)
        params.append(pytest.param(body, key, id=(key or body.splitlines()[0])[:30]))
    return params


def command_lines() -> list[str]:
    lines = []
    for body in fenced("bash"):
        for line in body.splitlines():
            if line.strip() and not any(line.startswith(prefix) for prefix in NOT_RUN):
                lines.append(line)
    return lines


def test_readme_has_the_blocks_this_file_checks():
    bodies = fenced("python")
    assert all(any(key in body for body in bodies) for key in CHECKS)
    assert sum(line.startswith(tuple(NOT_RUN)) for body in fenced("bash") for line in body.splitlines()) == 2
    assert len(command_lines()) >= 8


@pytest.mark.parametrize("body, key", python_blocks())
def test_python_block_runs_as_written(body, key, tmp_path):
    code = body + ("\n" + CHECKS[key] + "\n" if key else "")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=PYTHON_TIME_LIMIT
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture
def checkpoint_dir(tmp_path, monkeypatch):
    """The README's `./my-checkpoint`: a config.json is all the checks before work read."""
    from quantpass.presets import model_config

    model_config("dense").save_pretrained(tmp_path / "my-checkpoint")
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("line", command_lines())
def test_command_line_passes_every_check_before_work(line, checkpoint_dir, monkeypatch, capsys):
    argv = shlex.split(line, comments=True)
    assert argv[:1] == ["quantpass"] or argv[:3] == ["python", "-m", "quantpass"], line
    argv = argv[1:] if argv[0] == "quantpass" else argv[3:]
    ran = []
    monkeypatch.setattr(cli, "_run", lambda args, configs: ran.append(("run", configs)) or 0)
    monkeypatch.setattr(cli, "_explain", lambda args, config: ran.append(("explain", config)) or 0)
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert ran or argv[0] == "formats"


def plan_block() -> tuple[list[str], str]:
    text = README.read_text()
    begin = re.search(r"<!-- plan:begin \((quantpass explain [^)]*)\) -->\n```\n", text)
    assert begin, "README lacks the plan sample's begin marker"
    return shlex.split(begin.group(1))[1:], text[begin.end() :].split("```")[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the README's plan sample is the CPU one")
@pytest.mark.skipif(not cpu_avx2.available()[0], reason="the sample is the default path: quantpass's CPU kernels")
def test_readme_plan_sample_is_what_explain_prints(capsys):
    """Every column and the whole reason (the kernel library's name without its source hash): checked up
    to the reason's first ':', the sample kept showing aten's kernels and the per-expert loop after the
    default became quantpass's kernels and one C call per MoE layer."""
    argv, sample = plan_block()
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out

    def rows(text: str) -> list[list[str]]:  # a linear's M limit depends on the CPU (cpu.LINEAR_MAX_M)
        return [
            re.split(
                r"  +", re.sub(r"-[0-9a-f]{16}\.so|(?<=for M <= )\d+(?=, dequantize)", "", line.strip()), maxsplit=5
            )
            for line in text.strip().splitlines()
        ]

    assert rows(sample) == rows(printed), (
        f"README's plan sample is stale; `quantpass {shlex.join(argv)}` prints:\n{printed}"
    )
