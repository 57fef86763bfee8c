"""Projections inside PyTorch's opaque attention ops are quantized (issue #11, the zoo's `opaque-mha`).

Dynamo keeps `nn.MultiheadAttention` as one `F.multi_head_attention_forward` call and, under
`torch.no_grad()`, `nn.TransformerEncoderLayer` as one `torch._transformer_encoder_layer_fwd` call:
before `patterns/attention.py` their in_proj/out_proj (and the encoder's FFN) weights were never
quantized and had no plan row. The rewritten call computes the same thing through
`passes/attention_math.py`; its dense form is checked against PyTorch's own ops here, option by
option, and the quantized models against eager.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import quantpass as qp
from quantpass.metrics import cosine
from quantpass.passes import attention_math as am

E, HEADS, L, S, B = 32, 4, 7, 5, 3  # odd sequence lengths
FLOOR = {"int8_weight_only": 0.999, "fp8_per_channel": 0.99, "nvfp4": 0.95}


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _mha(**kwargs):
    torch.manual_seed(0)
    return nn.MultiheadAttention(E, HEADS, **kwargs).eval()


def _dense(weight, bias=None):
    return ("dense", weight, bias)


def _causal(n):
    return torch.triu(torch.ones(n, n, dtype=torch.bool), 1)


# ------------------------------------------------------------------ the dense equivalent is exact
MHA_CASES = {
    "self": ({}, "self", {}),
    "self-need-weights-per-head": ({}, "self", {"need_weights": True, "average_attn_weights": False}),
    "cross-kv": ({}, "kv", {"need_weights": True}),
    "distinct-qkv": ({}, "qkv", {"need_weights": False}),
    "padding-bool": ({}, "kv", {"key_padding_mask": "pad"}),
    "causal-float": ({}, "self", {"attn_mask": "causal-float", "need_weights": False}),
    "causal-hint": ({}, "self", {"attn_mask": "causal", "is_causal": True, "need_weights": False}),
    "mask-3d-and-padding": ({}, "self", {"attn_mask": "3d", "key_padding_mask": "pad-float"}),
    "unbatched": ({}, "unbatched", {"need_weights": True}),
    "kdim-vdim": ({"kdim": 24, "vdim": 16}, "kv-dims", {}),
    "bias-kv-zero-attn": ({"add_bias_kv": True, "add_zero_attn": True}, "kv", {"key_padding_mask": "pad"}),
    "no-bias": ({"bias": False}, "self", {}),
}


def _mha_inputs(kind: str):
    x, memory = _randn(L, B, E, seed=1), _randn(S, B, E, seed=2)
    if kind == "self":
        return x, x, x
    if kind == "kv":
        return x, memory, memory
    if kind == "qkv":
        return x, memory, _randn(S, B, E, seed=3)
    if kind == "unbatched":
        return x[:, 0], memory[:, 0], memory[:, 0]
    return x, _randn(S, B, 24, seed=2), _randn(S, B, 16, seed=3)


def _mask(name, src_len):
    pad = torch.zeros(B, src_len, dtype=torch.bool)
    pad[1, -2:] = True
    return {
        "pad": pad,
        "pad-float": torch.zeros(B, src_len).masked_fill(pad, float("-inf")),
        "causal": _causal(L),
        "causal-float": torch.zeros(L, L).masked_fill(_causal(L), float("-inf")),
        "3d": _randn(B * HEADS, L, L, seed=5),
    }[name]


@pytest.mark.parametrize("case", MHA_CASES)
def test_multi_head_attention_matches_pytorch(case):
    module_kwargs, inputs, call_kwargs = MHA_CASES[case]
    module = _mha(**module_kwargs)
    query, key, value = _mha_inputs(inputs)
    call_kwargs = {k: _mask(v, key.shape[0]) if isinstance(v, str) else v for k, v in call_kwargs.items()}
    m = module
    separate = not m._qkv_same_embed_dim
    with torch.no_grad():
        expected = F.multi_head_attention_forward(
            query, key, value, E, HEADS, m.in_proj_weight, m.in_proj_bias, m.bias_k, m.bias_v, m.add_zero_attn,
            0.0, m.out_proj.weight, m.out_proj.bias, training=False, use_separate_proj_weight=separate,
            q_proj_weight=m.q_proj_weight, k_proj_weight=m.k_proj_weight, v_proj_weight=m.v_proj_weight,
            **call_kwargs,
        )  # fmt: skip
        slots = (
            {n: _dense(getattr(m, f"{n}_weight")) for n in ("q_proj", "k_proj", "v_proj")}
            if separate
            else {"in_proj": _dense(m.in_proj_weight, m.in_proj_bias)}
        )
        got = am.multi_head_attention(
            query, key, value, HEADS, _dense(m.out_proj.weight, m.out_proj.bias), **slots,
            in_bias=m.in_proj_bias if separate else None, bias_k=m.bias_k, bias_v=m.bias_v,
            add_zero_attn=m.add_zero_attn, **call_kwargs,
        )  # fmt: skip
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    if expected[1] is None:
        assert got[1] is None
    else:
        torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-6)


def _encoder_layer(**kwargs):
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(E, HEADS, 48, batch_first=True, **kwargs).eval()


ENCODER_CASES = {
    "post-norm-relu": ({}, {}),
    "pre-norm-gelu": ({"norm_first": True, "activation": "gelu"}, {}),
    "padding": ({}, {"src_key_padding_mask": "pad"}),
    "mask-and-padding": ({"norm_first": True}, {"src_mask": "causal", "src_key_padding_mask": "pad"}),
}


def _encoder_masks(kwargs):
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[1, -2:] = True
    return {k: pad if v == "pad" else _causal(L) for k, v in kwargs.items()}


def _fast_path_args(layer, src, masks):
    """The arguments nn.TransformerEncoderLayer's fast path gives `torch._transformer_encoder_layer_fwd`."""
    src_mask = masks.get("src_mask")
    padding = F._canonical_mask(masks.get("src_key_padding_mask"), "pad", F._none_or_dtype(src_mask), "m", src.dtype)
    src_mask = F._canonical_mask(src_mask, "src_mask", None, "", src.dtype, check_other=False)
    mask, mask_type = layer.self_attn.merge_masks(src_mask, padding, src)
    return mask, mask_type


