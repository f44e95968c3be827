"""``python -m trainer evaluate-suite MODEL [MODEL ...] [CONFIG.yaml] [key=value ...]``.

How much of the teacher a student keeps, in one table. Each MODEL (a local Hugging Face directory
or ``models:/NAME@ALIAS``; the first is the reference, normally the teacher) is fine-tuned on each
task of a fixed suite (``benchmarks/quality/tasks/``, built by ``benchmarks/quality/make_tasks.py``,
described in docs/quality.md) with each seed, through :func:`trainer.finetuning.finetune.finetune`,
the same code a downstream team runs.

The protocol keeps the reported numbers clean of every choice: each task has a *train* split (the first
``train_size`` examples of its training file), a *dev* split (``dev_size`` examples of the rest of that file,
never trained on, stratified: :func:`dev_rows`) on which every choice is made (the learning rate, with
``lrs``), and a *test* split (the first ``valid_size`` examples of its validation file) that is only ever
reported. The JSON records each split's label counts per task (``label_counts``), so a skewed split shows. The
table gives each task's test score as mean ± spread over the seeds (the spread is max - min), the average of
the task means, the *skill* (the mean over tasks of the score above chance: what a constant predictor scores
on the same test examples) and each model's *share* of the first model's skill, with a 95 % paired bootstrap
interval over the test examples and the seeds; then every pair of models' difference of skill with its
interval, written "no measurable difference" when the interval holds zero
(:mod:`trainer.evaluation.suite_statistics`). It also gives each task's chance level and bag-of-words baseline
(stored with the tasks).

``method=probe`` scores each model instead by a linear probe on its frozen features (mean-pooled
last hidden states, a cross-validated ridge model; :mod:`trainer.evaluation.probe`): deterministic, so
one fit per task on all the data by default (``METHOD_DEFAULTS``), at about a forward pass's cost, and a
difference between two models is never the seed's. It measures only what a linear model reads from
the frozen representation; fine-tuning (the default) is what a user will do with a student.

The fine-tuned suite is sized for a CPU: ``train_size`` (default 500), ``dev_size`` (300) and
``valid_size`` (1,000, the test; ``debian-section`` has 896) examples of each task, ``max_seq_len`` 128.
The test is the large split because an interval's width is set by it: at 300 test examples a task's 95 %
interval is about +-0.05 wide, as wide as the margin between the real MiniLM and word counts on a
Debian task; testing costs a forward pass an example, training a forward and backward pass per epoch.
Results go to ``output``
(JSON, written atomically) and, when tracking is on, to MLflow: one run per model in experiment
``evaluate-suite`` with the task scores as metrics (``<task>/mean``, ``<task>/spread``, ``average``,
``skill``, ``share`` and its interval) and the JSON as an artifact.
The fine-tuning runs themselves are not tracked (their scores are in the suite's run).

``jobs=N`` runs N fine-tunes at once, each in a worker process of its own (started fresh, not
forked: CUDA cannot be forked). For a GPU: one small model's fine-tune leaves it idle most of the
time (32 steps of a 20M-parameter model, between tokenising and loading), so a few share it well.
On a CPU the workers share the cores (each gets cores / N threads, the cores this process may use:
its affinity capped by a container's CPU quota, :mod:`trainer.runtime.cpus`; ``jobs=1`` runs no more
threads than those) and gain little. Each run is
seeded alone, so a score is the one ``jobs=1`` gives with as many threads as a worker has (another
thread count rounds differently: a score may move in its sixth digit). A model's ``wall_s`` is then
the sum of its runs' times, not the time the suite took.

``lrs=[R1,R2,...]`` fine-tunes every model on every task at each rate, and scores each task at the
rate whose mean *dev* score over the seeds is best (``@rate`` in the table; the JSON keeps each rate's dev
and test means). One fixed rate favours one kind of model: measured, the pretrained MiniLM's pair task of the
earlier suite fell to chance at 5e-4, a BERT trained here from scratch leaves chance only there, and MiniLM's
``wordnet-supersense`` scores 0.598 at 1e-4 and 0.729 at 5e-4 (docs/log/quality.md).
The grid is the same for every model, fixed before the suite runs.

A suite stopped part way (a time limit, a lost machine) continues where it stopped when run again with the
same ``work_dir``: each run's result is kept there as soon as it is known (``<run>.result.json`` beside the
run's output, written atomically), with what it was computed from: the SHA-256 of the model's files and of
the task's examples, and the run's settings. A run whose record matches is not run again (the log says
``reused``, the JSON counts them under ``runs``); one whose model, examples or settings changed since, or
whose record cannot be read, is run again. The code is not part of the record: after changing the
fine-tuning or the probe, start from an empty ``work_dir``. Without ``work_dir`` every suite starts afresh.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import gzip
import hashlib
import itertools
import json
import logging
import math
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import field
from pathlib import Path
from typing import Any, Literal

from common.atomic import write_text_atomically
from common.config import ConfigError, flatten, from_dict, require, to_dict
from trainer.config import MlflowConfig
from trainer.evaluation import bag_of_words
from trainer.evaluation import suite_statistics as stats
from trainer.evaluation.probe import probe
from trainer.finetuning.finetune import PRIMARY_METRIC, FinetuneConfig, finetune
from trainer.runtime.cpus import usable_cpus
from trainer.tracking.tracker import RunSpec, open_tracker

log = logging.getLogger(__name__)

TASKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "quality" / "tasks"
KIND_TO_TASK = {"classification": "classification", "pair": "classification", "regression": "regression"}
# What a size or the seeds left unset (None) mean for each method: the fine-tune's suite sized for a
# 2-core CPU, several seeds; the probe's one deterministic fit on all the data, which it needs (a
# ridge fit on 384 features from 500 examples is itself unstable; docs/log/quality.md).
METHOD_DEFAULTS: dict[str, dict[str, Any]] = {
    "finetune": {"train_size": 500, "dev_size": 300, "valid_size": 1000, "seeds": [0, 1, 2]},
    "probe": {"train_size": 0, "dev_size": 0, "valid_size": 0, "seeds": [0]},  # its penalty: cross-validated on train
}
PROTOCOL = 3  # a run's record from before the dev/test protocol (1) or the stratified dev split (2) is not reused


@dataclasses.dataclass
class SuiteMlflowConfig(MlflowConfig):
    experiment: str = "evaluate-suite"


@dataclasses.dataclass
class SuiteConfig:
    models: list[str] = field(default_factory=list)  # the first is the reference (the teacher)
    method: Literal["finetune", "probe"] = "finetune"  # probe: a linear model on the frozen features
    tasks: list[str] = field(default_factory=list)  # empty: every task in tasks_dir/tasks.json
    tasks_dir: str = str(TASKS_DIR)
    train_size: int | None = None  # the first N training examples of each task (0: all but dev; None: METHOD_DEFAULTS)
    dev_size: int | None = None  # N of the rest of each task's training file, stratified: every choice is made on these
    valid_size: int | None = None  # the test: the first N of each task's validation file, only ever reported (0: all)
    seeds: list[int] | None = None  # one fine-tuning run each (None: METHOD_DEFAULTS)
    epochs: int = 2
    batch_size: int = 32
    lr: float = 1e-4
    lrs: list[float] | None = None  # rates to try, each task scored at its best (see the module's docstring); None: lr
    max_seq_len: int = 128
    jobs: int = 1  # fine-tunes at once, each in its own worker process (for a GPU; see the module's docstring)
    output: str = "evaluate-suite.json"
    work_dir: str | None = None  # fine-tuned models, task subsets, each run's result (a suite run again continues)
    bootstrap: int = 1000  # paired bootstrap resamples (examples and seeds) for the confidence intervals; 0: none
    baseline: bool = False  # also the bag-of-words baseline fitted on the same train split: one more row, compared
    mlflow: SuiteMlflowConfig = field(default_factory=SuiteMlflowConfig)

    def validate(self) -> None:
        require(len(self.models) >= 1, "models", "name at least one model (the first is the reference)")
        if self.seeds is not None:
            require(len(self.seeds) >= 1, "seeds", "needs at least one seed")
            require(len(set(self.seeds)) == len(self.seeds), "seeds", f"repeats a seed: {self.seeds}")
            require(
                self.method == "finetune" or len(self.seeds) == 1,
                "seeds",
                f"a probe is one deterministic fit: leave seeds unset, or give one, not {self.seeds}",
            )
        for key in ("train_size", "dev_size", "valid_size"):
            value = getattr(self, key)
            require(value is None or value >= 0, key, "must be >= 0 (0: the whole split)")
        require(
            self.method == "probe" or self.dev_size is None or self.dev_size >= 1,
            "dev_size",
            "a fine-tuned suite makes its choices on dev examples: give at least one",
        )
        require(self.bootstrap == 0 or self.bootstrap >= 100, "bootstrap", "must be 0 (none) or >= 100 resamples")
        for key in ("epochs", "batch_size", "max_seq_len", "jobs"):
            require(getattr(self, key) >= 1, key, "must be >= 1")
        require(self.lr > 0, "lr", "must be > 0")
        if self.lrs is not None:
            require(len(self.lrs) >= 1 and all(lr > 0 for lr in self.lrs), "lrs", f"must be rates > 0, got {self.lrs}")
            require(len(set(self.lrs)) == len(self.lrs), "lrs", f"repeats a rate: {self.lrs}")
            require(self.method == "finetune", "lrs", "a probe does not fine-tune: leave lrs unset")

    @property
    def rates(self) -> list[float]:
        return self.lrs or [self.lr]

    def resolved(self) -> SuiteConfig:
        """This config with each unset size and the seeds taken from ``METHOD_DEFAULTS[method]``."""
        unset = {key: value for key, value in METHOD_DEFAULTS[self.method].items() if getattr(self, key) is None}
        return dataclasses.replace(self, **unset)


def evaluate_suite(cfg: SuiteConfig) -> dict[str, Any]:
    """Fine-tune (or probe) every model on every task with every seed; returns the report also written
    to ``cfg.output``, whose config shows the sizes and seeds used."""
    cfg = cfg.resolved()
    tasks = load_tasks(cfg)  # a bad task name or model directory fails before any fine-tuning
    for model in cfg.models:
        if ":/" not in model:
            require((Path(model) / "config.json").is_file(), "models", f"{model} is not a Hugging Face model directory")
    with tempfile.TemporaryDirectory(prefix="evaluate-suite.") as tmp:
        work = Path(cfg.work_dir) if cfg.work_dir else Path(tmp)
        subsets = {name: write_subsets(task, work / "data" / name, cfg) for name, task in tasks.items()}
        data = {name: paths for name, (paths, _) in subsets.items()}
        local = [local_model(cfg, model, work / f"model-{index}" / "base") for index, model in enumerate(cfg.models)]
        runs = [  # seeds outer to tasks: a suite cut short has logged every task at the first seed
            Run(index, model, local[index], task, seed, lr, work / f"model-{index}" / task / f"lr{lr:g}" / str(seed))
            for index, model in enumerate(cfg.models)
            for seed in cfg.seeds
            for task in tasks
            for lr in cfg.rates
        ]
        keys = run_keys(cfg, runs, local, data) if cfg.work_dir else {}  # a temporary work_dir keeps nothing
        timed, reused = run_all(cfg, runs, tasks, data, keys)
        labels = {name: [row[tasks[name]["label_column"]] for row in read_rows(data[name]["test"])] for name in tasks}
        baseline = bag_of_words_rows(cfg, tasks, data) if cfg.baseline else None
    results = []
    for index, model in enumerate(cfg.models):
        mine = [(run, result) for run, result in zip(runs, timed, strict=True) if run.index == index]
        by_rate = {  # task -> rate -> each seed's result, in the order of cfg.seeds
            name: {lr: [result for run, result in mine if (run.task, run.lr) == (name, lr)] for lr in cfg.rates}
            for name in tasks
        }
        totals = {key: round(sum(result[key] for _, result in mine), 1) for key in ("wall_s", "cpu_s")}
        results.append({"model": model, "runs": by_rate, **totals})
    if baseline is not None:
        results.append(baseline)
    report = summarise(cfg, tasks, results, labels)
    for name, (_, counts) in subsets.items():
        report["tasks"][name]["label_counts"] = counts
    report["runs"] = {"total": len(runs), "reused": reused}
    write_text_atomically(cfg.output, json.dumps(report, indent=2) + "\n")
    for entry in report["models"]:
        track(cfg, entry, report)
    return report


# -------------------------------------------------------------------------------------------------- tasks
def load_tasks(cfg: SuiteConfig) -> dict[str, dict[str, Any]]:
    """The chosen tasks' descriptions from ``tasks.json``, in the order asked (default: all, as listed)."""
    manifest_path = Path(cfg.tasks_dir) / "tasks.json"
    if not manifest_path.is_file():
        raise ConfigError(f"tasks_dir: {cfg.tasks_dir} has no tasks.json (see benchmarks/quality/make_tasks.py)")
    available = json.loads(manifest_path.read_text(encoding="utf-8"))["tasks"]
    unknown = [name for name in cfg.tasks if name not in available]
    require(not unknown, "tasks", f"unknown tasks {unknown}; available: {', '.join(available)}")
    return {name: {**available[name], "name": name} for name in (cfg.tasks or available)}


