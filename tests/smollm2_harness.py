"""SmolLM2 exported once per test run as a deployer exports it, for the slow tests that need the real model."""

from __future__ import annotations

import os
from pathlib import Path

from kvq_export.export.exporter import ensure_export
from kvq_export.flavors import FlavorName
from kvq_export.request import CalibrationSpec, ExportRequest, WeightSpec
from kvq_export.vocab import WeightFormat

#: The ort-int8 cache on int4 weights, its scales calibrated on 1024 tokens (a quarter of the default): the tests
#: that use it check kernels, scheduling and tokenizers, which the scales do not change.
DEPLOYER = ExportRequest(model="smollm2", scheme="ort-int8", flavor=FlavorName.ORT_GQA,
                         weights=WeightSpec(format=WeightFormat.INT4), calibration=CalibrationSpec(tokens=1024))


def deployer_export(tmp_path_factory) -> Path:
    """:data:`DEPLOYER`, exported once per run and shared by every pytest-xdist worker.

    The workers' folders sit in one temporary root for the run; the export's own lock makes a second worker wait
    for the first and reuse its export (:func:`~kvq_export.export.exporter.ensure_export`).
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    return ensure_export(DEPLOYER, root / "smollm2-deployer")