@pytest.mark.parametrize("case", ENCODER_CASES)
def test_encoder_layer_fast_path_matches_pytorch(case):
    layer_kwargs, mask_kwargs = ENCODER_CASES[case]
    layer, src = _encoder_layer(**layer_kwargs), _randn(B, L, E, seed=1)
    masks = _encoder_masks(mask_kwargs)
    a = layer.self_attn
    with torch.no_grad():
        expected = layer(src, **masks)  # eval + no_grad: the fast path itself
        mask, mask_type = _fast_path_args(layer, src, masks)
        fast = torch._transformer_encoder_layer_fwd(
            src, E, HEADS, a.in_proj_weight, a.in_proj_bias, a.out_proj.weight, a.out_proj.bias,
            layer.activation_relu_or_gelu == 2, layer.norm_first, layer.norm1.eps, layer.norm1.weight,
            layer.norm1.bias, layer.norm2.weight, layer.norm2.bias, layer.linear1.weight, layer.linear1.bias,
            layer.linear2.weight, layer.linear2.bias, mask, mask_type,
        )  # fmt: skip
        got = am.transformer_encoder_layer(
            src, HEADS, _dense(a.in_proj_weight, a.in_proj_bias), _dense(a.out_proj.weight, a.out_proj.bias),
            layer.activation_relu_or_gelu == 2, layer.norm_first, layer.norm1.eps,
            (layer.norm1.weight, layer.norm1.bias), (layer.norm2.weight, layer.norm2.bias),
            _dense(layer.linear1.weight, layer.linear1.bias), _dense(layer.linear2.weight, layer.linear2.bias),
            mask, mask_type,
        )  # fmt: skip
    torch.testing.assert_close(fast, expected, rtol=1e-5, atol=1e-5)  # the call Dynamo captures is the layer
    keep = ~masks["src_key_padding_mask"] if "src_key_padding_mask" in masks else torch.ones(B, L, dtype=torch.bool)
    torch.testing.assert_close(got[keep], expected[keep], rtol=1e-5, atol=1e-5)  # padded rows: undefined


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("mask_type", [None, 0, 1, 2])
def test_native_multi_head_attention_matches_pytorch(mask_type, need_weights):
    m, x = _mha(batch_first=True), _randn(B, L, E, seed=1)
    mask = {
        None: None,
        0: torch.zeros(L, L).masked_fill(_causal(L), float("-inf")),
        1: torch.zeros(B, L).index_fill(1, torch.tensor([L - 1]), float("-inf")),
        2: _randn(B, HEADS, L, L, seed=4) > 0.5,  # bool: True = masked; float masks reach it as 0 / -inf
    }[mask_type]
    args = (m.in_proj_weight, m.in_proj_bias, m.out_proj.weight, m.out_proj.bias)
    with torch.no_grad():
        expected = torch._native_multi_head_attention(x, x, x, E, HEADS, *args, mask, need_weights, True, mask_type)
        got = am.native_multi_head_attention(
            x, x, x, HEADS, _dense(*args[:2]), _dense(*args[2:]), mask, need_weights, True, mask_type
        )
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    if need_weights:
        torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ compiled: quantized, close to eager
