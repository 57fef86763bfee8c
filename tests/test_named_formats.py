"""The format table (issue 16): one `Format` row per name, every name table derived from it, and a
format added in a test runs end to end through torch.compile on the reference backend."""

import pytest
import torch
from tiny_models import token_ids
from tiny_moe_models import eager_and_compiled_logits, moe_op_count, tiny_moe

import quantpass as qp
from quantpass.kernels import oracle
from quantpass.metrics import cosine, sqnr
from quantpass.passes.fx_utils import op_counts
from quantpass.quant_registry import keys, named_formats
from quantpass.quant_registry.keys import F32, INT8, GroupShape, QuantKey, ScaleDesc, kInt8DynamicTokenSym
from quantpass.quant_registry.named_formats import FORMATS, Format, register_format, unregister_format
from quantpass.quant_registry.spec import DEFAULT_ACTIVATION, ROLE_NAMES, SHORTHANDS, QuantSpec, quant_key
from quantpass.report import formats_table


def test_name_tables_are_views_of_the_rows():
    assert {f.name: f.pair for f in FORMATS.values()} == SHORTHANDS
    assert quant_key("mxfp4", "activation") == keys.kMxfp4Dynamic  # the name's activation key ...
    assert SHORTHANDS["mxfp4"] == (keys.kMxfp4Static, None)  # ... is not its shorthand's default
    assert ROLE_NAMES["fp8_per_token"] == ROLE_NAMES["fp8_per_channel"]  # an alias
    assert ROLE_NAMES["int4_per_group"] == (keys.kInt4StaticGroup128Sym, None)
    assert "int8_weight_only" not in ROLE_NAMES  # as a weight name it would get W8A8's default
    assert DEFAULT_ACTIVATION[keys.kInt8StaticChannelSym] == kInt8DynamicTokenSym  # the first row wins


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_format_has_kernels_and_a_floor(name):
    fmt = FORMATS[name]
    for kind, table in oracle.CANDIDATES.items():
        assert "reference" in table[fmt.pair], f"{name}: no reference {kind} row"
    assert fmt.verify_floor_db == named_formats.FLOOR_DB_BY_BITS[fmt.bits]
    assert fmt.bits == (4 if any(k is not None and k.bits == 4 for k in fmt.pair) else 8)


def test_a_taken_name_is_refused():
    with pytest.raises(ValueError, match="'int8_per_token' is taken"):
        register_format(Format("w8", keys.kInt8StaticChannelSym, None, aliases=("int8_per_token",)))
    assert "w8" not in FORMATS


# INT8 with one scale per 1x64 group: existing element and scale kinds, so no numerics hook.
kInt8StaticGroup64Sym = QuantKey(INT8, ScaleDesc(F32, True, GroupShape(1, 64)))


@pytest.fixture
def int8_group64(monkeypatch):
    """Everything adding the format takes: a key name, one Format row, one row per backend table
    (the reference backend's tables are the oracle's candidate rows; reference numerics are generic)."""
    keys.register_key("kInt8StaticGroup64Sym", kInt8StaticGroup64Sym)
    fmt = register_format(Format("int8_group64", kInt8StaticGroup64Sym, kInt8DynamicTokenSym, floor_db=25.0))
    for table in oracle.CANDIDATES.values():
        monkeypatch.setitem(table, fmt.pair, ["reference"])
    yield fmt
    unregister_format(fmt.name)
    keys.unregister_key("kInt8StaticGroup64Sym")


def test_a_format_registered_here_runs_end_to_end(int8_group64):
    assert QuantSpec.from_name("int8_group64").pair == int8_group64.pair
    assert QuantSpec(weight="int8_group64").name() == "int8_group64"  # activation from the row
    assert named_formats.floor_db(*int8_group64.pair) == 25.0
    assert "int8_group64" in formats_table()

    model = tiny_moe("mixtral", "batched_mm", dtype=torch.float32)
    backend = qp.backend(linear="int8_group64", moe="int8_group64", lowering="aot_eager")
    backend.keep_graphs = True
    reference_logits, logits = eager_and_compiled_logits(model, token_ids(length=9), backend)
    rows = [row for row in backend.plan.rows if row.quantized]
    assert {row.kind for row in rows} == {"linear", "moe"}, backend.plan
    assert all(row.format == "int8_group64" and row.backend == "reference" for row in rows), backend.plan
    assert all(row.weight == "kInt8StaticGroup64Sym" for row in rows)
    assert any("verified" in row.reason for row in rows)
    ((_, after),) = backend.graphs
    assert moe_op_count(op_counts(after)) == 2
    assert cosine(reference_logits, logits) >= 0.99


def test_finer_groups_err_less(int8_group64):
    w = torch.randn(96, 256) * torch.logspace(-2, 1, 256)  # columns of very different ranges
    errs = {k: sqnr(w, qp.dequantize(qp.quantize(w, k))) for k in (keys.kInt8StaticChannelSym, kInt8StaticGroup64Sym)}
    assert errs[kInt8StaticGroup64Sym] > errs[keys.kInt8StaticChannelSym] + 3, errs
