"""The README's commands run as written, in order, on a tiny model; models/README.md names every file of models/.

Every ``$ kvq ...`` line of a ```console block of README.md runs in one temporary directory, in order, through
click's CliRunner, and must exit 0; its Python API snippet then runs in the same directory. ```bash blocks hold
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
MODELS = ROOT / "models"

#: a link to a heading of models/smollm2.md (from the root, models/ or tools/), or to one of the page itself
LINK = r"\]\((?:\.\./models/|models/)?smollm2\.md#([^)]+)\)|\]\(#([^)]+)\)"

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


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def python_api_snippet(text: str) -> str:
    """The ```python block of the README's "Python API" section."""
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
    commands = console_commands(README.read_text())
    assert len(commands) >= 15
    for command in commands:
        assert shlex.split(command, comments=True)[0] == "kvq", command
    # what cannot run in a test stays out of console blocks
    for blocked in ("serve", "build", "bench-serve", "demo"):
        assert not any(shlex.split(c, comments=True)[1] == blocked for c in commands), blocked


def test_readme_shows_the_demo_as_it_prints():
    """The demo's sample output in the README has the columns and rows ``kvq demo`` prints, and its serve lines.

    (``tests/test_demo.py`` checks that ``kvq demo`` prints these same columns, rows and lines.)
    """
    text = README.read_text()
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


def test_readme_commands_and_python_api_run_in_order(tiny_world):
    text = README.read_text()
    for command in console_commands(text):
        result = kvq(*tiny_argv(command, tiny_world))
        assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    snippet = python_api_snippet(text).replace('"smollm2"', repr(str(tiny_world)))
    exec(compile(snippet, "README.md (Python API)", "exec"), {})
    assert (Path("out/kivi4") / "kvq.json").is_file()


def test_every_python_snippet_runs_or_is_the_api_one():
    text = README.read_text()
    api = python_api_snippet(text)
    others = [block for block in python_blocks(text) if block != api]
    assert others, "the README's scheme snippet"
    for block in others:  # self-contained: they export nothing and read no model
        exec(compile(block, "README.md", "exec"), {})


def test_links_into_models_smollm2_md_name_its_headings():
    card = (MODELS / "smollm2.md").read_text()
    anchors = {github_anchor(h) for h in re.findall(r"^#+ (.*)$", card, re.M)}
    for source in (README, MODELS / "smollm2.md", MODELS / "README.md", ROOT / "tools" / "README.md"):
        for link in re.findall(LINK, source.read_text()):
            fragment = link[0] or link[1]
            if source != MODELS / "smollm2.md" and link[1]:
                continue  # a fragment of the linking page itself
            assert fragment in anchors, f"{source.name}: no heading for #{fragment}"
    assert "protocol-p" in anchors


def test_models_readme_names_every_file_of_models():
    listed = (MODELS / "README.md").read_text()
    missing = [p.name for p in MODELS.iterdir() if p.name != "README.md" and p.name not in listed]
    assert not missing, f"models/README.md does not mention {missing}"
