"""``python -m preprocessing.augment [CONFIG.yaml] input=... mlm=... output=... [key=value ...]``:
TinyBERT's data augmentation (Jiao et al., 2020) as a Beam pipeline.

Each example of a labelled task file (JSONL, optionally gzipped; the rows ``trainer finetune`` and
``trainer task-distill`` read) yields itself and ``variants`` copies in which each word of the text
columns is, with probability ``probability``, replaced by one of a masked-LM's ``top_k`` candidates
for it. Whole-word: the word (however many word pieces it has) is replaced by one ``[MASK]`` and
only candidates that are whole words are kept (no ``##`` piece, no punctuation, not the word
itself). TinyBERT asks the MLM for single-piece words and GloVe for the others; one masked slot per
word gives both kinds an MLM candidate without a second model. The candidates of a word are
computed once per example (one forward pass per word, all words of an example in one batch) and
every variant draws from them, so the MLM cost does not grow with ``variants``.

Deterministic for a seed: a variant's choices come from a generator seeded by (seed, example
index, variant), and the candidates from the model alone, so any runner with any number of
workers writes the same file. The output directory holds ``train.jsonl.gz`` (sorted by example,
the original first; labels and other columns copied) and ``augment.json`` (the config and the
counts); it appears whole (``common.atomic``). Bad input (a line that is not a JSON object, a
missing or empty text column) is a counted, reported skip, as for corpora.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import logging
import random
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import field
from pathlib import Path
from typing import Any

from common.atomic import atomic_directory
from common.cli import exit_process, run_cli, split_config_args
from common.config import ConfigError, load_config, require, to_dict
from preprocessing.config import DIRECT_RUNNERS, LOGGING_DEFAULTS
from preprocessing.quiet import quiet_beam_logging

log = logging.getLogger("preprocessing")
NAMESPACE = "augment"
OUTPUT_FILE = "train.jsonl.gz"
SUMMARY_FILE = "augment.json"
WORD = re.compile(r"\w+")
# transformers builds a model under a process-wide "meta device" context: two DirectRunner worker
# threads loading the MLM at once would see each other's context. One load at a time.
LOAD_LOCK = threading.Lock()


@dataclasses.dataclass
class AugmentConfig:
    input: str  # a JSONL file (optionally .gz) of labelled examples
    mlm: str  # a Hugging Face masked-LM directory (its tokenizer included)
    output: str  # the directory to write
    text_columns: list[str] = field(default_factory=lambda: ["text"])  # the columns whose words are replaced
    variants: int = 20  # augmented copies per example (TinyBERT: 20)
    probability: float = 0.4  # of each word being replaced (TinyBERT: 0.4)
    top_k: int = 15  # candidates per word (TinyBERT: 15)
    max_seq_len: int = 128
    keep_original: bool = True
    seed: int = 0
    beam: dict[str, Any] = field(default_factory=dict)  # Beam pipeline options (runner, direct_num_workers, ...)

    def validate(self) -> None:
        require(bool(self.text_columns), "text_columns", "name at least one column")
        require(self.variants >= 1, "variants", "must be >= 1")
        require(0 < self.probability <= 1, "probability", "must be in (0, 1]")
        require(self.top_k >= 1, "top_k", "must be >= 1")
        require(self.max_seq_len >= 8, "max_seq_len", "must be >= 8")
        require(Path(self.input).is_file(), "input", f"{self.input} does not exist")
        require((Path(self.mlm) / "config.json").is_file(), "mlm", f"{self.mlm} is not a Hugging Face model directory")

    def beam_options(self) -> dict[str, Any]:
        if self.beam.get("runner", "DirectRunner") in DIRECT_RUNNERS:
            return {**LOGGING_DEFAULTS, "runner": "DirectRunner", "direct_num_workers": 1, **self.beam}
        return {**LOGGING_DEFAULTS, **self.beam}


# ------------------------------------------------------------------------------------------ pure parts
def parse_row(line: str, text_columns: list[str]) -> tuple[dict[str, Any] | None, str | None]:
    """The row, or None and the name of the reason it is skipped."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None, "bad_json"
    if not isinstance(row, dict):
        return None, "bad_json"
    if any(column not in row for column in text_columns):
        return None, "missing_column"
    if any(not isinstance(row[column], str) or not row[column].strip() for column in text_columns):
        return None, "empty_text"
    return row, None


