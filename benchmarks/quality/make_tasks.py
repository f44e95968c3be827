"""Builds the evaluation suite's task files (``benchmarks/quality/tasks/``) from Debian's archive
index and WordNet, and measures each task's bag-of-words baseline.

    # inputs (once; nothing here touches the system's own apt state)
    mkdir -p /tmp/apt/lists/partial
    apt-get update -o Dir::State::Lists=/tmp/apt/lists -o Acquire::Languages=en
    (cd /tmp/apt && apt-get download wordnet-base && dpkg-deb -x wordnet-base_*.deb wn)
    # build
    python benchmarks/quality/make_tasks.py --lists /tmp/apt/lists --wordnet /tmp/apt/wn/usr/share/wordnet

Three tasks, each a ``train.jsonl.gz`` and a ``validation.jsonl.gz``, described in ``tasks.json``
(kind, columns, metric, sizes, source, the baseline) and in ``README.md`` (provenance, licences):

- ``debian-section``: a package's description -> its archive section (10 classes).
- ``debian-size``: a package's description -> log10 of its installed size in KiB (regression).
- ``wordnet-supersense``: a noun sense's definition -> the WordNet lexicographer file it is filed in
  (its supersense: act, animal, artifact, ... ; 10 classes). It replaced ``wordnet-hypernym`` (is the
  second of two senses the first's hypernym, or a sibling of it?), on which every model sat near chance
  (the real MiniLM 0.61, word counts 0.54, chance 0.50: docs/log/quality.md). A prototype, screened
  before it was chosen (500 training examples, 600 validation): a logistic regression on the frozen
  MiniLM's mean-pooled features 0.757, the bag-of-words baseline 0.525; with the lemmas before the
  definition 0.745 and 0.530, so the lemmas are left out.

Each validation file holds a third of the task's examples, up to 1,000, so that the suite can test
on many: a task's 95 % interval is about +-0.05 wide at 300 test examples.

Deterministic for ``--seed``: the same inputs give byte-identical files (gzip without a
timestamp). Classification splits are ordered in rounds of one example per class, so that the
first N rows (the suite's size knob) are as balanced as the whole split. Debian packages are
deduplicated by source package before the split, so near-identical descriptions of one source's
binaries never sit on both sides of it.

The baseline is TF-IDF bag-of-words (unigrams and bigrams) with logistic regression (classes) or
ridge regression (size), fit on the train split and scored on validation (:mod:`trainer.evaluation.bag_of_words`).
A task is kept only if that baseline stays below 0.90.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import math
import random
import re
import subprocess
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
TRAIN_SIZE, VALID_SIZE = 2000, 1000
SECTIONS = ("admin", "database", "editors", "games", "graphics", "mail", "math", "net", "science", "sound")
BASELINE_LIMIT = 0.90
WORDNET_SOURCE = "WordNet 3.0 noun database (Debian package wordnet-base 1:3.0-37)"
# Ten of WordNet's 26 noun lexicographer files ("supersenses"; lexnames(5WN): the number in data.noun's second
# field -> the name after "noun."), each with over 2,500 synsets: six kinds of thing, four of abstraction.
SUPERSENSES = {
    "04": "act",
    "05": "animal",
    "06": "artifact",
    "09": "cognition",
    "10": "communication",
    "13": "food",
    "15": "location",
    "18": "person",
    "20": "plant",
    "26": "state",
}


# ------------------------------------------------------------------------------------------- Debian
def deb822(text: str) -> list[dict[str, str]]:
    """Paragraphs of a Debian control file: field -> value (continuation lines joined with newlines)."""
    records = []
    for block in text.split("\n\n"):
        record: dict[str, str] = {}
        field = None
        for line in block.splitlines():
            if line.startswith((" ", "\t")) and field:
                record[field] += "\n" + line[1:]
            elif ":" in line:
                field, value = line.split(":", 1)
                record[field] = value.strip()
        if record:
            records.append(record)
    return records


def lz4_text(path: Path) -> str:
    return subprocess.run(["lz4cat", str(path)], check=True, capture_output=True).stdout.decode("utf-8")


def description_text(long_description: str) -> str:
    """Debian's description markup as plain text: ' .' lines are paragraph breaks; lines are joined."""
    paragraphs = [" ".join(line.split()) for line in long_description.split("\n.\n")]
    return "\n".join(p.replace("\n", " ") for p in paragraphs if p and p != ".")


