"""TensorRT engine build and comparison: what runs without TensorRT, and the ``trt`` tests that need it.

Without TensorRT, ``build_engine`` / ``compare_with_onnxruntime`` must stop with a one-line
DependencyError naming what to install, and the ``trt`` tests skip with that same message. The
optimization profiles are computed from the manifest alone, so they are checked here on CPU.
"""

from __future__ import annotations

import dataclasses

import pytest
from tiny_models import tiny_model

from kvq_export._lazy import available, require
from kvq_export.errors import DependencyError
from kvq_export.export.exporter import export_model
from kvq_export.manifest import Manifest
from kvq_export.presets import PRESETS
from kvq_export.region_split import split_lengths
from kvq_export.trt import build_engine, compare_with_onnxruntime, engine_profiles


def _missing_reason() -> str | None:
    try:
        require("tensorrt")
        require("tensorrt.plugin")
    except DependencyError as err:
        return str(err)
    return None


MISSING = _missing_reason()
needs_trt = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
SCHEME = dataclasses.replace(PRESETS["kivi-4"][0], residual_length=32, sink_tokens=2)


@pytest.fixture(scope="module")
def trt_export(tmp_path_factory):
    return export_model(tiny_model("llama"), SCHEME, tmp_path_factory.mktemp("engine") / "kivi-trt", flavor="trt")


@pytest.mark.skipif(MISSING is None, reason="TensorRT is installed: the missing-dependency path cannot be shown")
def test_build_and_compare_stop_with_one_line_without_tensorrt(trt_export):
    for call in (lambda: build_engine(trt_export), lambda: compare_with_onnxruntime(trt_export)):
        with pytest.raises(DependencyError) as err:
            call()
        message = str(err.value)
        assert "\n" not in message and "TensorRT >= 10.9" in message and "install" in message


def test_optimization_profiles_cover_every_input(trt_export):
    manifest = Manifest.load(trt_export)
    profiles = engine_profiles(manifest, max_batch=8, max_context=1000, max_prefill=300)
    names = ["input_ids", "attention_mask", *(t.name for t in manifest.cache("past"))]
    assert list(profiles) == ["prefill", "decode"]
    for shapes in profiles.values():
        assert list(shapes) == names
        for lo, opt, hi in shapes.values():
            assert all(a <= b <= c for a, b, c in zip(lo, opt, hi))
    prefill, decode = profiles["prefill"], profiles["decode"]
    assert prefill["input_ids"] == ((1, 1), (4, 256), (8, 300)) and decode["input_ids"][2] == (8, 1)
    key_tq, value_tq = SCHEME.for_layer(0)
    _, key_quant, _ = split_lengths(key_tq, SCHEME, 1000)
    assert decode["past.0.key.codes"][2] == (8, 2, key_quant, 16)  # int4: 32 channels -> 16 bytes
    assert decode["past.0.key.scales"][2][2] == key_quant // 32  # channel axis: groups of 32 tokens
    assert decode["past.0.key.recent"][2][2] == 32 + 32 - 1  # window + a group being filled
    assert decode["past.0.value.recent"][2][2] == 32  # token axis: exactly the window
    assert decode["past.0.key.sinks"] == ((1, 2, 0, 32), (4, 2, 2, 32), (8, 2, 2, 32))
    assert prefill["past.0.value.codes"][1][2] == 0  # prefill is tuned for an empty cache


@pytest.mark.trt
@needs_trt
def test_plugins_register_from_the_manifest(trt_export):
    from kvq_plugins.trt_plugin import register_for_export

    ids = register_for_export(trt_export)
    assert ids == ["kvq::kvq_attention_asym_asym"] * 2
    assert register_for_export(trt_export) == ids  # idempotent within a process


@pytest.mark.trt
@pytest.mark.gpu
@needs_trt
def test_engine_matches_onnxruntime_reference(trt_export, tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    engine = build_engine(trt_export, max_batch=2, max_context=256, max_prefill=64, output=tmp_path / "m.engine")
    reference = export_model(tiny_model("llama"), SCHEME, tmp_path / "reference")
    assert compare_with_onnxruntime(trt_export, reference_dir=reference, engine=engine, steps=40)


def test_tensorrt_availability_is_reported_consistently():
    assert (MISSING is None) == (available("tensorrt") and available("tensorrt.plugin"))


def test_aot_ptx_loses_only_unused_trailing_scratch_parameters():
    from kvq_plugins.trt_plugin import fit_ptx_params

    from kvq_export.errors import KVQError

    params = ",\n".join(f"\t.param .u64 .ptr .global .align 1 k_param_{i}" for i in range(5))
    ptx = f".visible .entry k(\n{params}\n)\n{{\n\tld.param.u64 %rd1, [k_param_0];\n\tret;\n}}\n"
    fitted = fit_ptx_params(ptx, "k", 3)
    assert fitted.split(")")[0].count(".param") == 3 and "k_param_3" not in fitted and fitted.endswith("ret;\n}\n")
    assert fit_ptx_params(ptx, "k", 5) == ptx
    with pytest.raises(KVQError, match="takes 5 parameters; TensorRT passes 4"):
        fit_ptx_params(ptx.replace("[k_param_0]", "[k_param_4]"), "k", 4)
    with pytest.raises(KVQError, match="no .entry"):
        fit_ptx_params(ptx, "other", 3)
