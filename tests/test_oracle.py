"""The backend oracle: choices for injected capabilities, precedence, and every error path."""

import logging

import pytest

from quantpass.kernels import cpu_avx2, cpu_fp4, cpu_fp8, oracle
from quantpass.kernels.oracle import Capability, NoKernelError, Problem, resolve_activation_key, select, variants
from quantpass.quant_registry import QuantSpec, keys

CPU = Capability("cpu", None, frozenset({"triton"}))
CPU_INTERPRETER = Capability("cpu", None, frozenset({"triton"}), triton_interpret=True)
H200 = Capability("cuda", 90, frozenset({"triton"}))
B200 = Capability("cuda", 100, frozenset({"triton", "flashinfer"}))
B200_NO_FLASHINFER = Capability("cuda", 100, frozenset({"triton"}))
MI300 = Capability("cuda", None, frozenset({"triton"}), hip=True)
BIG = Problem(n=4096, k=4096)
MOE = Problem(n=1536, k=4096, experts=64, topk=8, activation="silu")
FP4_ON_CPU = "cpu" if cpu_fp4.available()[0] else "reference"  # quantpass's FP4 kernel, where it builds
FP8_ON_CPU = "cpu" if cpu_fp8.available()[0] else "reference"  # and its FP8 one


@pytest.fixture(autouse=True)
def _fresh_oracle(monkeypatch):
    monkeypatch.delenv("QUANTPASS_DISABLED_BACKENDS", raising=False)
    oracle._select.cache_clear()
    oracle._logged.clear()
    yield
    oracle._select.cache_clear()


def choose(kind, spec, capability, problem=BIG, backend=None):
    if not isinstance(spec, QuantSpec):
        spec = QuantSpec.from_name(spec) if isinstance(spec, str) else QuantSpec(*spec)
    return select(kind, spec.weight, spec.activation, capability, problem, backend)


@pytest.mark.parametrize(
    ("kind", "spec", "capability", "problem", "expected"),
    [
        ("linear", "fp8_per_channel", CPU, BIG, FP8_ON_CPU),  # no FP8 units: _scaled_mm emulates (CPU_PRIORITY)
        ("linear", "fp8_per_tensor", CPU, BIG, FP8_ON_CPU),
        ("linear", "fp8_weight_only", CPU, BIG, FP8_ON_CPU),
        ("linear", ("fp8_per_tensor", "kFp8StaticTensorSym"), CPU, BIG, FP8_ON_CPU),  # a checkpoint's input_scale
        ("linear", "fp8_per_channel", H200, BIG, "native"),  # torch._scaled_mm, activation quant fused
        ("linear", "fp8_per_block", CPU, BIG, FP8_ON_CPU),  # no block _scaled_mm on CPU; Triton only if named
        ("linear", "fp8_per_block", H200, BIG, "native"),  # cuBLASLt blockwise ahead of Triton (serialised rescale)
        ("linear", "fp8_per_block", B200, BIG, "triton"),  # torch's blockwise GEMM is SM90-only
        ("linear", "fp8_per_block", H200, Problem(n=4000, k=4096), "triton"),  # N % 128: torch refuses
        ("linear", "int8_per_channel", CPU, BIG, "cpu"),  # torch._int_mm is 10x slower at prefill here
        ("linear", "int8_per_channel", H200, BIG, "native"),  # torch._int_mm
        ("linear", "int8_weight_only", CPU, BIG, "cpu"),
        ("linear", "int4_weight_only", CPU, BIG, "cpu"),
        ("linear", "int4_weight_only", H200, BIG, "triton"),
        ("linear", "mxfp8", B200, BIG, "flashinfer"),
        ("linear", "mxfp8", B200, Problem(n=4096, k=4096, m=1), "native"),  # decode: no 128-row tiles
        ("linear", "mxfp8", B200, Problem(n=64, k=4096), "native"),  # mm_mxfp8 needs N >= 128
        ("linear", "mxfp8", B200_NO_FLASHINFER, BIG, "native"),
        ("linear", "mxfp8", H200, BIG, "triton"),  # tl.dot_scaled, emulated on SM90: nothing native runs it
        ("linear", "mxfp4", H200, BIG, "native"),  # emulated Triton ranks after dequantize + F.linear
        ("linear", "mxfp4", B200, BIG, "native"),  # MX x bf16 is emulated on SM100 too
        ("moe", "mxfp4", H200, MOE, "triton"),  # emulated, but ahead of the fp32 reference
        ("linear", "mxfp8", CPU, BIG, FP8_ON_CPU),
        ("linear", "nvfp4", CPU, BIG, FP4_ON_CPU),
        ("linear", "nvfp4_weight_only", CPU, BIG, FP4_ON_CPU),
        ("linear", "mxfp4", CPU, BIG, FP4_ON_CPU),  # CPU_PRIORITY: then the reference, faster than native's decode
        ("linear", "mxfp4", CPU_INTERPRETER, BIG, FP4_ON_CPU),  # the interpreter is never picked on its own
        ("moe", "mxfp4", CPU, MOE, FP4_ON_CPU),
        ("moe", "nvfp4", CPU, MOE, FP4_ON_CPU),  # W4A4 in one C call (the reference's loop above its largest M)
        ("moe", "mxfp8", B200, MOE, "flashinfer"),
        ("moe", "mxfp8", B200, Problem(n=1536, k=4096, experts=64, topk=8, activation="swigluoai"), "triton"),
        ("moe", "mxfp8", B200, Problem(n=1536, k=4096, experts=64, topk=8, has_bias=True), "triton"),
        ("moe", "mxfp8", H200, MOE, "triton"),
        ("moe", "fp8_per_block", H200, MOE, "triton"),
        ("moe", "fp8_per_block", CPU, MOE, FP8_ON_CPU),  # one C call: the kernel quantizes each GEMM's rows
        ("moe", "mxfp8", CPU, MOE, FP8_ON_CPU),
        ("moe", "nvfp4", H200, MOE, "reference"),
        ("linear", "fp8_per_channel", MI300, BIG, "reference"),  # HIP: only the reference until supported
        ("linear", "int4_weight_only", MI300, BIG, "reference"),
        ("moe", "fp8_per_channel", MI300, MOE, "reference"),
    ],
)
def test_choices(kind, spec, capability, problem, expected):
    selection = choose(kind, spec, capability, problem)
    assert selection.backend == expected, selection
    assert all(isinstance(why, str) and why for why in selection.rejected.values())