def write_subsets(task: dict[str, Any], dest: Path, cfg: SuiteConfig) -> tuple[dict[str, Path], dict[str, Any]]:
    """The task's examples as plain JSONL files for finetune: ``train``, the first ``train_size`` rows of its
    training file (shuffled once, when built); ``dev``, ``dev_size`` of the rows after those, with the training
    file's label proportions (:func:`dev_rows`), never trained on, where every choice is made; ``test``, the
    first ``valid_size`` rows of its validation file, only ever reported. With ``train_size=0`` train is every
    row not in dev. A probe needs no dev split. Returns the files and each split's :func:`label_counts`."""
    dest.mkdir(parents=True, exist_ok=True)
    rows = {}
    for split in ("train", "validation"):
        with gzip.open(Path(cfg.tasks_dir) / task["name"] / f"{split}.jsonl.gz", "rt", encoding="utf-8") as f:
            rows[split] = [line for line in f if line.strip()]
    train, dev_size = rows["train"], cfg.dev_size or 0
    train_size = cfg.train_size or len(train) - dev_size
    require(
        train_size + dev_size <= len(train),
        "dev_size",
        f"{task['name']} has {len(train)} training examples: {train_size} to train and {dev_size} for dev do not fit",
    )
    labels = [json.loads(line)[task["label_column"]] for line in train]
    dev = dev_rows(labels, train_size if cfg.train_size else 0, dev_size, task)
    chosen = set(dev)
    subsets = {
        "train": [line for i, line in enumerate(train) if i not in chosen][:train_size],
        "test": rows["validation"][: cfg.valid_size or None],
    }
    if dev_size:
        subsets["dev"] = [train[i] for i in dev]
    paths = {}
    for split, lines in subsets.items():
        paths[split] = dest / f"{split}.jsonl"
        paths[split].write_text("".join(lines), encoding="utf-8")
    return paths, label_counts(task, paths, labels)