def debian_packages(lists: Path) -> tuple[list[dict[str, Any]], str]:
    """One package per source package (the binary named like its source, else the shortest name),
    with its full English description; transitional and dummy packages are left out."""
    (packages_file,) = lists.glob("*_debian_dists_bookworm_main_binary-amd64_Packages.lz4")
    (translation_file,) = lists.glob("*_debian_dists_bookworm_main_i18n_Translation-en.lz4")
    descriptions = {
        (r["Package"], r["Description-md5"]): r["Description-en"] for r in deb822(lz4_text(translation_file))
    }
    by_source: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in deb822(lz4_text(packages_file)):
        full = descriptions.get((r["Package"], r.get("Description-md5", "")))
        if full is None or "Installed-Size" not in r:
            continue
        short, _, body = full.partition("\n")
        if re.search(r"transitional|dummy", short, re.I) or not body.strip():
            continue
        source = r.get("Source", r["Package"]).split()[0]
        by_source[source].append(
            {
                "package": r["Package"],
                "version": r["Version"],
                "section": r["Section"].split("/")[-1],
                "installed_kib": int(r["Installed-Size"]),
                "text": short.strip() + "\n" + description_text(body),
            }
        )
    chosen = [
        min(group, key=lambda p: (p["package"] != source, len(p["package"]), p["package"]))
        for source, group in by_source.items()
    ]
    release = next(lists.glob("*_debian_dists_bookworm_InRelease")).read_text(encoding="utf-8")
    version, date = (re.search(rf"^{field}: (.*)$", release, re.M).group(1) for field in ("Version", "Date"))
    return sorted(chosen, key=lambda p: p["package"]), f"Debian {version} bookworm (archive index of {date})"


def section_task(packages: list[dict[str, Any]], rng: random.Random) -> list[dict[str, Any]]:
    """Balanced as far as the smallest sections allow: at most (train+valid)/10 per section."""
    per_class = (TRAIN_SIZE + VALID_SIZE) // len(SECTIONS)
    rows = []
    for section in SECTIONS:
        pool = [p for p in packages if p["section"] == section]
        rng.shuffle(pool)
        rows += [{"text": p["text"], "label": section, "package": p["package"]} for p in pool[:per_class]]
    rng.shuffle(rows)
    return rows


def size_task(packages: list[dict[str, Any]], rng: random.Random) -> list[dict[str, Any]]:
    """Any section; the label is log10 of the installed size in KiB (Debian counts at least 1)."""
    pool = list(packages)
    rng.shuffle(pool)
    return [
        {"text": p["text"], "label": round(math.log10(max(p["installed_kib"], 1)), 4), "package": p["package"]}
        for p in pool[: TRAIN_SIZE + VALID_SIZE]
    ]


# ------------------------------------------------------------------------------------------ WordNet
def wordnet_definitions(wordnet: Path) -> list[tuple[str, str, str]]:
    """(synset offset, lexicographer file number, definition) for every noun synset of ``data.noun``, in file
    order. The definition is the gloss without its example sentences (the quoted parts after ``; "``)."""
    senses = []
    for line in (wordnet / "data.noun").read_text(encoding="utf-8").splitlines():
        if line.startswith(" "):
            continue  # the licence header
        fields, _, gloss = line.partition(" | ")
        offset, lexfile = fields.split()[:2]
        senses.append((offset, lexfile, gloss.split('; "')[0].strip().rstrip(";")))
    return senses


def supersense_task(senses: list[tuple[str, str, str]], rng: random.Random) -> list[dict[str, Any]]:
    """(TRAIN_SIZE + VALID_SIZE) / 10 senses of each of the ten ``SUPERSENSES``, each as its definition alone:
    without the lemmas, the class is read from what the definition's words say together, not from a name (of a
    genus, a dish, a town) that word counts learn by heart. A definition that more than one noun synset shares
    is left out: its class could be ambiguous, and it could sit on both sides of the split. Each row keeps its
    synset's offset in data.noun (``synset``, for reference; the suite does not read it)."""
    shared = {definition for definition, n in Counter(d for _, _, d in senses).items() if n > 1}
    per_class = (TRAIN_SIZE + VALID_SIZE) // len(SUPERSENSES)
    rows = []
    for lexfile, supersense in SUPERSENSES.items():
        pool = [(offset, d) for offset, number, d in senses if number == lexfile and d not in shared]
        rng.shuffle(pool)
        rows += [{"text": d, "label": supersense, "synset": f"{offset}-n"} for offset, d in pool[:per_class]]
    rng.shuffle(rows)
    return rows


