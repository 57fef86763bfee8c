"""Debug output: per-compile folders with graphs, plan and depyf's dumps (issue #6)."""

import pytest
import torch
from tiny_models import Block

import quantpass as qp


def compile_folders(root):
    return sorted(root.glob("compile_*"))


def test_debug_dir_holds_graphs_plan_and_depyf_code(tmp_path):
    torch._dynamo.reset()
    backend = qp.backend(linear="int8_per_channel", lowering="aot_eager", debug_dir=str(tmp_path))
    with torch.no_grad():
        torch.compile(Block(), backend=backend)(torch.randn(4, 64))
    (folder,) = compile_folders(tmp_path)
    files = {p.name for p in folder.iterdir()}
    assert files == {"before.py", "after.py", "plan.txt", "dynamo_code.py"}
    assert "torch._C._nn.linear" in (folder / "before.py").read_text()
    after = (folder / "after.py").read_text()
    assert "quantpass" in after and "torch._C._nn.linear" not in after
    assert "linear: 2 quantized" in (folder / "plan.txt").read_text()
    dynamo_code = (folder / "dynamo_code.py").read_text()
    assert "depyf" in dynamo_code and "__compiled_fn" in dynamo_code  # decompiled: calls the graph


def test_env_flag_turns_debug_output_on(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTPASS_DEBUG_DIR", str(tmp_path))
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(Block(), backend=qp.backend(linear="fp8_per_channel", lowering="aot_eager"))(torch.randn(3, 64))
    (folder,) = compile_folders(tmp_path)
    assert (folder / "after.py").is_file() and (folder / "dynamo_code.py").is_file()


def test_plain_torch_compile_inside_depyf_prepare_debug(tmp_path):
    depyf = pytest.importorskip("depyf")
    torch._dynamo.reset()
    compiled = torch.compile(Block(), backend=qp.backend(linear="int8_per_channel", lowering="aot_eager"))
    with depyf.prepare_debug(str(tmp_path)), torch.no_grad():  # the README's recipe for this door
        compiled(torch.randn(4, 64))
    assert any(p.name.startswith("full_code_for_") for p in tmp_path.iterdir())


def test_decorator_adds_depyf_session_dumps(tmp_path):
    @qp.compile(linear="int8_weight_only", lowering="aot_eager", debug_dir=str(tmp_path))
    class Debugged(Block):
        pass

    torch._dynamo.reset()
    with torch.no_grad():
        Debugged()(torch.randn(2, 64))
    assert len(compile_folders(tmp_path)) == 1
    depyf_files = [p.name for p in (tmp_path / "depyf").iterdir()]
    assert any(name.startswith("full_code_for_") for name in depyf_files)  # guards + decompiled code
    assert any(name.startswith("__compiled_fn_") and "Forward_graph" in name for name in depyf_files)  # AOT graph
