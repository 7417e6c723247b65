"""``kvq ARGS`` in this process through click's CliRunner, answered like ``subprocess.run``.

Exit code, stdout and stderr as a :class:`subprocess.CompletedProcess`; an exception other than click's exit (a
one-line ``KVQError`` is one) is raised with its traceback, so a test sees the bug instead of exit code 1.
"""

from __future__ import annotations

import subprocess

from click.testing import CliRunner

from kvq_export.cli import cli


def kvq(*args) -> subprocess.CompletedProcess:
    argv = [str(a) for a in args]
    result = CliRunner().invoke(cli, argv)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(["kvq", *argv], result.exit_code, result.stdout, result.stderr)
