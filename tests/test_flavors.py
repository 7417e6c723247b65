"""The flavour registry: declared layouts, runtimes, plugins, graph classes and refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvq_export.cache_layout import BUFFER, REGIONS
from kvq_export.errors import ExportError
from kvq_export.flavors import FLAVORS, FlavorName, Runtime, flavor_names, get_flavor
from kvq_export.presets import get_preset


def test_every_flavour_declares_its_capabilities():
    assert flavor_names() == ["reference", "ort-gqa", "trt"] == [str(name) for name in FlavorName]
    reference, gqa, trt = (get_flavor(name) for name in flavor_names())
    assert (reference.layout, gqa.layout, trt.layout) == (REGIONS, BUFFER, REGIONS)
    assert [f.needs_plugins for f in (reference, gqa, trt)] == [False, False, True]
    assert gqa.serves("onnxruntime-genai") and gqa.serves(Runtime.ONNXRUNTIME)
    assert not reference.serves(Runtime.GENAI) and trt.runtimes == (Runtime.TENSORRT,)
    assert [f.serves("tensorrt") for f in (reference, gqa, trt)] == [True, False, True]  # com.microsoft ops: no
    assert get_flavor(FlavorName.ORT_GQA) is gqa and FLAVORS[FlavorName.TRT] is trt


def test_graph_classes_share_one_base_with_declared_flags():
    from kvq_export.export.decoder import CacheGraph

    classes = {name: get_flavor(name).graph_class() for name in flavor_names()}
    assert all(issubclass(cls, CacheGraph) for cls in classes.values())
    assert [classes[n].__name__ for n in flavor_names()] == ["QuantizedCacheGraph", "GQACacheGraph", "TrtCacheGraph"]
    from kvq_export.flavors.cache_graph import AttentionForm
    from kvq_export.flavors.ort_gqa.graph import GQABodyRopeCacheGraph

    assert classes["ort-gqa"].attention == AttentionForm.PROJECTED  # RoPE in the node
    assert GQABodyRopeCacheGraph.attention == AttentionForm.PACKED  # RoPE in the body, q|k|v packed
    assert classes["reference"].attention == classes["trt"].attention == AttentionForm.HEADS
    assert classes["reference"].supports_attn_softcap and not classes["trt"].supports_attn_softcap
    assert not any(cls.fuses_body for cls in classes.values())  # an ort-gqa option, on by default
    assert CacheGraph.rotation(None, 0, "key") is None  # the base hook: no rotation


def test_unsupported_gives_the_reasons_and_build_refuses_with_them():
    from tiny_models import tiny_model

    from kvq_export.model_source import model_facts

    reference, gqa = get_flavor("reference"), get_flavor("ort-gqa")
    kivi = get_preset("kivi-4")
    assert reference.unsupported(kivi) == [] and gqa.unsupported(get_preset("ort-int8")) == []
    reasons = gqa.unsupported(kivi)
    assert reasons and any("dynamic scales" in r for r in reasons)
    facts = model_facts(tiny_model("llama").config)
    with pytest.raises(ExportError, match="flavor ort-gqa cannot hold scheme kivi-4: .*dynamic scales"):
        gqa.build(kivi, facts)
    graph = reference.build(kivi, facts)
    assert type(graph).__name__ == "QuantizedCacheGraph" and graph.geometry.num_layers == facts.num_layers


def test_unknown_flavour_names_the_allowed_ones():
    with pytest.raises(ExportError, match=r"unknown flavor 'nope'; allowed: reference, ort-gqa, trt"):
        get_flavor("nope")


def test_the_registry_imports_no_graph_code():
    code = ("import sys, kvq_export.flavors as f\n"
            "f.get_flavor('ort-gqa')\n"
            "assert not any(m in sys.modules for m in ('onnx_ir', 'kvq_export.flavors.ort_gqa.graph', 'torch')), "
            "sorted(m for m in sys.modules if m.startswith(('onnx', 'kvq_export.export')))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
