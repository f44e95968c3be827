"""Cleaning: NFC, control characters, whitespace runs."""

from preprocessing.cleaning import clean_text


def test_nfc_normalises_decomposed_characters():
    text, removed = clean_text("Cafe\u0301 au lait")
    assert text == "Caf\u00e9 au lait"
    assert not removed


def test_control_characters_and_nuls_are_removed_and_reported():
    text, removed = clean_text("a\x00b\x01c\x7f d\x85e\ud800f")
    assert text == "abc def"
    assert removed


def test_whitespace_runs_collapse_but_line_breaks_survive():
    text, _ = clean_text("  one\t\t two  \r\n\r\n\n   three \u00a0 four  \n")
    assert text == "one two\nthree four"


def test_clean_text_is_idempotent():
    once, _ = clean_text("x \x00 y\n\n z\u0301")
    assert clean_text(once) == (once, False)
