"""`@qp.compile`: instances of a decorated class compile with quantpass on their first call (issue #6)."""

import pytest
import torch
from tiny_models import Block

import quantpass as qp
from quantpass.metrics import cosine

OPTIONS = {"linear": "int8_per_channel", "lowering": "aot_eager"}


def compiles(module_class) -> int:
    """How many graphs the class's shared backend has compiled."""
    return len(module_class._quantpass_settings.backend.quantpass.plans)


@qp.compile(**OPTIONS)
class AnnotatedBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # annotated: dim 0 is inferred dynamic
        return super().forward(x)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    AnnotatedBlock._quantpass_settings.backend.quantpass.plans.clear()  # shared by the tests below


def test_compiles_on_first_call_and_holds_the_plan():
    block = AnnotatedBlock()
    assert block.quantpass_plan is None and compiles(AnnotatedBlock) == 0  # nothing before the first call
    x = torch.randn(5, 64)
    with torch.no_grad():
        expected = Block.forward(block, x)  # before: run eagerly after, it gets its weights back (the plan says so)
        assert cosine(expected, block(x)) > 0.999
    assert compiles(AnnotatedBlock) == 1
    assert block.quantpass_plan.summary() == "linear: 2 quantized (int8_per_channel; cpu 2) | 0 skipped"
    assert {row.fqn for row in block.quantpass_plan.rows} == {"up", "down"}


def test_instances_share_one_graph_and_each_knows_its_plan():
    first, second = AnnotatedBlock(), AnnotatedBlock()
    x = torch.randn(4, 64)
    with torch.no_grad():
        outputs = [first(x), second(x)]
        expected = [Block.forward(first, x), Block.forward(second, x)]
    assert compiles(AnnotatedBlock) == 1  # the second instance reused the first one's graph
    assert all(cosine(e, o) > 0.999 for e, o in zip(expected, outputs))  # ...with its own weights
    assert len(second.quantpass_plan.quantized()) == 2


@pytest.mark.parametrize("explicit", [True, False], ids=["dynamic_arg_dims", "inferred_from_annotations"])
def test_dynamic_dims_do_not_recompile(explicit):
    if explicit:

        @qp.compile(**OPTIONS, dynamic_arg_dims={"x": 0})
        class Model(Block):  # no annotation: only the explicit dims mark anything
            pass

    else:
        Model = AnnotatedBlock
    model = Model()
    with torch.no_grad():
        for rows in (3, 7, 11):
            x = torch.randn(rows, 64)
            assert cosine(Block.forward(model, x), model(x)) > 0.999
    assert compiles(Model) == 1


def test_dynamic_sequence_dim_of_a_transformers_model():
    transformers = pytest.importorskip("transformers")

    @qp.compile(**OPTIONS, dynamic_arg_dims={"input_ids": 1})
    class TinyLlama(transformers.LlamaForCausalLM):
        pass

    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, vocab_size=128
    )
    model = TinyLlama(config).eval()
    with torch.no_grad():
        for length in (5, 9):
            ids = torch.randint(0, 128, (1, length))
            assert cosine(transformers.LlamaForCausalLM.__call__(model, ids).logits, model(ids).logits) > 0.99
    assert compiles(TinyLlama) == 1
    assert model.quantpass_plan.summary().startswith("linear: 7 quantized")


def test_enable_if_decides_per_instance():
    @qp.compile(**OPTIONS, enable_if=lambda module: module.up.out_features > 64)
    class Sized(Block):
        pass

    small, large = Sized(hidden=32), Sized(hidden=96)
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert torch.equal(small(x), Block.forward(small, x))  # eager: bit-identical
        large(x)
    assert small.quantpass_plan is None
    assert len(large.quantpass_plan.quantized()) == 2


def test_subclasses_inherit_and_can_opt_out():
    class Inherits(AnnotatedBlock):
        pass

    @qp.compile(enabled=False)
    class OptsOut(AnnotatedBlock):
        pass

    x = torch.randn(4, 64)
    with torch.no_grad():
        inherits, opts_out = Inherits(), OptsOut()
        inherits(x)
        assert torch.equal(opts_out(x), Block.forward(opts_out, x))
    assert len(inherits.quantpass_plan.quantized()) == 2
    assert opts_out.quantpass_plan is None


def test_state_dict_loaded_before_the_first_call():
    source, target = Block(), AnnotatedBlock()
    target.load_state_dict(source.state_dict())
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert cosine(source(x), target(x)) > 0.999


def test_weight_update_after_the_first_call_is_picked_up():
    block = AnnotatedBlock()
    x = torch.randn(4, 64)
    new = torch.randn_like(block.up.weight)
    with torch.no_grad():
        stale = block(x)  # quantizes, then frees the original weights
        qp.load_weights(block, {"up.weight": new})  # e.g. an RL weight sync
        fresh = block(x)
        expected = block.down(torch.relu(torch.nn.functional.linear(x, new, block.up.bias))) + x
    assert cosine(expected, fresh) > 0.999 > cosine(expected, stale)
    assert compiles(AnnotatedBlock) == 1


def test_bad_options_fail_at_decoration():
    with pytest.raises(ValueError, match="invalid quantization 'fp9'"):
        qp.compile(linear="fp9")
    with pytest.raises(ValueError, match="invalid quantpass option 'lineer'"):
        qp.compile(lineer="fp8_per_channel")
    with pytest.raises(ValueError, match="invalid dynamic_arg_dims argument 'y' for Block.forward; valid: x"):
        qp.compile(dynamic_arg_dims={"y": 0})(Block)
    with pytest.raises(TypeError, match="decorates torch.nn.Module subclasses"):
        qp.compile(linear="fp8_per_channel")(object)


def test_a_class_with_nothing_to_quantize_still_runs():
    """Every layer ignored: the backend lowers the graph unchanged (AOTAutograd here), and the
    decorator must call that with Dynamo's *args convention."""

    @qp.compile(linear="int8_per_channel", ignore=["*"], lowering="aot_eager")
    class Ignored(Block):
        pass

    block = Ignored()
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.allclose(block(x), Block.forward(block, x))
        assert torch.allclose(block(x), Block.forward(block, x))
    assert block.quantpass_plan.quantized() == [] and len(block.quantpass_plan.rows) == 2