def variant_rng(seed: int, index: int, variant: int) -> random.Random:
    digest = hashlib.sha256(f"{seed}:{index}:{variant}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def apply_choices(
    text: str, spans: list[tuple[int, int]], candidates: list[list[str]], rng: random.Random, probability: float
) -> str:
    """``text`` with each word span replaced, with ``probability``, by a candidate drawn from its list."""
    pieces, last = [], 0
    for (start, end), words in zip(spans, candidates, strict=True):
        if words and rng.random() < probability:
            pieces += [text[last:start], rng.choice(words)]
            last = end
    return "".join([*pieces, text[last:]])


class MaskedLmCandidates:
    """For each word of a text, the masked-LM's top-k whole-word replacements (empty: none)."""

    def __init__(self, model_dir: str, top_k: int, max_seq_len: int) -> None:
        import torch
        from transformers import AutoModelForMaskedLM, AutoTokenizer

        torch.set_num_threads(1)  # one worker, one core: the runner decides the parallelism
        self.torch = torch
        with LOAD_LOCK:
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if self.tokenizer.mask_token is None:
            raise ConfigError(f"mlm: the tokenizer of {model_dir} has no mask token")
        with LOAD_LOCK:
            self.model = AutoModelForMaskedLM.from_pretrained(model_dir).eval()
        self.top_k, self.max_seq_len = top_k, max_seq_len
        vocab = self.tokenizer.get_vocab()
        special = set(self.tokenizer.all_special_ids)
        # Which vocabulary entries may replace a word: whole words, decoded once.
        self.words: dict[int, str] = {}
        for token, token_id in vocab.items():
            if token_id in special or token.startswith("##"):
                continue
            word = self.tokenizer.convert_tokens_to_string([token]).strip()
            if WORD.fullmatch(word) and not word.isdigit():
                self.words[token_id] = word

    def __call__(self, text: str) -> tuple[list[tuple[int, int]], list[list[str]]]:
        spans = [match.span() for match in WORD.finditer(text)]
        # Words past max_seq_len (truncated away) get no candidates and cost no forward pass.
        offsets = self.tokenizer(text, truncation=True, max_length=self.max_seq_len, return_offsets_mapping=True)
        limit = max(end for _, end in offsets["offset_mapping"])
        within = [span for span in spans if span[1] <= limit]
        if not within:
            return spans, [[] for _ in spans]
        mask = self.tokenizer.mask_token
        masked = [text[:start] + mask + text[end:] for start, end in within]
        encoded = self.tokenizer(
            masked, truncation=True, max_length=self.max_seq_len, padding=True, return_tensors="pt"
        )
        with self.torch.no_grad():
            logits = self.model(**encoded).logits
        candidates: list[list[str]] = []
        for row, (start, end) in enumerate(within):
            at = (encoded["input_ids"][row] == self.tokenizer.mask_token_id).nonzero()
            if len(at) == 0:  # the word lies past max_seq_len
                candidates.append([])
                continue
            original = text[start:end].lower()
            ranked = logits[row, int(at[0])].argsort(descending=True).tolist()
            words: list[str] = []
            for token_id in ranked:
                word = self.words.get(token_id)
                if word is not None and word.lower() != original and word not in words:
                    words.append(word)
                    if len(words) == self.top_k:
                        break
            candidates.append(words)
        return spans, candidates + [[] for _ in spans[len(within) :]]


