from __future__ import annotations

import pytest

from common.config import ConfigError
from common.tokenizer import describe_tokenizer, load_tokenizer, tokenizer_identity


def test_identity_survives_a_save_roundtrip(bert_tokenizer_dir, tmp_path):
    tok = load_tokenizer(str(bert_tokenizer_dir))
    ident = tokenizer_identity(tok, str(bert_tokenizer_dir))
    assert ident["vocab_size"] == 30522
    assert ident["special_token_ids"]["cls"] == 101 and ident["special_token_ids"]["pad"] == 0
    tok.save_pretrained(tmp_path)
    again = tokenizer_identity(load_tokenizer(str(tmp_path)), str(tmp_path))
    assert again["fingerprint"] == ident["fingerprint"]


def test_unreadable_tokenizer_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer"):
        load_tokenizer(str(tmp_path / "nope"))


def test_fingerprint_ignores_call_time_truncation_and_padding(bert_tokenizer_dir):
    tok = load_tokenizer(str(bert_tokenizer_dir))
    before = tokenizer_identity(tok, "x")["fingerprint"]
    tok(["some text", "more"], truncation=True, max_length=8, padding="max_length")
    assert tokenizer_identity(tok, "x")["fingerprint"] == before


def test_the_description_is_the_identity_and_the_serialised_core(bert_tokenizer_dir, tmp_path):
    described = describe_tokenizer(str(bert_tokenizer_dir))
    tok = load_tokenizer(str(bert_tokenizer_dir))
    assert described["identity"] == tokenizer_identity(tok, str(bert_tokenizer_dir))
    assert described["json"] == tok.backend_tokenizer.to_str()
    with pytest.raises(ConfigError, match="tokenizer: cannot load"):
        describe_tokenizer(str(tmp_path / "nope"))
