"""The Calibration artifact: its file round trip, its digest, bounded reads and the graph as the source of truth."""

from __future__ import annotations

import hashlib
import io
import json
import random
import shutil
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from seeds import base_seed
from tiny_models import WORDS, save_tiny_model_dir

from kvq_export.calibration import Calibration
from kvq_export.calibration.artifact import HIGH_CHANNELS, PARTS
from kvq_export.errors import KVQError, RuntimeInputError, SchemeError
from kvq_export.export.exporter import export_model
from kvq_export.graph_facts import check_graph_calibration
from kvq_export.manifest import Manifest, load_static
from kvq_export.presets import get_preset
from kvq_export.request import CalibrationSpec
from kvq_export.vocab import Part

#: a calibration whose digest kvq.json files and graphs already record: the rule must never change
FIXED = {0: {"key": {"scales": np.arange(6, dtype=np.float32).reshape(2, 3) / 7 + 0.5,
                     "zero_points": -np.arange(6, dtype=np.float32).reshape(2, 3)},
             "value": {HIGH_CHANNELS: np.array([[1, 4], [0, 2]], np.int32)}},
         3: {"value": {"scales": np.full((2, 1), 0.25, np.float32)}}}


# -- the file and the digest --------------------------------------------------------------------------------
@st.composite
def calibrations(draw):
    """Nested mappings over a few layers, parts and roles, each array its own 2-D shape."""
    static: dict = {}
    for layer in draw(st.lists(st.integers(0, 40), min_size=1, max_size=4, unique=True)):
        for part in draw(st.lists(st.sampled_from(PARTS), min_size=1, max_size=2, unique=True)):
            for role in draw(st.lists(st.sampled_from(("scales", "zero_points", HIGH_CHANNELS)), min_size=1,
                                      max_size=3, unique=True)):
                shape = (draw(st.integers(1, 4)), draw(st.integers(1, 9)))
                seed = draw(st.integers(0, 2**31 - 1))
                rng = np.random.default_rng(seed)
                array = (rng.integers(0, 64, shape).astype(np.int32) if role == HIGH_CHANNELS
                         else rng.standard_normal(shape).astype(np.float32))
                static.setdefault(layer, {}).setdefault(part, {})[role] = array
    return static


@settings(max_examples=40, deadline=None)
@given(static=calibrations())
def test_save_then_load_gives_the_same_arrays_and_digest(static, tmp_path_factory):
    calibration = Calibration.of(static)
    back = Calibration.load(calibration.save(tmp_path_factory.mktemp("rt") / "c.npz"))
    assert back == calibration and back.digest() == calibration.digest()
    assert list(back) == sorted(static)
    for layer, parts in static.items():
        for part, roles in parts.items():
            for role, array in roles.items():
                got = back[layer][part][role]
                assert got.dtype == array.dtype and got.shape == array.shape
                np.testing.assert_array_equal(got, array)


def test_the_digest_rule_is_stable():
    calibration = Calibration.of(FIXED)
    assert calibration.digest() == "d4f34c9ca3cd8fa6"
    assert calibration.digest(40) == "d4f34c9ca3cd8fa63aaaf61ebc6db844ee3774d5"
    # names, shapes and float32 bytes in (layer, part, role) order, whatever order or type the input came in
    reordered = {3: FIXED[3], 0: {"value": FIXED[0]["value"], "key": dict(reversed(FIXED[0]["key"].items()))}}
    as_torch = {layer: {part: {role: torch.as_tensor(a.astype(np.float64) if role != HIGH_CHANNELS else a)
                               for role, a in roles.items()} for part, roles in parts.items()}
                for layer, parts in FIXED.items()}
    assert Calibration.of(reordered).digest() == Calibration.of(as_torch).digest() == calibration.digest()
    changed = {**FIXED, 3: {"value": {"scales": np.full((2, 1), 0.5, np.float32)}}}
    assert Calibration.of(changed).digest() != calibration.digest()


def test_parts_index_as_part_members_and_the_file_keeps_its_bytes(tmp_path):
    """Parts are :class:`Part` members (a StrEnum): names, JSON keys and the bytes of the file stay as they were."""
    calibration = Calibration.of(FIXED)
    assert [type(part) for part in calibration[0]] == [Part, Part]
    assert calibration[0][Part.KEY] is calibration[0]["key"] and list(calibration.arrays)[0] == "0.key.scales"
    assert json.dumps({part: 0 for part in calibration[0]}) == '{"key": 0, "value": 0}'
    path = calibration.save(tmp_path / "c.npz")
    assert zipfile.ZipFile(path).namelist() == ["0.key.scales.npy", "0.key.zero_points.npy",
                                               "0.value.high_channels.npy", "3.value.scales.npy"]
    # what kvq wrote before parts were typed (numpy's .npy header and zip layout included)
    assert hashlib.sha256(path.read_bytes()).hexdigest()[:16] == "fe82b06cc6d0ad4d"


