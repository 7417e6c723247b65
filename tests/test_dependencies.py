"""`import kvq_export` and every `kvq <cmd> --help` work without triton, tensorrt or a GPU stack."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import kvq_export

# Make the optional GPU stacks unimportable, whatever is installed, then import / run.
_BLOCK = (
    "import sys\n"
    "for m in ('triton', 'tensorrt', 'tensorrt.plugin', 'pycuda', 'cuda'):\n"
    "    sys.modules[m] = None\n"
)


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCK + code], capture_output=True, text=True)


def test_top_level_import_is_light():
    proc = _python(
        "import kvq_export\n"
        "heavy = [m for m in ('torch', 'onnxruntime', 'transformers', 'triton', 'tensorrt') if sys.modules.get(m)]\n"
        "assert not heavy, heavy\n"
    )
    assert proc.returncode == 0, proc.stderr


def test_every_submodule_imports_without_gpu_stacks():
    names = [m.name for m in pkgutil.walk_packages(kvq_export.__path__, "kvq_export.")]
    assert "kvq_export.reference.cache" in names
    proc = _python("import importlib\n" + "".join(f"importlib.import_module({n!r})\n" for n in names))
    assert proc.returncode == 0, proc.stderr


def test_every_cli_help_without_gpu_stacks():
    proc = _python(
        "from click.testing import CliRunner\n"
        "from kvq_export.cli import cli\n"
        "for name in [None, *sorted(cli.commands)]:\n"
        "    r = CliRunner().invoke(cli, ([name] if name else []) + ['--help'])\n"
        "    assert r.exit_code == 0, (name, r.output)\n"
        "assert not sys.modules.get('torch'), 'help imported torch'\n"
    )
    assert proc.returncode == 0, proc.stderr
