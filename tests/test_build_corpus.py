"""benchmarks/quality/build_corpus.py without the network: a tiny .deb built here (dpkg-deb --build) goes through
the verification, extraction, conversion and filters, and the output is checked and built twice."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from helpers import REPO

pytestmark = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")


def prose(topic: str) -> str:
    """A paragraph of English long enough to be kept, its own for each topic (a paragraph seen before is removed)."""
    return (
        f"The quick brown fox jumps over the lazy dog in the {topic} file, and this sentence is here so that the "
        "document is long enough to be kept by the filter. It is written in English, with the common words that "
        "the language check counts, and it says nothing of any importance to anyone who reads it."
    )


HTML = f"""<!DOCTYPE html>
<html><head><title>Page title</title><style>p {{ color: red; }}</style></head>
<body>
<nav><a href="index.html">NAVIGATION LINK</a></nav>
<div class="sphinxsidebar"><div><h3>SIDEBAR HEADING</h3></div></div>
<h1>A heading<a class="headerlink" href="#x">¶</a></h1>
<p>{prose("html")}</p>
<script>var hidden = "SCRIPT TEXT";</script>
<p>Second &amp; last paragraph, with <b>bold</b> and <code>code</code> inside it.</p>
<pre>line one
    indented line two</pre>
<footer>FOOTER TEXT</footer>
</body></html>
"""
MAN = f""".TH FAKE 1 "2024" "fake 1.0" "User Commands"
.SH NAME
fake \\- a program that does nothing
.SH DESCRIPTION
.B fake
is a program. {prose("man")}
.PP
It reads \\fIno\\fP files and writes \\fBnothing\\fR at all.
"""
NOTES = "Notes on the fake package.\n\n" + prose("notes") + "\n"
LEAK = "This description was copied from the evaluation suite and must never reach the pretraining corpus at all."
LEAKED = f"{prose('leaked')}\n\n{LEAK}\n\n{prose('notes')}\n"  # a leaked paragraph, and one of the notes again


def load() -> ModuleType:
    """benchmarks/quality/build_corpus.py, imported from its path (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("build_corpus", REPO / "benchmarks" / "quality" / "build_corpus.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bc() -> ModuleType:
    return load()


@pytest.fixture(scope="module")
def fake_deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A .deb with an HTML page, a man page, a gzipped text, a copy of it, a too-short text and a copyright file,
    named as apt-get download names it, in a cache directory of its own."""
    root = tmp_path_factory.mktemp("fake-doc")
    (root / "DEBIAN").mkdir()
    (root / "DEBIAN" / "control").write_text(
        "Package: fake-doc\nVersion: 1.0-1\nArchitecture: all\nMaintainer: Nobody <nobody@example.org>\n"
        "Description: a package for the corpus builder's test\n"
    )
    doc = root / "usr" / "share" / "doc" / "fake-doc"
    doc.mkdir(parents=True)
    (doc / "guide.html").write_text(HTML)
    (doc / "notes.txt.gz").write_bytes(gzip.compress(NOTES.encode(), mtime=0))
    (doc / "copy-of-notes.txt").write_text(NOTES)  # the same text once more: a duplicate
    (doc / "short.txt").write_text("Too short to keep.\n")
    (doc / "leaked.txt").write_text(LEAKED)
    (doc / "copyright").write_text(f"License: CC0-1.0\n {prose('copyright')}\n")  # never read as a document
    man = root / "usr" / "share" / "man" / "man1"
    man.mkdir(parents=True)
    (man / "fake.1.gz").write_bytes(gzip.compress(MAN.encode(), mtime=0))
    cache = tmp_path_factory.mktemp("cache")
    deb = cache / "fake-doc_1.0-1_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(root), str(deb)], check=True, capture_output=True)
    return deb


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An evaluation suite of one task, whose one text the fake package leaks."""
    tasks = tmp_path_factory.mktemp("tasks")
    (tasks / "debian-section").mkdir()
    row = {"label": "doc", "package": "leak", "text": LEAK}
    (tasks / "debian-section" / "train.jsonl.gz").write_bytes(gzip.compress((json.dumps(row) + "\n").encode()))
    return tasks


def package(bc: ModuleType, deb: Path, sha256: str | None = None) -> object:
    digest = sha256 or hashlib.sha256(deb.read_bytes()).hexdigest()
    return bc.Package("fake-doc", "1.0-1", digest, "manual", ("html", "man", "text"), "CC0-1.0 (test)")


def read_rows(path: Path) -> list[dict[str, str]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_a_fake_package_is_converted_filtered_and_counted(
    bc: ModuleType, fake_deb: Path, tasks_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    manifest = bc.build([package(bc, fake_deb)], out, fake_deb.parent, tasks_dir=tasks_dir, jobs=1, log=lambda _: None)
    rows = read_rows(out / "corpus-fake-doc.jsonl.gz")
    texts = {row["id"].rsplit("/", 1)[-1]: row["text"] for row in rows}
    # sorted paths: copy-of-notes.txt comes before notes.txt.gz, which is then the duplicate
    assert list(texts) == ["copy-of-notes.txt", "guide.html", "leaked.txt", "fake.1.gz"]
    assert {row["source"] for row in rows} == {"fake-doc"}

    html = texts["guide.html"]
    assert html.startswith("A heading\n\nThe quick brown fox")
    assert "Second & last paragraph, with bold and code inside it." in html
    assert "line one\nindented line two" in html  # <pre> keeps its lines; blanks are normalised
    for left_out in ("NAVIGATION", "SIDEBAR", "SCRIPT TEXT", "FOOTER", "color", "Page title", "¶", "<", ">"):
        assert left_out not in html

    man = texts["fake.1.gz"]
    assert "a program that does nothing" in man and "reads no files and writes nothing at all" in man
    assert "\\f" not in man and ".TH" not in man

    assert texts["leaked.txt"] == prose("leaked")  # the leaked paragraph and the one seen before go, the rest stays

    source = manifest["sources"]["fake-doc"]
    assert source["files"] == 6  # copyright is not read
    assert source["documents"] == len(rows) == 4
    assert source["dropped"] == {"duplicate": 1, "short": 1}
    assert source["contaminated_paragraphs_removed"] == 1
    assert source["repeated_paragraph_characters_removed"] == len("\n\n" + prose("notes"))
    assert source["characters"] == sum(len(row["text"]) for row in rows)
    tokenizer = bc.load_tokenizer()
    expected_tokens = sum(len(tokenizer.encode(row["text"], add_special_tokens=False).ids) for row in rows)
    assert source["wordpiece_tokens"] == expected_tokens
    assert manifest["totals"]["wordpiece_tokens"] == expected_tokens
    assert manifest["packages"][0]["sha256"] == hashlib.sha256(fake_deb.read_bytes()).hexdigest()
    assert manifest["contamination_check"]["task_texts"] == 1
    assert json.loads((out / "corpus-manifest.json").read_text()) == manifest
    assert sorted(path.name for path in out.iterdir()) == ["corpus-fake-doc.jsonl.gz", "corpus-manifest.json"]

    again = tmp_path / "again"
    bc.build([package(bc, fake_deb)], again, fake_deb.parent, tasks_dir=tasks_dir, jobs=2, log=lambda _: None)
    for name in ("corpus-fake-doc.jsonl.gz", "corpus-manifest.json"):
        assert (again / name).read_bytes() == (out / name).read_bytes(), f"{name} differs (1 process, then 2)"


def test_a_deb_that_is_not_the_pinned_one_stops_the_build(bc: ModuleType, fake_deb: Path, tmp_path: Path) -> None:
    wrong = package(bc, fake_deb, sha256="0" * 64)
    with pytest.raises(bc.CorpusError, match=r"sha256 [0-9a-f]{64} does not match the pinned 0{64} of fake-doc=1\.0-1"):
        bc.build([wrong], tmp_path / "out", fake_deb.parent, tasks_dir=None, jobs=1, log=lambda _: None)
    assert not (tmp_path / "out" / "corpus-fake-doc.jsonl.gz").exists()


def test_without_groff_a_man_page_still_reads_as_text(bc: ModuleType) -> None:
    text = bc.normalise(bc.strip_man_macros(MAN))
    assert "a program that does nothing" in text and "It reads no files and writes nothing at all." in text
    assert "\\f" not in text and ".TH" not in text


def test_gcide_blocks_from_wordnet_are_removed(bc: ModuleType) -> None:
    entry = (
        "Fox \\Fox\\, n.\n   1. A carnivorous animal of the genus Vulpes.\n        [1913 Webster]\n\n"
        "   2. the grey or reddish fur of a fox.\n\n   Syn: fox fur\n        [WordNet 1.5]\n"
    )
    text = bc.without_wordnet(entry)
    assert "genus Vulpes" in text and "reddish fur" not in text and "Webster]" not in text


def test_an_unknown_package_name_is_refused(bc: ModuleType) -> None:
    with pytest.raises(bc.CorpusError, match="not in the pinned list: no-such-package"):
        bc.select("dict-gcide,no-such-package")
    assert [p.name for p in bc.select("python3.11-doc,dict-gcide")] == ["dict-gcide", "python3.11-doc"]