def test_the_artifact_is_a_read_only_mapping():
    calibration = Calibration.of(FIXED)
    assert set(calibration) == {0, 3} and calibration[0]["value"][HIGH_CHANNELS].dtype == np.int32
    with pytest.raises(TypeError):
        calibration[0]["key"]["scales"] = np.ones((2, 3), np.float32)
    assert calibration.to_torch()[0]["value"][HIGH_CHANNELS].dtype == torch.int64
    with pytest.raises(KVQError, match="must hold integer channel indices"):
        Calibration.of({0: {"key": {HIGH_CHANNELS: np.ones((2, 2), np.float32)}}})
    with pytest.raises(KVQError, match="must be 2-D"):
        Calibration.of({0: {"key": {"scales": np.ones(3, np.float32)}}})


def test_check_refuses_arrays_no_stream_uses():
    scheme = get_preset("ort-int8")
    geometry = SimpleNamespace(num_layers=1, num_kv_heads=2, head_dim=3)
    ok = {0: {part: {"scales": np.ones((2, 3), np.float32)} for part in PARTS}}
    Calibration.of(ok).check(scheme, geometry)
    with pytest.raises(SchemeError, match=r"calibration 1\.key\.scales belongs to no stream"):
        Calibration.of({**ok, 1: ok[0]}).check(scheme, geometry)


# -- bounded reads ------------------------------------------------------------------------------------------
def _one_line(err: Exception) -> str:
    text = str(err)
    assert "\n" not in text
    return text


def test_an_oversized_file_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "huge.npz"
    with open(path, "wb") as handle:  # sparse: 65 MiB that take no disk
        handle.truncate(65 << 20)
    with pytest.raises(KVQError, match="kvq reads at most 64 MiB") as err:
        Calibration.load(path)
    _one_line(err.value)


def _npz_with(name: str, member: bytes, compress: int = zipfile.ZIP_STORED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compress) as archive:
        archive.writestr(name, member)
    return buffer.getvalue()


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    return buffer.getvalue()


def test_a_header_claiming_a_huge_array_is_refused_not_allocated(tmp_path):
    buffer = io.BytesIO()  # np.load would allocate the 1.2 TB it claims before reading the 24 bytes that follow
    np.lib.format.write_array_header_1_0(buffer, {"descr": "<f4", "fortran_order": False, "shape": (10**11, 3)})
    path = tmp_path / "liar.npz"
    path.write_bytes(_npz_with("0.key.scales.npy", buffer.getvalue() + np.ones(6, np.float32).tobytes()))
    with pytest.raises(KVQError, match=r"not a readable calibration file: .*claims shape \[100000000000, 3\]") as err:
        Calibration.load(path)
    _one_line(err.value)


def test_an_archive_that_unpacks_past_the_limit_is_refused(tmp_path):
    path = tmp_path / "bomb.npz"
    path.write_bytes(_npz_with("0.key.scales.npy", _npy(np.zeros((1024, 1024), np.float32)), zipfile.ZIP_DEFLATED))
    assert path.stat().st_size < 64 << 10
    with pytest.raises(KVQError, match="unpack to 4194432 bytes; kvq reads at most 65536"):
        Calibration.load(path, limit=64 << 10)
    Calibration.load(path)  # within the default limit it is a plain (large) calibration


@pytest.mark.parametrize(("array", "match"), [
    (np.array([[object()]], dtype=object), "holds object"),
    (np.ones((2, 3), np.float64), "holds float64"),
])
def test_members_of_another_dtype_are_refused(tmp_path, array, match):
    path = tmp_path / "odd.npz"
    path.write_bytes(_npz_with("0.key.scales.npy", _npy(array)))
    with pytest.raises(KVQError, match=match):
        Calibration.load(path)


def test_a_wrong_dtype_for_the_role_is_refused(tmp_path):
    path = tmp_path / "ints.npz"
    np.savez(path, **{"0.key.scales": np.ones((2, 3), np.int32)})
    with pytest.raises(KVQError, match="'0.key.scales' must be 2-D float32, got int32"):
        Calibration.load(path)


