"""The docs a newcomer reads stay short and their links lead somewhere.

Each ``docs/*.md`` page is at most ``MAX_LINES`` lines, so that it can lead with the answer and be read
whole; history goes to ``docs/log/``, which is not held to it. Every relative link in README.md and the
pages (``[text](path)`` or ``[text](path#anchor)``) names a file that exists, and an anchor names a
heading of its page; every ``docs/....md`` path the pages mention in prose exists too, so that a page
split or renamed leaves no reader at a dead end.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 400
PAGES = sorted((REPO / "docs").glob("*.md"))
READ = [REPO / "README.md", *PAGES]

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MENTION = re.compile(r"(?<![\w/.-])docs/[\w./-]+?\.md\b")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose(page: Path) -> list[str]:
    """The page's lines outside fenced code blocks (a ``# comment`` in a shell block is not a heading)."""
    lines, fenced = [], False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(page: Path) -> set[str]:
    return {anchor(m.group(1)) for line in prose(page) if (m := HEADING.match(line))}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_a_page_is_at_most_400_lines(page: Path) -> None:
    n = len(page.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_LINES, (
        f"docs/{page.name} has {n} lines, more than {MAX_LINES}: move history to docs/log/, split a topic into "
        "a page of its own, or make a hand-copied procedure a script"
    )


@pytest.mark.parametrize("page", READ, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_at_files_and_headings_that_exist(page: Path) -> None:
    broken = []
    for line in prose(page):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{target}: no such file")
            elif fragment and file.suffix == ".md" and fragment not in anchors(file):
                broken.append(f"{target}: no heading #{fragment} in {file.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", READ, ids=lambda p: str(p.relative_to(REPO)))
def test_pages_the_prose_names_exist(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    missing = sorted({m for m in MENTION.findall(text) if "*" not in m and not (REPO / m).exists()})
    assert not missing, f"{page.relative_to(REPO)} names pages that do not exist: {missing}"


def test_anchor_follows_github() -> None:
    assert anchor("Where the data lives: local disk, a shared filesystem, or an object store") == (
        "where-the-data-lives-local-disk-a-shared-filesystem-or-an-object-store"
    )
    assert anchor("The linear probe: `method=probe`") == "the-linear-probe-methodprobe"
    assert anchor("Resuming on another number of GPUs") == "resuming-on-another-number-of-gpus"
