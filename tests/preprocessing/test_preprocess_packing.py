"""Hashing, FULL-SENTENCES packing and the shard layout."""

import numpy as np

from preprocessing.packing import (
    document_hash,
    document_stream,
    hash_bucket,
    hash_split,
    pack_sequences,
    plan_shards,
    token_frequencies,
    tokenizer_dtype,
)

CLS, SEP, PAD = 101, 102, 0


def test_dtype_follows_vocabulary_size():
    assert tokenizer_dtype(30522) == np.uint16
    assert tokenizer_dtype(65536) == np.int32


def test_hash_is_content_and_seed_dependent():
    assert document_hash("abc", 0) == document_hash("abc", 0)
    assert document_hash("abc", 0) != document_hash("abd", 0)
    assert document_hash("abc", 0) != document_hash("abc", 1)


def test_split_fraction_is_respected_and_independent_of_buckets():
    digests = [document_hash(f"document {i}", 0) for i in range(20000)]
    valid = sum(hash_split(d, 0.1) == "valid" for d in digests)
    assert 1800 < valid < 2200
    assert all(hash_split(d, 0.0) == "train" for d in digests[:100])
    assert {hash_bucket(d, 7) for d in digests} == set(range(7))


def test_buckets_are_hash_ranges_so_their_order_is_the_global_order():
    digests = sorted(document_hash(f"document {i}", 3) for i in range(5000))
    for num_buckets in (1, 2, 7, 64):
        buckets = [hash_bucket(d, num_buckets) for d in digests]
        assert buckets == sorted(buckets) and set(buckets) == set(range(num_buckets))


def test_stream_and_packing_span_document_boundaries_and_pad_only_the_end():
    docs = [np.arange(1, 6, dtype=np.uint16), np.arange(10, 13, dtype=np.uint16)]
    stream = document_stream(docs, SEP, np.dtype(np.uint16))
    assert stream.tolist() == [1, 2, 3, 4, 5, SEP, 10, 11, 12, SEP]
    packed = pack_sequences(stream, 4, CLS, PAD)
    assert packed.dtype == np.uint16
    assert packed.tolist() == [
        [CLS, 1, 2, 3],
        [CLS, 4, 5, SEP],
        [CLS, 10, 11, 12],
        [CLS, SEP, PAD, PAD],
    ]


def test_plan_shards_cuts_the_concatenated_stream_into_exact_shards():
    # 3 bucket streams of 10, 0 and 7 tokens; 2 sequences of 4 (3 content tokens) per shard.
    buckets = [(2, 7, "b2"), (0, 10, "b0")]
    tasks = plan_shards("train", buckets, max_seq_len=4, samples_per_shard=2)
    assert [t.index for t in tasks] == [0, 1, 2]
    covered = [(s.path, s.start, s.stop) for t in tasks for s in t.slices]
    assert covered == [("b0", 0, 6), ("b0", 6, 10), ("b2", 0, 2), ("b2", 2, 7)]
    assert [sum(s.stop - s.start for s in t.slices) for t in tasks] == [6, 6, 5]
    assert plan_shards("valid", [], 4, 2) == []


def test_corpus_tokenizer_never_truncates_and_never_emits_special_tokens(bert_tokenizer_dir):
    from common.tokenizer import load_tokenizer
    from preprocessing.packing import encode_batch, plain_tokenizer

    tokenizer = load_tokenizer(str(bert_tokenizer_dir))
    assert tokenizer.backend_tokenizer.truncation is not None  # the shipped tokenizer.json truncates at 128
    core = plain_tokenizer(tokenizer)
    long_text, typed_specials = "word " * 1000, "a [SEP] b [CLS] c [PAD]"
    long_ids, special_ids = encode_batch(core, [long_text, typed_specials], np.dtype(np.uint16))
    assert len(long_ids) == 1000
    assert not set(special_ids.tolist()) & {tokenizer.sep_token_id, tokenizer.cls_token_id, tokenizer.pad_token_id}


def test_token_frequencies_leave_out_padding_and_span_count_chunks():
    rng = np.random.default_rng(0)
    sequences = rng.integers(0, 300, size=(700, 128)).astype(np.uint16)  # 89,600 ids: two count chunks
    sequences[-1, 50:] = PAD
    counts = token_frequencies(sequences, 300, PAD)
    expected = np.bincount(sequences[sequences != PAD].astype(np.int64), minlength=300)
    np.testing.assert_array_equal(counts, expected)
    assert counts.dtype == np.int64 and counts[PAD] == 0
