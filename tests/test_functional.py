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


# -- the public API's errors: one line, naming what to pass (issue #15) --------------------------


@pytest.mark.parametrize(
    "name, key",
    [
        ("int8_weight_only", qp.keys.kInt8StaticChannelSym),
        ("fp8_per_channel", qp.keys.kFp8StaticChannelSym),  # a shorthand: its weight key
        ("int4_per_group", qp.keys.kInt4StaticGroup128Sym),  # a role name
        ("kFp8DynamicTokenSym", qp.keys.kFp8DynamicTokenSym),  # any key by name, activation keys too
    ],
)
def test_quantize_takes_format_and_key_names(name, key):
    w = torch.randn(40, 256)
    by_name, by_key = qp.quantize(w, name), qp.quantize(w, key)
    assert by_name.key == key
    assert torch.equal(by_name.data, by_key.data) and torch.equal(by_name.scale, by_key.scale)


@pytest.mark.parametrize(
    "key, message",
    [
        ("fp8_per_chanel", "invalid key 'fp8_per_chanel' for quantize; valid: fp8_per_block, fp8_per_channel,"),
        (3, "invalid key 3 for quantize: pass a format name (e.g. 'int8_weight_only')"),
    ],
)
def test_quantize_bad_key_is_one_line(key, message):
    with pytest.raises(ValueError) as error:
        qp.quantize(torch.randn(8, 32), key)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_linear_with_a_plain_tensor_says_to_quantize_it():
    with pytest.raises(TypeError) as error:
        qp.linear(torch.randn(2, 64), torch.randn(32, 64), "int8_weight_only")
    assert str(error.value) == (
        "qp.linear takes a quantized weight, got Tensor: quantize it once first, "
        "e.g. qp.linear(x, qp.quantize(weight, 'int8_weight_only'))"
    )


def test_linear_takes_a_format_name_for_spec():
    qt = qp.quantize(torch.randn(32, 64), "int8_weight_only")
    x = torch.randn(3, 64)
    weight_only = qp.QuantSpec(qp.keys.kInt8StaticChannelSym, activation=None)  # the spec the name stands for
    torch.testing.assert_close(qp.linear(x, qt, "int8_weight_only"), qp.linear(x, qt, weight_only))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"linear": "fp8_per_chanel"}, "quantpass options: invalid quantization 'fp8_per_chanel'; valid: "),
        ({"lowerin": "eager"}, "quantpass options: invalid quantpass option 'lowerin'; valid: "),
        ({"verify": "yes"}, "quantpass options: invalid quantpass option verify='yes'; valid: True, False"),
    ],
)
def test_torch_compile_options_fail_at_the_first_call_with_their_line_first(options, message):
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    compiled = torch.compile(model, backend="quantpass", options=options)  # torch.compile runs no backend code yet
    with pytest.raises(ValueError) as error:
        compiled(torch.randn(2, 64))
    assert str(error.value).splitlines()[0].startswith(message), str(error.value)
    assert isinstance(error.value, qp.backend.__globals__["InvalidOptionError"])


def test_backend_object_fails_at_construction():
    with pytest.raises(ValueError, match=r"^invalid quantization 'fp8_per_chanel'; valid: "):
        qp.backend(linear="fp8_per_chanel")


def test_explain_after_a_compile_released_the_weights():  # README's first snippet did this (issue #12)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    x = torch.randn(4, 64)
    with torch.no_grad():
        torch.compile(model, backend=qp.backend(linear="int8_weight_only", lowering="aot_eager"))(x)
    assert qp.explain(model, x, linear="int4_weight_only").quantized()
