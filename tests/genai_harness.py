"""onnxruntime-genai's model builder on a tiny model directory, for tests that compare against its exports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tiny_models import save_tiny_model_dir


def builder_model_dir(path: Path) -> Path:
    """The tiny model as a Hugging Face directory the builder accepts (it needs end- and start-of-text tokens)."""
    model_dir = save_tiny_model_dir(path)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "eos_token_id": 1, "bos_token_id": 1}))
    return model_dir


def run_builder(model_dir: Path, out: Path, scales: Path, scheme: str = "int8_per_channel"
                ) -> subprocess.CompletedProcess:
    """``python -m onnxruntime_genai.models.builder`` (fp32, CPU) with a ``scheme`` cache on the ``scales`` file."""
    return subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(model_dir), "-o",
                           str(out), "-p", "fp32", "-e", "cpu", "-c", str(out.parent / f"{out.name}-cache"),
                           "--extra_options", f"kv_cache_quant_scheme={scheme}", f"kv_cache_scale_file={scales}"],
                          capture_output=True, text=True)
