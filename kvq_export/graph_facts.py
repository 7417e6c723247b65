"""The graph is the source of truth for what it fixes: the scheme, the model facts, the build, the embedded scales.

An exporter writes these facts into the ONNX graph's metadata (:func:`graph_metadata`); a loader compares them with
``kvq.json`` (:func:`check_graph_metadata`) and a calibration file's arrays with the graph's own constants
(:func:`check_graph_calibration`), so an edited manifest or a replaced calibration file is refused instead of giving
wrong numbers. Graphs are read without their weights.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kvq_export._read import CALIBRATION_LIMIT
from kvq_export.calibration.artifact import Calibration
from kvq_export.calibration.graph_check import compare_with_graph, reads_graph_constant
from kvq_export.errors import KVQError, RuntimeInputError
from kvq_export.manifest import MANIFEST_NAME, Manifest, resolve_inside
from kvq_export.manifest_sections import TokenizerFacts
from kvq_export.model_facts import ModelFacts
from kvq_export.scheme import KVQuantScheme

#: ONNX metadata key under which the graph carries the scheme it was built for (compared with the manifest's).
GRAPH_SCHEME_KEY = "kvq.scheme"
#: ONNX metadata keys of the other facts the graph fixes (see :func:`graph_metadata`): the model facts (JSON of
#: the ``model`` section without ``source``), the graph's build (flavour, cache layout, compute dtype) and the
#: digest of the static scales / high channels embedded in it.
GRAPH_MODEL_KEY = "kvq.model"
GRAPH_BUILD_KEY = "kvq.graph"
GRAPH_CALIBRATION_KEY = "kvq.calibration"
#: ... and the token ids that end or pad a row (the manifest's ``tokenizer`` section: an edited EOS cuts answers)
GRAPH_TOKENIZER_KEY = "kvq.tokenizer"


def graph_metadata(scheme: KVQuantScheme, model: ModelFacts, *, flavor: str, layout: str, dtype: str, opset: int,
                   calibration_digest: str | None, tokenizer: TokenizerFacts | None = None) -> dict[str, str]:
    """The ONNX metadata an exporter writes into the graph: everything the graph fixes, as the manifest spells it.

    A loader compares it with ``kvq.json`` (:func:`check_graph_metadata`): an edited manifest (a scheme, a model
    fact, the flavour) or a replaced calibration file is refused instead of giving wrong numbers.
    """
    facts = {k: v for k, v in model.to_dict().items() if k != "source"}
    out = {GRAPH_SCHEME_KEY: scheme.to_json(indent=None), GRAPH_MODEL_KEY: json.dumps(facts, sort_keys=True),
           GRAPH_BUILD_KEY: json.dumps({"flavor": flavor, "layout": layout, "dtype": dtype, "opset": opset},
                                       sort_keys=True)}
    if calibration_digest is not None:
        out[GRAPH_CALIBRATION_KEY] = calibration_digest
    if tokenizer is not None:
        out[GRAPH_TOKENIZER_KEY] = json.dumps(tokenizer.to_dict(), sort_keys=True)
    return out


def check_graph_metadata(directory: str | os.PathLike[str], manifest: Manifest, carried: Mapping[str, str],
                         static: Calibration | None) -> None:
    """Refuse a manifest (or calibration file) that disagrees with what the graph ``carried`` in its metadata.

    ``static``: the calibration file's arrays (:func:`load_static`). A graph from before kvq wrote a key is not
    checked for that key.
    """
    edited = f"{directory}: {MANIFEST_NAME} describes"
    if GRAPH_SCHEME_KEY in carried:
        try:
            built = KVQuantScheme.from_json(carried[GRAPH_SCHEME_KEY])
        except KVQError as err:
            raise RuntimeInputError(f"{directory}: the graph's scheme is unreadable: {err}") from None
        if built != manifest.scheme:
            raise RuntimeInputError(
                f"{edited} a scheme the graph was not built for (graph: {built.describe()}; manifest: "
                f"{manifest.scheme.describe()}); the manifest was edited")
    if GRAPH_MODEL_KEY in carried:
        want = _json_object(directory, carried[GRAPH_MODEL_KEY], GRAPH_MODEL_KEY)
        have = {k: v for k, v in manifest.model.to_dict().items() if k != "source"}
        differ = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
        if differ:
            name = differ[0]
            raise RuntimeInputError(f"{edited} another model than the graph was built for: model.{name} is "
                                    f"{have.get(name)!r}, the graph's is {want.get(name)!r}; the manifest was edited")
    if GRAPH_BUILD_KEY in carried:
        want = _json_object(directory, carried[GRAPH_BUILD_KEY], GRAPH_BUILD_KEY)
        have = {"flavor": manifest.flavor, "layout": manifest.layout, "dtype": manifest.dtype,
                "opset": manifest.opset}
        for name in sorted(have):
            if name == "opset" and name not in want:  # recorded since; an older graph is not checked for it
                continue
            if want.get(name) != have[name]:
                field = "cache.layout_name" if name == "layout" else name
                raise RuntimeInputError(f"{edited} {field} {have[name]!r}, the graph was built as "
                                        f"{want.get(name)!r}; the manifest was edited")
    if GRAPH_TOKENIZER_KEY in carried:
        want, have = _json_object(directory, carried[GRAPH_TOKENIZER_KEY], GRAPH_TOKENIZER_KEY), \
            manifest.tokenizer.to_dict()
        name = next((k for k in sorted(set(want) | set(have)) if want.get(k) != have.get(k)), None)
        if name is not None:
            raise RuntimeInputError(f"{edited} tokenizer.{name} {have.get(name)!r}, the graph was built with "
                                    f"{want.get(name)!r}; the manifest was edited")
    if GRAPH_MODEL_KEY in carried:  # a graph that records its facts also records whether it embeds scales
        built = carried.get(GRAPH_CALIBRATION_KEY)
        if (built is None) != (static is None):
            raise RuntimeInputError(f"{edited} {'no' if static is None else 'a'} calibration file, the graph was "
                                    f"built {'with' if built else 'without'} calibrated constants; the manifest "
                                    "was edited")
        if built is not None:
            got = static.digest(len(built))
            if got != built:
                raise RuntimeInputError(f"{directory}: {manifest.calibration.file} holds other scales than the "
                                        f"graph embeds (digest {got}, graph {built}): the calibration file was "
                                        "replaced; export again")


def check_graph_facts(directory: str | os.PathLike[str], manifest: Manifest, graph: str | os.PathLike[str],
                      static: Calibration | None, *, carried: Mapping[str, str] | None = None) -> None:
    """Refuse a manifest or calibration file that disagrees with the graph at ``graph``, read once without weights.

    Its metadata (or ``carried``: the metadata a runtime already read from its own session, when the graph then
    need not be parsed unless there are constants to compare) with :func:`check_graph_metadata`, and with a
    calibration file its constants with :func:`check_graph_calibration`.
    """
    proto = _load_graph_proto(graph) if carried is None or static is not None else None
    check_graph_metadata(directory, manifest, _metadata(proto) if carried is None else carried, static)
    check_graph_calibration(directory, manifest, graph, static, proto=proto)


def check_graph_calibration(directory: str | os.PathLike[str], manifest: Manifest, graph: str | os.PathLike[str],
                            calibration: Calibration | None, *, proto=None) -> None:
    """Refuse a calibration file whose arrays are not the constants the graph at ``graph`` computes with.

    Digests only say that two files were written together; the graph's own scales, zero points and high-channel
    constants are what it runs, so a calibration file (with recomputed digests) that disagrees is refused.
    ``proto``: the graph already read without its weights (:func:`read_graph_constants`).
    """
    if calibration is None:
        return
    constants = read_graph_constants(graph, reads_graph_constant, proto=proto)
    compared = compare_with_graph(calibration, constants, manifest.scheme, manifest.model, error=RuntimeInputError)
    if not compared:
        raise RuntimeInputError(f"{directory}: {Path(graph).name} holds none of the constants of "
                                f"{manifest.calibration.file}: the graph was not built from it; export again")


def read_graph_constants(path: str | os.PathLike[str], wanted, *, limit: int = CALIBRATION_LIMIT,
                         proto=None) -> dict[str, np.ndarray]:
    """The initializers of an ONNX file whose names ``wanted(name)`` accepts, within ``limit`` bytes in all.

    Other weights are not read. A tensor kept in the external data file is read from its recorded offset in a
    file inside the graph's directory. ``proto``: the file already read without its weights (it is not read again).
    """
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import uses_external_data

    graph = Path(path)
    model = _load_graph_proto(graph) if proto is None else proto
    out: dict[str, np.ndarray] = {}
    total = 0
    for tensor in model.graph.initializer:
        if not wanted(tensor.name):
            continue
        if uses_external_data(tensor):
            tensor.raw_data = _external_bytes(graph, tensor, limit - total)
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT
        try:
            out[tensor.name] = numpy_helper.to_array(tensor)
        except (ValueError, TypeError) as err:
            raise RuntimeInputError(f"{graph}: constant {tensor.name} is unreadable: {err}") from None
        total += out[tensor.name].nbytes
        if total > limit:
            raise RuntimeInputError(f"{graph}: its calibration constants exceed {limit} bytes; kvq reads at most that")
    return out


def _external_bytes(graph: Path, tensor, budget: int) -> bytes:
    """The bytes of one external-data tensor (at most ``budget``), from a file inside the graph's directory."""
    info = {entry.key: entry.value for entry in tensor.external_data}
    where = resolve_inside(graph.parent, info.get("location", ""))
    try:
        offset, length = int(info.get("offset", 0)), int(info.get("length", -1))
    except ValueError:
        raise RuntimeInputError(f"{graph}: constant {tensor.name} has a malformed external data record") from None
    if length < 0 or length > budget:
        raise RuntimeInputError(f"{graph}: constant {tensor.name} claims {length} bytes of external data; kvq reads "
                                f"at most {budget} more")
    try:
        with open(where, "rb") as handle:
            handle.seek(offset)
            data = handle.read(length)
    except OSError as err:
        raise RuntimeInputError(f"cannot read {where}: {err.strerror or err}") from None
    if len(data) != length:
        raise RuntimeInputError(f"{where} ends before constant {tensor.name} ({len(data)} of {length} bytes)")
    return data


def _json_object(directory, text: str, key: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as err:
        raise RuntimeInputError(f"{directory}: the graph's {key} metadata is not JSON: {err}") from None
    if not isinstance(value, dict):
        raise RuntimeInputError(f"{directory}: the graph's {key} metadata is not a JSON object")
    return value


def read_graph_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The metadata of an ONNX file (its weights are not read)."""
    return _metadata(_load_graph_proto(path))


def _metadata(proto) -> dict[str, str]:
    return {entry.key: entry.value for entry in proto.metadata_props}


def _load_graph_proto(path: str | os.PathLike[str]):
    """An ONNX file's graph without its external weights; an unreadable file is a one-line error."""
    import onnx

    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as err:  # noqa: BLE001 - onnx raises its own untyped errors for unreadable files
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RuntimeInputError(f"cannot read the ONNX file {path}: {first}") from None


