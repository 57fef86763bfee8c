"""The reference backend's per-call temporaries live in one per-thread CPU workspace
(`reference._Arena`): allocated per call they landed each time elsewhere in the heap holes that
released weights leave and kept re-touched pages resident (issue 12's FP8 and MXFP4 rows). Results
are bit for bit those of the per-call tensors: activations round-tripped in place, the same
products written into the output's columns."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from quantpass.kernels import reference
from quantpass.quant_registry import formats, keys

IN_PLACE_KEYS = [None, keys.kFp8DynamicTokenSym, keys.kFp8DynamicTensorSym, keys.kInt8DynamicTokenSym]


def _activations(dtype):
    x = torch.randn(37, 200, generator=torch.Generator().manual_seed(4)) * torch.logspace(-3, 3, 200)
    x[3] = 0.0  # an all-zero row
    x[5, :4] = torch.tensor([-1e30, 5e-40, -0.0, 1e-3])  # saturation, an fp32 subnormal, a signed zero
    return x.to(dtype)


@pytest.mark.parametrize("key", IN_PLACE_KEYS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_in_place_activation_round_trip_is_bit_identical(key, dtype):
    x = _activations(dtype)
    if not reference._in_place(x, key):
        assert key is None and dtype == torch.float32  # fp32 x with no key: x itself, nothing to copy
        return
    buffer = torch.full((x.numel() + 7,), float("nan"))  # poisoned, longer than needed
    got = reference._fake_quantize_rows(x, key, buffer[: x.numel()])
    want = reference.fake_quantize(x, key)
    assert got.data_ptr() == buffer.data_ptr()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # signed zeros included
    assert torch.isnan(buffer[x.numel() :]).all()


def test_static_and_grouped_keys_and_empty_inputs_take_the_general_path():
    x = _activations(torch.bfloat16)
    assert not reference._in_place(x, keys.kFp8StaticTensorSym)  # calibrated scale
    assert not reference._in_place(x, keys.kMxfp4Dynamic)  # grouped
    assert not reference._in_place(x[:0], keys.kFp8DynamicTensorSym)  # no rows: no per-tensor amax


@pytest.mark.parametrize("key", [keys.kMxfp4Static, keys.kFp8StaticChannelSym, keys.kNvfp4Static], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_results_never_alias_the_workspace(key, dtype, monkeypatch):
    monkeypatch.setattr(reference, "DEQUANTIZE_CHUNK", 5000)  # many row steps through one scratch
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    qt, bias = formats.quantize(w, key), torch.randn(300).to(dtype)
    x = _activations(dtype)
    activation = keys.kFp8DynamicTokenSym if key == keys.kFp8StaticChannelSym else None
    want = (reference.fake_quantize(x, activation) @ formats.dequantize(qt, torch.float32).t() + bias.float()).to(dtype)
    first = reference.linear(x, qt, activation, bias)
    second = reference.linear(x, qt, activation, bias)  # reuses the workspace: must not change `first`
    workspace = reference._THREAD.workspace
    start, stop = workspace.data_ptr(), workspace.data_ptr() + workspace.nbytes
    for out in (first, second):
        assert not start <= out.data_ptr() < stop
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(first, second)


@pytest.mark.parametrize("activation", [None, keys.kFp8DynamicTokenSym], ids=str)
def test_autograd_still_flows_through_the_reference(activation, monkeypatch):
    """Under autograd (tests and `verify` call the reference on tensors that require grad) no
    workspace, no `out=` product: the gradients of the dense product."""
    monkeypatch.setattr(reference, "DEQUANTIZE_CHUNK", 5000)
    qt = formats.quantize(torch.randn(300, 64, generator=torch.Generator().manual_seed(6)), keys.kMxfp4Static)
    x = torch.randn(7, 64, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(300, dtype=torch.bfloat16, requires_grad=True)
    reference.linear(x, qt, activation, bias).float().sum().backward()
    dense = formats.dequantize(qt, torch.float32)
    if activation is None:  # the round trip of a dynamic key has no useful derivative to compare
        torch.testing.assert_close(x.grad.float(), dense.sum(0).expand(7, 64), rtol=1e-2, atol=1e-2)
    assert x.grad is not None and torch.equal(bias.grad, torch.full_like(bias, 7))  # one per row
    frozen = bias.detach()  # bias alone records grad: the product is still computed, not aliased
    out = reference.linear(x.detach(), qt, activation, bias)
    assert out.requires_grad and not reference._THREAD.workspace.requires_grad
    assert torch.equal(out.detach(), reference.linear(x.detach(), qt, activation, frozen))


def test_each_thread_has_its_own_workspace():
    qt = formats.quantize(torch.randn(64, 64), keys.kMxfp4Static)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    reference.linear(x, qt, None, None)
    seen = []
    thread = threading.Thread(
        target=lambda: (reference.linear(x, qt, None, None), seen.append(reference._THREAD.workspace))
    )
    thread.start()
    thread.join()
    assert seen and seen[0].data_ptr() != reference._THREAD.workspace.data_ptr()


class _NewBytes(TorchDispatchMode):
    """Bytes of the new storages the ops run under it create (outputs that alias no input: not
    views, not `out=` arguments)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.total += t.untyped_storage().nbytes()
        return out


@pytest.mark.parametrize(
    "weight, activation",
    [(keys.kMxfp4Static, None), (keys.kNvfp4Static, None), (keys.kFp8StaticChannelSym, keys.kFp8DynamicTokenSym)],
    ids=["mxfp4", "nvfp4-weight-only", "fp8-w8a8"],
)
def test_a_call_allocates_little_beyond_its_output(weight, activation):
    """A 2816x1024 weight (11 row steps) at M=32, bf16 output 176 KiB: bytes of the tensors a warm
    call creates. Measured 2026-12-01: per-call tensors (each step's 1 MiB of fp32 values, the e2m1
    index, fp32 x and product) 18.5 / 18.9 / 12.5 MiB; in the workspace 1.2 / 1.5 / 0.2 MiB (the
    output and each step's group scales)."""
    qt = formats.quantize(torch.randn(2816, 1024).to(torch.bfloat16), weight)
    x = torch.randn(32, 1024).to(torch.bfloat16)
    reference.linear(x, qt, activation, None)  # the thread's workspace, the e2m1 tables
    with _NewBytes() as new:
        reference.linear(x, qt, activation, None)
    assert new.total < 2 * 2**20, f"{new.total / 2**20:.2f} MiB"
