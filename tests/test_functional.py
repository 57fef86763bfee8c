"""`qp.linear` (the eager entry point) and the weight cache."""

import gc

import pytest
import torch

import quantpass as qp
from quantpass import functional
from quantpass.kernels.oracle import LINEAR_CANDIDATES
from quantpass.metrics import sqnr
from quantpass.quant_registry.keys import needs_input_scale
from quantpass.weight_cache import WeightCache

# static activation keys need a checkpoint's calibrated input scale: tests/test_checkpoints.py
PAIRS = sorted((pair for pair in LINEAR_CANDIDATES if not needs_input_scale(pair[1])), key=str)


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{w}-{a}" for w, a in PAIRS])
def test_linear_matches_reference_for_every_pair(pair):
    weight_key, activation_key = pair
    w = torch.randn(48, 160, dtype=torch.bfloat16)
    x = torch.randn(2, 7, 160, dtype=torch.bfloat16)
    bias = torch.randn(48, dtype=torch.bfloat16)
    qt = qp.quantize(w, weight_key)
    spec = qp.QuantSpec(weight_key, activation_key)
    auto = qp.linear(x, qt, spec, bias=bias)
    ground_truth = qp.linear(x, qt, spec, bias=bias, backend="reference")
    assert auto.shape == (2, 7, 48) and auto.dtype == torch.bfloat16
    assert sqnr(ground_truth.float(), auto.float()) > 30  # the same quantized operands
    assert sqnr((x.float() @ w.float().t() + bias.float()), ground_truth.float()) > (10 if weight_key.bits == 4 else 20)


def test_linear_errors_and_defaults():
    qt = qp.quantize(torch.randn(32, 64), qp.keys.kInt8StaticChannelSym)
    x = torch.randn(3, 64)
    assert qp.linear(x, qt).shape == (3, 32)  # spec defaults to the weight key's own default pair
    with pytest.raises(ValueError, match="does not match the QTensor's key"):
        qp.linear(x, qt, "fp8_per_channel")
    with pytest.raises(ValueError, match="x has 65 features, the weight expects 64"):
        qp.linear(torch.randn(3, 65), qt)
    with pytest.raises(ValueError, match="invalid backend 'cuda'"):
        qp.linear(x, qt, backend="cuda")


def test_prepared_weight_is_cached_per_qtensor_and_dropped_with_it():
    qt = qp.quantize(torch.randn(32, 64), qp.keys.kInt8StaticChannelSym)
    qp.linear(torch.randn(1, 64), qt, backend="reference")
    key = (id(qt), "reference")
    assert key in functional._prepared
    del qt
    gc.collect()
    assert key not in functional._prepared


def test_weight_cache_identity_version_and_lifetime():
    cache = WeightCache()
    param = torch.nn.Parameter(torch.randn(4, 4))
    build = lambda values: values[0].sum().item()  # noqa: E731
    assert cache.get([param], "t", build) == pytest.approx(param.sum().item())
    cache.get([param], "t", build)
    assert cache.builds == 1
    with torch.no_grad():
        param.add_(1)  # bumps _version
    assert cache.get([param], "t", build) == pytest.approx(param.sum().item())
    assert cache.builds == 2
    other = torch.nn.Parameter(param.detach().clone())  # equal values, another object
    cache.get([other], "t", build)
    assert cache.builds == 3 and len(cache) == 2
    del other
    gc.collect()
    assert len(cache) == 1  # entries die with their parameter
