"""Every relative link in the user documentation resolves: the file exists, and so does the anchor.

The README is split into pages under docs/ that link to each other and to the benchmarks' pages
(benchmarks/README.md, an index, and its topic pages under benchmarks/docs/); a renamed heading or
a moved section would otherwise leave links that open the top of a page, or nothing. Anchors are
GitHub's: a heading's text, lowercased, without punctuation, spaces as hyphens, a repeated one
suffixed -1, -2, ...
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "benchmarks" / "docs").glob("*.md"),
                *(ROOT / "docs").glob("*.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def prose(text: str) -> str:
    """The text without fenced code blocks, whose brackets are not links."""
    return FENCE.sub("", text)


def anchors(page: Path) -> set[str]:
    """Every anchor a page defines: its headings' (numbered when repeated) and explicit ones."""
    text = prose(page.read_text())
    seen: dict[str, int] = {}
    found = set(HTML_ANCHOR.findall(text))
    for heading in HEADING.findall(text):
        base = slug(heading)
        count = seen.get(base, 0)
        found.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return found


def links(page: Path) -> list[str]:
    """The relative link targets of a page's prose (code spans keep their text: `[x](y)` in
    backticks is no link, but a link whose text is code is)."""
    def unquote(span: re.Match) -> str:
        code = span.group(2)
        return "code" if "](" in code else code.replace("[", "(").replace("]", ")")

    text = CODE_SPAN.sub(unquote, prose(page.read_text()))
    return [target for target in LINK.findall(text) if not EXTERNAL.match(target)]


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Each link of `page` whose file or anchor does not exist, with the reason (paths from `root`)."""
    problems = []
    for target in links(page):
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        shown = destination.relative_to(root) if destination.is_relative_to(root) else destination
        if not destination.exists():
            problems.append(f"{target}: no file {shown}")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            problems.append(f"{target}: no heading with anchor #{anchor} in {shown}")
    return problems


def test_the_slug_is_githubs():
    assert slug("Deploying on Jetson / Raspberry Pi") == "deploying-on-jetson--raspberry-pi"
    assert slug("Outputs in `--out`") == "outputs-in---out"
    assert slug("Scale (`scale.py`)") == "scale-scalepy"
    assert slug("15. Security") == "15-security"
    assert slug("What is and isn't protected") == "what-is-and-isnt-protected"


def test_a_broken_file_or_anchor_is_reported(tmp_path):
    # Prepare: a page with good links, a missing file, a missing anchor, and links in code
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[good](other.md#a-section-1) [here](#page) [gone](missing.md) "
                    "[bad](other.md#nowhere) `[code](missing.md)`\n\n```\n[fenced](missing.md)\n```\n"
                    "[web](https://example.com/x.md)\n")

    # Execute
    problems = broken_links(page, tmp_path)

    # Assert
    assert problems == ["missing.md: no file missing.md",
                        "other.md#nowhere: no heading with anchor #nowhere in other.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []
