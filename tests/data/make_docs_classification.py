"""Writes ``docs-classification.jsonl``: prose paragraphs of the Python docs (label 0) and the
Linux kernel docs (label 1), a small real text-classification set for the fine-tuning tests.

    python tests/data/make_docs_classification.py /work/shared/corpora tests/data/docs-classification.jsonl

Deterministic: the same corpora give the same file. Only prose is kept (no code, tables or
headings), so the classifier has to read the text, not spot reStructuredText markup.
"""

from __future__ import annotations

import gzip
import json
import random
import re
import sys
from pathlib import Path

PER_CLASS = 150
SOURCES = (("python-docs.jsonl.gz", 0), ("linux-docs.jsonl.gz", 1))


def paragraphs(corpus: Path) -> list[str]:
    """Prose paragraphs of 150-450 characters, each once, in corpus order."""
    seen: set[str] = set()
    kept = []
    with gzip.open(corpus, "rt", encoding="utf-8") as f:
        for line in f:
            for block in json.loads(line)["text"].split("\n\n"):
                lines = block.strip("\n").splitlines()
                if not lines or any(not ln.strip() or ln[0].isspace() for ln in lines):
                    continue  # indented: code, quotes, definition bodies
                text = " ".join(ln.strip() for ln in lines)
                if not 150 <= len(text) <= 450 or text in seen:
                    continue
                if re.search(r"^[.:=*#|+-]|::|`|\|", text) or re.search(r"[=\-~^]{4}", text):
                    continue  # directives, tables, headings, inline markup
                letters = sum(c.isalpha() or c.isspace() for c in text)
                if letters / len(text) < 0.9:
                    continue
                seen.add(text)
                kept.append(text)
    return kept


def main(corpora: Path, out: Path) -> None:
    rows = []
    for name, label in SOURCES:
        chosen = random.Random(label).sample(paragraphs(corpora / name), PER_CLASS)
        rows += [{"text": text, "label": label} for text in chosen]
    random.Random(0).shuffle(rows)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    tmp.replace(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
