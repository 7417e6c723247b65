"""Write docs/cli.md, the CLI reference, from click: ``kvq --help`` and every command's ``--help``.

    python tools/gen_cli_docs.py            # rewrite docs/cli.md
    python tools/gen_cli_docs.py --check    # exit 1 if docs/cli.md differs from what click prints now

Help is rendered at a fixed width, so the page does not depend on the terminal that wrote it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "docs" / "cli.md"
WIDTH = 100

HEADER = """# `kvq` command reference

Every command's `--help`, as click prints it. This page is generated: after changing an option or a help text,
run `python tools/gen_cli_docs.py` (`tests/test_cli_docs.py` fails while it is stale). What the commands are for,
in order of use: [quickstart](quickstart.md).
"""


def command_help(group: click.Group, name: str | None) -> str:
    """``kvq [name] --help`` as click prints it at :data:`WIDTH` columns."""
    root = click.Context(group, info_name="kvq", **settings(group))
    if name is None:
        return group.get_help(root)
    command = group.commands[name]
    return command.get_help(click.Context(command, info_name=name, parent=root, **settings(command)))


def settings(command: click.Command) -> dict:
    """The command's own context settings (its help option names among them) at the page's fixed width."""
    return {**command.context_settings, "terminal_width": WIDTH, "max_content_width": WIDTH}


def render() -> str:
    """The whole page: an index of the commands, then each command's help in a text block."""
    from kvq_export.cli import cli

    names = sorted(name for name, command in cli.commands.items() if not command.hidden)
    parts = [HEADER, "## Commands\n", "| command | what |", "|---|---|"]
    for name in names:
        summary = cli.commands[name].get_short_help_str(limit=90)
        parts.append(f"| [`kvq {name}`](#kvq-{name}) | {summary} |")
    parts.append("")
    for name in [None, *names]:
        title = "kvq" if name is None else f"kvq {name}"
        parts += [f"## `{title}`\n", "```text", command_help(cli, name).rstrip(), "```", ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale instead of writing it")
    parser.add_argument("--out", type=Path, default=TARGET, help="the page to write (default docs/cli.md)")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.is_file() or args.out.read_text() != text:
            print(f"{args.out} is stale: run python tools/gen_cli_docs.py", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
