"""An export is data, not code.

Every file stays inside the directory, the manifest is typed and checked against the graph, weights and
calibration against their checksums; and one rule says when an export may be reused.
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import WORDS, save_tiny_model_dir

from kvq_export.errors import KVQError, RuntimeInputError
from kvq_export.export.exporter import ensure_export, export_model
from kvq_export.manifest import Manifest, load_static
from kvq_export.request import CalibrationSpec, ExportRequest
from kvq_export.runtime.session import KVQSession


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def model_dir(root):
    return save_tiny_model_dir(root / "tiny")


@pytest.fixture(scope="module")
def kivi(root, model_dir):
    return export_model(model_dir, "kivi-2", root / "kivi")


@pytest.fixture(scope="module")
def static(root, model_dir):
    text = root / "calib.txt"
    text.write_text(" ".join(WORDS * 20))
    return export_model(model_dir, "ort-int8", root / "static",
                        calibration=CalibrationSpec(corpus=str(text), tokens=256, offset=0))


def _copy(src, tmp_path, name="copy"):
    return shutil.copytree(src, tmp_path / name)


def _edit(directory, change):
    path = directory / "kvq.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("name", ["../outside.npz", "/etc/passwd", "sub/../../outside.npz", ""])
def test_manifest_file_names_must_stay_inside_the_export(static, tmp_path, name):
    directory = _copy(static, tmp_path)
    shutil.copy(directory / "calibration.npz", tmp_path / "outside.npz")
    _edit(directory, lambda m: m["calibration"].update(file=name))
    with pytest.raises(RuntimeInputError, match="not a plain name inside the export"):
        KVQSession(directory)


@pytest.mark.parametrize("target", ["calibration.npz", "tokenizer.json", "model.onnx.data"])
def test_a_symlink_out_of_the_export_is_refused(static, tmp_path, target):
    directory = _copy(static, tmp_path)
    outside = tmp_path / f"outside-{target}"
    shutil.move(directory / target, outside)
    (directory / target).symlink_to(outside)
    with pytest.raises(RuntimeInputError, match="outside the export directory"):
        KVQSession(directory, verify_weights=False)


def test_the_calibration_digest_is_checked(static, tmp_path):
    directory = _copy(static, tmp_path)
    manifest = Manifest.load(directory)
    scales = load_static(directory, manifest)
    np.savez(directory / "calibration.npz", **{f"{layer}.{part}.{role}": array * 2 for layer, parts in scales.items()
                                               for part, roles in parts.items() for role, array in roles.items()})
    # the file's checksum would refuse it first: these check the calibration digest behind it
    with pytest.raises(RuntimeInputError, match="does not match the calibration digest"):
        KVQSession(directory, verify_weights=False)
    (directory / "calibration.npz").write_bytes(b"not a zip")
    with pytest.raises(RuntimeInputError, match="not a readable calibration file"):
        KVQSession(directory, verify_weights=False)


@pytest.mark.parametrize("change", [
    lambda m: m["scheme"].update(residual_length=m["scheme"]["residual_length"] * 2),
    lambda m: m["scheme"].update(sink_tokens=4),
    lambda m: (m["scheme"]["key"].update(bits=4), m["scheme"]["value"].update(bits=4)),
    lambda m: m["scheme"]["key"].update(clip=0.5),
], ids=["residual_length", "sink_tokens", "bits", "clip"])
def test_an_edited_scheme_is_refused_not_run(kivi, tmp_path, change):
    directory = _copy(kivi, tmp_path)
    _edit(directory, change)
    with pytest.raises(RuntimeInputError, match="scheme the graph was not built for"):
        KVQSession(directory)


@pytest.mark.parametrize("name", ["model.onnx", "model.onnx.data"])
def test_corrupted_weights_are_refused_unless_the_check_is_skipped(kivi, tmp_path, name):
    directory = _copy(kivi, tmp_path)
    data = bytearray((directory / name).read_bytes())
    data[-400:-100] = b"\x00" * 300
    (directory / name).write_bytes(bytes(data))
    with pytest.raises(RuntimeInputError, match=f"{name} does not match its sha256"):
        KVQSession(directory)
    (directory / name).write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(RuntimeInputError, match="truncated or replaced"):
        KVQSession(directory)
    with pytest.raises(RuntimeInputError, match="ONNX Runtime cannot load"):
        KVQSession(directory, verify_weights=False)


def test_the_opt_out_runs_a_modified_but_loadable_export(kivi, tmp_path):
    directory = _copy(kivi, tmp_path)
    data = bytearray((directory / "model.onnx.data").read_bytes())
    data[1000:1400] = b"\x3f" * 400
    (directory / "model.onnx.data").write_bytes(bytes(data))
    with pytest.raises(RuntimeInputError, match="sha256"):
        KVQSession(directory)
    assert len(KVQSession(directory, verify_weights=False).generate([[5, 6]], 2)[0].tokens) == 2


# -- random corruptions of a manifest: always a KVQError (or a valid manifest), never another exception --------
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats() | st.text(max_size=8),
                    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children,
                                                                                        max_size=3), max_leaves=6)


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value[:3]):
            yield from _paths(child, (*prefix, index))


@pytest.fixture(scope="module")
def manifest_dict(kivi):
    return json.loads((kivi / "kvq.json").read_text())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_manifest_corruptions_give_kvq_errors(manifest_dict, data):
    corrupted = copy.deepcopy(manifest_dict)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p in _paths(corrupted) if p]
        if not paths:
            break
        path = data.draw(st.sampled_from(paths))
        parent = corrupted
        for key in path[:-1]:
            parent = parent[key]
        if data.draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(JSON)
    try:
        Manifest.from_dict(corrupted)
    except KVQError:
        pass


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 2000), junk=st.binary(max_size=8))
def test_truncated_or_garbled_manifest_files_give_kvq_errors(kivi, tmp_path_factory, cut, junk):
    directory = tmp_path_factory.mktemp("m")
    text = (kivi / "kvq.json").read_bytes()
    (directory / "kvq.json").write_bytes(text[:cut] + junk)
    try:
        Manifest.load(directory)
    except KVQError:
        pass


@pytest.mark.parametrize("content, message", [
    (b"[]", "expected a JSON object"), (b"\xff\xfe{}", "not UTF-8"), (b"{", "not valid JSON"),
    (b"[" * 100000, "not valid JSON"),
])
def test_manifests_that_are_not_objects(tmp_path, content, message):
    (tmp_path / "kvq.json").write_bytes(content)
    with pytest.raises(RuntimeInputError, match=message):
        Manifest.load(tmp_path)


@pytest.mark.parametrize("change, message", [
    (lambda m: m.update(opset="23"), "'opset' must be an integer"),
    (lambda m: m.pop("model"), "missing the field 'model'"),
    (lambda m: m["model"].update(num_layers=2.0), "'model.num_layers' must be an integer"),
    (lambda m: m["model"].update(num_layers=10**9), "'model.num_layers' is 1000000000"),
    (lambda m: m.update(inputs={}), "'inputs' must be a list"),
    (lambda m: m["scheme"]["key"].update(bits=2.0), "invalid bits=2.0"),
    (lambda m: m.update(weights={"model.onnx": {"sha256": 1, "bytes": 3}}), "'weights.model.onnx.sha256'"),
])
def test_manifest_fields_are_typed(manifest_dict, change, message):
    data = copy.deepcopy(manifest_dict)
    change(data)
    with pytest.raises(RuntimeInputError, match=message):
        Manifest.from_dict(data)


# -- one rule for reusing an export --------------------------------------------------------------------------
def test_ensure_export_reuses_only_a_current_intact_export(model_dir, tmp_path):
    fp32, fp16 = (ExportRequest(model=str(model_dir), scheme="fp16", dtype=dtype) for dtype in ("fp32", "fp16"))
    out = ensure_export(fp32, tmp_path / "base")
    stamp = os.stat(out / "model.onnx").st_mtime_ns
    assert ensure_export(fp32, out) == out and os.stat(out / "model.onnx").st_mtime_ns == stamp
    _edit(out, lambda m: m["build"].update(kvq_code="0" * 16))  # built by other kvq code of the same version
    ensure_export(fp32, out)
    assert os.stat(out / "model.onnx").st_mtime_ns != stamp
    stamp = os.stat(out / "model.onnx").st_mtime_ns
    ensure_export(fp16, out)  # another request
    assert Manifest.load(out).dtype == "fp16" and os.stat(out / "model.onnx").st_mtime_ns != stamp
    data = bytearray((out / "model.onnx.data").read_bytes())
    data[:64] = b"\x00" * 64
    (out / "model.onnx.data").write_bytes(bytes(data))
    ensure_export(fp16, out)  # corrupted weights: exported again
    KVQSession(out)


def test_bench_and_validate_use_the_same_reuse_rule():
    import inspect

    from kvq_export import bench, demo
    from kvq_export.validate import runner

    for module in (bench, demo, runner):
        assert "ensure_export" in inspect.getsource(module)
    assert not hasattr(bench, "code_digest")


def test_ensure_export_waits_for_a_concurrent_writer_then_reuses_its_export(model_dir, tmp_path):
    import threading
    import time

    from kvq_export import _atomic

    request = ExportRequest(model=str(model_dir), scheme="fp16")
    out = ensure_export(request, tmp_path / "shared")
    code = Manifest.load(out).build.kvq_code
    stamp = os.stat(out / "model.onnx").st_mtime_ns
    result = {}
    with _atomic.target_lock(out):  # another process is (re)making the shared baseline
        _edit(out, lambda m: m["build"].update(kvq_code="stale"))
        waiter = threading.Thread(target=lambda: result.update(path=ensure_export(request, out)))
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive()  # blocked on the lock, not failing and not exporting a second time
        _edit(out, lambda m: m["build"].update(kvq_code=code))  # the other process finishes
    waiter.join(60)
    assert result["path"] == out and os.stat(out / "model.onnx").st_mtime_ns == stamp