class Attention(nn.Module):
    """nn.MultiheadAttention as a model uses it: self-, cross- or distinct-input attention."""

    def __init__(self, inputs="self", need_weights=False, **kwargs):
        super().__init__()
        self.attn = nn.MultiheadAttention(E, HEADS, batch_first=True, **kwargs)
        self.inputs, self.need_weights = inputs, need_weights

    def forward(self, x, memory):
        key = x if self.inputs == "self" else memory
        value = memory * 0.5 if self.inputs == "qkv" else key
        out, weights = self.attn(x, key, value, need_weights=self.need_weights)
        return out if weights is None else torch.cat([out.flatten(), weights.flatten()])


def _compile(model, fmt="int8_weight_only", **options):
    backend = qp.backend(linear=fmt, lowering="aot_eager", **options)
    torch._dynamo.reset()
    return torch.compile(model, backend=backend), backend


def _rows(backend) -> dict:
    return {row.fqn: row for row in backend.plan.rows}


@pytest.mark.parametrize("fmt", FLOOR)
@pytest.mark.parametrize(
    "make",
    [
        lambda: Attention(),
        lambda: Attention("kv", need_weights=True),
        lambda: Attention("qkv"),
        lambda: Attention("kv", kdim=E, vdim=E, add_bias_kv=True),
    ],
    ids=["self", "cross-need-weights", "distinct-qkv", "bias-kv"],
)
def test_multihead_attention_projections_are_quantized(make, fmt):
    torch.manual_seed(0)
    model, x, memory = make().eval(), _randn(B, L, E, seed=1), _randn(B, S, E, seed=2)
    compiled, backend = _compile(model, fmt)
    with torch.no_grad():
        expected, got = model(x, memory), compiled(x, memory)
    torch._dynamo.reset()
    rows = _rows(backend)
    assert set(rows) == {"attn.in_proj_weight", "attn.out_proj"}
    assert all(row.quantized for row in rows.values()), backend.plan
    assert "scaled_dot_product_attention" in rows["attn.out_proj"].reason
    assert cosine(expected, got) >= FLOOR[fmt]
    assert not torch.equal(expected, got)  # it did quantize


def test_separate_qkv_weights_are_each_quantized():
    torch.manual_seed(0)
    model = Attention("qkv", kdim=24, vdim=16).eval()
    x, memory = _randn(B, L, E, seed=1), _randn(B, S, 24, seed=2)
    model.forward = lambda x, memory: model.attn(x, memory, memory[..., :16], need_weights=False)[0]
    compiled, backend = _compile(model)
    with torch.no_grad():
        expected, got = model(x, memory), compiled(x, memory)
    torch._dynamo.reset()
    rows = _rows(backend)
    assert set(rows) == {f"attn.{p}_proj_weight" for p in "qkv"} | {"attn.out_proj"}
    assert all(row.quantized for row in rows.values())
    assert cosine(expected, got) >= FLOOR["int8_weight_only"]


@pytest.mark.parametrize("fmt", FLOOR)
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_fast_path_is_quantized(fmt, norm_first):
    layer, src = _encoder_layer(norm_first=norm_first, activation="gelu"), _randn(B, L, E, seed=1)
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[1, -2:] = True
    compiled, backend = _compile(layer, fmt)
    with torch.no_grad():
        expected, got = layer(src, src_key_padding_mask=pad), compiled(src, src_key_padding_mask=pad)
    torch._dynamo.reset()
    rows = _rows(backend)
    assert set(rows) == {"self_attn.in_proj_weight", "self_attn.out_proj", "linear1", "linear2"}
    assert all(row.quantized and "_transformer_encoder_layer_fwd" in row.reason for row in rows.values())
    assert cosine(expected[~pad], got[~pad]) >= FLOOR[fmt]


def test_one_projection_can_be_left_alone():
    layer, src = _encoder_layer(), _randn(B, L, E, seed=1)
    compiled, backend = _compile(layer, ignore=["*.out_proj"])
    with torch.no_grad():
        expected, got = layer(src), compiled(src)
    torch._dynamo.reset()
    rows = _rows(backend)
    assert not rows["self_attn.out_proj"].quantized and "ignore" in rows["self_attn.out_proj"].reason
    assert all(rows[name].quantized for name in ("self_attn.in_proj_weight", "linear1", "linear2"))
    assert cosine(expected, got) >= FLOOR["int8_weight_only"]