def interleave(rows: list[dict[str, Any]], rng: random.Random) -> list[dict[str, Any]]:
    """Rows in rounds of one example per label (each round in a random order), so that every prefix
    of a split (the suite's ``train_size``) holds the labels in the same proportions as the split."""
    by_label: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_label[row["label"]].append(row)
    ordered = []
    for round_ in range(max(map(len, by_label.values()))):
        batch = [group[round_] for group in by_label.values() if round_ < len(group)]
        rng.shuffle(batch)
        ordered += batch
    return ordered


# ----------------------------------------------------------------------------------------- baseline
def bow_baseline(train: list[dict[str, Any]], valid: list[dict[str, Any]], kind: str) -> dict[str, float]:
    """The suite's bag-of-words baseline (:mod:`trainer.evaluation.bag_of_words`), scored on validation."""
    import numpy as np
    from scipy.stats import pearsonr, spearmanr

    from trainer.evaluation import bag_of_words

    predicted = bag_of_words.predict(train, valid, {"kind": kind, "text_pair_column": "text_pair"})
    y_valid = [r["label"] for r in valid]
    if kind == "regression":
        return {
            "pearson": round(float(pearsonr(predicted, y_valid)[0]), 4),
            "spearman": round(float(spearmanr(predicted, y_valid)[0]), 4),
        }
    return {"accuracy": round(float(np.mean(np.array(predicted) == np.array(y_valid))), 4)}


# ------------------------------------------------------------------------------------------- output
def write_jsonl_gz(path: Path, rows: list[dict[str, Any]]) -> None:
    """Byte-identical for the same rows: gzip without a file name or timestamp."""
    raw = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows).encode("utf-8")
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0, filename="") as f:
        f.write(raw)
    path.write_bytes(buffer.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lists", type=Path, required=True, help="apt lists directory with Translation-en")
    parser.add_argument("--wordnet", type=Path, required=True, help="WordNet 3.0 dict directory (data.noun)")
    parser.add_argument("--out", type=Path, default=TASKS_DIR)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    packages, debian_release = debian_packages(args.lists)
    debian_source = f"{debian_release} main, Packages + Translation-en"
    specs = {
        "debian-section": {
            "kind": "classification",
            "metric": "accuracy",
            "text_column": "text",
            "rows": section_task(packages, random.Random(args.seed)),
            "source": debian_source,
        },
        "debian-size": {
            "kind": "regression",
            "metric": "pearson",
            "text_column": "text",
            "rows": size_task(packages, random.Random(args.seed + 1)),
            "source": debian_source,
        },
        "wordnet-supersense": {
            "kind": "classification",
            "metric": "accuracy",
            "text_column": "text",
            "rows": supersense_task(wordnet_definitions(args.wordnet), random.Random(args.seed + 2)),
            "source": WORDNET_SOURCE,
        },
    }
    manifest: dict[str, Any] = {"seed": args.seed, "tasks": {}}
    for name, spec in specs.items():
        rows = spec.pop("rows")
        valid_size = min(VALID_SIZE, len(rows) // 3)
        train, valid = rows[valid_size:][:TRAIN_SIZE], rows[:valid_size]
        if spec["kind"] != "regression":
            train, valid = interleave(train, random.Random(args.seed)), interleave(valid, random.Random(args.seed))
        baseline = bow_baseline(train, valid, spec["kind"])
        score = baseline[spec["metric"]]
        print(f"{name}: {len(train)} train, {len(valid)} validation, bag-of-words {spec['metric']} {score:.4f}")
        if score >= BASELINE_LIMIT:
            raise SystemExit(f"{name}: the bag-of-words baseline scores {score:.4f} >= {BASELINE_LIMIT}: too easy")
        (args.out / name).mkdir(parents=True, exist_ok=True)
        write_jsonl_gz(args.out / name / "train.jsonl.gz", train)
        write_jsonl_gz(args.out / name / "validation.jsonl.gz", valid)
        labels = sorted({r["label"] for r in train}, key=str) if spec["kind"] != "regression" else None
        manifest["tasks"][name] = {
            **spec,
            "label_column": "label",
            "labels": labels,
            "train_size": len(train),
            "validation_size": len(valid),
            "bow_baseline": baseline,
        }
    (args.out / "tasks.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
