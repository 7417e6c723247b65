"""docs/howto/add-a-flavour.md, followed for a trivial flavour: registered here, exported on a tiny model, run."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import tiny_model

from kvq_export.cache_layout import REGIONS
from kvq_export.errors import ExportError
from kvq_export.export.exporter import export_model
from kvq_export.flavors import FLAVORS, Flavor, Runtime, get_flavor, register_flavor
from kvq_export.flavors.reference.graph import QuantizedCacheGraph
from kvq_export.manifest import Manifest
from kvq_export.runtime.session import KVQSession


class WindowlessCacheGraph(QuantizedCacheGraph):
    """The reference cache graph, refusing a high-precision window (its capability check)."""

    @classmethod
    def unsupported(cls, scheme, num_layers, head_dim=None):
        reasons = super().unsupported(scheme, num_layers, head_dim)
        if scheme.residual_length:
            reasons.append(f"residual_length={scheme.residual_length}: this flavour keeps no fp16 window")
        return reasons


@pytest.fixture
def windowless():
    flavor = register_flavor(Flavor("windowless", REGIONS, f"{__name__}:WindowlessCacheGraph",
                                    (Runtime.ONNXRUNTIME,), needs_plugins=False, about="the how-to's example"))
    yield flavor
    FLAVORS.pop("windowless")


def test_a_registered_flavour_exports_and_runs_like_the_graph_it_extends(windowless, tmp_path):
    model = tiny_model("llama")
    assert get_flavor("windowless") is windowless
    mine = export_model(model, "int8", tmp_path / "mine", flavor="windowless")
    ref = export_model(model, "int8", tmp_path / "ref", flavor="reference")
    assert Manifest.load(mine).flavor == "windowless"
    prompts = [[5, 17, 99, 3, 42], [60, 61, 2]]
    outs = [KVQSession(d).generate(prompts, max_new_tokens=6, stop_at_eos=False) for d in (mine, ref)]
    assert [g.tokens for g in outs[0]] == [g.tokens for g in outs[1]] and len(outs[0][0].tokens) == 6
    assert (mine / "model.onnx").read_bytes() != b"" and np.array_equal(
        np.frombuffer((mine / "model.onnx.data").read_bytes(), np.uint8),
        np.frombuffer((ref / "model.onnx.data").read_bytes(), np.uint8))


def test_a_registered_flavour_refuses_with_its_own_reasons(windowless, tmp_path):
    with pytest.raises(ExportError, match="windowless cannot hold scheme kivi-4: .*keeps no fp16 window"):
        export_model(tiny_model("llama"), "kivi-4", tmp_path / "e", flavor="windowless")
    with pytest.raises(ExportError, match="registered already"):
        register_flavor(windowless)
