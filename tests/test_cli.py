"""The click CLI: help without heavy stacks, memory JSON, one-line errors."""

from __future__ import annotations

import json

import pytest
from cli_harness import kvq
from click.testing import CliRunner

from kvq_export.cli import cli

COMMANDS = sorted(cli.commands)


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_every_command_has_help():
    assert {"schemes", "memory", "demo"} <= set(COMMANDS)
    for name in [None, *COMMANDS]:
        result = run(*([name] if name else []), "--help")
        assert result.exit_code == 0, result.output
        assert "Usage:" in result.output


def test_schemes_lists_every_preset_with_bits():
    result = run("schemes")
    assert result.exit_code == 0
    for name, bits in [("int4-sym-g32", "4.5"), ("kivi-2", "3"), ("int8", "8.25"), ("ort-int4", "4")]:
        line = next(row for row in result.output.splitlines() if f" {name} " in row)
        assert f" {bits} " in line
    data = json.loads(run("schemes", "--json").output)
    assert data["kivi-4"]["residual_length"] == 128


def test_memory_json_q4_0_smollm2():
    result = run("memory", "--model", "smollm2", "--scheme", "int4-sym-g32", "--seq-len", "4096", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["bits_per_element"] == 4.5
    assert data["total_bytes"] == 26_542_080 and data["fp16_bytes"] == 94_371_840
    assert set(data["breakdown"]) == {"payload", "scales", "zero_points", "high_precision", "padding"}
    assert set(data) >= {"total_bytes", "fp16_bytes", "ratio", "bits_per_element", "breakdown"}


def test_memory_table_shows_breakdown_and_curve():
    result = run("memory", "--scheme", "kivi-2", "--seq-len", "1000")
    assert result.exit_code == 0
    assert "high_precision" in result.output and "over sequence length" in result.output


@pytest.mark.parametrize("args, message", [
    (["memory", "--scheme", "q3", "--seq-len", "8"], "unknown scheme 'q3'"),
    (["memory", "--scheme", "int4-sym-g32", "--seq-len", "8", "--model", "no-such-model"], "no-such-model"),
    (["memory", "--scheme", '{"key": {"bits": 7}}', "--seq-len", "8"], "bits=7"),
])
def test_bad_input_is_one_line_exit_1(args, message):
    proc = kvq(*args)
    assert proc.returncode == 1
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_invalid_scheme_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"key": {"format": "int", "bits": 4, "axis": "channel", "group_size": 32},
                               "residual_length": 100}))
    proc = kvq("memory", "--scheme", bad, "--seq-len", "8")
    assert proc.returncode == 1 and "residual_length=100" in proc.stderr and "Traceback" not in proc.stderr
