"""Text normalisation applied to every document before hashing and tokenizing.

Cleaning runs before de-duplication, so two documents that differ only in Unicode form,
stray control bytes or whitespace count as duplicates.
"""

from __future__ import annotations

import re
import unicodedata

# C0/C1 control characters (NUL included) except tab, newline and carriage return, which
# are whitespace; lone surrogates (possible via JSON "\ud800" escapes) cannot be encoded.
_REMOVED = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")


def clean_text(text: str) -> tuple[str, bool]:
    """NFC, drop control characters, collapse whitespace runs -> (clean text, whether chars were removed).

    Runs of spaces and tabs become one space; runs of whitespace holding a line break become
    one ``\\n`` (paragraph structure survives for tokenizers that see newlines).
    """
    removed = False
    if _REMOVED.search(text):
        text = _REMOVED.sub("", text)
        removed = True
    if not text.isascii():
        text = unicodedata.normalize("NFC", text)
    # Per line, collapse whitespace runs; blank lines vanish. str.split() is one C loop with no
    # pattern matching, cheaper than regex substitutions doing the same (docs/log/benchmarks.md).
    lines = (" ".join(line.split()) for line in text.split("\n"))
    return "\n".join(line for line in lines if line), removed
