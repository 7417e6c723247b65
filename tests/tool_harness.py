"""The scripts in tools/ as modules, so tests call their ``main(argv)`` in this process.

tools/ is a folder of scripts, not a package: each is loaded from its file once and kept in ``sys.modules``
under its own name (its dataclasses resolve their annotations there).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def tool(name: str) -> ModuleType:
    """``tools/NAME.py`` as a module."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def run_tool(name: str, *argv: str | Path) -> int:
    """``python tools/NAME.py ARGV...``, in this process: its exit status."""
    return tool(name).main([str(a) for a in argv])
