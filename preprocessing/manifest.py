"""The dataset manifest (docs/contracts.md) and the end-of-run summary built from it.

The manifest is the last file written and is published by an atomic rename: its presence
is what makes an output directory a complete dataset.
"""

from __future__ import annotations

import json
from typing import Any

from apache_beam.io.filesystems import FileSystems

from preprocessing.shards import write_atomic

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKEN_COUNTS = "token_counts.npy"
SPLITS = ("train", "valid")
WORK_DIR = ".work"
"""Intermediate files of a run (spills, token streams, the tokenizer), removed once the manifest is out."""


def nest_counts(counts: dict[str, int]) -> dict[str, Any]:
    """Flat ``documents.dropped.too_long``-style counters -> the manifest's nested sections."""
    counts = {k: v for k, v in counts.items() if v}

    def section(prefix: str) -> dict[str, int]:
        return dict(sorted((k.removeprefix(prefix), v) for k, v in counts.items() if k.startswith(prefix)))

    dropped, repaired, cleaned, files = (
        section(p) for p in ("documents.dropped.", "documents.repaired.", "documents.cleaned.", "files.")
    )
    return {
        "documents": {
            "read": counts.get("documents.read", 0),
            "kept": counts.get("documents.kept", 0),
            "dropped": dropped,
            "repaired": repaired,
            "cleaned": cleaned,
        },
        "files": files,
        "input_bytes": counts.get("input_bytes", 0),
    }


def build_manifest(
    tokenizer_identity: dict[str, Any],
    max_seq_len: int,
    dtype: str,
    shards: list[tuple[str, dict[str, Any]]],
    counts: dict[str, int],
    config: dict[str, Any],
) -> dict[str, Any]:
    splits: dict[str, Any] = {}
    for split in SPLITS:
        entries = sorted((entry for s, entry in shards if s == split), key=lambda e: e["path"])
        splits[split] = {
            "samples": sum(e["samples"] for e in entries),
            "tokens": sum(e["tokens"] for e in entries),
            "shards": entries,
        }
    nested = nest_counts(counts)
    return {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer_identity,
        "max_seq_len": max_seq_len,
        "dtype": dtype,
        "splits": splits,
        "documents": nested["documents"],
        "files": nested["files"],
        "input_bytes": nested["input_bytes"],
        "token_counts": TOKEN_COUNTS,
        "config": config,
    }


def write_manifest(output: str, manifest: dict[str, Any]) -> None:
    write_atomic(FileSystems.join(output, MANIFEST), json.dumps(manifest, indent=2, sort_keys=False).encode())


def read_manifest(output: str) -> dict[str, Any]:
    with FileSystems.open(FileSystems.join(output, MANIFEST)) as handle:
        return json.loads(handle.read().decode("utf-8"))


def summary_table(manifest: dict[str, Any], seconds: float) -> str:
    """The end-of-run table: documents read/kept/dropped by reason, tokens, sequences, shards, MB/s."""
    docs = manifest["documents"]
    rows: list[tuple[str, str]] = [("documents read", f"{docs['read']:,}"), ("documents kept", f"{docs['kept']:,}")]
    rows += [(f"  dropped: {reason}", f"{n:,}") for reason, n in docs["dropped"].items()]
    rows += [(f"  repaired: {reason}", f"{n:,}") for reason, n in docs["repaired"].items()]
    rows += [(f"  cleaned: {reason}", f"{n:,}") for reason, n in docs["cleaned"].items()]
    rows += [(f"files {outcome}", f"{n:,}") for outcome, n in manifest["files"].items()]
    for split in SPLITS:
        info = manifest["splits"][split]
        rows.append(
            (
                f"{split}: tokens / sequences / shards",
                f"{info['tokens']:,} / {info['samples']:,} / {len(info['shards'])}",
            )
        )
    megabytes = manifest["input_bytes"] / 1e6  # the text read, after decompression
    rate = megabytes / max(seconds, 1e-9)
    rows.append(("text MB (decompressed) / seconds / MB/s", f"{megabytes:,.1f} / {seconds:,.1f} / {rate:,.2f}"))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
