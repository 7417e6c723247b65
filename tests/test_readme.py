"""The documented commands run as written, in order, on a tiny model; models/README.md names every file of models/.

Every ``$ kvq ...`` line of a ```console block of README.md and of docs/ (:data:`PAGES`, in that order: the
quickstart first, then every other page by path) runs in one temporary directory, in order, through click's
CliRunner, and must exit 0; the quickstart's Python API snippet then runs in the same directory. ```bash blocks hold
what cannot run here (the real model for minutes, a server, TensorRT, tools outside kvq) and are not run; a
```console block may hold nothing else than ``$ kvq`` commands and their printed output.

The real model and corpus are replaced, never the commands' options: ``smollm2`` (as ``--model`` or
``model=``) is a tiny random Hugging Face directory, and the built-in corpus ``britannica`` a file of random
words of the tiny vocabulary, long enough for the default calibration text (4096 tokens from token 60000).
The one override, :data:`SHORTER`, shortens validation windows kept at their real size in the README.
"""

from __future__ import annotations

import random
import re
import shlex
from pathlib import Path

import pytest
from cli_harness import kvq
from tiny_models import WORDS, save_tiny_model_dir

from kvq_export import corpus
from kvq_export.demo import DEMO_RUNS, DEPARTS, TABLE_COLUMNS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DEMO_PAGE = ROOT / "docs" / "design" / "demo.md"
DOCS = ROOT / "docs"
QUICKSTART = DOCS / "quickstart.md"
MODELS = ROOT / "models"

#: the pages whose commands run, in order: README, the quickstart, then docs/ by path (the generated CLI reference
#: holds help texts, not commands)
PAGES = [README, QUICKSTART, *sorted(p for p in DOCS.rglob("*.md") if p not in (QUICKSTART, DOCS / "cli.md"))]

#: pages whose python snippets are self-contained (they export nothing and read no model)
SNIPPET_PAGES = [README, *sorted((DOCS / "concepts").glob("*.md"))]

#: option values the README keeps at the real model's size, and what the tiny run uses instead
SHORTER = {("validate", "--windows"): "2", ("validate", "--window-len"): "64"}


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block of ``text``, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)]


def console_commands(text: str) -> list[str]:
    """The ``$`` lines of every ```console block (backslash continuations joined), in order."""
    commands = []
    for lang, body in fenced_blocks(text):
        if lang != "console":
            continue
        lines = body.splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            i += 1
            if not line.startswith("$ "):
                continue  # printed output
            command = line[2:]
            while command.endswith("\\") and i < len(lines):
                command = command[:-1] + " " + lines[i].strip()
                i += 1
            commands.append(command)
    return commands


def tiny_argv(command: str, model_dir: Path) -> list[str]:
    """``command``'s arguments after ``kvq``, the real model replaced by the tiny one and SHORTER applied."""
    words = shlex.split(command, comments=True)
    assert words[0] == "kvq", f"a console block runs kvq commands only (use a bash block): {command}"
    argv = words[1:]
    for i in range(1, len(argv)):
        if argv[i - 1] == "--model" and argv[i] == "smollm2":
            argv[i] = str(model_dir)
        if (argv[0], argv[i - 1]) in SHORTER:
            argv[i] = SHORTER[(argv[0], argv[i - 1])]
    return argv


def python_blocks(text: str) -> list[str]:
    return [body for lang, body in fenced_blocks(text) if lang == "python"]


def all_console_commands() -> list[str]:
    """The ``$ kvq`` lines of every page of :data:`PAGES`, in order."""
    return [command for page in PAGES for command in console_commands(page.read_text())]


def python_api_snippet(text: str) -> str:
    """The ```python block of the quickstart's "Python API" section."""
    section = text[text.index("\n## Python API"):]
    section = section[:section.index("\n## ", 1)]
    blocks = python_blocks(section)
    assert len(blocks) == 1, "the Python API section holds one python snippet"
    return blocks[0]


