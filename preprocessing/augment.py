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

Deterministic for a seed: a variant's choices come from a generator seeded by (seed, example,
variant), where an example is named by its file's place among the sorted matches of ``input`` and
its line number, and the candidates come from the model alone, so any runner with any number of
workers writes the same file. The output directory holds ``train.jsonl.gz`` (sorted by file, line
and variant, each original first; labels and other columns copied) and ``augment.json`` (the
config and the counts); it appears whole (``common.atomic``). Bad input (a line that is not a JSON
object, a missing or empty text column, a line over 16 Mi characters) is a counted, reported skip,
as for corpora.

Memory: no step holds the dataset, which TinyBERT's 20 variants make 21 times the input, and the
rows never pass through the runner (the DirectRunner would buffer each step's output in memory):
they move through files in a work directory inside the output, and the runner carries only keys
and paths. The driver lists the input files; a worker copies each file into pieces of at most
``PIECE_LINES`` lines that never cross a shard (``lines_per_shard`` lines, by file and line
alone); a worker augments a piece into a rows file in output order (each original, then its
variants) and emits (shard, piece's first line, rows path); grouping by shard gathers those names;
a worker streams a shard's rows files, in line order, into one gzip member and deletes them; the
driver streams the members, in shard order, into ``train.jsonl.gz`` (gzip members laid end to end
are one gzip stream) and removes the work directory (``common.atomic`` removes it on an error).
So a worker holds one example's rows or a copy buffer at a time, and the runner a key and a path
or two per piece, whatever ``variants`` and the length of the text (peak RSS: docs/benchmarks.md,
"Augmentation memory"). A line over
``MAX_LINE_CHARS`` (16 Mi characters) is a counted skip, never read whole. Workers write into the
output directory, so it must be on a filesystem they share with the driver.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import hashlib
import itertools
import json
import logging
import os
import random
import re
import shutil
import threading
import time
import uuid
import zlib
from collections.abc import Iterable, Iterator
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
WORK_DIR = "work"  # inside the output directory while the pipeline runs; removed after
PIECE_LINES = 100  # input lines one worker augments at once (at most 2,100 rows with 20 variants)
MAX_LINE_CHARS = 16 * 2**20  # a longer input line is a counted skip, never read whole
COPY_BYTES = 1 << 20
WORD = re.compile(r"\w+")
# Two DirectRunner worker threads setting up at once: transformers' first import (a lazy module)
# fails in one of them ("cannot import name"), and it builds a model under a process-wide "meta
# device" context that the other would see. One import and load at a time.
LOAD_LOCK = threading.Lock()


@dataclasses.dataclass
class AugmentConfig:
    input: str  # a JSONL file (optionally .gz) of labelled examples, or a glob of them
    mlm: str  # a Hugging Face masked-LM directory (its tokenizer included)
    output: str  # the directory to write
    text_columns: list[str] = field(default_factory=lambda: ["text"])  # the columns whose words are replaced
    variants: int = 20  # augmented copies per example (TinyBERT: 20)
    probability: float = 0.4  # of each word being replaced (TinyBERT: 0.4)
    top_k: int = 15  # candidates per word (TinyBERT: 15)
    max_seq_len: int = 128
    keep_original: bool = True
    seed: int = 0
    lines_per_shard: int = 2_000  # input lines per output shard: one gzip member, written by one worker
    beam: dict[str, Any] = field(default_factory=dict)  # Beam pipeline options (runner, direct_num_workers, ...)

    def validate(self) -> None:
        require(bool(self.text_columns), "text_columns", "name at least one column")
        require(self.variants >= 1, "variants", "must be >= 1")
        require(0 < self.probability <= 1, "probability", "must be in (0, 1]")
        require(self.top_k >= 1, "top_k", "must be >= 1")
        require(self.max_seq_len >= 8, "max_seq_len", "must be >= 8")
        require(self.lines_per_shard >= 1, "lines_per_shard", "must be >= 1")
        require(bool(input_files(self.input)), "input", f"{self.input} matches no file")
        require((Path(self.mlm) / "config.json").is_file(), "mlm", f"{self.mlm} is not a Hugging Face model directory")

    def beam_options(self) -> dict[str, Any]:
        """For the DirectRunner, worker threads: Beam's default ``in_memory`` mode would run one
        worker whatever ``direct_num_workers`` says; the MLM's forward passes release the GIL."""
        if self.beam.get("runner", "DirectRunner") in DIRECT_RUNNERS:
            threads = {"direct_num_workers": 1, "direct_running_mode": "multi_threading"}
            return {**LOGGING_DEFAULTS, "runner": "DirectRunner", **threads, **self.beam}
        return {**LOGGING_DEFAULTS, **self.beam}


# ------------------------------------------------------------------------------------------ pure parts
def input_files(pattern: str) -> list[str]:
    """The files ``input`` names, absolute and sorted: a file's place in this list is part of the
    names of its examples (``example_id``). A path that exists is itself, glob characters or not."""
    if Path(pattern).is_file():
        return [os.path.abspath(pattern)]
    matches = glob.glob(os.path.expanduser(pattern), recursive=True)
    return sorted(os.path.abspath(path) for path in matches if Path(path).is_file())


def check_output(output: str, files: list[str]) -> None:
    """The output directory is replaced whole at the end: refuse, before any work, one that holds anything
    but an earlier augmentation's two files (``output=task`` beside ``task/dev.jsonl`` would delete it), or
    one of the inputs (``input=out/train.jsonl.gz output=out`` would replace the data with its own variants)."""
    out = Path(output).absolute()
    inside = [path for path in files if Path(path).is_relative_to(out)]
    if inside:
        raise ConfigError(f"output: {output} holds the input {inside[0]}, which the output replaces: choose another")
    if out.exists():
        own = {OUTPUT_FILE, SUMMARY_FILE}
        foreign = sorted(p.name for p in out.iterdir() if p.name not in own) if out.is_dir() else [out.name]
        if foreign:
            raise ConfigError(
                f"output: {output} holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}, which "
                "replacing it would delete: name a new directory, or an earlier augmentation's"
            )


def example_id(file: int, line: int) -> str:
    """An example's name in the seed's draws: the line number in the first file, ``file:line`` in
    the others, so that a single file's examples are named by their line numbers alone."""
    return str(line) if file == 0 else f"{file}:{line}"


def parse_row(line: str, text_columns: list[str]) -> tuple[dict[str, Any] | None, str | None]:
    """The row, or None and the name of the reason it is skipped."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):  # not JSON; an int over Python's 4,300 digits; nesting past the stack
        return None, "bad_json"
    if not isinstance(row, dict):
        return None, "bad_json"
    if any(column not in row for column in text_columns):
        return None, "missing_column"
    if any(not isinstance(row[column], str) or not row[column].strip() for column in text_columns):
        return None, "empty_text"
    return row, None


def variant_rng(seed: int, example: str, variant: int) -> random.Random:
    digest = hashlib.sha256(f"{seed}:{example}:{variant}".encode()).digest()
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
        with LOAD_LOCK:
            import torch
            from transformers import AutoModelForMaskedLM, AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
            if self.tokenizer.mask_token is None:
                raise ConfigError(f"mlm: the tokenizer of {model_dir} has no mask token")
            self.model = AutoModelForMaskedLM.from_pretrained(model_dir).eval()
        torch.set_num_threads(1)  # one worker, one core: the runner decides the parallelism
        self.torch = torch
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
# The rows never travel through the runner: they move through files in the work directory, and the
# runner carries only keys and paths (a runner's buffers then do not grow with the data). Names are
# zero-padded, so that they sort in (file, line) order.
def piece_name(file: int, first_line: int) -> str:
    return f"{file:09d}-{first_line:012d}"


def shard_name(file: int, shard: int) -> str:
    return f"{file:09d}-{shard:012d}.gz"


def read_lines(path: str) -> Iterator[tuple[int, str | None, str | None]]:
    """(line number, text, why it is skipped) of each line of a file, gzipped or plain. A skipped line has no
    text: one over ``MAX_LINE_CHARS`` (``too_long``, never held whole: at most that many characters at
    once) or not UTF-8 (``invalid_utf8``); a gzip file cut short (``truncated_file``) ends after its last
    complete line, as the corpus reader's do."""
    opener: Any = gzip.open if path.endswith(".gz") else open
    line = 0
    # surrogateescape: a bad byte becomes a lone surrogate, found per line below, instead of ending the file
    with opener(path, "rt", encoding="utf-8", errors="surrogateescape") as f:
        try:
            while text := f.readline(MAX_LINE_CHARS + 1):
                line += 1
                if len(text) <= MAX_LINE_CHARS or text.endswith("\n"):
                    yield (line, text, None) if text.isascii() or is_utf8(text) else (line, None, "invalid_utf8")
                    continue
                while (rest := f.readline(MAX_LINE_CHARS)) and not rest.endswith("\n"):
                    pass  # the rest of the line, dropped a block at a time
                yield line, None, "too_long"
        except (EOFError, gzip.BadGzipFile, zlib.error):
            yield line + 1, None, "truncated_file"


def is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: a byte surrogateescape kept
        return False
    return True


def split_file(element: tuple[int, str], work: str, lines_per_shard: int) -> Iterator[tuple[int, int, int, str]]:
    """A worker copies one input file into pieces of at most ``PIECE_LINES`` lines that never cross
    a shard (``lines_per_shard`` lines, from the file's first): (file, shard, first line, piece path).
    A piece is the unit one worker augments. A line skipped on reading (``read_lines``) becomes a blank
    one (blank lines are dropped) and a counted skip, so the lines keep their numbers."""
    import apache_beam as beam

    file, path = element

    def piece_of(item: tuple[int, str | None, str | None]) -> int:
        line = item[0]
        return line - (line - 1) % lines_per_shard % PIECE_LINES  # the piece's first line

    for first_line, lines in itertools.groupby(read_lines(path), key=piece_of):
        final = Path(work) / "input" / f"{piece_name(file, first_line)}.txt"
        partial = final.with_name(f"{final.name}.{uuid.uuid4().hex}.partial")
        with open(partial, "w", encoding="utf-8", newline="") as piece:
            for _, text, skipped in lines:
                if skipped is not None:
                    beam.metrics.Metrics.counter(NAMESPACE, f"skipped_{skipped}").inc()
                piece.write("\n" if text is None else text)
        os.replace(partial, final)  # a retried bundle replaces the piece, never tears it
        yield file, (first_line - 1) // lines_per_shard, first_line, str(final)


def build_augment_dofn(cfg: AugmentConfig, work: str) -> Any:
    import apache_beam as beam

    class Augment(beam.DoFn):
        """(file, shard, first line, piece path) -> ((file, shard), (first line, rows path)): the
        rows of the piece's examples (each original, then its variants: the output's order) written
        to a work file, gzipped (fast level: 21 times the input waits on disk). A piece without
        rows (bad or blank lines only) writes nothing and yields nothing, so a shard without rows
        gets no gzip member. Bad lines counted."""

        def setup(self) -> None:
            self.candidates = MaskedLmCandidates(cfg.mlm, cfg.top_k, cfg.max_seq_len)

        def process(self, element: tuple[int, int, int, str]) -> Iterator[tuple[tuple[int, int], tuple[int, str]]]:
            file, shard, first_line, path = element
            final = Path(work) / "rows" / f"{piece_name(file, first_line)}.jsonl.gz"
            partial = final.with_name(f"{final.name}.{uuid.uuid4().hex}.partial")
            rows = 0
            with open(path, encoding="utf-8", newline="") as lines, gzip.open(partial, "wb", compresslevel=1) as out:
                for line, text in enumerate(lines, start=first_line):
                    for row in self.rows(file, line, text):
                        out.write(row.encode("utf-8") + b"\n")
                        rows += 1
            if rows == 0:
                partial.unlink()
                return
            os.replace(partial, final)
            yield (file, shard), (first_line, str(final))

        def rows(self, file: int, line: int, text: str) -> Iterator[str]:
            """One input line's rows as JSON: the original (variant 0), then variants 1, 2, ..."""
            if not text.strip():
                return
            row, problem = parse_row(text, cfg.text_columns)
            count = beam.metrics.Metrics.counter
            if row is None:
                count(NAMESPACE, f"skipped_{problem}").inc()
                return
            count(NAMESPACE, "examples").inc()
            if cfg.keep_original:
                yield json.dumps(row, ensure_ascii=False, sort_keys=True)
            found = {column: self.candidates(row[column]) for column in cfg.text_columns}
            seen = {tuple(row[column] for column in cfg.text_columns)}
            for variant in range(1, cfg.variants + 1):
                rng = variant_rng(cfg.seed, example_id(file, line), variant)
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
                yield json.dumps({**row, **new}, ensure_ascii=False, sort_keys=True)

    return Augment()


def write_shard(element: tuple[tuple[int, int], Iterable[tuple[int, str]]], work: str) -> None:
    """One shard's rows files, in line order, streamed into one gzip member and deleted. The same
    bytes as ``gzip.compress(rows, mtime=0)`` (zlib's gzip wrapper, level 9; deflate's output does
    not depend on how its input is fed), so every run writes the same file. Renamed into place: a
    retried bundle replaces the shard, never tears it, and one that finds it in place is done."""
    (file, shard), names = element
    path = Path(work) / "shards" / shard_name(file, shard)
    if path.exists():
        return
    pieces = [piece for _, piece in sorted(names)]
    partial = path.with_name(f"{path.name}.{uuid.uuid4().hex}.partial")
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    with open(partial, "wb") as out:
        for piece in pieces:
            with gzip.open(piece, "rb") as rows:
                while chunk := rows.read(COPY_BYTES):
                    out.write(compressor.compress(chunk))
        out.write(compressor.flush())
    os.replace(partial, path)
    for piece in pieces:
        os.remove(piece)


def concatenate_shards(shards: Path, dest: Path) -> None:
    """The shards, in order, streamed into ``dest`` (gzip members end to end are one gzip stream)."""
    with open(dest, "wb") as out:
        for path in sorted(shards.glob("*.gz")):
            with open(path, "rb") as shard:
                shutil.copyfileobj(shard, out)


def run(cfg: AugmentConfig) -> dict[str, int]:
    """Run the pipeline; returns the counts (also in ``augment.json``)."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    from preprocessing.pipeline import make_runner
    from preprocessing.preflight import check_beam_options

    options = PipelineOptions(flags=[], **cfg.beam_options())
    runner = make_runner(options)  # first: it registers its runner's options (the DaskRunner's address)
    check_beam_options(cfg.beam_options())  # Beam itself drops a misspelt option with a log line, and runs
    files = input_files(cfg.input)
    check_output(cfg.output, files)
    started = time.monotonic()
    with atomic_directory(cfg.output) as tmp:  # the directory appears whole; on an error, with no work left
        work = tmp / WORK_DIR
        for part in ("input", "rows", "shards"):
            (work / part).mkdir(parents=True)
        pipeline = beam.Pipeline(runner=runner, options=options)
        (
            pipeline
            | "Files" >> beam.Create(list(enumerate(files)))
            | "Split" >> beam.FlatMap(split_file, str(work), cfg.lines_per_shard)
            | "Spread" >> beam.Reshuffle()  # a file's pieces over all workers, not the one that split it
            | "Augment" >> beam.ParDo(build_augment_dofn(cfg, str(work)))
            | "Group" >> beam.GroupByKey()
            | "Write" >> beam.Map(write_shard, str(work))
        )
        result = pipeline.run()
        result.wait_until_finish()
        concatenate_shards(work / "shards", tmp / OUTPUT_FILE)
        shutil.rmtree(work)
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
