"""Memory (issue #12): quantized weights replace the originals; what still works on such a model.

Every test builds its own model: a released weight is gone from that model for good.
"""

import copy
import gc
import io

import pytest
import torch
import torch.nn as nn
from tiny_models import Block, tiny_llama, token_ids
from tiny_moe_models import tiny_moe

import quantpass as qp
from quantpass.metrics import cosine
from quantpass.quant_registry.spec import SHORTHANDS
from quantpass.weight_cache import WEIGHTS

LLAMA_FLOOR = {"nvfp4": 0.94, "mxfp4": 0.96, "int4_weight_only": 0.96, "nvfp4_weight_only": 0.96}  # test_backend's


def compile_once(model, *args, **options):
    backend = qp.backend(**{"lowering": "aot_eager", **options})
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        out = compiled(*args)
    return compiled, backend, out


def released(model) -> dict[str, bool]:
    return {name: p.untyped_storage().nbytes() == 0 for name, p in model.named_parameters()}


@pytest.mark.parametrize("shorthand", sorted(SHORTHANDS))
def test_every_format_releases_the_quantized_weights(shorthand):
    model, ids = tiny_llama(), token_ids()
    with torch.no_grad():
        expected = model(ids).logits
    compiled, backend, out = compile_once(model, ids, linear=shorthand)
    assert cosine(expected, out.logits) >= LLAMA_FLOOR.get(shorthand, 0.99)
    state = released(model)
    quantized = {row.fqn + ".weight" for row in backend.plan.quantized()}
    assert len(quantized) == 14 and all(state[name] for name in quantized)
    assert not state["lm_head.weight"] and not state["model.embed_tokens.weight"]  # left alone: kept
    with torch.no_grad():  # the next call runs from the cache alone, same numbers
        assert torch.equal(compiled(ids).logits, out.logits)


@pytest.mark.parametrize("fmt", ["int8_weight_only", "fp8_per_channel"])
def test_moe_experts_are_released(fmt):
    model = tiny_moe("qwen3_moe", "grouped_mm", torch.float32)
    ids = token_ids(length=9)
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
    _, backend, out = compile_once(model, ids, moe=fmt)
    assert cosine(expected, out.logits) >= 0.99
    experts = {name: gone for name, gone in released(model).items() if ".experts." in name}
    assert experts and all(experts.values()) and backend.plan.quantized("moe")


def test_keep_original_weights_keeps_them():
    model, x = Block(), torch.randn(4, 64)
    compile_once(model, x, linear="int8_weight_only", keep_original_weights=True)
    assert not any(released(model).values())


def test_no_recompile_and_each_instance_its_own_weights():
    blocks, x = [Block() for _ in range(3)], torch.randn(4, 64)
    with torch.no_grad():
        expected = [block(x) for block in blocks]
    backend = qp.backend(linear="int8_weight_only", lowering="aot_eager")
    torch._dynamo.reset()
    compiled = [torch.compile(block, backend=backend) for block in blocks]
    with torch.no_grad():
        first = [c(x) for c in compiled]
        again = [c(x) for c in compiled]  # released now: guards still hold, cache serves
    assert len(backend.plans) == 1
    for ref, out, out2 in zip(expected, first, again):
        assert cosine(ref, out) > 0.999 and torch.equal(out, out2)
    assert cosine(first[0], first[1]) < 0.99
    assert all(released(block)["up.weight"] and released(block)["down.weight"] for block in blocks)


def test_a_compile_that_keeps_the_originals_then_one_that_frees_them():
    """The second compile finds the first one's build in the cache (same weights, same layout), which
    recorded nothing to restore from: it builds again rather than failing to free the weights."""
    model, x = Block(), torch.randn(4, 64)
    _, _, kept = compile_once(model, x, linear="int8_weight_only", keep_original_weights=True)
    assert not any(released(model).values())
    _, _, freed = compile_once(model, x, linear="int8_weight_only")
    assert torch.equal(kept, freed) and released(model)["up.weight"] and released(model)["down.weight"]