@pytest.mark.parametrize("ours", [True, False])
def test_int4_on_cpu_with_either_kernel(ours, monkeypatch):
    """quantpass's INT4 kernel takes any N; without it, aten's packing needs N % 16 == 0 and native runs."""
    if ours and not cpu_avx2.available()[0]:
        pytest.skip(f"quantpass's CPU kernels can't run here: {cpu_avx2.available()[1]}")
    if not ours:
        monkeypatch.setattr(cpu_avx2, "available", lambda: (False, "turned off by the test"))
    assert choose("linear", "int4_weight_only", CPU, Problem(n=40, k=4096)).backend == ("cpu" if ours else "native")


def test_rejections_are_recorded_in_priority_order(monkeypatch):
    monkeypatch.setenv("QUANTPASS_DISABLED_BACKENDS", "cpu")
    selection = choose("linear", "fp8_per_block", CPU)
    assert list(selection.rejected) == ["cpu", "native", "triton"]
    assert selection.rejected["triton"] == "not chosen automatically on cpu (name it to use it)"
    assert "block" in selection.rejected["native"] or "CPU" in selection.rejected["native"]


def test_named_backend_wins_and_reasons_say_so():
    selection = choose("linear", "fp8_per_channel", CPU_INTERPRETER, backend="triton")
    assert (selection.backend, selection.reason) == ("triton", "named by the user")
    assert choose("linear", "fp8_per_channel", CPU, backend="native").backend == "native"
    assert choose("linear", "fp8_per_channel", CPU, backend="auto").backend == FP8_ON_CPU


def test_named_backend_that_cannot_run_raises_its_reason():
    with pytest.raises(
        NoKernelError, match=r"backend 'triton' can't run linear .* on cpu: needs CUDA, or TRITON_INTERPRET=1"
    ):
        choose("linear", "fp8_per_channel", CPU, backend="triton")
    with pytest.raises(NoKernelError, match=r"'flashinfer' can't run linear .* on cuda sm90: needs SM100 or SM103"):
        choose("linear", "mxfp8", H200, backend="flashinfer")


def test_named_backend_without_a_kernel_for_the_pair_lists_what_it_has():
    with pytest.raises(NoKernelError) as err:
        choose("linear", "int8_per_channel", B200, backend="flashinfer")
    assert "backend 'flashinfer' has no linear kernel for weight kInt8StaticChannelSym" in str(err.value)
    assert "backends for this pair: cpu, native, triton, reference" in str(err.value)
    with pytest.raises(
        NoKernelError,
        match=r"it takes activations \['None'\] with this weight; backends for this pair: triton, reference",
    ):
        choose("linear", (keys.kMxfp4Static, keys.kMxfp8Dynamic), CPU, backend="native")


def test_pair_without_any_kernel_lists_supported_pairs():
    with pytest.raises(
        NoKernelError,
        match=r"no linear kernel for weight kInt4StaticGroup128Sym with activation kInt8DynamicTokenSym; supported pairs: \[",
    ):
        choose("linear", (keys.kInt4StaticGroup128Sym, keys.kInt8DynamicTokenSym), CPU)


