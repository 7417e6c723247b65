"""docs/cli.md is what click prints now: ``python tools/gen_cli_docs.py`` rewrites it, and this test says when to."""

from __future__ import annotations

from pathlib import Path

import pytest
from tool_harness import tool as load_tool

from kvq_export.cli import cli

ROOT = Path(__file__).resolve().parent.parent


def gen_cli_docs():
    """tools/gen_cli_docs.py as a module."""
    return load_tool("gen_cli_docs")


def test_docs_cli_md_is_current():
    tool = gen_cli_docs()
    if tool.main(["--check"]) != 0:
        old, new = tool.TARGET.read_text().splitlines(), tool.render().splitlines()
        first = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        pytest.fail(f"docs/cli.md is stale from its line {first + 1}: run python tools/gen_cli_docs.py\n"
                    f"  page: {old[first] if first < len(old) else '(end)'}\n"
                    f"  now:  {new[first] if first < len(new) else '(end)'}")


def test_every_command_and_option_is_on_the_page():
    page = (ROOT / "docs" / "cli.md").read_text()
    for name, command in cli.commands.items():
        assert f"## `kvq {name}`" in page, name
        for param in command.params:
            if getattr(param, "hidden", False):
                continue  # a deprecated spelling, kept working but not shown
            for opt in getattr(param, "opts", []):
                if opt.startswith("-"):
                    assert opt in page, f"kvq {name} {opt}"


def test_check_fails_on_a_stale_page_and_writing_fixes_it(tmp_path):
    tool = gen_cli_docs()
    page = tmp_path / "cli.md"
    page.write_text("# an old page\n")
    assert tool.main(["--check", "--out", str(page)]) == 1
    assert tool.main(["--out", str(page)]) == 0
    assert tool.main(["--check", "--out", str(page)]) == 0
    assert page.read_text() == tool.render()