def test_load_weights_streams_into_the_cache():
    model, x = Block(), torch.randn(4, 64)
    compiled, _, _ = compile_once(model, x, linear="int8_weight_only")
    new = {"up.weight": torch.randn(96, 64), "down.weight": torch.randn(64, 96)}
    builds = WEIGHTS.builds
    assert qp.load_weights(compiled, new) == 2  # the compiled wrapper or the model: both work
    assert released(model)["up.weight"]  # quantized straight into the cache: no full-precision copy
    with torch.no_grad():
        out = compiled(x)
        expected = new["down.weight"] @ torch.relu(new["up.weight"] @ x.T + model.up.bias[:, None]) + x.T
    assert cosine(expected.T, out) > 0.999 and WEIGHTS.builds == builds + 2
    with pytest.raises(KeyError, match="no parameter or buffer 'up.wieght'"):
        qp.load_weights(model, {"up.wieght": new["up.weight"]})
    with pytest.raises(ValueError, match="'up.weight' has shape"):
        qp.load_weights(model, {"up.weight": torch.randn(3, 3)})


def test_load_state_dict_routes_released_weights_through_load_weights():
    model, x = Block(), torch.randn(4, 64)
    source = Block()
    compiled, _, _ = compile_once(model, x, linear="int8_weight_only")
    result = model.load_state_dict(source.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    with torch.no_grad():
        assert cosine(source(x), compiled(x)) > 0.999
    assert released(model)["up.weight"]


def test_state_dict_copies_and_pickles_see_dequantized_values():
    model, x = Block(), torch.randn(4, 64)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    _, _, quantized_out = compile_once(model, x, linear="int8_weight_only")
    state = model.state_dict()
    assert cosine(state["up.weight"], original["up.weight"]) > 0.9999  # dequantized, not freed memory
    assert torch.equal(state["up.weight"], qp.state_dict(model)["up.weight"])
    assert isinstance(qp.state_dict(model, quantized=True)["up.weight"], qp.QTensor)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert not any(released(twin).values())
        with torch.no_grad():
            assert cosine(twin(x), quantized_out) > 0.9999
    assert released(model)["up.weight"]  # copying restored nothing on the original


def test_eager_call_after_release_restores_with_a_warning(caplog):
    model, x = Block(), torch.randn(4, 64)
    with torch.no_grad():
        expected = model(x)
    compiled, _, out = compile_once(model, x, linear="int8_weight_only")
    with torch.no_grad():
        eager = model(x)  # outside the compiled model: restored from the quantized values
        again = compiled(x)
    assert cosine(expected, eager) > 0.999 and torch.equal(out, again)
    assert not released(model)["up.weight"]


@pytest.mark.parametrize("other", ["inductor", "aot_eager"])
def test_plain_torch_compile_after_release_restores_with_a_warning(other, caplog):
    """Comparing against plain `torch.compile` on the same model object: that backend would read the
    freed storages (Inductor: "data is not allocated yet"); the wrapper's call restores them first."""
    model, x = Block(), torch.randn(4, 64)
    with torch.no_grad():
        expected = model(x)
    compiled, _, out = compile_once(model, x, linear="int8_weight_only")
    assert released(model)["up.weight"]
    caplog.set_level("DEBUG", logger="quantpass")
    with torch.no_grad():
        plain = torch.compile(model, backend=other)(x)
        again = compiled(x)
    assert cosine(expected, plain) > 0.999 and torch.equal(out, again)
    assert not any(released(model).values())
    assert any(f"Block compiled with backend {other}, but quantpass released" in r.message for r in caplog.records)


@pytest.mark.parametrize("other", ["inductor", "aot_eager"])
def test_a_function_compiled_with_another_backend_restores_what_it_traces(other, caplog):
    """`torch.compile(fn)` over a model whose weights quantpass released: Dynamo traces the model's
    modules for that backend, which would read the freed storages (Inductor raised "data is not
    allocated yet"); each traced module gets its weights back at trace time, with the warning. A
    function compiled with quantpass keeps them released (the same trace-time check)."""
    model, x = Block(), torch.randn(4, 64)
    with torch.no_grad():
        expected = model(x)
    _compiled, _, out = compile_once(model, x, linear="int8_weight_only")
    assert released(model)["up.weight"]

    def quantpass_fn(inputs):
        return model(inputs) * 2

    with torch.no_grad():
        twice = torch.compile(quantpass_fn, backend=qp.backend(linear="int8_weight_only", lowering="aot_eager"))(x)
    assert released(model)["up.weight"] and cosine(2 * out, twice) > 0.9999

    def fn(inputs):
        return model(inputs) * 2

    caplog.set_level("DEBUG", logger="quantpass")
    with torch.no_grad():
        plain = torch.compile(fn, backend=other)(x)
    assert cosine(2 * expected, plain) > 0.999 and not any(released(model).values())
    assert any(f"traced for backend {other}, but quantpass released" in r.message for r in caplog.records)


def _breaking_forward(self, x):
    torch._dynamo.graph_break()
    return torch.nn.functional.linear(x, self.weight).relu()


def graph_breaking_blocks(count: int) -> nn.Sequential:
    """`count` module classes, each its own forward code (Dynamo caches per code object), each
    breaking the graph: every block is called from eager code between graphs."""
    blocks = []
    for i in range(count):
        forward = type(_breaking_forward)(_breaking_forward.__code__.replace(co_name=f"forward_{i}"), globals())
        cls = type(f"Breaking{i}", (nn.Module,), {"forward": forward})
        block = cls()
        block.weight = nn.Parameter(torch.randn(32, 32) / 32**0.5)  # its own: it reads it, not a child
        blocks.append(block)
    return nn.Sequential(*blocks).eval()


@pytest.mark.parametrize("other", [None, "aot_eager"])
def test_graph_breaks_in_many_module_classes(other, caplog):
    """The eager guard runs for each module called between graphs. Dynamo compiled it as a frame of its
    own there, once per module class: past 8 classes it warned that `_restore_before_eager_use` hit
    the recompile limit and ran it eagerly. It is never a frame of its own now; the forward it precedes
    is compiled by the backend of that torch.compile, so quantpass's keeps its weights released and
    another backend's gets them back first."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    from quantpass.weight_cache import _restore_before_eager_use

    torch.manual_seed(0)
    model, x = graph_breaking_blocks(12), torch.randn(4, 32)
    with torch.no_grad():
        expected = model(x)
    compiled, _, out = compile_once(model, x, linear="int8_weight_only")
    with torch.no_grad():
        again = compiled(x)
    assert _debug_get_cache_entry_list(_restore_before_eager_use.__code__) == []
    assert all(released(model).values())
    assert cosine(expected, out) > 0.999 and torch.equal(out, again)
    if other is not None:
        caplog.set_level("DEBUG", logger="quantpass")
        with torch.no_grad():
            plain = torch.compile(lambda inputs: model(inputs), backend=other)(x)  # each block: from eager code
        assert cosine(expected, plain) > 0.999 and not any(released(model).values())  # dequantized INT8
        assert any(f"Breaking11 traced for backend {other}, but quantpass" in r.message for r in caplog.records)


@pytest.mark.parametrize("how", ["name", "name and options", "backend object"])
def test_quantpass_compiled_wrappers_keep_weights_released(how):
    """The wrapper check must recognise every way of compiling with quantpass, or every quantpass
    model would get its weights back on its next call."""
    from quantpass.weight_cache import _backend_of, _is_quantpass

    model, x = Block(), torch.randn(4, 64)
    torch._dynamo.reset()
    options = {"linear": "int8_weight_only"}
    if how == "name":  # no options: quantizes nothing, but is still quantpass's
        compiled = torch.compile(model, backend="quantpass")
    elif how == "name and options":
        compiled = torch.compile(model, backend="quantpass", options=options)
    else:
        compiled = torch.compile(model, backend=qp.backend(**options, lowering="aot_eager"))
    assert _is_quantpass(_backend_of(compiled))
    if how != "name":
        with torch.no_grad():
            first = compiled(x)
            assert released(model)["up.weight"]
            assert torch.equal(compiled(x), first) and released(model)["up.weight"]


def test_a_graph_reading_a_released_weight_raw_restores_it():
    """An embedding tied to a quantized head: the graph holding the embedding is compiled before the
    graph that quantizes (and releases) the head; the next call restores it first."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(32, 64)
            self.head = nn.Linear(64, 32, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            h = self.embed(ids)
            torch._dynamo.graph_break()
            return self.head(h)

    model, ids = Tied(), torch.randint(0, 32, (2, 5))
    with torch.no_grad():
        expected = model(ids)
    compiled, backend, _ = compile_once(model, ids, linear="int8_weight_only", targets={"head": "int8_weight_only"})
    assert backend.plan.quantized() and released(model)["embed.weight"]
    with torch.no_grad():
        out = compiled(ids)
    assert cosine(expected, out) > 0.999 and not released(model)["embed.weight"]


def test_released_weight_dies_with_its_model():
    model, x = Block(), torch.randn(4, 64)
    compile_once(model, x, linear="int8_weight_only")
    entries = len(WEIGHTS)
    torch._dynamo.reset()
    del model
    gc.collect()
    assert len(WEIGHTS) <= entries - 2
