"""``python -m trainer evaluate-suite``: it runs end to end and reports every task; the task files hold
what tasks.json and docs/quality.md say; bad keys are clear errors."""

from __future__ import annotations

import collections
import dataclasses
import gzip
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from types import ModuleType

import pytest

from common.config import ConfigError, load_config
from trainer.commands.evaluate_suite import main
from trainer.evaluation.suite import TASKS_DIR, SuiteConfig, evaluate_suite

MANIFEST = json.loads((TASKS_DIR / "tasks.json").read_text(encoding="utf-8"))["tasks"]


def make_tasks() -> ModuleType:
    """benchmarks/quality/make_tasks.py, imported from its path (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("make_tasks", TASKS_DIR.parent / "make_tasks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(task: str, split: str, tasks_dir=TASKS_DIR) -> list[dict]:
    with gzip.open(tasks_dir / task / f"{split}.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


PAIR_TASK = "same-supersense"


def with_a_pair_task(dest) -> dict:
    """A tasks directory at ``dest``: the committed tasks (linked) and a sentence-pair task, the suite's ``pair``
    kind, which no committed task has since ``wordnet-hypernym`` was replaced: two WordNet definitions from
    wordnet-supersense -> are they of the same supersense (1) or not (0), alternately. Returns its manifest."""

    def pairs(split: str, size: int) -> list[dict]:
        source, out = rows("wordnet-supersense", split), []
        for i, row in enumerate(source[: 2 * size]):
            same = i % 2 == 0
            other = next(r for r in source[i + 1 :] if (r["label"] == row["label"]) == same)
            out.append({"text": row["text"], "text_pair": other["text"], "label": int(same)})
        return out[:size]

    splits = {"train": pairs("train", 96), "validation": pairs("validation", 48)}
    (dest / PAIR_TASK).mkdir(parents=True)
    for split, examples in splits.items():
        with gzip.open(dest / PAIR_TASK / f"{split}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in examples)
    for task in MANIFEST:
        (dest / task).symlink_to(TASKS_DIR / task, target_is_directory=True)
    spec = {"kind": "pair", "metric": "accuracy", "text_column": "text", "text_pair_column": "text_pair"}
    spec |= {"label_column": "label", "labels": [0, 1], "train_size": 96, "validation_size": 48}
    spec["bow_baseline"] = make_tasks().bow_baseline(splits["train"], splits["validation"], "pair")
    manifest = {**MANIFEST, PAIR_TASK: spec}
    (dest / "tasks.json").write_text(json.dumps({"tasks": manifest}), encoding="utf-8")
    return manifest


def test_suite_runs_two_models_and_reports_every_task(tiny_teacher_dir, bert_tokenizer_dir, tmp_path, capsys):
    """Toy size (16 examples, one seed, one epoch) on the tiny teacher and the real MiniLM encoder, tracked
    in a local SQLite store: one table with every task's test score, the average, the skill above chance and
    the share with its interval; the same in the JSON and in one MLflow run per model. The splits: train the
    first 16 training examples, dev the last 8 (every choice), test the first 8 validation examples. One step
    on 16 examples of ten classes may leave even MiniLM at chance: then the table says there is no share."""
    from mlflow import MlflowClient

    output, store = tmp_path / "suite.json", f"sqlite:///{tmp_path}/mlflow.db"
    argv = [str(bert_tokenizer_dir), str(tiny_teacher_dir), "train_size=16", "dev_size=8", "valid_size=8"]
    argv += ["seeds=[0]", "epochs=1", "max_seq_len=32", f"output={output}", f"mlflow.tracking_uri={store}"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    header, _, first, second, chance, baseline, *notes = table.splitlines()
    assert all(task in header for task in MANIFEST) and "average" in header and "above chance" in header
    assert second.startswith(str(tiny_teacher_dir)) and chance.startswith("chance (a constant predictor)")
    assert baseline.startswith("bag-of-words baseline")

    report = json.loads(output.read_text())
    above_chance = report["models"][0]["skill"] > 0
    share = "100.0% [100.0%, 100.0%]" if above_chance else "n/a (the first model is not above chance)"
    assert first.startswith(str(bert_tokenizer_dir)) and first.rstrip().endswith(share)
    assert list(report["tasks"]) == list(MANIFEST)
    assert [m["model"] for m in report["models"]] == [str(bert_tokenizer_dir), str(tiny_teacher_dir)]
    for task, entry in report["tasks"].items():
        assert (entry["train_size"], entry["dev_size"], entry["test_size"]) == (16, 8, 8)
        assert [sum(entry["label_counts"][split].values()) for split in ("train", "dev", "test")] == [16, 8, 8]
        assert entry["bow_baseline"] == MANIFEST[task]["bow_baseline"][MANIFEST[task]["metric"]]
        labels = [str(r["label"]) for r in rows(task, "validation")[:8]]
        majority = max(labels.count(label) for label in labels) / 8
        assert entry["chance"] == (0.0 if MANIFEST[task]["kind"] == "regression" else majority)
    for model in report["models"]:
        assert set(model["tasks"]) == set(MANIFEST)
        assert all(
            math.isfinite(t["mean"]) and t["spread"] == 0 and list(t["seeds"]) == ["0"] for t in model["tasks"].values()
        )
        means = [t["mean"] for t in model["tasks"].values()]
        assert model["average"] == pytest.approx(sum(means) / len(means))
        above = [t["mean"] - report["tasks"][name]["chance"] for name, t in model["tasks"].items()]
        assert model["skill"] == pytest.approx(sum(above) / len(above))
        assert model["skill_ci"][0] <= model["skill_ci"][1]
    teacher, student = report["models"]
    if above_chance:
        assert teacher["share"] == 1.0 and teacher["share_ci"] == [1.0, 1.0]
        assert student["share"] == pytest.approx(student["skill"] / teacher["skill"])
    else:
        assert teacher["share"] is None and student["share"] is None
    [difference] = report["differences"]
    assert difference["difference"] == pytest.approx(teacher["skill"] - student["skill"])
    low, high = difference["ci95"]
    expected = "first better" if low > 0 else "second better" if high < 0 else "no measurable difference"
    assert difference["verdict"] == expected and any(expected.split()[-1] in line for line in notes)
    assert set(difference["by_task"]) == set(MANIFEST)
    for name, task_difference in difference["by_task"].items():
        assert task_difference["difference"] == pytest.approx(
            teacher["tasks"][name]["mean"] - student["tasks"][name]["mean"]
        )

    # Every figure is computed again from the predictions the JSON carries (benchmarks/results.py --check)
    from trainer.evaluation.suite import mismatches

    assert all(len(p) == 8 for m in report["models"] for t in m["tasks"].values() for p in t["predictions"].values())
    assert mismatches(report) == []
    edited = json.loads(json.dumps(report))
    edited["models"][1]["tasks"]["debian-section"]["mean"] += 0.01
    edited["differences"][0]["verdict"] = "first better" if expected != "first better" else "second better"
    found = mismatches(edited)
    assert len(found) == 2 and found[0].startswith("models[1].tasks.debian-section.mean"), found
    edited = json.loads(json.dumps(report))
    predictions = edited["models"][0]["tasks"]["wordnet-supersense"]["predictions"]["0"]
    predictions[:] = [(v + 1) % len(MANIFEST["wordnet-supersense"]["labels"]) for v in predictions]  # all wrong now
    assert any("wordnet-supersense.mean" in line for line in mismatches(edited))

    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("evaluate-suite").experiment_id])
    by_model = {run.data.tags["source_model"]: run for run in runs}
    assert set(by_model) == {str(bert_tokenizer_dir), str(tiny_teacher_dir)}
    for model in report["models"]:
        metrics = by_model[model["model"]].data.metrics
        assert metrics["average"] == pytest.approx(model["average"])
        assert metrics["skill"] == pytest.approx(model["skill"])
        assert all(metrics[f"{task}/mean"] == pytest.approx(model["tasks"][task]["mean"]) for task in MANIFEST)


def test_seeds_give_a_spread_and_tasks_can_be_chosen(tiny_teacher_dir, tmp_path):
    argv = [f"models=[{tiny_teacher_dir}]", "tasks=[wordnet-supersense]", "train_size=16", "dev_size=8"]
    cfg = load_config(SuiteConfig, None, [*argv, "valid_size=16", "seeds=[0,1]"])
    cfg = dataclasses.replace(cfg, epochs=1, max_seq_len=32, output=str(tmp_path / "s.json"))
    cfg.mlflow.enabled = False
    (model,) = evaluate_suite(cfg)["models"]
    scores = model["tasks"]["wordnet-supersense"]
    assert list(model["tasks"]) == ["wordnet-supersense"] and list(scores["seeds"]) == ["0", "1"]
    assert scores["spread"] == pytest.approx(max(scores["seeds"].values()) - min(scores["seeds"].values()))


def test_the_bag_of_words_baseline_is_one_more_row_on_the_same_splits(tiny_teacher_dir, tmp_path):
    """``baseline=true``: TF-IDF + a linear model fitted on the same train split and scored on the same test
    examples as every model (the figure make_tasks.py computes for those rows), compared with each model by
    the paired bootstrap; its scores are the same at every seed (it has none)."""
    argv = [f"models=[{tiny_teacher_dir}]", "tasks=[debian-section,debian-size]", "train_size=32", "dev_size=8"]
    cfg = load_config(SuiteConfig, None, [*argv, "valid_size=32", "seeds=[0,1]", "baseline=true", "bootstrap=200"])
    cfg = dataclasses.replace(cfg, epochs=1, max_seq_len=32, output=str(tmp_path / "s.json"))
    cfg.mlflow.enabled = False
    report = evaluate_suite(cfg)
    _, bow = report["models"]
    assert bow["model"] == "bag-of-words (same train split)"
    for task in ("debian-section", "debian-size"):
        expected = make_tasks().bow_baseline(
            rows(task, "train")[:32], rows(task, "validation")[:32], MANIFEST[task]["kind"]
        )
        assert bow["tasks"][task]["mean"] == pytest.approx(expected[MANIFEST[task]["metric"]], abs=1e-4), task
        assert bow["tasks"][task]["spread"] == 0 and bow["tasks"][task]["dev_mean"] is None
    [difference] = report["differences"]
    assert (difference["first"], difference["second"]) == (str(tiny_teacher_dir), bow["model"])
    assert difference["ci95"][0] <= difference["difference"] <= difference["ci95"][1]


def test_a_sentence_pair_task_is_fine_tuned_on_both_texts_and_has_its_baseline(tiny_teacher_dir, tmp_path):
    """A ``pair`` task (two texts, :func:`with_a_pair_task`) through the fine-tuned suite and the bag-of-words row
    (both texts' vectors and their product): every seed scored, the baseline the figure make_tasks.py computes."""
    manifest = with_a_pair_task(tmp_path / "tasks")
    argv = [f"models=[{tiny_teacher_dir}]", f"tasks_dir={tmp_path / 'tasks'}", f"tasks=[{PAIR_TASK}]", "train_size=32"]
    cfg = load_config(SuiteConfig, None, [*argv, "dev_size=16", "valid_size=32", "seeds=[0,1]", "baseline=true"])
    cfg = dataclasses.replace(cfg, epochs=1, max_seq_len=64, bootstrap=200, output=str(tmp_path / "s.json"))
    cfg.mlflow.enabled = False
    report = evaluate_suite(cfg)
    model, bow = (entry["tasks"][PAIR_TASK] for entry in report["models"])
    assert list(model["seeds"]) == ["0", "1"] and all(0 <= v <= 1 for v in model["seeds"].values())
    assert report["tasks"][PAIR_TASK]["bow_baseline"] == manifest[PAIR_TASK]["bow_baseline"]["accuracy"]
    train, test = (rows(PAIR_TASK, split, tmp_path / "tasks")[:32] for split in ("train", "validation"))
    expected = make_tasks().bow_baseline(train, test, "pair")["accuracy"]
    assert bow["mean"] == pytest.approx(expected, abs=1e-4)


@pytest.mark.full
def test_jobs_run_fine_tunes_in_worker_processes_with_the_same_scores(tiny_teacher_dir, bert_tokenizer_dir, tmp_path):
    """``jobs=2`` through the real command: the runs go to two worker processes (the log names each run's
    process), and every score is the one ``jobs=1`` gives with the workers' thread count, run by run and
    to the bit (each run is seeded alone; another thread count rounds differently, in the sixth digit)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 2))}  # what each worker gets
    reports, pids = [], []
    for jobs in (1, 2):
        output = tmp_path / f"jobs{jobs}.json"
        argv = [str(bert_tokenizer_dir), str(tiny_teacher_dir), "tasks=[debian-size,wordnet-supersense]"]
        argv += ["train_size=16", "dev_size=8", "valid_size=8", "seeds=[0,1]", "epochs=1", "max_seq_len=32"]
        argv += [f"jobs={jobs}"]
        argv += [f"output={output}", "mlflow.enabled=false"]
        done = subprocess.run(
            [sys.executable, "-m", "trainer", "evaluate-suite", *argv],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        pids.append({int(pid) for pid in re.findall(r"evaluate-suite: .* \| pid (\d+)", done.stderr)})
        reports.append(json.loads(output.read_text()))
    assert len(pids[0]) == 1 and len(pids[1]) == 2 and not pids[0] & pids[1]
    one, two = ({m["model"]: m["tasks"] for m in report["models"]} for report in reports)
    assert list(one) == list(two) == [str(bert_tokenizer_dir), str(tiny_teacher_dir)]
    for model, tasks in one.items():
        for task, scores in tasks.items():
            assert two[model][task]["seeds"] == scores["seeds"], (model, task)


@pytest.mark.full
def test_a_suite_run_again_with_its_work_dir_continues_where_it_stopped(tiny_teacher_dir, tmp_path, caplog):
    """A suite killed (SIGKILL: nothing of it cleans up) once its first run is recorded, then run again with
    the same ``work_dir``, reuses that run and runs the rest: its report equals, score by score, a suite's
    never stopped. A record counts only for what it was made from: a changed model file, a changed setting
    or a record that cannot be read runs that run again."""
    copy = tmp_path / "copy"  # a second model whose files this test may change
    shutil.copytree(tiny_teacher_dir, copy)
    work = tmp_path / "work"
    settings = ["tasks=[debian-size,wordnet-supersense]", "train_size=16", "dev_size=8"]
    settings += ["valid_size=8", "seeds=[0]", "epochs=1", "max_seq_len=32", "mlflow.enabled=false"]
    common = [str(tiny_teacher_dir), str(copy), *settings]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same threads in every run: the same rounding

    def suite(*args: str) -> subprocess.Popen:
        argv = [sys.executable, "-m", "trainer", "evaluate-suite", *common, *args]
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    stopped = suite(f"work_dir={work}", f"output={tmp_path / 'stopped.json'}")
    while not list(work.rglob("*.result.json")) and stopped.poll() is None:
        time.sleep(0.02)
    stopped.send_signal(signal.SIGKILL)
    stopped.communicate()
    assert len(list(work.rglob("*.result.json"))) == 1 and not (tmp_path / "stopped.json").exists()

    again = suite(f"work_dir={work}", f"output={tmp_path / 'again.json'}")
    fresh = suite(f"output={tmp_path / 'fresh.json'}")  # no work_dir: nothing to reuse
    logs = {}
    for name, process in (("again", again), ("fresh", fresh)):
        logs[name] = process.communicate()[1]
        assert process.returncode == 0, logs[name]
    assert len(re.findall(r"evaluate-suite: .* reused: .*\.result\.json", logs["again"])) == 1
    assert len(re.findall(r"evaluate-suite: .* \| pid \d+", logs["again"])) == 3  # the runs it ran
    again_report, fresh_report = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("again", "fresh"))
    assert again_report["runs"] == {"total": 4, "reused": 1} and fresh_report["runs"] == {"total": 4, "reused": 0}
    assert [m["tasks"] for m in again_report["models"]] == [m["tasks"] for m in fresh_report["models"]]

    def reused(*args: str) -> int:
        argv = [f"models=[{tiny_teacher_dir},{copy}]", *settings, f"work_dir={work}", f"output={tmp_path / 'r.json'}"]
        cfg = load_config(SuiteConfig, None, [*argv, *args])
        return evaluate_suite(cfg)["runs"]["reused"]

    records = sorted(work.glob("model-0/*/*/*.result.json"))
    records[0].write_text("{", encoding="utf-8")  # torn by hand: what an atomic write never leaves
    (copy / "config.json").write_text((copy / "config.json").read_text().replace("{", '{"note": 1, ', 1))
    with caplog.at_level("INFO", logger="trainer.evaluation.suite"):
        assert reused() == 1  # the first model's other task; the copy's two ran again: its files changed
    assert "cannot be read" in caplog.text and "recorded for another model_sha256" in caplog.text
    assert reused() == 4 and reused("batch_size=8") == 0
    assert reused("method=probe") == 0 and reused("method=probe") == 4  # a probe's runs are recorded too


def test_lrs_pick_each_tasks_rate_on_dev_and_report_test(tiny_teacher_dir, tmp_path, capsys):
    """``lrs=[1e-4,3e-3]``: every task fine-tuned at both rates; each task's rate is the one with the better mean
    *dev* score over the seeds, and its test scores equal, seed by seed, a suite run at that rate alone (the
    test split took no part in the pick); the table says which rate."""
    common = [str(tiny_teacher_dir), "tasks=[debian-section,debian-size]", "train_size=16", "dev_size=8"]
    common += ["valid_size=8", "seeds=[0,1]", "epochs=1", "max_seq_len=32", "mlflow.enabled=false"]
    assert main([*common, "lrs=[1e-4,3e-3]", f"output={tmp_path / 'grid.json'}"]) == 0
    table = capsys.readouterr().out
    assert "each task at the learning rate of 0.0001, 0.003 whose mean dev score is best" in table
    (grid,) = json.loads((tmp_path / "grid.json").read_text())["models"]
    for rate in ("1e-4", "3e-3"):
        assert main([*common, f"lr={rate}", f"output={tmp_path / rate}.json"]) == 0
    alone = {
        rate: json.loads((tmp_path / f"{rate}.json").read_text())["models"][0]["tasks"] for rate in ("1e-4", "3e-3")
    }
    for task, entry in grid["tasks"].items():
        dev = {"1e-4": alone["1e-4"][task]["dev_mean"], "3e-3": alone["3e-3"][task]["dev_mean"]}
        test = {"1e-4": alone["1e-4"][task]["mean"], "3e-3": alone["3e-3"][task]["mean"]}
        assert entry["by_lr"] == {
            "0.0001": {"dev": dev["1e-4"], "test": test["1e-4"]},
            "0.003": {"dev": dev["3e-3"], "test": test["3e-3"]},
        }, task
        best = max(dev, key=dev.get)  # the first on a tie, as the suite picks
        assert entry["lr"] == float(best) and entry["seeds"] == alone[best][task]["seeds"], task
        assert f"@{entry['lr']:g}" in table
    with pytest.raises(ConfigError, match=r"lrs: repeats a rate"):
        main([*common, "lrs=[1e-4,1e-4]"])
    with pytest.raises(ConfigError, match=r"lrs: a probe does not fine-tune"):
        main([str(tiny_teacher_dir), "method=probe", "lrs=[1e-4]"])


@pytest.mark.full
def test_the_probe_equals_scikit_learn_on_the_same_features(bert_tokenizer_dir, tmp_path, capsys):
    """``method=probe`` on the real MiniLM encoder, every task and a pair task (:func:`with_a_pair_task`) at
    80 / 48 examples: the same scores as scikit-learn's RidgeClassifier and Ridge on features pooled and
    standardised here by hand (each text's last hidden states averaged over its real tokens; (u, v, |u - v|,
    u v) for a pair), with the penalty chosen here the same way (5 interleaved folds, the grid, the larger
    penalty on a tie); and the same report again on a second run (no seed, nothing random)."""
    np = pytest.importorskip("numpy")
    pytest.importorskip("sklearn")
    import torch
    from scipy.stats import pearsonr
    from sklearn.linear_model import Ridge, RidgeClassifier
    from transformers import AutoModel, AutoTokenizer

    from trainer.evaluation.probe import PENALTIES

    output, manifest = tmp_path / "probe.json", with_a_pair_task(tmp_path / "tasks")
    argv = [str(bert_tokenizer_dir), "method=probe", f"tasks_dir={tmp_path / 'tasks'}", "seeds=[0]", "train_size=80"]
    argv += ["valid_size=48"]
    argv += ["max_seq_len=64", f"output={output}", "mlflow.enabled=false"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "linear probe on the frozen mean-pooled features" in table
    [row] = [line for line in table.splitlines() if line.startswith(str(bert_tokenizer_dir))]
    assert "±" not in row and "100.0%" in row  # one fit: no spread to show
    report = json.loads(output.read_text())
    [entry] = report["models"]
    assert all("lr" not in task and "by_lr" not in task for task in entry["tasks"].values())  # nothing fine-tuned

    model, tokenizer = (
        AutoModel.from_pretrained(bert_tokenizer_dir).eval(),
        AutoTokenizer.from_pretrained(bert_tokenizer_dir),
    )

    def pooled(texts):
        batch = tokenizer(texts, truncation=True, max_length=64, padding=True, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        return ((hidden * mask).sum(1) / mask.sum(1)).double().numpy()

    def score(kind, penalty, x, y, x_eval, y_eval):
        if kind == "regression":
            return pearsonr(Ridge(alpha=penalty).fit(x, y).predict(x_eval), y_eval)[0]
        return float(np.mean(RidgeClassifier(alpha=penalty).fit(x, y).predict(x_eval) == y_eval))

    for name, task in manifest.items():
        train, valid = (rows(name, split, tmp_path / "tasks") for split in ("train", "validation"))
        train, valid = train[:80], valid[:48]

        def features(split, kind=task["kind"]):
            u = pooled([r["text"] for r in split])
            if kind != "pair":
                return u
            v = pooled([r["text_pair"] for r in split])
            return np.concatenate([u, v, np.abs(u - v), u * v], axis=1)

        raw_train = features(train)
        mean, sd = raw_train.mean(0), raw_train.std(0, ddof=1)
        x_train, x_valid = (raw_train - mean) / sd, (features(valid) - mean) / sd
        y_train, y_valid = np.array([r["label"] for r in train]), np.array([r["label"] for r in valid])
        fold = np.arange(len(train)) % 5
        held_out = {
            penalty: np.mean(
                [
                    score(
                        task["kind"],
                        penalty,
                        x_train[fold != k],
                        y_train[fold != k],
                        x_train[fold == k],
                        y_train[fold == k],
                    )
                    for k in range(5)
                ]
            )
            for penalty in PENALTIES
        }
        best = max(held_out.values())
        penalty = max(p for p, s in held_out.items() if s >= best - 1e-9)
        expected = score(task["kind"], penalty, x_train, y_train, x_valid, y_valid)
        tolerance = 1e-6 if task["kind"] == "regression" else 1e-9  # one closed-form solution, two solvers
        assert entry["tasks"][name]["mean"] == pytest.approx(expected, abs=tolerance), (name, penalty)
    assert 0 < entry["tasks"]["wordnet-supersense"]["mean"] < 1 and entry["share"] == 1.0

    assert main([*argv[:-2], f"output={tmp_path / 'again.json'}", "mlflow.enabled=false"]) == 0
    again = json.loads((tmp_path / "again.json").read_text())["models"][0]
    assert {t: v["mean"] for t, v in again["tasks"].items()} == {t: v["mean"] for t, v in entry["tasks"].items()}


def test_bad_keys_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="models: name at least one model"):
        main(["mlflow.enabled=false"])
    with pytest.raises(ConfigError, match=r"tasks: unknown tasks \['sst2'\]; available: debian-section"):
        main([str(tmp_path), "tasks=[sst2]", "mlflow.enabled=false"])
    with pytest.raises(ConfigError, match="seeds: repeats a seed"):
        main([str(tmp_path), "seeds=[1,1]"])
    with pytest.raises(ConfigError, match=r"method: must be one of 'finetune', 'probe', got 'knn'"):
        main([str(tmp_path), "method=knn"])
    with pytest.raises(ConfigError, match=r"seeds: a probe is one deterministic fit: leave seeds unset, or give one"):
        main([str(tmp_path), "method=probe", "seeds=[0,1]"])
    with pytest.raises(ConfigError, match=r"tasks_dir: .* has no tasks.json"):
        main([str(tmp_path), f"tasks_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=rf"models: {tmp_path} is not a Hugging Face model directory"):
        main([str(tmp_path), "mlflow.enabled=false"])
    with pytest.raises(ConfigError, match="dev_size: a fine-tuned suite makes its choices on dev examples"):
        main([str(tmp_path), "dev_size=0"])
    with pytest.raises(ConfigError, match="bootstrap: must be 0"):
        main([str(tmp_path), "bootstrap=10"])


@pytest.mark.parametrize("task", list(MANIFEST))
@pytest.mark.parametrize(("train_size", "dev_size"), [(500, 300), (500, 150), (800, 40), (0, 300)])
def test_each_dev_split_has_its_tasks_label_proportions_apart_from_train_and_test(task, train_size, dev_size, tmp_path):
    """The task files are written in rounds of one row per class, so their last rows are the largest classes'
    leftovers: a dev split of the last N rows lacked whole classes. Dev holds every class (or, for a regression
    target, every decile of the training file's targets) within one example of its share of the training file,
    none of train's rows or test's, the same rows every time."""
    from trainer.evaluation.suite import REGRESSION_STRATA, load_tasks, strata, write_subsets

    cfg = SuiteConfig(models=["unused"], tasks=[task], train_size=train_size, dev_size=dev_size).resolved()
    spec = load_tasks(cfg)[task]
    paths, counts = write_subsets(spec, tmp_path / "a", cfg)
    again, _ = write_subsets(spec, tmp_path / "b", cfg)
    assert all(paths[split].read_bytes() == again[split].read_bytes() for split in paths)
    lines = {split: paths[split].read_text().splitlines() for split in paths}
    assert not set(lines["dev"]) & set(lines["train"]) and not set(lines["dev"]) & set(lines["test"])
    assert len(lines["dev"]) == dev_size and len(lines["train"]) == (train_size or spec["train_size"] - dev_size)
    if train_size:  # train is the first train_size rows, as before
        assert [json.loads(line) for line in lines["train"]] == rows(task, "train")[:train_size]
    whole = [r["label"] for r in rows(task, "train")]
    expected = collections.Counter(strata(whole, spec, whole))
    assert len(expected) == (REGRESSION_STRATA if spec["kind"] == "regression" else len(spec["labels"]))
    assert set(counts["dev"]) == set(expected), "a class or decile is missing from dev"
    for name, count in counts["dev"].items():
        assert abs(count - dev_size * expected[name] / len(whole)) < 1 + 1e-9, (name, count)


def test_train_and_dev_must_fit_in_a_tasks_training_file(tiny_teacher_dir, tmp_path):
    """Dev is carved from the training file after train's rows, never overlapping train: asking for more is an
    error naming the key, before any fine-tuning; so is a class with no row left for dev."""
    from trainer.evaluation.suite import dev_rows

    task = {"name": "toy", "kind": "classification"}
    labels = ["a", "b"] * 10 + ["a"] * 5  # every "b" sits in the first 20 rows
    assert [labels[i] for i in dev_rows(labels, 10, 4, task)].count("b") >= 1
    with pytest.raises(ConfigError, match="train_size: toy: no training example of b is left for the dev split"):
        dev_rows(labels, 20, 4, task)
    size = MANIFEST["debian-size"]["train_size"]
    argv = [str(tiny_teacher_dir), "tasks=[debian-size]", f"train_size={size}", "dev_size=8", "mlflow.enabled=false"]
    with pytest.raises(ConfigError, match=rf"dev_size: debian-size has {size} training examples: {size} to train"):
        main([*argv, f"output={tmp_path / 'x.json'}"])


def test_unset_sizes_and_seeds_are_the_methods_defaults():
    """Fine-tuning: the CPU-sized suite, three seeds; the probe: all the data, one fit; set values kept."""
    resolved = [
        load_config(SuiteConfig, None, ["models=[m]", *args]).resolved()
        for args in ([], ["method=probe"], ["method=probe", "train_size=64", "seeds=[3]"])
    ]
    assert [(r.train_size, r.dev_size, r.valid_size, r.seeds) for r in resolved] == [
        (500, 300, 1000, [0, 1, 2]),
        (0, 0, 0, [0]),
        (64, 0, 0, [3]),
    ]


@pytest.mark.parametrize("task", sorted(MANIFEST))
def test_task_files_hold_what_the_manifest_says(task):
    """Sizes as documented, every label present and of the task's kind, no text empty, no example in both
    splits, and a bag-of-words baseline (recomputed here) below 0.90: the task is not trivial."""
    spec = MANIFEST[task]
    train, valid = rows(task, "train"), rows(task, "validation")
    assert (len(train), len(valid)) == (spec["train_size"], spec["validation_size"])
    assert spec["train_size"] >= 1000 and spec["validation_size"] >= 400
    text_columns = [spec["text_column"]] + ([spec["text_pair_column"]] if spec["kind"] == "pair" else [])
    for row in train + valid:
        assert all(isinstance(row[c], str) and row[c].strip() for c in text_columns)
        if spec["kind"] == "regression":
            assert isinstance(row["label"], float) and math.isfinite(row["label"])
        else:
            assert row["label"] in spec["labels"]
    if spec["kind"] != "regression":
        assert {r["label"] for r in valid} == set(spec["labels"])
    key = lambda r: tuple(r[c] for c in text_columns)  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in valid}

    pytest.importorskip("sklearn")
    assert make_tasks().bow_baseline(train, valid, spec["kind"]) == spec["bow_baseline"]
    assert spec["bow_baseline"][spec["metric"]] < 0.90


def test_a_report_made_in_another_checkout_is_checked_against_this_checkouts_task_files() -> None:
    """A worktree's or the GPU machine's report recorded its own ``benchmarks/quality/tasks``; --check reads this
    checkout's. Any other task directory (a test's own) is kept as recorded."""
    from trainer.evaluation.suite import TASKS_DIR, SuiteConfig, reported_config

    config = dataclasses.asdict(SuiteConfig(models=["m"], tasks_dir="/elsewhere/benchmarks/quality/tasks"))
    assert reported_config({"config": config}).tasks_dir == str(TASKS_DIR)
    config["tasks_dir"] = "/tmp/my-tasks"
    assert reported_config({"config": config}).tasks_dir == "/tmp/my-tasks"