# -- the graph is the source of truth --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("artifact")
    random.seed(base_seed())
    (path / "words.txt").write_text(" ".join(random.choice(WORDS) for _ in range(3000)))
    save_tiny_model_dir(path / "tiny")
    return path


EXPORTS = [("ort-int4-hc16", "reference"), ("ort-int4-asymk", "ort-gqa"), ("ort-int4-hc16", "ort-gqa"),
           ("ort-int4-hc16", "trt")]


@pytest.fixture(scope="module")
def exports(root):
    spec = CalibrationSpec(corpus=str(root / "words.txt"), tokens=256, offset=0)
    return {(scheme, flavor): export_model(str(root / "tiny"), scheme, root / f"{scheme}-{flavor}", flavor=flavor,
                                           calibration=spec) for scheme, flavor in EXPORTS}


def _doctored(calibration: Calibration, name: str) -> Calibration:
    arrays = dict(calibration.arrays)
    array = arrays[name]
    if name.endswith(HIGH_CHANNELS):  # another valid choice: the lowest channels
        changed = np.broadcast_to(np.arange(array.shape[1], dtype=np.int32), array.shape)
        if np.array_equal(changed, array):
            changed = changed + 1
        arrays[name] = changed
    else:
        arrays[name] = array * 2
    return Calibration(arrays)


@pytest.mark.parametrize(("scheme", "flavor"), EXPORTS)
def test_every_calibration_array_is_compared_with_the_graph(exports, scheme, flavor):
    directory = exports[scheme, flavor]
    manifest = Manifest.load(directory)
    calibration = load_static(directory, manifest)
    graphs = ["model.onnx"] + (["model.genai.onnx"] if flavor == "ort-gqa" else [])
    for graph in graphs:
        check_graph_calibration(directory, manifest, directory / graph, calibration)  # as exported: accepted
        for name in calibration.arrays:
            with pytest.raises(RuntimeInputError, match=r"graph constant static\.\d+\.\w+\.[\w.]+ disagrees with "
                                                        rf"calibration {'.'.join(name.split('.')[:2])}") as err:
                check_graph_calibration(directory, manifest, directory / graph, _doctored(calibration, name))
            _one_line(err.value)


def _rewrite_everything(directory: Path, doctored: Calibration) -> None:
    """Replace the calibration and recompute every digest that names it: kvq.json's and the graphs' own."""
    import onnx

    np.savez(directory / "calibration.npz", **doctored.arrays)
    for graph in ("model.onnx", "model.genai.onnx"):
        path = directory / graph
        if path.is_file():
            model = onnx.load(str(path), load_external_data=False)
            for entry in model.metadata_props:
                if entry.key == "kvq.calibration":
                    entry.value = doctored.digest(len(entry.value))
            onnx.save(model, str(path))
    data = json.loads((directory / "kvq.json").read_text())
    data["calibration"]["digest"] = doctored.digest()
    for name in data["weights"]:
        blob = (directory / name).read_bytes()
        data["weights"][name] = {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
    (directory / "kvq.json").write_text(json.dumps(data))


def test_a_doctored_calibration_with_every_digest_recomputed_is_refused_at_load(exports, tmp_path):
    from kvq_export.runtime.genai import GenaiSession
    from kvq_export.runtime.session import KVQSession

    directory = Path(shutil.copytree(exports["ort-int4-asymk", "ort-gqa"], tmp_path / "e"))
    calibration = load_static(directory, Manifest.load(directory))
    _rewrite_everything(directory, _doctored(calibration, "1.key.zero_points"))
    with pytest.raises(RuntimeInputError, match=r"graph constant static\.1\.packed\.offset disagrees with "
                                                r"calibration 1\.key") as err:
        KVQSession(directory)
    _one_line(err.value)
    with pytest.raises(RuntimeInputError, match="disagrees with calibration 1.key"):
        GenaiSession(directory)


def test_an_oversized_calibration_file_in_an_export_is_one_line(exports, tmp_path):
    from kvq_export.runtime.session import KVQSession

    directory = Path(shutil.copytree(exports["ort-int4-hc16", "reference"], tmp_path / "e"))
    with open(directory / "calibration.npz", "r+b") as handle:
        handle.truncate(65 << 20)
    with pytest.raises(RuntimeInputError, match="calibration file .* kvq reads at most 64 MiB") as err:
        KVQSession(directory, verify_weights=False)
    _one_line(err.value)