REGRESSION_STRATA = 10  # a regression target's dev split spans its deciles


def strata(labels: list[Any], task: dict[str, Any], reference: list[Any]) -> list[str]:
    """Each label's stratum: the class itself, or for a regression target the decile of ``reference`` (the
    training file's targets) it falls in, named by its range (``[lo, hi)``; the last decile holds its top)."""
    if task["kind"] != "regression":
        return [str(label) for label in labels]
    edges = sorted(float(v) for v in reference)
    cuts = [edges[len(edges) * k // REGRESSION_STRATA] for k in range(1, REGRESSION_STRATA)]
    bounds = [edges[0], *cuts, edges[-1]]
    names = [f"[{lo:g}, {hi:g})" for lo, hi in itertools.pairwise(bounds)]
    return [names[bisect.bisect_right(cuts, float(v))] for v in labels]


def dev_rows(labels: list[Any], after: int, size: int, task: dict[str, Any]) -> list[int]:
    """Indices, in file order, of ``size`` training rows for the dev split, drawn from those at ``after`` or
    later (never the first ``after``, which train on), stratified: each stratum (class, or regression decile:
    :func:`strata`) gets its share of ``size`` by the whole training file's proportions (largest remainders,
    at least one each while ``size`` allows), taken from the end of the file.

    The files are written in rounds of one row per class, so the last rows of a file are the leftovers of
    its largest classes: a dev split of the last N rows lacked whole classes. A class that has no row left
    after the train split is a :class:`ConfigError` naming ``train_size``."""
    if not size:
        return []
    names = strata(labels, task, labels)
    proportions = collections.Counter(names)
    pool: dict[str, list[int]] = {name: [] for name in proportions}
    for i in range(after, len(labels)):
        pool[names[i]].append(i)
    must = len(proportions) <= size  # every stratum present, where the size allows
    missing = sorted(name for name, rows in pool.items() if not rows)
    require(
        not (must and missing),
        "train_size",
        f"{task['name']}: no training example of {', '.join(missing)} is left for the dev split after the first "
        f"{after}: lower train_size",
    )
    exact = {name: size * count / len(labels) for name, count in proportions.items()}
    share = {name: min(len(pool[name]), max(int(exact[name]), 1 if must else 0)) for name in pool}
    spare = sorted(pool, key=lambda name: (int(exact[name]) - exact[name], name))  # largest remainder first
    while (left := size - sum(share.values())) > 0:
        room = [name for name in spare if share[name] < len(pool[name])]
        require(bool(room), "dev_size", f"{task['name']}: only {sum(share.values())} rows are left for dev")
        for name in room[:left]:
            share[name] += 1
    while (extra := sum(share.values()) - size) > 0:  # the minimum of one each overshot: trim the largest
        largest = max(share, key=lambda name: (share[name], name))
        share[largest] -= min(extra, share[largest] - 1)
    return sorted(i for name, rows in pool.items() for i in rows[len(rows) - share[name] :])


def label_counts(task: dict[str, Any], data: dict[str, Path], reference: list[Any]) -> dict[str, dict[str, int]]:
    """Each split's examples per stratum (:func:`strata`): what shows a skewed split."""
    counts = {}
    for split, path in data.items():
        names = strata([row[task["label_column"]] for row in read_rows(path)], task, reference)
        counts[split] = dict(sorted(collections.Counter(names).items()))
    return counts


BAG_OF_WORDS = "bag-of-words (same train split)"


def bag_of_words_rows(cfg: SuiteConfig, tasks: dict[str, dict[str, Any]], data: dict[str, dict[str, Path]]) -> dict:
    """The bag-of-words baseline as one more model: fitted on each task's train split, its test predictions the
    same for every seed (it has none) and rate, so the bootstrap pairs it with every model like any other."""
    started, cpu_started = time.monotonic(), time.process_time()
    runs = {}
    for name, task in tasks.items():
        train, test = read_rows(data[name]["train"]), read_rows(data[name]["test"])
        predicted = bag_of_words.predict(train, test, task)
        score = stats.score(predicted, [r[task["label_column"]] for r in test], task["kind"] == "regression")
        result = {"dev": None, "test": score, "predicted": predicted}
        runs[name] = {lr: [result] * len(cfg.seeds) for lr in cfg.rates}
    seconds = {"wall_s": round(time.monotonic() - started, 1), "cpu_s": round(time.process_time() - cpu_started, 1)}
    return {"model": BAG_OF_WORDS, "runs": runs, **seconds}


def read_rows(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def local_model(cfg: SuiteConfig, model: str, scratch: Path) -> str:
    """A local directory as is; a registered model (``models:/...``) pulled once into ``scratch``
    from the suite's tracking server, so that its runs do not pull it again. A ``work_dir`` kept from an
    earlier suite holds an earlier pull there (the alias may have moved since): replaced, as the
    fine-tuned models beside it are; ``pull`` itself refuses a destination that is not empty."""
    if ":/" not in model or Path(model).is_dir():
        return model
    from trainer.tracking.config import resolve_tracking_uri
    from trainer.tracking.pull import pull

    shutil.rmtree(scratch, ignore_errors=True)
    return str(pull(model, scratch, resolve_tracking_uri(cfg.mlflow)))


# -------------------------------------------------------------------------------------------------- runs
@dataclasses.dataclass(frozen=True)
class Run:
    """One fine-tune (or probe) of the suite's ``index``-th model, ``model`` as named and ``local`` its
    directory here, on ``task`` with ``seed`` at learning rate ``lr``; ``out`` receives the fine-tuned model."""

    index: int
    model: str
    local: str
    task: str
    seed: int
    lr: float
    out: Path


def run_all(
    cfg: SuiteConfig,
    runs: list[Run],
    tasks: dict[str, dict[str, Any]],
    data: dict[str, dict[str, Path]],
    keys: dict[Run, dict[str, Any]],
) -> tuple[list[dict[str, float]], int]:
    """Each run's result (``timed_run``), in the order of ``runs``, and how many were reused: a run with a
    key whose recorded result matches it is not run again; the others run one after another in this
    process, or ``cfg.jobs`` at a time in fresh worker processes, and each result is recorded (under its
    key, if it has one) as soon as it is known, whatever happens to the runs after it."""
    results = {run: kept for run in runs if run in keys and (kept := recorded(run, keys[run])) is not None}
    for run, result in results.items():
        log.info(
            "evaluate-suite: %s | %s | seed %d | lr %g | test %.4f reused: %s",
            run.model,
            run.task,
            run.seed,
            run.lr,
            result["test"],
            result_path(run),
        )
    todo = [run for run in runs if run not in results]

    def finished(run: Run, result: dict[str, float]) -> None:
        if run in keys:
            record = {"key": keys[run], "result": result}
            result_path(run).parent.mkdir(parents=True, exist_ok=True)  # a probe writes nothing else there
            write_text_atomically(result_path(run), json.dumps(record, indent=2) + "\n")
        results[run] = log_run(cfg, run, tasks[run.task], result)

    cpus = usable_cpus()  # the workers share the CPUs, not oversubscribe them (nor a container's quota)
    if cfg.jobs == 1:
        limit_threads(cpus)
        for run in todo:
            finished(run, timed_run(cfg, run, tasks[run.task], data[run.task]))
    elif todo:
        threads = max(1, cpus // cfg.jobs)
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(cfg.jobs, mp_context=spawn, initializer=worker_init, initargs=(threads,)) as pool:
            futures = {pool.submit(timed_run, cfg, run, tasks[run.task], data[run.task]): run for run in todo}
            try:
                for future in as_completed(futures):
                    finished(futures[future], future.result())
            except BaseException:
                pool.shutdown(cancel_futures=True)  # a failed run stops the suite: start no other
                raise
    return [results[run] for run in runs], len(runs) - len(todo)


def run_keys(
    cfg: SuiteConfig, runs: list[Run], local: list[str], data: dict[str, dict[str, Path]]
) -> dict[Run, dict[str, Any]]:
    """What each run's result depends on, to recognise it in a ``work_dir`` run again: the model's files
    and the task's example files by their SHA-256 (each hashed once), and the run's settings."""
    models = [files_sha256(Path(model), sorted(p for p in Path(model).rglob("*") if p.is_file())) for model in local]
    examples = {name: files_sha256(paths["train"].parent, sorted(paths.values())) for name, paths in data.items()}
    settings = {key: getattr(cfg, key) for key in ("method", "epochs", "batch_size", "max_seq_len")}
    settings["protocol"] = PROTOCOL
    return {
        run: {
            **settings,
            "model_sha256": models[run.index],
            "task": run.task,
            "task_sha256": examples[run.task],
            "seed": run.seed,
            "lr": run.lr,
        }
        for run in runs
    }


def files_sha256(root: Path, paths: list[Path]) -> str:
    """One SHA-256 over the files' names (relative to ``root``) and their bytes, in the order given."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(str(path.relative_to(root)).encode("utf-8") + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


def result_path(run: Run) -> Path:
    return run.out.with_name(f"{run.out.name}.result.json")


def recorded(run: Run, key: dict[str, Any]) -> dict[str, float] | None:
    """The result recorded for ``run`` if its record was made under ``key``; else None, and why is logged."""
    path = result_path(run)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        kept = record["key"]
        changed = sorted(name for name in key.keys() | kept.keys() if kept.get(name) != key.get(name))
        result = record["result"]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        log.warning("evaluate-suite: %s cannot be read (%r): the run is run again", path, error)
        return None
    if changed:
        log.info("evaluate-suite: %s was recorded for another %s: the run is run again", path, ", ".join(changed))
        return None
    return result


def worker_init(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def limit_threads(cpus: int) -> None:
    """This process's PyTorch threads cut to ``cpus`` where it would start more (its default counts the
    CPUs the affinity mask allows, not a container's quota); an ``OMP_NUM_THREADS`` the user set stands."""
    import torch

    if "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() > cpus:
        torch.set_num_threads(cpus)


def timed_run(cfg: SuiteConfig, run: Run, task: dict[str, Any], data: dict[str, Path]) -> dict[str, Any]:
    """One fine-tuning run of ``run.local`` (or its linear probe, ``method=probe``): its primary score
    (accuracy, or Pearson's r for regression) on dev (None for a probe) and on test, each test example's
    prediction, its wall and CPU seconds (this process's, all threads) and the process that ran it."""
    started, cpu_started = time.monotonic(), time.process_time()
    if cfg.method == "probe":
        probed = probe(run.local, task, data, cfg.max_seq_len, cfg.batch_size)
        scores = {"dev": None, "test": probed["score"], "predicted": probed["predictions"]["predicted"]}
    else:
        scores = finetune_one(cfg, run.local, task, data, run.out, run.seed, run.lr)
    seconds = {"wall_s": time.monotonic() - started, "cpu_s": time.process_time() - cpu_started}
    return {**scores, **seconds, "pid": os.getpid()}


def log_run(cfg: SuiteConfig, run: Run, task: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    dev = "" if result["dev"] is None else f"dev {result['dev']:.4f}, "
    log.info(
        "evaluate-suite: %s | %s | %s | seed %d | lr %g | %s %stest %.4f | %.0f s (CPU %.0f s) | pid %d",
        run.model,
        run.task,
        cfg.method,
        run.seed,
        run.lr,
        task["metric"],
        dev,
        result["test"],
        result["wall_s"],
        result["cpu_s"],
        result["pid"],
    )
    return result


def finetune_one(
    cfg: SuiteConfig, model: str, task: dict[str, Any], data: dict[str, Path], out: Path, seed: int, lr: float
) -> dict[str, Any]:
    """Fine-tune on train, validated on dev (what the rate is picked by), the final model scored on test."""
    kind = KIND_TO_TASK[task["kind"]]
    overrides = {
        "model": model,
        "data": str(data["train"]),
        "validation": str(data["dev"]),
        "test": str(data["test"]),
        "save_predictions": True,
        "new_pooler": True,  # a teacher's trained pooler would be a head start no student has
        "output_dir": str(out),
        "text_column": task["text_column"],
        "text_pair_column": task.get("text_pair_column"),
        "label_column": task["label_column"],
        "task": kind,
        "max_seq_len": cfg.max_seq_len,
        "epochs": cfg.epochs,
        "batch_size": cfg.batch_size,
        "lr": lr,
        "log_every_steps": 50,
        "seed": seed,
        "mlflow": {"enabled": False},  # the suite records the scores, in one run per model
    }
    metric = PRIMARY_METRIC[kind]
    result = finetune(from_dict(FinetuneConfig, overrides))
    predicted = json.loads((out / "predictions.json").read_text(encoding="utf-8"))["test"]["predicted"]
    return {"dev": float(result[metric]), "test": float(result["test"][metric]), "predicted": predicted}


# ------------------------------------------------------------------------------------------------ report
def summarise(
    cfg: SuiteConfig, tasks: dict[str, dict[str, Any]], results: list[dict[str, Any]], labels: dict[str, list[Any]]
) -> dict[str, Any]:
    """Per model and task: the test score's mean, spread (max - min) and per-seed values, at the rate whose
    mean *dev* score is best when ``lrs`` names several (with every rate's dev and test means); per model: the
    average of the task means, its skill (the mean over tasks above chance, :mod:`suite_statistics`) and its
    share of the first model's skill, with a 95 % paired bootstrap interval; and, for every pair of models,
    the difference of their skills with its interval."""
    chances = {name: stats.chance(labels[name], task["kind"] == "regression") for name, task in tasks.items()}
    models, chosen = [], []
    for result in results:
        per_task, picked = {}, {}
        for name, by_lr in result["runs"].items():
            dev_means = {  # a probe or the bag-of-words baseline has no dev score: its one result is taken
                lr: statistics.fmean(r["dev"] for r in runs) if runs[0]["dev"] is not None else None
                for lr, runs in by_lr.items()
            }
            # the rate best on dev, the first on a tie
            lr = max(by_lr, key=lambda rate: -math.inf if dev_means[rate] is None else dev_means[rate])
            test = [r["test"] for r in by_lr[lr]]
            picked[name] = [r["predicted"] for r in by_lr[lr]]
            per_task[name] = {
                "mean": statistics.fmean(test),
                "spread": max(test) - min(test),
                "std": statistics.stdev(test) if len(test) > 1 else 0.0,
                "seeds": dict(zip(map(str, cfg.seeds), test, strict=True)),
                "above_chance": statistics.fmean(test) - chances[name],
                "predictions": {  # each seed's test predictions, in test-file order: what `recompute` starts from
                    str(seed): compact(predicted, tasks[name])
                    for seed, predicted in zip(cfg.seeds, picked[name], strict=True)
                },
            }
            if cfg.method == "finetune":  # a probe fine-tunes nothing: no rate to name, no dev split
                per_task[name]["lr"] = lr
                per_task[name]["dev_mean"] = dev_means[lr]
                per_task[name]["by_lr"] = {
                    f"{rate:g}": {"dev": dev_means[rate], "test": statistics.fmean(r["test"] for r in runs)}
                    for rate, runs in by_lr.items()
                }
        average = statistics.fmean(entry["mean"] for entry in per_task.values())
        skill = statistics.fmean(entry["above_chance"] for entry in per_task.values())
        timing = {key: result[key] for key in ("wall_s", "cpu_s")}  # cpu_s: this process's CPU time, all threads
        models.append({"model": result["model"], "tasks": per_task, "average": average, "skill": skill, **timing})
        chosen.append(picked)
    reference = models[0]["skill"]
    for entry in models:
        entry["share"] = entry["skill"] / reference if reference > 0 else None  # no share of a model at chance
    differences = []
    if cfg.bootstrap:
        predictions = [
            stats.TaskPredictions(labels[name], [picked[name] for picked in chosen], task["kind"] == "regression")
            for name, task in tasks.items()
        ]
        above = stats.bootstrap_skills(predictions, list(chances.values()), cfg.bootstrap)  # [b, model, task]
        skills = above.mean(axis=2)
        for index, entry in enumerate(models):
            entry["skill_ci"] = stats.interval(skills[:, index])
            if reference > 0:
                entry["share_ci"] = stats.interval(skills[:, index] / skills[:, 0])
        for first, second in itertools.combinations(range(len(models)), 2):
            ci = stats.interval(skills[:, first] - skills[:, second])
            by_task = {}
            for t, name in enumerate(tasks):
                task_ci = stats.interval(above[:, first, t] - above[:, second, t])
                by_task[name] = {
                    "difference": models[first]["tasks"][name]["mean"] - models[second]["tasks"][name]["mean"],
                    "ci95": task_ci,
                    "verdict": stats.verdict(task_ci, "first", "second"),
                }
            differences.append(
                {
                    "first": models[first]["model"],
                    "second": models[second]["model"],
                    "difference": models[first]["skill"] - models[second]["skill"],
                    "ci95": ci,
                    "verdict": stats.verdict(ci, "first", "second"),
                    "by_task": by_task,
                }
            )
    return {
        "protocol": {
            "choices": "on dev (dev_size training examples after train's, stratified)"
            if cfg.method == "finetune"
            else "none",
            "reported": "test (the first valid_size validation examples)",
            "share": "skill above chance over the first model's",
            "intervals": f"paired bootstrap, {cfg.bootstrap} resamples of examples and seeds, 95 % percentile",
        },
        "tasks": {
            name: {
                "kind": task["kind"],
                "metric": task["metric"],
                "train_size": min(cfg.train_size or task["train_size"], task["train_size"]),
                "dev_size": cfg.dev_size or 0,
                "test_size": len(labels[name]),
                "chance": chances[name],
                "bow_baseline": task["bow_baseline"][task["metric"]],
            }
            for name, task in tasks.items()
        },
        "models": models,
        "differences": differences,
        "config": to_dict(cfg),
    }


def compact(predicted: list[Any], task: dict[str, Any]) -> list[Any]:
    """Predictions as the JSON keeps them: a class by its index in the task's ``labels``; a value whole (a model
    near a constant predictor varies in its sixth digit, and Pearson's r reads only the variation)."""
    if task["kind"] == "regression":
        return [float(v) for v in predicted]
    index = {str(label): i for i, label in enumerate(task["labels"])}
    return [index[str(v)] for v in predicted]


def expand(values: list[Any], task: dict[str, Any]) -> list[Any]:
    """:func:`compact`'s inverse."""
    return list(values) if task["kind"] == "regression" else [task["labels"][i] for i in values]


def labels_of_test(cfg: SuiteConfig, task: dict[str, Any]) -> list[Any]:
    """The task's test labels: the first ``valid_size`` rows of its validation file (:func:`write_subsets`)."""
    with gzip.open(Path(cfg.tasks_dir) / task["name"] / "validation.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [row[task["label_column"]] for row in rows[: cfg.valid_size or None]]


def reported_config(report: dict[str, Any]) -> SuiteConfig:
    """The config a report was made with, its task files this checkout's: a report made in another checkout (a
    worktree, the GPU machine) recorded that checkout's ``benchmarks/quality/tasks``, which is not here. Task
    files changed since the report give other labels, and its figures then fail :func:`mismatches`."""
    cfg = from_dict(SuiteConfig, report["config"])
    if Path(cfg.tasks_dir).parts[-3:] == TASKS_DIR.parts[-3:]:
        cfg = dataclasses.replace(cfg, tasks_dir=str(TASKS_DIR))
    return cfg


def recompute(report: dict[str, Any]) -> dict[str, Any]:
    """The report's scores, skills, shares, intervals and verdicts computed again from the predictions it
    carries and the task files: what ``benchmarks/results.py --check`` compares a committed result with, so
    that a number edited in a result file (or a result computed from other predictions) fails."""
    cfg = reported_config(report)
    tasks = load_tasks(cfg)
    labels = {name: labels_of_test(cfg, task) for name, task in tasks.items()}
    results = []
    for entry in report["models"]:
        runs = {}
        for name, task in tasks.items():
            kept = entry["tasks"][name]
            predicted = [expand(kept["predictions"][str(seed)], task) for seed in cfg.seeds]
            regression = task["kind"] == "regression"
            seeds = [
                {"dev": kept.get("dev_mean"), "test": stats.score(p, labels[name], regression), "predicted": p}
                for p in predicted
            ]
            runs[name] = {kept.get("lr", cfg.rates[0]): seeds}
        results.append({"model": entry["model"], "runs": runs, "wall_s": entry["wall_s"], "cpu_s": entry["cpu_s"]})
    return summarise(dataclasses.replace(cfg, lrs=None), tasks, results, labels)


CHECKED = {"mean", "spread", "seeds", "above_chance", "average", "skill", "share", "skill_ci", "share_ci"}
CHECKED |= {"difference", "ci95", "verdict"}  # every figure a table shows, and each pair's verdict


def mismatches(report: dict[str, Any], tolerance: float = 1e-4) -> list[str]:
    """Where ``report`` differs from :func:`recompute` (each as ``path: kept != recomputed``); [] if nowhere.
    ``tolerance`` absorbs a metric computed in float32 by the fine-tuning, not an edited figure."""
    found: list[str] = []

    def walk(kept: Any, computed: Any, path: str, checked: bool) -> None:
        if isinstance(kept, dict):
            for key, value in kept.items():
                if key in computed:
                    walk(value, computed[key], f"{path}.{key}", checked or key in CHECKED)
        elif isinstance(kept, list) and kept and all(isinstance(v, dict) for v in kept):
            for i, (a, b) in enumerate(zip(kept, computed, strict=True)):
                walk(a, b, f"{path}[{i}]", checked)
        elif not checked:
            return
        elif isinstance(kept, list | float | int) and not isinstance(kept, bool):
            pairs = list(zip(kept, computed, strict=True)) if isinstance(kept, list) else [(kept, computed)]
            if any(a is None or b is None or abs(a - b) > tolerance for a, b in pairs):
                found.append(f"{path}: {kept} != {computed}")
        elif kept != computed:
            found.append(f"{path}: {kept!r} != {computed!r}")

    again = recompute(report)
    for key in ("models", "differences"):
        walk(report[key], again[key], key, False)
    return found


def format_table(report: dict[str, Any]) -> str:
    """One row per model (and one for chance, one for the bag-of-words baseline), one column per task's test
    score, then the average, the skill above chance and the share of the first model's skill with its
    interval; then every pair's difference of skill with its interval."""
    names = list(report["tasks"])
    header = ["model", *(f"{n} ({report['tasks'][n]['metric']})" for n in names), "average", "above chance", "share"]
    rows = []
    probe = report["config"]["method"] == "probe"  # one fit: no spread to show
    grid = len(report["config"].get("lrs") or []) > 1  # each task at the rate picked on dev: say which
    for entry in report["models"]:
        cells = [
            f"{entry['tasks'][n]['mean']:.3f}"
            + ("" if probe else f" ± {entry['tasks'][n]['spread']:.3f}")
            + (f" @{entry['tasks'][n]['lr']:g}" if grid and entry["tasks"][n].get("dev_mean") is not None else "")
            for n in names
        ]
        share = "n/a (the first model is not above chance)" if entry["share"] is None else f"{entry['share']:.1%}"
        if "share_ci" in entry:
            share += f" [{entry['share_ci'][0]:.1%}, {entry['share_ci'][1]:.1%}]"
        rows.append([entry["model"], *cells, f"{entry['average']:.3f}", f"{entry['skill']:+.3f}", share])
    chances = [report["tasks"][n]["chance"] for n in names]
    baselines = [report["tasks"][n]["bow_baseline"] for n in names]
    for label, values in (("chance (a constant predictor)", chances), ("bag-of-words baseline (all train)", baselines)):
        rows.append([label, *(f"{v:.3f}" for v in values), f"{statistics.fmean(values):.3f}"])
    rows = [row + [""] * (len(header) - len(row)) for row in rows]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        " | ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)) for row in [header, *rows]
    ]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    seeds = ", ".join(map(str, report["config"]["seeds"]))
    walls = ", ".join(f"{entry['wall_s']:.0f} s" for entry in report["models"])
    if probe:
        notes = ["(linear probe on the frozen mean-pooled features: one fit, its penalty cross-validated on train)"]
    else:
        notes = [f"(test scores: mean ± spread (max - min) over seeds {seeds}; every choice made on dev)"]
        if grid:
            rates = ", ".join(f"{lr:g}" for lr in report["config"]["lrs"])
            notes.append(f"(each task at the learning rate of {rates} whose mean dev score is best: @rate)")
    notes.append("(above chance: the mean over tasks of score - chance; share: of the first model's, [95 % interval])")
    notes.append(f"(wall time per model, {report['config']['method']} included: {walls})")
    if report["differences"]:
        notes.append("differences of skill above chance, first - second [paired bootstrap 95 % interval]:")
        for diff in report["differences"]:
            verdict = diff["verdict"].replace("first", diff["first"]).replace("second", diff["second"])
            notes.append(
                f"  {diff['first']} - {diff['second']}: {diff['difference']:+.3f} "
                f"[{diff['ci95'][0]:+.3f}, {diff['ci95'][1]:+.3f}]: {verdict}"
            )
    return "\n".join([*lines, *notes])


def track(cfg: SuiteConfig, entry: dict[str, Any], report: dict[str, Any]) -> None:
    """One MLflow run per model: the task means and spreads, the average and the share; the report as JSON."""
    spec = RunSpec(
        experiment=cfg.mlflow.experiment,
        run_name=cfg.mlflow.run_name or Path(entry["model"]).name or entry["model"],
        params={key: str(value) for key, value in flatten(to_dict(cfg)).items() if key != "models"},
        tags={"source_model": entry["model"], "reference_model": cfg.models[0]},
        texts={"evaluate-suite.json": json.dumps(report, indent=2)},
    )
    tracker = open_tracker(cfg.mlflow, spec)
    metrics = {key: entry[key] for key in ("average", "skill", "share", "wall_s", "cpu_s") if entry[key] is not None}
    if "share_ci" in entry:
        metrics.update(share_ci_low=entry["share_ci"][0], share_ci_high=entry["share_ci"][1])
    for name, scores in entry["tasks"].items():
        metrics.update({f"{name}/mean": scores["mean"], f"{name}/spread": scores["spread"]})
    tracker.log_metrics(metrics, 0)
    tracker.finish({})