# ------------------------------------------------------------------------------------------------ Beam
def build_augment_dofn(cfg: AugmentConfig) -> Any:
    import apache_beam as beam

    class Augment(beam.DoFn):
        """(index, line) -> ((index, variant), row) for the original and its variants; bad lines counted."""

        def setup(self) -> None:
            self.candidates = MaskedLmCandidates(cfg.mlm, cfg.top_k, cfg.max_seq_len)

        def process(self, element: tuple[int, str]) -> Iterator[tuple[tuple[int, int], str]]:
            index, line = element
            if not line.strip():
                return
            row, problem = parse_row(line, cfg.text_columns)
            count = beam.metrics.Metrics.counter
            if row is None:
                count(NAMESPACE, f"skipped_{problem}").inc()
                return
            count(NAMESPACE, "examples").inc()
            if cfg.keep_original:
                yield (index, 0), json.dumps(row, ensure_ascii=False, sort_keys=True)
            found = {column: self.candidates(row[column]) for column in cfg.text_columns}
            seen = {tuple(row[column] for column in cfg.text_columns)}
            for variant in range(1, cfg.variants + 1):
                rng = variant_rng(cfg.seed, index, variant)
                new = {
                    column: apply_choices(row[column], *found[column], rng, cfg.probability)
                    for column in cfg.text_columns
                }
                key = tuple(new[column] for column in cfg.text_columns)
                if key in seen:  # a variant no different from the original or an earlier one
                    count(NAMESPACE, "duplicate_variants").inc()
                    continue
                seen.add(key)
                count(NAMESPACE, "variants").inc()
                yield (index, variant), json.dumps({**row, **new}, ensure_ascii=False, sort_keys=True)

    return Augment()


def read_lines(path: str) -> list[tuple[int, str]]:
    opener: Any = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return list(enumerate(f, start=1))


def write_rows(rows: list[tuple[tuple[int, int], str]], directory: str) -> None:
    """The rows in (example, variant) order, gzipped with a fixed mtime (the same bytes every run)."""
    with open(Path(directory) / OUTPUT_FILE, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        for _, line in sorted(rows):
            f.write(line.encode("utf-8") + b"\n")


def run(cfg: AugmentConfig) -> dict[str, int]:
    """Run the pipeline; returns the counts (also in ``augment.json``)."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    from preprocessing.pipeline import make_runner

    options = PipelineOptions(flags=[], **cfg.beam_options())
    runner = make_runner(options)
    lines = read_lines(cfg.input)
    started = time.monotonic()
    with atomic_directory(cfg.output) as tmp:  # the directory appears whole, counts included
        pipeline = beam.Pipeline(runner=runner, options=options)
        (
            pipeline
            | "Lines" >> beam.Create(lines, reshuffle=True)
            | "Augment" >> beam.ParDo(build_augment_dofn(cfg))
            | "All" >> beam.combiners.ToList()
            | "Write" >> beam.Map(write_rows, str(tmp))
        )
        result = pipeline.run()
        result.wait_until_finish()
        counters = result.metrics().query(beam.metrics.MetricsFilter().with_namespace(NAMESPACE))["counters"]
        counts = {counter.key.metric.name: int(counter.committed or counter.attempted) for counter in counters}
        summary = {"config": to_dict(cfg), "counts": counts}
        (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    skipped = {k: v for k, v in counts.items() if k.startswith("skipped_")}
    if skipped:
        log.warning("augment: skipped %d bad lines of %s: %s", sum(skipped.values()), cfg.input, skipped)
    log.info("augment: %s in %.1f s -> %s", counts, time.monotonic() - started, Path(cfg.output) / OUTPUT_FILE)
    return counts


def main(argv: list[str]) -> int:
    path, overrides = split_config_args(argv, __doc__)
    cfg = load_config(AugmentConfig, path, overrides)
    quiet_beam_logging()
    counts = run(cfg)
    print(json.dumps(counts, sort_keys=True))
    return 0


if __name__ == "__main__":
    exit_process(run_cli(main))
