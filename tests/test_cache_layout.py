"""Cache layouts: the one split rule on every kind of value, and each layout's arrays, capacity and names."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq_export.cache_layout import BUFFER, LAYOUTS, REGIONS, layout_named
from kvq_export.errors import KVQError
from kvq_export.flavors.reference.graph import GraphSplitOps
from kvq_export.graph.builder import GraphBuilder
from kvq_export.model_facts import Geometry
from kvq_export.naming import CAPACITY_AXIS
from kvq_export.presets import get_preset
from kvq_export.region_split import RegionSplit
from kvq_export.vocab import Axis, Direction, Format, LayoutName, Part, Role

splits = st.builds(RegionSplit, sink_tokens=st.integers(0, 6), residual_length=st.integers(0, 40),
                   unit=st.sampled_from([1, 4, 32]), quantized=st.booleans())


def _by_hand(split: RegionSplit, n: int) -> tuple[int, int, int]:
    """The rule as the manifest states it, token by token: sinks fill first, the window flushes whole units."""
    if not split.quantized:
        return 0, 0, n
    sinks = quantized = recent = 0
    for _ in range(n):
        if sinks < split.sink_tokens:
            sinks += 1
            continue
        recent += 1
        flushed = split.flush(recent)
        quantized, recent = quantized + flushed, recent - flushed
    return sinks, quantized, recent


@settings(max_examples=150, deadline=None)
@given(split=splits, n=st.integers(0, 200))
def test_split_rule_is_the_streaming_rule_and_agrees_on_ints_numpy_and_torch(split, n):
    want = _by_hand(split, n)
    assert split.lengths(n) == want
    assert sum(want) == n and want[1] % split.unit == 0
    vector = np.array([n, 0, n // 2], np.int64)
    for values in (vector, torch.from_numpy(vector)):
        got = [np.asarray(x).tolist() for x in split.lengths(values)]
        assert [g[0] for g in got] == list(want)
        assert [g[1] for g in got] == [0, 0, 0]
    assert split.longest_recent(n) >= want[2]


def test_split_rule_in_the_graph_matches_python():
    """The exporter's graph evaluates the same rule (ONNX Runtime on a vector of lengths)."""
    import onnxruntime as ort

    lengths = np.arange(0, 300, 7, dtype=np.int64)
    for split in (RegionSplit(4, 32, 1), RegionSplit(0, 32, 32), RegionSplit(2, 0, 64), RegionSplit(3, 8, 4, False)):
        b = GraphBuilder(opset=21)
        n = b.input("n", ir.DataType.INT64, ("rows",))
        for name, value in zip(("sinks", "quantized", "recent"), split.lengths(n, GraphSplitOps(b))):
            b.output(value, name, ir.DataType.INT64, ("rows",))
        model = ir.serde.serialize_model(b.build())
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        got = session.run(None, {"n": lengths})
        want = np.array([split.lengths(int(x)) for x in lengths]).T
        np.testing.assert_array_equal(np.stack(got), want)


def test_layouts_are_named_and_an_unknown_name_is_refused():
    assert layout_named("regions") is REGIONS and layout_named("buffer") is BUFFER and set(LAYOUTS) == {
        "regions", "buffer"}
    assert (REGIONS.name, BUFFER.name) == (LayoutName.REGIONS, LayoutName.BUFFER)
    with pytest.raises(KVQError, match="cache layout 'ring' is not supported; allowed: regions, buffer"):
        layout_named("ring")


@pytest.mark.parametrize("preset", ["kivi-4", "int4-g32", "ort-int8", "fp16"])
def test_arrays_fill_every_tensor_at_its_declared_shape(preset):
    scheme = get_preset(preset)
    layout = BUFFER if preset == "ort-int8" else REGIONS
    specs = layout.tensors(scheme, Geometry(num_layers=2, num_kv_heads=3, head_dim=32))
    for length, rng in ((0, None), (77, np.random.default_rng(0))):
        arrays = layout.arrays(specs, scheme, 2, batch=2, length=length, capacity=100, rng=rng)
        sizes = layout.axis_sizes(scheme, 2, length, 100)
        for spec in specs:
            want = [2 if d == "batch" else d if isinstance(d, int) else sizes[d] for d in spec.shape]
            assert list(arrays[spec.name].shape) == want, spec.name
        assert arrays["past.seq_lengths"].tolist() == [length, length]
    if layout is REGIONS:  # region sizes add up to the tokens held
        assert sum(sizes.get(f"past.0.key.{r}_tokens", 0) for r in ("sinks", "quantized", "recent")) == 77
        assert layout.capacity_for(10) is None and not layout.shared(specs[1])
    else:
        assert sizes == {CAPACITY_AXIS: 100} and layout.capacity_for(10) == 10
        assert layout.capacity_of({s.name: arrays[s.name].shape for s in specs}) == 100
        assert all(layout.shared(s) for s in specs[1:]) and not layout.shared(specs[0])


def test_a_buffer_grows_with_its_contents_kept():
    spec = BUFFER.tensors(get_preset("ort-int8"), Geometry(num_layers=1, num_kv_heads=2, head_dim=8))[1]
    old = np.arange(2 * 2 * 5 * 8, dtype=np.int8).reshape(2, 2, 5, 8)
    new = BUFFER.grown(spec, old, 12)
    assert new.shape == (2, 2, 12, 8) and new.dtype == np.int8
    np.testing.assert_array_equal(new[:, :, :5], old)


def test_cache_tensors_hold_members_and_describe_themselves_in_plain_strings():
    specs = REGIONS.tensors(get_preset("kivi-4"), Geometry(num_layers=1, num_kv_heads=2, head_dim=32), "present")
    assert [(s.direction, s.part, s.role) for s in specs[:2]] == [
        (Direction.PRESENT, None, Role.SEQ_LENGTHS), (Direction.PRESENT, Part.KEY, Role.SINKS)]
    codes = next(s for s in specs if s.role == Role.CODES)
    assert (codes.format, codes.group_axis) == (Format.INT, Axis.CHANNEL)
    described = codes.to_dict()
    assert all(type(described[k]) is str for k in ("direction", "part", "role", "format", "group_axis", "quantizer"))