def test_unknown_names():
    with pytest.raises(
        ValueError, match="invalid backend 'cuda'; valid: auto, cpu, flashinfer, native, reference, triton"
    ):
        choose("linear", "mxfp8", CPU, backend="cuda")
    with pytest.raises(ValueError, match="invalid kind 'attention'; valid: linear, moe"):
        choose("attention", "mxfp8", CPU)


def test_disabled_backends_env(monkeypatch):
    monkeypatch.setenv("QUANTPASS_DISABLED_BACKENDS", "native, cpu")
    selection = choose("linear", "int8_weight_only", CPU)
    assert selection.backend == "reference"
    assert selection.rejected["cpu"] == selection.rejected["native"] == "disabled by QUANTPASS_DISABLED_BACKENDS"
    # ... but a named backend still runs: the user's word beats the environment
    assert choose("linear", "int8_weight_only", CPU, backend="cpu").backend == "cpu"


def test_auto_with_nothing_left_lists_every_rejection(monkeypatch):
    monkeypatch.setenv("QUANTPASS_DISABLED_BACKENDS", "cpu,native,reference")
    with pytest.raises(NoKernelError) as err:
        choose("linear", "fp8_per_channel", CPU)
    message = str(err.value)
    assert message.startswith("no backend can run linear kFp8StaticChannelSym/kFp8DynamicTokenSym on cpu: cpu: ")
    for name in ("cpu: disabled", "native: disabled", "triton: not chosen automatically", "reference: disabled"):
        assert name in message


def test_invalid_disabled_backend_name(monkeypatch):
    monkeypatch.setenv("QUANTPASS_DISABLED_BACKENDS", "tensorrt")
    with pytest.raises(
        ValueError,
        match="invalid backend 'tensorrt' in QUANTPASS_DISABLED_BACKENDS; valid: cpu, flashinfer, native, reference, triton",
    ):
        choose("linear", "fp8_per_channel", CPU)


def test_family_variants_filtered_by_activation():
    assert variants("moe", "triton", keys.kMxfp4Static) == [None, keys.kMxfp8Dynamic]
    assert variants("linear", "flashinfer", keys.kMxfp8Static) == [keys.kMxfp8Dynamic]
    assert variants("linear", "flashinfer", keys.kMxfp4Static) == []
    bf16 = choose("moe", QuantSpec(weight="mxfp4"), H200, MOE, backend="triton")  # unset: MXFP4 x BF16
    mxfp8 = choose("moe", QuantSpec(weight="mxfp4", activation="mxfp8"), H200, MOE, backend="triton")
    assert bf16.backend == mxfp8.backend == "triton"


def test_activation_override_resolution():
    assert resolve_activation_key(None, None) is None
    assert resolve_activation_key(keys.kMxfp8Dynamic, None) == keys.kMxfp8Dynamic  # the user's override
    assert resolve_activation_key(None, keys.kMxfp8Dynamic) == keys.kMxfp8Dynamic  # the checkpoint's
    assert resolve_activation_key(keys.kMxfp8Dynamic, keys.kMxfp8Dynamic) == keys.kMxfp8Dynamic
    with pytest.raises(
        ValueError,
        match="activation kFp8DynamicTokenSym requested, but the checkpoint declares activation kMxfp8Dynamic",
    ):
        resolve_activation_key(keys.kFp8DynamicTokenSym, keys.kMxfp8Dynamic)


