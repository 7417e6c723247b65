"""Expose attention's inputs (post-RoPE q, this call's k/v) of a real exported graph as outputs.

The graph names them ``probe.<layer>.{q,key,value}`` (:func:`kvq_export.naming.probe_name`). A probed
session loads ``model.onnx`` with those values added as outputs; the weights stay in the export's
external data file, which the probed copy (written beside it only while the session is created)
refers to.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kvq_export.errors import RuntimeInputError
from kvq_export.manifest import MODEL_NAME
from kvq_export.naming import PROBES, probe_name
from kvq_export.runtime.session import KVQSession


def probed_session(directory: str | os.PathLike[str], **kwargs) -> KVQSession:
    """A :class:`KVQSession` whose every step also returns the probes (in ``session.last_extra``)."""
    import onnx
    import onnxruntime as ort

    from kvq_export.runtime.session import choose_providers

    session = KVQSession(directory, **kwargs)
    directory = Path(directory)
    model = onnx.load(str(directory / MODEL_NAME), load_external_data=False)
    layers = int(session.manifest.model["num_layers"])
    names = [probe_name(layer, which) for layer in range(layers) for which in PROBES]
    produced = {out for node in model.graph.node for out in node.output}
    missing = [n for n in names if n not in produced]
    if missing:
        raise RuntimeInputError(f"{directory}: the graph has no {missing[0]} (exported by an older kvq?)")
    model.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names)
    fd, tmp = tempfile.mkstemp(prefix=".probed-", suffix=".onnx", dir=directory)
    os.close(fd)
    try:
        onnx.save(model, tmp)
        session.session = ort.InferenceSession(tmp, providers=choose_providers(kwargs.get("providers")))
    finally:
        os.unlink(tmp)
    session.extra_outputs = tuple(names)
    return session