def test_grad_mode_quantizes_and_passes_input_gradients():
    """Grad mode: Dynamo traces the layer's slow path (MHA call + FFN linears); inputs get gradients
    through the quantized projections (frozen weights: the LoRA-on-a-quantized-base case)."""
    layer = _encoder_layer().requires_grad_(False)
    src = _randn(B, L, E, seed=1)
    compiled, backend = _compile(layer)
    grads = []
    for model in (layer, compiled):
        x = src.clone().requires_grad_(True)
        model(x).square().sum().backward()
        grads.append(x.grad)
    torch._dynamo.reset()
    rows = _rows(backend)
    assert set(rows) == {"self_attn.in_proj_weight", "self_attn.out_proj", "linear1", "linear2"}
    assert all(row.quantized for row in rows.values()), backend.plan
    assert cosine(grads[0], grads[1]) >= 0.999


def test_an_undecomposable_call_says_why_in_the_plan():
    """Training-mode dropout: the call stays PyTorch's, each projection has a row saying why."""
    model = Attention(dropout=0.5).train()
    compiled, backend = _compile(model)
    with torch.no_grad():
        compiled(_randn(B, L, E, seed=1), _randn(B, S, E, seed=2))
    torch._dynamo.reset()
    rows = _rows(backend)
    assert set(rows) == {"attn.in_proj_weight", "attn.out_proj"}
    for row in rows.values():
        assert not row.quantized and "dropout in training mode: not decomposed" in row.reason


def test_direct_native_attention_call_is_quantized():
    class Native(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(E, HEADS, batch_first=True)

        def forward(self, x):
            a = self.attn
            args = (a.in_proj_weight, a.in_proj_bias, a.out_proj.weight, a.out_proj.bias)
            return torch._native_multi_head_attention(x, x, x, E, HEADS, *args, None, False)[0]

    torch.manual_seed(0)
    model, x = Native().eval(), _randn(B, L, E, seed=1)
    compiled, backend = _compile(model)
    with torch.no_grad():
        expected, got = model(x), compiled(x)
    torch._dynamo.reset()
    assert {row.fqn for row in backend.plan.rows if row.quantized} == {"attn.in_proj_weight", "attn.out_proj"}
    assert cosine(expected, got) >= FLOOR["int8_weight_only"]


@pytest.mark.parametrize("make", [lambda: Attention(), lambda: _encoder_layer()], ids=["mha", "encoder-layer"])
def test_eager_call_after_compile_gets_released_weights_back(make):
    """After a compile released the quantized weights, the model run eagerly gets them back."""
    model, x = make().eval(), _randn(B, L, E, seed=1)
    args = (x,) if isinstance(model, nn.TransformerEncoderLayer) else (x, _randn(B, S, E, seed=2))
    compiled, _ = _compile(model)
    with torch.no_grad():
        expected = model(*args)
        compiled(*args)
        torch._dynamo.reset()
        again = model(*args)  # eager, on weights restored dequantized
    assert cosine(expected, again) >= FLOOR["int8_weight_only"]


class _AttentionThenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.lin = nn.MultiheadAttention(64, 4, batch_first=True), nn.Linear(64, 64)

    def forward(self, x, memory):
        return self.lin(self.attn(x, memory, memory, need_weights=False)[0])


@pytest.mark.parametrize("string_backend", [False, True], ids=["qp.backend", "backend='quantpass'"])
def test_dynamic_shapes_with_attention_compile_once_and_match(string_backend):
    """dynamic=True: Dynamo restarts the frame's analysis after the backend ran (the dropout float);
    the first weight release must not change how the retrace sees module calls (it raised
    SpeculationLogDivergence when the eager guard's global hook appeared only then)."""
    torch.manual_seed(0)
    model = _AttentionThenLinear().eval()
    options = {"linear": "int8_weight_only", "lowering": "aot_eager"}
    backend = "quantpass" if string_backend else qp.backend(**options)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, options=options if string_backend else None, dynamic=True)
    with torch.no_grad():
        for length in (5, 9):
            x, memory = _randn(2, length, 64, seed=length), _randn(2, length + 2, 64, seed=length + 1)
            assert cosine(model(x, memory), compiled(x, memory)) >= FLOOR["int8_weight_only"]
    torch._dynamo.reset()
