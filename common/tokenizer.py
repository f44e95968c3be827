"""Loading the teacher's tokenizer, and the identity that ties a dataset to it.

Preprocessing records :func:`tokenizer_identity` in the dataset manifest and the trainer
compares it with the teacher's, so a dataset tokenized for one teacher cannot silently be
used with another. The fingerprint hashes the fast tokenizer's canonical serialisation
(vocabulary, normaliser, pre-tokeniser, post-processor), so it is the same whether the
tokenizer came from a hub id, a local directory or a re-saved copy.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from common.config import ConfigError


def load_tokenizer(name_or_path: str) -> Any:
    """``AutoTokenizer.from_pretrained`` (fast), with a clear error instead of a traceback."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, use_fast=True)
    except (OSError, ValueError) as err:
        raise ConfigError(f"tokenizer: cannot load {name_or_path!r}: {err}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"tokenizer: {name_or_path!r} has no fast (Rust) tokenizer")
    return tokenizer


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    names = ("cls", "sep", "pad", "mask", "unk", "bos", "eos")
    ids = {name: getattr(tokenizer, f"{name}_token_id", None) for name in names}
    return {name: int(i) for name, i in ids.items() if i is not None}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of what maps text to ids; truncation/padding are call-time settings and left out."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    state.pop("truncation", None)
    state.pop("padding", None)
    canonical = json.dumps(state, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def tokenizer_identity(tokenizer: Any, name_or_path: str) -> dict[str, Any]:
    return {
        "name_or_path": name_or_path,
        "vocab_size": len(tokenizer),
        "special_token_ids": special_token_ids(tokenizer),
        "fingerprint": tokenizer_fingerprint(tokenizer),
    }


def describe_tokenizer(name_or_path: str) -> dict[str, Any]:
    """What a process that never imports transformers needs: the identity and the serialised
    Rust core (``tokenizers.Tokenizer.from_str`` rebuilds it).

    Raises :class:`ConfigError` as :func:`load_tokenizer` does."""
    tokenizer = load_tokenizer(name_or_path)
    return {"identity": tokenizer_identity(tokenizer, name_or_path), "json": tokenizer.backend_tokenizer.to_str()}