@pytest.fixture
def tiny_world(tmp_path, monkeypatch):
    """A working directory, a tiny model directory and a tiny ``britannica``; kvq's cache inside tmp_path."""
    model_dir = save_tiny_model_dir(tmp_path / "tiny-llama")
    text = tmp_path / "words.txt"
    rng = random.Random(0)
    text.write_text(" ".join(rng.choice(WORDS) for _ in range(66000)))
    monkeypatch.setitem(corpus.BUILTIN_CORPORA, "britannica",
                        corpus.BuiltinCorpus("random words of the tiny vocabulary", lambda root: [text]))
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return model_dir


def test_console_blocks_hold_kvq_commands_only():
    commands = all_console_commands()
    assert len(commands) >= 15
    for command in commands:
        assert shlex.split(command, comments=True)[0] == "kvq", command
    # what cannot run in a test stays out of console blocks
    for blocked in ("serve", "build", "bench-serve", "demo"):
        assert not any(shlex.split(c, comments=True)[1] == blocked for c in commands), blocked


def test_readme_shows_the_demo_as_it_prints():
    """The demo's sample output on its design page has the columns and rows ``kvq demo`` prints, and its serve lines.

    (``tests/test_demo.py`` checks that ``kvq demo`` prints these same columns, rows and lines.)
    """
    text = DEMO_PAGE.read_text()
    section = text[text.index("`make demo` (`kvq demo`)"):text.index("`make test` also runs")]
    sample = next(body for lang, body in fenced_blocks(section) if lang == "text")
    table = [line for line in sample.splitlines() if line.startswith("|")]
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in table]
    assert tuple(cells[0]) == TABLE_COLUMNS
    assert [row[0] for row in cells[2:]] == [run.role for run in DEMO_RUNS]
    assert [row[1] for row in cells[2:]] == [f"{run.scheme} ({run.flavor})" for run in DEMO_RUNS]
    assert [row[2] for row in cells[2:]] == [str(run.weights.format) for run in DEMO_RUNS]
    assert [row[5] for row in cells[2:]] == ["-", *(run.against or DEMO_RUNS[0].role for run in DEMO_RUNS[1:])]
    for line in ("EXPORT=/", 'kvq serve "$EXPORT"', "curl -s http://127.0.0.1:8000/v1/completions"):
        assert line in sample, line
    assert DEPARTS in section and "python -c" not in section


def test_console_argv_replaces_the_model_and_shortens_windows():
    argv = tiny_argv("kvq validate out/a --windows 8 --window-len 512  # note", Path("/m"))
    assert argv == ["validate", "out/a", "--windows", "2", "--window-len", "64"]
    assert tiny_argv("kvq export --model smollm2 --out o", Path("/m"))[2] == "/m"
    with pytest.raises(AssertionError):
        tiny_argv("python -c 'print(1)'", Path("/m"))


def test_documented_commands_and_python_api_run_in_order(tiny_world):
    for command in all_console_commands():
        result = kvq(*tiny_argv(command, tiny_world))
        assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    snippet = python_api_snippet(QUICKSTART.read_text()).replace('"smollm2"', repr(str(tiny_world)))
    exec(compile(snippet, "docs/quickstart.md (Python API)", "exec"), {})
    assert (Path("out/kivi4") / "kvq.json").is_file()


def test_self_contained_python_snippets_run():
    snippets = [(page, block) for page in SNIPPET_PAGES for block in python_blocks(page.read_text())]
    assert snippets, "the scheme page's snippet"
    for page, block in snippets:
        exec(compile(block, str(page.relative_to(ROOT)), "exec"), {})


def test_models_readme_names_every_file_of_models():
    listed = (MODELS / "README.md").read_text()
    missing = [p.name for p in MODELS.iterdir() if p.name != "README.md" and p.name not in listed]
    assert not missing, f"models/README.md does not mention {missing}"
