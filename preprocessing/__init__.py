"""Corpus preprocessing: raw text -> tokenized, packed, deterministic WebDataset shards (Apache Beam)."""
