from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import Future

import pytest

from common.config import ConfigError
from common.tokenizer import _deliver, describe_tokenizer_in_background, load_tokenizer, tokenizer_identity


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


def test_a_child_process_describes_the_tokenizer_as_this_process_would(bert_tokenizer_dir, tmp_path):
    described = describe_tokenizer_in_background(str(bert_tokenizer_dir)).result(timeout=120)
    assert not multiprocessing.active_children()  # the child is gone once it has answered
    tok = load_tokenizer(str(bert_tokenizer_dir))
    assert described["identity"] == tokenizer_identity(tok, str(bert_tokenizer_dir))
    assert described["json"] == tok.backend_tokenizer.to_str()
    with pytest.raises(ConfigError, match="tokenizer: cannot load"):
        describe_tokenizer_in_background(str(tmp_path / "nope")).result(timeout=120)


def test_a_child_that_dies_is_a_clear_error():
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=os._exit, args=(3,))
    child.start()
    sender.close()
    future: Future = Future()
    _deliver(receiver, child, future)
    with pytest.raises(ConfigError, match=r"tokenizer: the process loading it died \(exit code 3\)"):
        future.result(timeout=60)
