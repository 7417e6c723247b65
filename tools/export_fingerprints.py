"""Fingerprints of every export kvq writes on the tiny test models: one sha256 per file, for byte-for-byte checks.

Exports every preset (:mod:`kvq_export.presets`) x flavour on every tiny model (``tests/tiny_models.py``), plus
a few weight-storage and dtype variants, with fixed seeds, and writes one JSON object: case -> {file: sha256}
(or the one-line reason the export was refused). ``kvq.json`` is hashed without its ``build.kvq_code`` (the digest
of kvq's own source, which any edit changes). Two runs of two kvq sources that build the same graphs give the
same JSON; ``--compare OLD.json`` names every case that differs.

    OMP_NUM_THREADS=1 python tools/export_fingerprints.py --out /tmp/fp.json [--jobs 2] [--compare base.json]

Static-scale presets are calibrated as the tests calibrate them (``tests/gqa_harness.py`` ``calibration()``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

logger = logging.getLogger("export_fingerprints")

FLAVORS = ("reference", "ort-gqa", "trt")
FILES = ("model.onnx", "model.onnx.data", "model.genai.onnx", "genai_config.json")
#: weight storage and dtype variants, on the first tiny model only: (preset, flavour, weights, dtype)
VARIANTS = (("fp16", "reference", {"format": "int4"}, "fp32"),
            ("int8", "reference", {"format": "int8", "symmetric": False, "block_size": 64}, "fp32"),
            ("q4_0", "reference", {"format": "fp16"}, "fp32"),
            ("fp16", "ort-gqa", {"format": "int4"}, "fp32"),
            ("ort-int8", "ort-gqa", {"format": "fp16"}, "fp32"),
            ("fp16", "ort-gqa", {"format": "fp32"}, "fp16"),
            ("int8", "reference", {"format": "fp32"}, "fp16"),
            ("fp16", "trt", {"format": "fp32"}, "fp16"))


def cases() -> list[tuple[str, str, str, dict, str]]:
    """(arch, preset, flavour, weights, dtype) for every export fingerprinted."""
    from tiny_models import ARCHS, NEW_ARCHS

    from kvq_export.presets import preset_names

    out = [(arch, preset, flavor, {}, "fp32") for arch in ARCHS + NEW_ARCHS for preset in preset_names()
           for flavor in FLAVORS]
    out += [(ARCHS[0], preset, flavor, weights, dtype) for preset, flavor, weights, dtype in VARIANTS]
    return out


def case_name(arch: str, preset: str, flavor: str, weights: dict, dtype: str) -> str:
    extra = "".join(f"-{k}={v}" for k, v in sorted(weights.items())) + ("" if dtype == "fp32" else f"-{dtype}")
    return f"{arch}/{preset}/{flavor}{extra}"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _manifest_sha(path: Path) -> str:
    data = json.loads(path.read_text())
    data.get("build", {}).pop("kvq_code", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def fingerprint(case: tuple[str, str, str, dict, str]) -> tuple[str, dict[str, str] | str]:
    """One export's file hashes, or why it was refused."""
    import torch
    from gqa_harness import calibration
    from tiny_models import tiny_model

    from kvq_export.errors import KVQError
    from kvq_export.export.exporter import export
    from kvq_export.presets import get_preset
    from kvq_export.request import ExportRequest, WeightSpec

    torch.manual_seed(0)
    arch, preset, flavor, weights, dtype = case
    scheme = get_preset(preset)
    request = ExportRequest(model=None, scheme=scheme, flavor=flavor, weights=WeightSpec(**weights), dtype=dtype)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "export"
        try:
            static = calibration(arch, scheme) if scheme.needs_calibration else None
            export(request, out, model=tiny_model(arch), static=static)
        except KVQError as err:
            return case_name(*case), f"refused: {err}"
        except Exception as err:  # noqa: BLE001 - a failure is a fingerprint too (the same one before and after)
            return case_name(*case), f"failed: {type(err).__name__}: {err}"
        hashes = {name: _sha(out / name) for name in FILES if (out / name).is_file()}
        hashes["kvq.json"] = _manifest_sha(out / "kvq.json")
        return case_name(*case), hashes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--only", default="", help="only cases whose name contains this")
    parser.add_argument("--compare", type=Path, help="a fingerprint JSON to compare with")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    todo = [c for c in cases() if args.only in case_name(*c)]
    with ProcessPoolExecutor(args.jobs) as pool:
        result = dict(pool.map(fingerprint, todo, chunksize=4))
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True))
    exported = sum(isinstance(v, dict) for v in result.values())
    graphs = sum(k.endswith("onnx") for v in result.values() if isinstance(v, dict) for k in v)
    logger.warning("%d cases: %d exported (%d graphs), %d refused", len(result), exported, graphs,
                   len(result) - exported)
    if args.compare is None:
        return 0
    old = json.loads(args.compare.read_text())
    differ = sorted(k for k in result if old.get(k) != result[k])
    for name in differ:
        logger.warning("DIFFERS %s: %s -> %s", name, old.get(name), result[name])
    logger.warning("%d of %d cases compared differ", len(differ), len(result))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
