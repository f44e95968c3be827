"""Tokenizing, hashing and FULL-SENTENCES packing.

Each split is one token stream: the split's documents in hash order, each followed by
[SEP]. Sequence ``s`` of the split is [CLS] + the stream's tokens ``[s*C, (s+1)*C)`` with
``C = max_seq_len - 1``, so sequences span document boundaries and long documents continue
in the next sequence. Shard ``k`` holds sequences ``[k*S, (k+1)*S)``; only the split's very
last sequence is padded. Because the layout is a pure function of the stream, each shard can
be written independently from slices of the per-bucket streams.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

HASH_BYTES = 16


def tokenizer_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size < 65536 else np.dtype(np.int32)


def document_hash(text: str, seed: int) -> bytes:
    """Content hash salted by the seed: the dedup key, and (via its bits) bucket, split and order."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=HASH_BYTES, salt=seed.to_bytes(8, "little")).digest()


def hash_bucket(digest: bytes, num_buckets: int) -> int:
    """Range partition of the hash space: buckets in order hold documents in hash order, so
    bucket streams laid end to end are one global hash order whatever the bucket count."""
    return int.from_bytes(digest[:8], "big") * num_buckets >> 64


def hash_split(digest: bytes, valid_fraction: float) -> str:
    """Uses other bits than the bucket, so the split is independent of the bucket count."""
    return "valid" if int.from_bytes(digest[8:16], "little") < valid_fraction * 2.0**64 else "train"


def plain_tokenizer(tokenizer: Any) -> Any:
    """The fast tokenizer's Rust core, set up for corpus encoding (see :func:`core_from_json`)."""
    return core_from_json(tokenizer.backend_tokenizer.to_str())


def core_from_json(serialised: str) -> Any:
    """Rebuild a Rust tokenizer without the truncation/padding a tokenizer.json may carry, and
    with special-token strings in the text ("[SEP]" typed in a document) encoded as plain text,
    so only packing ever places special tokens."""
    from tokenizers import Tokenizer

    core = Tokenizer.from_str(serialised)
    core.no_truncation()
    core.no_padding()
    core.encode_special_tokens = True
    return core


def encode_batch(core: Any, texts: list[str], dtype: np.dtype) -> list[np.ndarray]:
    """Token ids of each text, without special tokens (packing adds [CLS]/[SEP])."""
    return [np.asarray(e.ids, dtype=dtype) for e in core.encode_batch_fast(texts, add_special_tokens=False)]


def document_stream(documents: list[np.ndarray], sep_id: int, dtype: np.dtype) -> np.ndarray:
    """``doc1 [SEP] doc2 [SEP] ...`` as one array."""
    if not documents:
        return np.zeros(0, dtype=dtype)
    sep = np.asarray([sep_id], dtype=dtype)
    return np.concatenate([part for doc in documents for part in (doc, sep)])


def pack_sequences(stream: np.ndarray, max_seq_len: int, cls_id: int, pad_id: int) -> np.ndarray:
    """[CLS] + consecutive ``max_seq_len - 1`` stream tokens per row; only the last row is padded."""
    content = max_seq_len - 1
    rows = -(-len(stream) // content)
    full = len(stream) // content
    sequences = np.full((rows, max_seq_len), pad_id, dtype=stream.dtype)
    sequences[:, 0] = cls_id
    sequences[:full, 1:] = stream[: full * content].reshape(full, content)
    rest = stream[full * content :]
    sequences[full:, 1 : 1 + len(rest)] = rest  # the last, partial row (if any)
    return sequences


def token_frequencies(sequences: np.ndarray, vocab_size: int, pad_id: int) -> np.ndarray:
    """How often each id occurs, padding left out. ``bincount`` first copies the ids it is given
    to int64; counted in cache-sized chunks, that copy stays in the cache instead of being a
    whole shard's worth."""
    ids = sequences.reshape(-1)
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(ids), _COUNT_CHUNK):
        counts += np.bincount(ids[start : start + _COUNT_CHUNK], minlength=vocab_size)
    counts[pad_id] = 0  # pad ids only ever pad: packing never puts one in the stream
    return counts


_COUNT_CHUNK = 1 << 16


@dataclass(frozen=True)
class StreamSlice:
    path: str
    start: int
    stop: int


@dataclass(frozen=True)
class ShardTask:
    split: str
    index: int
    slices: tuple[StreamSlice, ...]


def plan_shards(
    split: str, buckets: list[tuple[int, int, str]], max_seq_len: int, samples_per_shard: int
) -> list[ShardTask]:
    """Cut a split's stream (bucket streams ``(bucket, n_tokens, path)`` in bucket order) into shards."""
    tokens_per_shard = samples_per_shard * (max_seq_len - 1)
    tasks: list[ShardTask] = []
    pending: list[StreamSlice] = []
    room = tokens_per_shard
    for _bucket, n_tokens, path in sorted(buckets):
        start = 0
        while start < n_tokens:
            take = min(room, n_tokens - start)
            pending.append(StreamSlice(path, start, start + take))
            start += take
            room -= take
            if room == 0:
                tasks.append(ShardTask(split, len(tasks), tuple(pending)))
                pending, room = [], tokens_per_shard
    if pending:
        tasks.append(ShardTask(split, len(tasks), tuple(pending)))
    return tasks
