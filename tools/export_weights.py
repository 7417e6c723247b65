"""A kvq export's copy with its weights stored in another format (``kvq_export.export.weights``).

``kvq export --weights`` writes such an export directly; this converts an export that exists already (the tools
that time int4-weight exports reuse their fp32 exports this way): the copy's ``model.onnx`` goes through
:func:`~kvq_export.export.weights.quantize_weights`, onnxruntime-genai's entry graph is rebuilt from it and the
manifest's weight checksums are refreshed, so ``KVQSession`` and ``og.Model`` both load the copy.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path


def with_weights(src: str | Path, dst: str | Path, weights: str = "int4", **options) -> Path:
    """``dst``: ``src`` with ``weights`` (fp32, fp16, int8, int4); reused when made from the same source and options."""
    import onnx_ir as ir

    from kvq_export.export.builder import save
    from kvq_export.export.genai_package import GENAI_MODEL, adapt_graph
    from kvq_export.export.weights import quantize_weights
    from kvq_export.manifest import MANIFEST_NAME, MODEL_NAME, Manifest, weight_checksums

    src, dst = Path(src), Path(dst)
    stamp = {"source": json.loads((src / MANIFEST_NAME).read_text()).get("weights"), "weights": weights, **options}
    stamp_file = dst.with_name(f".{dst.name}.weights-stamp.json")  # beside it: an export holds only listed files
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return dst
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    if weights != "fp32":
        save(quantize_weights(ir.load(dst / MODEL_NAME), format=weights, **options), dst / MODEL_NAME)
        if (dst / GENAI_MODEL).is_file():
            adapt_graph(dst / MODEL_NAME, dst / GENAI_MODEL)
        manifest = Manifest.load(dst)
        dataclasses.replace(manifest, weights=weight_checksums(dst)).save(dst)
    stamp_file.write_text(json.dumps(stamp))
    return dst
