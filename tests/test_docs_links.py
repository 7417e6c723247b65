"""Every relative link of README.md, docs/ and models/ resolves: the file exists, and a #fragment names a heading.

Links to other sites are not followed. A fragment is checked against the headings of the Markdown file it points
into, spelled as GitHub spells a heading's anchor.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "models").rglob("*.md")])

#: ``[text](target)`` outside code; the target up to the first space (a title may follow)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)[^)]*\)")


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose(text: str) -> str:
    """``text`` without fenced blocks and inline code, where brackets are not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {github_anchor(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text())) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in relative_links(page):
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading #{fragment}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_protocol_p_keeps_its_anchor():
    """Pages, tools/README.md and the protocol tool's users link to models/smollm2.md#protocol-p."""
    assert "protocol-p" in anchors(ROOT / "models" / "smollm2.md")


def test_the_checker_sees_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("# A\n\n[b](b.md) [a](#a) [x](#missing) `[c](c.md)` [w](https://example.com)\n")
    assert relative_links(tmp_path / "a.md") == ["b.md", "#a", "#missing"]
    assert "a" in anchors(tmp_path / "a.md") and "missing" not in anchors(tmp_path / "a.md")