def test_choice_logged_once_at_info_and_rejections_at_debug(caplog):
    caplog.set_level(logging.DEBUG, logger="quantpass")
    pair = (keys.kMxfp4Static, keys.kMxfp8Dynamic)  # triton (not on its own on CPU), then the reference
    choose("linear", pair, CPU)
    choose("linear", pair, CPU, Problem(n=1024, k=1024))  # same choice, another shape
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    debugs = [r for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(infos) == 1 and "-> reference" in infos[0].message
    assert any("triton rejected" in r.message for r in debugs)


def test_selection_is_cached():
    first = choose("linear", "int8_weight_only", CPU)
    assert choose("linear", "int8_weight_only", CPU) is first


def test_device_priorities_only_reorder_the_table():
    for device, by_kind in oracle.PRIORITY_BY_DEVICE.items():
        for kind, rows in by_kind.items():
            for pair, ordered in rows.items():
                assert sorted(ordered) == sorted(oracle.CANDIDATES[kind][pair]), (device, kind, pair)


def test_kernel_table_asks_each_kernel_per_device_in_priority_order():
    rows = oracle.kernel_table()
    assert len(rows) == sum(len(table) for table in oracle.CANDIDATES.values())
    by_key = {(r["kind"], r["weight"], r["activation"]): r["backends"] for r in rows}
    int4 = by_key[("linear", keys.kInt4StaticGroup128Sym, None)]
    assert int4["cpu"] == ["cpu", "native", "reference"] and int4["cuda sm90"][0] == "triton"
    mxfp4 = by_key[("linear", keys.kMxfp4Static, None)]
    assert mxfp4["cuda sm90"] == mxfp4["cuda sm100"] == ["native", "triton", "reference"]  # emulated: after native
    mxfp8 = by_key[("linear", keys.kMxfp8Static, keys.kMxfp8Dynamic)]
    assert mxfp8["cuda sm100"][0] == "flashinfer" and "flashinfer" not in mxfp8["cuda sm90"]
    fp8 = by_key[("linear", keys.kFp8StaticChannelSym, keys.kFp8DynamicTokenSym)]["cpu"]
    assert fp8 == ["cpu", "reference", "native"][FP8_ON_CPU != "cpu" :]
    assert all("reference" in backends for row in rows for backends in row["backends"].values())


def test_emulated_paths_rank_after_native_ones_and_say_so():
    """An emulated kernel (reason "emulated: ...") is tried after every other runnable candidate but
    `reference`, wherever the table lists it; with nothing else runnable it still beats `reference`."""
    selection = choose("linear", "mxfp4", H200)
    assert selection.backend == "native"
    assert selection.rejected["triton"].startswith("emulated: tl.dot_scaled on sm90")
    assert "ranked after the other backends" in selection.rejected["triton"]
    mxfp8 = choose("linear", "mxfp8", H200)
    assert mxfp8.backend == "triton" and mxfp8.reason.startswith("emulated") and "triton" not in mxfp8.rejected
    decode = choose("linear", "mxfp8", B200_NO_FLASHINFER, Problem(n=4096, k=4096, m=16))
    assert decode.backend == "native"
    named = choose("linear", "mxfp4", H200, backend="triton")  # the user's word still wins
    assert named.backend == "triton"


@pytest.mark.parametrize(
    ("capability", "problem", "emulated"),
    [
        (H200, BIG, True),  # no native MX MMA below SM100
        (B200, BIG, False),  # M unknown (dynamic): 128-row tiles run native
        (B200, Problem(n=4096, k=4096, m=4096), False),
        (B200, Problem(n=4096, k=4096, m=64), True),  # decode tiles are upcast (tests/test_triton_aot.py)
    ],
)
def test_mx_x_mx_emulation_by_device_and_rows(capability, problem, emulated):
    from quantpass.kernels import triton as triton_backend

    ok, why = triton_backend.supports("linear", capability, keys.kMxfp8Static, keys.kMxfp8Dynamic, problem)
    assert ok and why.startswith(oracle.EMULATED) is emulated, why


def test_hip_devices_get_only_the_reference_with_a_reason():
    selection = choose("linear", "fp8_per_channel", MI300)
    assert selection.backend == "reference"
    assert set(selection.rejected) == {"cpu", "native", "triton"}
    assert all(why == oracle.HIP_REFUSAL for why in selection.rejected.values())
    with pytest.raises(NoKernelError, match=r"can't run linear .* on cuda \(HIP\): HIP \(ROCm\) device"):
        choose("linear", "fp8_per_channel", MI300, backend="triton")


def test_rocm_torch_is_detected_as_hip(monkeypatch):
    """A ROCm build reports an MI300 as "cuda" with capability 9.4, which would pass NVIDIA's sm checks."""
    import torch

    oracle._detect.cache_clear()
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 4))
    try:
        capability = Capability.detect("cuda")
    finally:
        oracle._detect.cache_clear()
    assert capability.hip and capability.sm is None
    assert select("linear", keys.kFp8StaticChannelSym, keys.kFp8DynamicTokenSym, capability, BIG).backend == "reference"


def test_every_registered_backend_implements_the_contract():
    from quantpass.kernels import registry
    from quantpass.quant_registry.spec import BACKEND_NAMES

    assert ("auto", *sorted(registry.BACKEND_MODULES)) == BACKEND_NAMES  # one list of names
    for name in registry.BACKENDS:
        module = registry.backend(name)
        assert isinstance(module, registry.Backend), name
        assert all(callable(getattr(module, member)) for member in registry.MEMBERS), name
    listed = {b for table in oracle.CANDIDATES.values() for backends in table.values() for b in backends}
    assert listed == set(registry.BACKENDS)  # every candidate row names a registered backend, and all are used


def test_a_module_missing_part_of_the_contract_is_refused(monkeypatch):
    from quantpass.kernels import registry

    monkeypatch.setitem(registry.BACKEND_MODULES, "half_done", "quantpass.kernels.flashinfer_layout")
    with pytest.raises(TypeError, match="lacks DEVICES, supports, prepare_weight"):
        registry.backend("half_done")
    with pytest.raises(ValueError, match="invalid backend 'nope'; valid: auto, cpu, flashinfer, native"):
        registry.backend("nope")
