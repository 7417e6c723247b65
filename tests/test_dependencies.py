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


def test_every_kvq_plugins_module_imports_without_gpu_stacks():
    """The kernels and the TensorRT plugin import triton / tensorrt only when a kernel runs or a plugin registers."""
    import kvq_plugins

    names = [m.name for m in pkgutil.walk_packages(kvq_plugins.__path__, "kvq_plugins.")]
    assert {"kvq_plugins.triton_kernels", "kvq_plugins.trt_plugin", "kvq_plugins.attention"} <= set(names)
    proc = _python("import importlib\n" + "".join(f"importlib.import_module({n!r})\n" for n in names)
                   + "import kvq_export.trt, kvq_export.flavors.trt.graph\n"
                   + "assert not any(sys.modules.get(m) for m in ('triton', 'tensorrt')), 'a GPU stack was imported'\n")
    assert proc.returncode == 0, proc.stderr


def test_pyproject_lists_every_package():
    """Every package is listed in pyproject (plugins/ installs as kvq_plugins, so packages are explicit)."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "kvq_export").rglob("__init__.py")}
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
    assert "kvq_plugins" in listed
