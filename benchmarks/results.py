"""The current answers, as tables generated from committed result files: README's one results table, the
speed table opening docs/benchmarks.md, the ablation tables of docs/quality.md (and of the GPU ablation made before
the dev/test protocol, in docs/log/quality.md), its table of the evaluation suite's tasks, and docs/mlflow-server.md's
registry under load and under faults.

    python benchmarks/results.py            # re-render README.md, docs/benchmarks.md, docs/quality.md
    python benchmarks/results.py --check    # exit 1 if a page's table differs from what the files give, or a
                                            # suite result's figures from those its predictions give

Measures nothing: each figure is read from the file named under its table (the latest GPU campaign, the
latest GPU ablation, the demo's timing, the task files and the suite-separation run), so a new result file
changes the pages only through this script.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks import demo_time, suite_time  # noqa: E402
from benchmarks.demo_time import minutes  # noqa: E402
from benchmarks.quality.ablation_report import comparison_lines, comparisons, run_name  # noqa: E402
from benchmarks.suite_time import made_by, render_between_markers  # noqa: E402
from trainer.evaluation.suite_statistics import described  # noqa: E402

THROUGHPUT = Path("docs/gpu-campaign/throughput.json")
ABLATION = Path("docs/gpu-ablation/2026-11-28-h200")  # the latest GPU ablation
# the MiniLM family at CPU scale under the dev/test protocol: (a), (f), (a5x) and (a0), the pairs with intervals
CPU_ABLATION = Path("docs/quality/ablation-cpu-2026-11-29")
# the MiniLM family at CPU scale under its protocol (benchmarks/quality/protocols/minilm-cpu.yaml): 3 students a variant
CPU_STUDY = Path("docs/quality/ablation-cpu-2026-12-03")
DEMO_TIME = Path("docs/demo/demo-time.json")
SUITE_TIME = Path("docs/test-suite/suite-time.json")
REGISTRY_LOAD = Path("docs/mlflow/registry-load.json")  # registry_load.py, retired (benchmarks/README.md)
REGISTRY_FAULTS = Path("docs/mlflow/registry-faults.json")  # its --faults
TASK_DISTILL = Path("docs/quality/task-distill.json")
TASKS = Path("benchmarks/quality/tasks/tasks.json")  # the suite's task files, with each one's bag-of-words baseline
SEPARATION = Path("docs/quality/suite-separation.json")  # MiniLM against bag-of-words on 500 train (a retired script)
HEADLINE = "distilbert-512-gb4096-mb64"  # the preset as shipped: 4096-sequence batches, 64 x 64 by accumulation
FAMILIES = {"bert": "a BERT teacher pretrained here (6 x 512)", "minilm": "all-MiniLM-L6-v2 + a fitted MLM head"}
TASK_LABELS = {
    "debian-section": "section (acc)",
    "debian-size": "size (r)",
    "wordnet-supersense": "supersense (acc)",
    "wordnet-hypernym": "hypernym (acc)",  # the earlier suite's third task, in the committed results before it
}


def load(path: Path) -> dict:
    return json.loads((REPO / path).read_text(encoding="utf-8"))


def variants(ablation: Path) -> dict[str, str]:
    """Run name (``bert-a``) -> what it is (``(a) L_ce + L_mlm + L_cos, teacher init``): the ablation's runs.tsv."""
    with open(REPO / ablation / "runs.tsv", encoding="utf-8") as handle:
        return {row["name"]: row["variant"] for row in csv.DictReader(handle, delimiter="\t")}


def speed_table() -> str:
    data = load(THROUGHPUT)
    rows = [
        "| case | preset | tokens | micro-batch | tokens/s | MFU | peak GiB | waiting for data |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case in sorted(data["cases"], key=lambda c: -(c["tokens_per_s"] or 0)):
        if case["rc"] != 0 or "profile.steps=3" in case["overrides"]:
            continue  # a profiled run measures the profiler
        rows.append(
            f"| {case['name']} | {case['preset']} | {case['seq']} | {case['micro']} | {case['tokens_per_s']:,.0f} | "
            f"{case['mfu']:.1%} | {case['max_memory_gib']:.1f} | {case['data_wait_share']:.1%} |"
        )
    steps = ", ".join(
        f"{s['name']} {s['tokens_per_s']:,.0f} tokens/s ({s['mfu']:.1%})"
        for s in data["steps"]
        if s["step"] in {"project", "naive"}
    )
    rows += [
        "",
        f"The training step alone (micro-batch 32, 512 tokens): {steps}. One {data['device']}, {data['versions']}; "
        f"MFU against {data['peak_flops'] / 1e12:.0f} TFLOP/s dense bf16. From `{THROUGHPUT}` "
        "(`benchmarks/gpu/run.sh` on the device; docs/gpu-machine.md).",
    ]
    return "\n".join(rows)


def family_table(family: str, ablation: Path = ABLATION) -> str:
    """One family's ablation (the run's files in ``ablation``): suite average and share, held-out masked LM, and
    the compared pairs with their intervals where the run has them."""
    suite, mlm = load(ablation / f"suite-{family}.json"), load(ablation / f"mlm-{family}.json")
    names = variants(ablation)
    by_run = {run_name(m["model"]): m for m in mlm["models"]}
    tasks = list(suite["tasks"])
    rows = [
        "| model | " + " | ".join(TASK_LABELS.get(t, t) for t in tasks) + " | suite average | share of teacher "
        "| masked-LM accuracy | perplexity | top-1 agreement |",
        "|---|" + "---:|" * (len(tasks) + 5),
    ]
    teacher_mlm = mlm["teacher"]
    for model in suite["models"]:
        name = run_name(model["model"])
        label = names.get(name, "teacher")
        if name == "teacher" or label == "teacher":
            label, scored = "teacher", teacher_mlm
        else:
            scored = by_run.get(name, {})
        cells = " | ".join(f"{model['tasks'][t]['mean']:.3f}" for t in tasks)
        masked = (
            f"{scored['mlm_accuracy']:.3f} | {scored['perplexity']:,.1f} | "
            + (f"{scored['top1_agreement']:.3f}" if "top1_agreement" in scored else "-")
            if scored
            else "- | - | -"
        )
        share = f"{model['share']:.1%}" + (
            f" [{model['share_ci'][0]:.1%}, {model['share_ci'][1]:.1%}]" if "share_ci" in model else ""
        )
        rows.append(f"| {label} | {cells} | {model['average']:.3f} | {share} | {masked} |")
    short = {name: f"({name.removeprefix(family + '-')})" for name in names}  # bert-a4 -> (a4)
    compared = comparison_lines(comparisons(family, suite, mlm), short)
    rows += ["", *compared] if compared else []
    baseline = " · ".join(f"{TASK_LABELS.get(t, t)} {info['bow_baseline']:.3f}" for t, info in suite["tasks"].items())
    config = suite["config"]
    picked = (  # a report from before the dev/test protocol: its share is raw and its rate picked on what it reports
        "picked on dev, reported on test, the share of the skill above chance [95 % paired bootstrap interval]"
        if "protocol" in suite
        else "picked on the same validation split it reports, the share of raw scores"
    )
    sizes = (  # under the protocol valid_size is the test split
        f"{config['train_size']} training, {config['dev_size']} dev and {config['valid_size']} test"
        if "protocol" in suite
        else f"{config['train_size']} training and {config['valid_size']} validation"
    )
    rates = f"each task at the better of rates {config['lrs']}" if config.get("lrs") else f"at rate {config['lr']}"
    rows += [
        "",
        f"{FAMILIES[family]}. Suite: {sizes} examples a "
        f"task, seeds {config['seeds']}, {rates} {picked}; "
        f"bag-of-words baseline {baseline}. Masked LM: {mlm['config']['max_batches']} "
        f"held-out batches of {mlm['config']['batch_size']} on {mlm['device']}. From `{ablation}/suite-{family}.json` "
        f"and `mlm-{family}.json`.",
    ]
    return "\n".join(rows)


def study_table(family: str, ablation: Path) -> str:
    """A study run under its protocol (its files in ``ablation``): per variant, the mean over its students of each
    task's test score, the suite's skill above chance and the held-out masked LM, beside the teacher and the
    bag-of-words baseline fitted on the same train split; then the protocol's comparisons as the report decided
    them (confirmatory, Holm) and any added after the runs (exploratory). ``--check`` decides them again from the
    suite's predictions (:func:`studies_as_fixed`)."""
    from benchmarks.quality.ablation_report import study_lines
    from benchmarks.quality.protocol import variant_of
    from trainer.evaluation.suite import BAG_OF_WORDS

    report, suite = load(ablation / "ablation.json"), load(ablation / f"suite-{family}.json")
    masked = load(ablation / f"mlm-{family}.json")
    scored = {run_name(m["model"]): m for m in masked["models"]} | {"teacher": masked["teacher"]}
    described_as = variants(ablation)  # run -> what it is
    groups: dict[str, list[tuple[str, dict]]] = {}
    for index, model in enumerate(suite["models"]):
        run = "teacher" if index == 0 else run_name(model["model"])
        group = run if run == "teacher" or model["model"] == BAG_OF_WORDS else variant_of(run, family)
        groups.setdefault(group, []).append((run, model))
    tasks = list(suite["tasks"])
    rows = [
        "| model | students | " + " | ".join(TASK_LABELS.get(t, t) for t in tasks) + " | suite average "
        "| skill above chance | masked-LM accuracy | perplexity |",
        "|---|---:|" + "---:|" * (len(tasks) + 4),
    ]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    for group, members in groups.items():
        models = [model for _, model in members]
        label = {"teacher": "teacher", BAG_OF_WORDS: BAG_OF_WORDS}.get(group) or described_as[f"{family}-{group}"]
        mlm = [scored[run] for run, _ in members if run in scored]
        cells = [f"{mean([m['tasks'][t]['mean'] for m in models]):.3f}" for t in tasks]
        cells += [f"{mean([m['average'] for m in models]):.3f}", f"{mean([m['skill'] for m in models]):+.3f}"]
        if mlm:
            cells += [f"{mean([m['mlm_accuracy'] for m in mlm]):.3f}", f"{mean([m['perplexity'] for m in mlm]):,.1f}"]
        else:  # bag-of-words has no masked LM
            cells += ["-", "-"]
        students = str(len(members)) if group not in ("teacher", BAG_OF_WORDS) else "-"
        rows.append(f"| {label} | {students} | " + " | ".join(cells) + " |")
    config = suite["config"]
    rates = config.get("lrs") or [config["lr"]]
    rate = (
        f"at the one rate {rates[0]:g} the protocol fixed (nothing picked)"
        if len(rates) == 1
        else f"each task at the rate of {rates} best on dev"
    )
    rows += [
        "",
        *study_lines(report["study"]),
        "",
        f"{FAMILIES[family]}. Suite: {config['train_size']} training, {config['dev_size']} dev and "
        f"{config['valid_size']} test examples a task, fine-tuning seeds {config['seeds']} for every model, {rate}; a "
        "variant's row is the mean over its students (distillation seeds), its interval drawn over students, then "
        f"fine-tuning seeds, then test examples. Masked LM: {masked['config']['max_batches']} held-out batches of "
        f"{masked['config']['batch_size']} on {masked['device']}. From `{ablation}/` (its README says what ran).",
    ]
    return "\n".join(rows)


# What each task asks: prose, not figures (the labels come from the task file).
TASK_INPUTS = {
    "debian-section": "a package's description → its archive section",
    "debian-size": "a package's description → log10 of its installed size (KiB)",
    "wordnet-supersense": "a noun sense's definition → the WordNet lexicographer file it is filed in",
}
METRIC_NAMES = {"accuracy": "accuracy", "pearson": "Pearson r"}


def suite_tasks_table() -> str:
    """The evaluation suite's tasks: what each asks, its source and metric from the task file with the
    bag-of-words baseline fitted on all its training examples; chance and the bag-of-words baseline fitted on
    the first 500, on the same test examples, from the suite-separation run (its second model)."""
    tasks = load(TASKS)["tasks"]
    report = load(SEPARATION)["report"]
    chance, bow = report["tasks"], report["models"][1]
    train = report["config"]["train_size"]
    rows = [
        f"| task | input → label | source | metric | majority / chance | BoW, all train | BoW, {train} train |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for name, task in tasks.items():
        labels = task.get("labels")
        described = TASK_INPUTS.get(name, "")
        if labels:
            described += f" ({len(labels)}: {', '.join(labels)})"
        metric = task["metric"]
        chance_cell = f"{chance[name]['chance']:.3f}" if name in chance else "-"
        small = f"{bow['tasks'][name]['mean']:.3f}" if name in bow["tasks"] else "-"
        rows.append(
            f"| `{name}` | {described} | {task['source']} | {METRIC_NAMES.get(metric, metric)} | {chance_cell} "
            f"| {task['bow_baseline'][metric]:.3f} | {small} |"
        )
    whole = all(entry["test_size"] == tasks[name]["validation_size"] for name, entry in chance.items() if name in tasks)
    tested = "the whole validation split" if whole else "the first examples of the validation split"
    sizes = ", ".join(f"`{name}` {entry['test_size']:,}" for name, entry in chance.items())
    rows += [
        "",
        f"From `{TASKS}` (source, metric, labels; BoW fitted on all the training examples) and `{SEPARATION}` "
        f"(chance; BoW fitted on the first {train}). Every figure is on {tested} ({sizes} examples).",
    ]
    return "\n".join(rows)


def demo_line() -> str:
    path = REPO / DEMO_TIME
    if not path.exists():
        return "not measured yet"
    runs = json.loads(path.read_text(encoding="utf-8"))["runs"]
    low, high = min(r["seconds"] for r in runs), max(r["seconds"] for r in runs)
    return f"{minutes(low)} to {minutes(high)} ({len(runs)} runs)"


def readme_table() -> str:
    throughput = {c["name"]: c for c in load(THROUGHPUT)["cases"]}
    head = throughput[HEADLINE]
    best = max((c for c in throughput.values() if c["rc"] == 0), key=lambda c: c["tokens_per_s"] or 0)
    compiled = ", compiled" if "compile=true" in best["overrides"] else ""
    demo = json.loads((REPO / DEMO_TIME).read_text()) if (REPO / DEMO_TIME).exists() else None
    rows = [
        "| question | current answer | from |",
        "|---|---|---|",
        f"| how fast, `distilbert-base` on one H200 (512 tokens, 4096-sequence batches) | {head['tokens_per_s']:,.0f} "
        f"tokens/s, {head['mfu']:.1%} MFU, {head['max_memory_gib']:.1f} GiB; best case {best['tokens_per_s']:,.0f} "
        f"({best['mfu']:.1%}, micro-batch {best['micro']}{compiled}) "
        f"| `{THROUGHPUT}` |",
    ]
    rows += [cpu_study_row(), separation_row(), task_distill_row()]
    if demo is not None:
        cpus, setup = demo["machine"]["cpus"], demo.get("setup")
        setup_note = f"; `make setup` first: {minutes(setup['seconds'])} (downloads included)" if setup else ""
        rows.append(
            f"| how long `make demo` takes | {demo_line()} after setup, on {cpus} CPUs{setup_note} | `{DEMO_TIME}` |"
        )
    return "\n".join(rows)


def cpu_study_row() -> str:
    """The MiniLM family's study at CPU scale: the protocol's comparisons with their Holm-decided verdicts."""
    report = load(CPU_STUDY / "ablation.json")
    tokens = {row["name"]: row["tokens"] for row in report["rows"]}
    study = report["study"]
    fixed, level = study["protocol"], study["protocol"]["decision"]["level"]

    def decided(c: dict) -> str:
        first, second = f"({c['first']})", f"({c['second']})"
        return f"{first} - {second} {described(c, first, second)} ({c['kind']})"

    answer = "; ".join(decided(c) for c in study["comparisons"])
    return (
        f"| does the distillation beat the copied layers (f)? (a 3-layer student of {FAMILIES['minilm']}, CPU scale: "
        f"(a) on {tokens['minilm-a'] / 1e6:.2f}M tokens, (a5x) on {tokens['minilm-a5x'] / 1e6:.2f}M; "
        f"{len(fixed['distillation_seeds'])} students a trained variant, fine-tuning seeds {fixed['suite']['seeds']}; "
        f"the study `{study['path']}`, fixed before its runs) | suite skill above chance: {answer}, the confirmatory "
        f"ones decided together by Holm's procedure at {level:.0%} | `{CPU_STUDY}/` |"
    )


def separation_row() -> str:
    report = load(SEPARATION)["report"]
    [difference] = report["differences"]
    return (
        f"| does the evaluation suite tell a pretrained encoder from word counts? (all-MiniLM-L6-v2 against "
        f"bag-of-words on the same {report['config']['train_size']} training examples a task) | skill above chance, "
        f"MiniLM - bag-of-words {described(difference, 'MiniLM', 'bag-of-words')} (95 % interval, test split) "
        f"| `{SEPARATION}` |"
    )


def separation_table() -> str:
    """docs/quality.md's table of MiniLM against bag-of-words on the same splits (`suite_separation.py`, retired)."""
    result = load(SEPARATION)
    report = result["report"]
    encoder, bow = report["models"]
    [difference] = report["differences"]
    rows = [
        "| task (metric) | chance | MiniLM | bag-of-words, same train | MiniLM - bag-of-words [95 % interval] |",
        "|---|---:|---:|---:|---|",
    ]
    for name, task in report["tasks"].items():
        by_task = described(difference["by_task"][name], "MiniLM", "bag-of-words")
        rows.append(
            f"| {name} ({task['metric']}) | {task['chance']:.3f} | {encoder['tasks'][name]['mean']:.3f} | "
            f"{bow['tasks'][name]['mean']:.3f} | {by_task} |"
        )
    low, high = difference["ci95"]
    verdict = difference["verdict"].replace("first", "MiniLM").replace("second", "bag-of-words")
    rows.append(
        f"| **average above chance** | | {encoder['skill']:+.3f} | {bow['skill']:+.3f} | "
        f"**{difference['difference']:+.3f} [{low:+.3f}, {high:+.3f}]**: {verdict} |"
    )
    config = report["config"]
    cpus = f"{result['machine']['cpus']} CPUs"
    fewer = [
        f"{name}: {task['test_size']}"
        for name, task in report["tasks"].items()
        if task["test_size"] < config["valid_size"]
    ]
    tests = f"{config['valid_size']} test" + (f" ({', '.join(fewer)})" if fewer else "")
    rows += [
        "",
        f"Test scores. {config['train_size']} train, {config['dev_size']} dev and {tests} "
        f"examples a task; MiniLM fine-tuned {config['epochs']} epochs, seeds {config['seeds']} (mean), each task at "
        f"the rate of {config['lrs']} best on dev; intervals: paired bootstrap over test examples and seeds, "
        f"{config['bootstrap']} resamples. {made_by(result, cpus)}.",
        "",
        f"The rate each task took, chosen on dev (MiniLM; at each rate of {config['lrs']}: dev / test): "
        + "; ".join(rate_line(name, entry) for name, entry in encoder["tasks"].items())
        + f". MiniLM's fine-tunes took {encoder['wall_s'] / 60:.0f} minutes on {cpus}.",
    ]
    return "\n".join(rows)


def rate_line(task: str, entry: dict) -> str:
    """``debian-size 0.0001 (0.0001: 0.540 / 0.541, 0.0005: 0.524 / 0.488)``: the rate dev chose, and what
    each rate scored on dev and on test (test shown, never used to choose)."""
    each = ", ".join(f"{lr}: {scores['dev']:.3f} / {scores['test']:.3f}" for lr, scores in entry["by_lr"].items())
    return f"{task} {entry['lr']:g} ({each})"


def task_distill_row() -> str:
    """The task-distillation study: the protocol's comparisons with their Holm-decided verdicts, or, for a record
    made before the protocol, its two headline differences labelled so."""
    result = load(TASK_DISTILL)
    if "study" in result:
        found, level = result["study"]["comparisons"], result["study"]["protocol"]["decision"]["level"]
        answer = "; ".join(
            f"{c['first']} - {c['second']} {described(c, c['first'], c['second'])} ({c['kind']})" for c in found
        )
        answer = f"{answer} (confirmatory ones decided together by Holm's procedure at {level:.0%})"
    else:
        by_pair = {(d["first"], d["second"]): d for d in result["differences"]}
        alone = by_pair[("task-distilled", "fine-tuned alone")]
        control = by_pair[("task-distilled + augmentation", "fine-tuned on the augmented data")]
        answer = (
            f"distilled - fine-tuned alone {described(alone, 'distilled', 'fine-tuned')}; with augmentation - "
            f"fine-tuned on the same augmented data {described(control, 'distilled', 'fine-tuned')} "
            "(before the protocol; not confirmatory)"
        )
    return (
        f"| does task distillation pay? (TinyBERT's second stage, a 2-layer MiniLM student, `{result['task']}`, "
        f"{result['sizes']['train']} training examples, seeds {result['config']['seeds']}) | test {result['metric']}, "
        f"{answer} | `{TASK_DISTILL}` |"
    )


def suite_time_table() -> str:
    result = load(SUITE_TIME)
    cpus = f"{result['machine']['cpus']} CPUs"
    return f"{suite_time.table(result)}\n{made_by(result, cpus, file=SUITE_TIME)}."


def fault_words(fault: dict | None) -> str:
    if fault is None:
        return "-"
    when = f"at {fault['at_s']:g} s"
    if "after_versions" in fault:
        when += f", once version {fault['after_versions']} was in"
    if fault["kind"] == "pg-restart":
        return f"`pg_ctl restart -m fast` {when} (over in {fault['down_s']:.1f} s)"
    return f"S3 unreachable for {fault['down_s']:.0f} s {when}"


# registry_load.py's --producer (retired: benchmarks/README.md), as the table says it
PRODUCERS = {"registrar": "registrar's workers", "direct": "direct (a process each, no export)"}


def registry_load_table() -> str:
    """docs/mlflow-server.md's load table: per load, what was registered, lost or duplicated, the failed attempts
    (retried) and how many of them SQLite refused as locked, the rate and the latency."""
    result = load(REGISTRY_LOAD)
    rows = [
        "| backend | runs registering through | fault mid-load | concurrent runs | checkpoint every (s) | versions "
        "| registered | lost | duplicated | failed attempts (retried) | of which the database refused (503) "
        "| of which request timeouts | 'database is locked' in the server's log (lines) | registrations/s "
        "| latency p50 (s) | p95 (s) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["loads"]:
        lost, duplicated = lost_and_duplicated(r)
        failed = r.get("failed_by_cause", {})
        rows.append(
            f"| {backend_words(r)} | {PRODUCERS[r.get('producer', 'registrar')]} | {fault_words(r.get('fault'))} | "
            f"{r['producers']} | {r.get('interval_s', result['interval_s']):g} | {r['expected']} | "
            f"{r['registered']} | {lost} | {duplicated} | {r['failed_attempts']} | "
            f"{failed.get('database refused', 0)} | {failed.get('request timeout', 0)} | "
            f"{r.get('server_log_locked_lines', '-')} | "
            f"{r['registrations_per_s']:.2f} | {latency(r, 'p50')} | {latency(r, 'p95')} |"
        )
    machine = result["machine"]
    measured = [part["machine"] for part in result.get("parts", [])] or [machine]  # a merged file: each part's
    averages = " and ".join(f"{m['load_average_at_end'][1]:.0f}" for m in measured)
    busy = f"load average {averages} over the last 5 minutes (shared with other jobs)"
    setup = f"{result['server_workers']} server workers"
    where = "the server, the stores and the runs on one machine"
    rows += ["", made_by(result, f"{machine['cpus']} CPUs ({machine['cpu']})", busy, setup, where)]
    if "parts" in result:  # merged: each backend's own measurement
        rows[-1] += "; measured by " + " and ".join(f"`{part['command']}`" for part in result["parts"])
    return "\n".join(rows)


def latency(measured: dict, percentile: str) -> str:
    return f"{measured['latency_s'][percentile]:.1f}" if measured["latency_s"] else "-"  # none registered: no latency


def backend_words(measured: dict) -> str:
    """The load's backend, and whether its server checked passwords (a load measured before --auth did)."""
    return measured["backend"] + ("" if measured.get("auth", "basic") == "basic" else ", no auth")


def lost_and_duplicated(measured: dict) -> tuple[int, int]:
    """A load's lost and duplicated steps (a load measured before they were counted apart found neither)."""
    if "lost" in measured:
        return measured["lost"], measured["duplicated"]
    assert not measured["problems"], "a load with problems records its lost and duplicated steps"
    return 0, 0


def registry_faults_table() -> str:
    """docs/mlflow-server.md's "Faults under load": each fault's load, its checks and what training saw."""
    result = load(REGISTRY_FAULTS)
    rows = [
        "| fault mid-load | concurrent runs | versions | registered | lost, duplicated, misordered or untagged "
        "| failed attempts (retried) | training time inside the registrar (max of runs) | run status while training "
        "/ at its end | latency p50 / p95 (s) | end of training's wait for the queue, max (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in result["loads"]:
        runs = r["runs"]
        fault = fault_words(r["fault"])
        if r["fault"]["at_s"] < min(run["training_s"] for run in runs):  # else in the end's wait for the queue
            fault += ", while every run trained"
        during = "/".join(sorted({s for run in runs for s in run["status_while_training"]})) or "-"
        ended = "/".join(sorted({run["status_at_end"] for run in runs}))
        latencies, end_wait = r["latency_s"], max(run["end_wait_s"] for run in runs)
        rows.append(
            f"| {fault} | {r['producers']} | {r['expected']} | {r['registered']} | "
            f"{len(r['problems'])} | {r['failed_attempts']} | {r['step_time_share_max']:.4%} | {during} / {ended} | "
            f"{latencies['p50']:.0f} / {latencies['p95']:.0f} | {end_wait:.0f} |"
        )
    machine = result["machine"]
    busy = f"load average {machine['load_average_at_end'][1]:.0f} over the last 5 minutes (shared with other jobs)"
    setup = (
        f"PostgreSQL, S3 (moto) and basic auth, {result['server_workers']} server workers, a checkpoint every "
        f"{result['interval_s']:g} s per run, the server, the stores and the runs on one machine"
    )
    rows += ["", made_by(result, f"{machine['cpus']} CPUs ({machine['cpu']})", busy, setup)]
    return "\n".join(rows)


def demo_time_table() -> str:
    return demo_time.table(load(DEMO_TIME)) if (REPO / DEMO_TIME).exists() else "Not measured yet."


PAGES = {
    "README.md": {"results": readme_table},
    "docs/mlflow-server.md": {"registry-load": registry_load_table, "registry-faults": registry_faults_table},
    "docs/benchmarks.md": {"speed": speed_table, "demo-time": demo_time_table, "suite-time": suite_time_table},
    "docs/log/quality.md": {  # the tables made before the protocols: the record, still generated
        "ablation-bert": lambda: family_table("bert"),
        "ablation-minilm": lambda: family_table("minilm"),
        "ablation-cpu-minilm": lambda: family_table("minilm", CPU_ABLATION),
    },
    "docs/quality.md": {
        "study-minilm-cpu": lambda: study_table("minilm", CPU_STUDY),
        "suite-separation": separation_table,
        "suite-tasks": suite_tasks_table,
    },
}


def suite_reports(root: Path = REPO / "docs") -> dict[Path, dict | None]:
    """Every committed evaluation-suite result under ``root``: the report when it carries its per-example
    predictions, None for one from before they were kept (it cannot be checked)."""
    found: dict[Path, dict | None] = {}
    for path in sorted(root.rglob("*.json")):
        report = json.loads(path.read_text(encoding="utf-8"))
        models = report.get("models") if isinstance(report, dict) else None
        if isinstance(models, list) and "config" in report and all("tasks" in m for m in models):
            carries = all("predictions" in t for m in models for t in m["tasks"].values())
            found[path] = report if carries else None
    return found


def recomputed_figures(root: Path = REPO / "docs") -> list[str]:
    """What differs between each checkable suite result and its figures computed again from its predictions
    (``trainer.evaluation.suite.mismatches``): an edited number, caption-free."""
    from trainer.evaluation.suite import mismatches

    problems, unchecked = [], []
    for path, report in suite_reports(root).items():
        if report is None:
            unchecked.append(path.relative_to(root.parent))
        else:
            problems += [f"{path.relative_to(root.parent)}: {line}" for line in mismatches(report)]
    if unchecked:
        print(f"{len(unchecked)} suite result(s) carry no predictions and are not recomputed", file=sys.stderr)
    return problems


def commit_of(path: Path, latest: bool = False) -> str:
    """The commit that added ``path`` (``latest``: that last changed it) in the git repository holding it."""
    import subprocess

    log = ["git", "log", *([] if latest else ["--diff-filter=A"]), "--format=%H", "-1", "--", path.name]
    return subprocess.run(log, cwd=path.parent, capture_output=True, text=True).stdout.strip()


def is_ancestor(first: str, then: str, where: Path) -> bool:
    """Whether commit ``first`` is ``then`` or an ancestor of it (in the git repository at ``where``)."""
    import subprocess

    ancestor = ["git", "merge-base", "--is-ancestor", first, then]
    return bool(first and then) and subprocess.run(ancestor, cwd=where, capture_output=True).returncode == 0


def committed_before(first: Path, then: Path, latest: bool = False) -> bool:
    """Whether the commit that added ``first`` is an earlier ancestor of the one that added ``then`` (``latest``:
    that last changed it, for a result rewritten in place; both in the git repository holding them)."""
    a, b = commit_of(first), commit_of(then, latest)
    return a != b and is_ancestor(a, b, then.parent)


def same(kept: Any, again: Any) -> bool:
    """Equal, numbers to 1e-9 (what a JSON round trip keeps), element by element in lists."""
    if isinstance(kept, list):
        return len(kept) == len(again) and all(same(a, b) for a, b in zip(kept, again, strict=True))
    if isinstance(kept, float):
        return abs(kept - again) <= 1e-9
    return kept == again


def fixed_first(path: Path, found: dict[str, Any], root: Path, ran: str | None = None) -> tuple[bool, list[str]]:
    """Whether a study's protocol (``found``: its ``path`` from the repository's root and its ``protocol`` as
    recorded) is still what its result recorded, and what is wrong: missing or changed since the runs, or not
    committed before ``path``. With ``ran`` (the commit a result rewritten in place records it ran at): that
    commit must hold the protocol, and the result's latest version must come after it."""
    import yaml

    where, fixed_path = path.relative_to(root.parent), root.parent / found["path"]
    if not fixed_path.is_file() or yaml.safe_load(fixed_path.read_text(encoding="utf-8")) != found["protocol"]:
        return False, [f"{where}: its protocol {found['path']} is missing or changed since the runs"]
    problems = []
    if not committed_before(fixed_path, path, latest=ran is not None):
        problems.append(f"{where}: its protocol {found['path']} was not committed before it")
    if ran is not None and not is_ancestor(commit_of(fixed_path), ran, path.parent):
        problems.append(f"{where}: it ran at commit {ran[:10]}, which does not hold its protocol {found['path']}")
    return True, problems


def differing(where: Path, kept: list[dict[str, Any]], again: list[dict[str, Any]]) -> list[str]:
    """Each field of a study's comparisons that differs from the same comparisons decided again."""
    problems = []
    for k, a in zip(kept, again, strict=True):
        for key in ("first", "second", "kind", "students", "difference", "ci95", "p", "verdict"):
            if not same(k[key], a[key]):
                problems.append(f"{where}: ({k['first']}) - ({k['second']}) {key}: {k[key]} != {a[key]}")
    return problems


def studies_as_fixed(root: Path = REPO / "docs") -> list[str]:
    """What is wrong with each committed study (an ablation report with a ``study``): its protocol must have
    been committed before its results, unchanged since, and its comparisons must be what the suite's
    predictions give (``benchmarks/quality/protocol.py``)."""
    from benchmarks.quality import protocol

    problems = []
    for path in sorted(root.rglob("ablation.json")):
        report = json.loads(path.read_text(encoding="utf-8"))
        if "study" not in report:
            continue
        found, where = report["study"], path.relative_to(root.parent)
        unchanged, wrong = fixed_first(path, found, root)
        problems += wrong
        if not unchanged:
            continue
        suite = json.loads((path.parent / f"suite-{found['protocol']['family']}.json").read_text(encoding="utf-8"))
        added = [(c["first"], c["second"]) for c in found["comparisons"] if c["kind"] == "exploratory"]
        problems += differing(where, found["comparisons"], protocol.decide(found["protocol"], suite, added))
    return problems


def task_studies_as_fixed(root: Path = REPO / "docs") -> list[str]:
    """What is wrong with each committed task-distillation study (``task-distill*.json`` with a ``study``): its
    protocol committed before it and unchanged since, its chance level, each row's score at each seed (to the
    fine-tuning's float32) and mean, and its comparisons what its per-example predictions give
    (``protocol.decide_task_study``). A record without predictions, made before the protocol, is not
    confirmatory and is only counted."""
    from benchmarks.quality import protocol

    problems, before = [], []
    for path in sorted(root.rglob("task-distill*.json")):
        report = json.loads(path.read_text(encoding="utf-8"))
        where = path.relative_to(root.parent)
        if "study" not in report:
            before.append(where)
            continue
        found = report["study"]
        unchanged, wrong = fixed_first(path, found, root, report["commit"])
        problems += wrong
        if not unchanged:
            continue
        rows = report["students"]
        again = protocol.decide_task_study(
            found["protocol"], {label: row["predictions"] for label, row in rows.items()}
        )
        if not same(report["chance"], again["chance"]):
            problems.append(f"{where}: chance: {report['chance']} != {again['chance']}")
        for label, scores in again["scores"].items():
            kept = [rows[label]["seeds"][str(seed)] for seed in found["protocol"]["seeds"]]
            for value, score in zip([*kept, rows[label]["mean"]], [*scores, sum(scores) / len(scores)], strict=True):
                if abs(value - score) > 1e-4:  # the fine-tuning's metric, in float32
                    problems.append(f"{where}: {label} scores: {kept} (mean {rows[label]['mean']}) != {scores}")
                    break
        problems += differing(where, found["comparisons"], again["comparisons"])
    if before:
        print(f"{len(before)} task-distillation result(s) from before the protocol, not confirmatory", file=sys.stderr)
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if a table is stale or a suite result's figures")
    parser.add_argument("--root", type=Path, default=REPO / "docs", help=argparse.SUPPRESS)  # the tests' results
    args = parser.parse_args()
    checked = (recomputed_figures, studies_as_fixed, task_studies_as_fixed)
    if args.check and (problems := [problem for check in checked for problem in check(args.root)]):
        print("suite results differ from their predictions:\n" + "\n".join(problems), file=sys.stderr)
        return 1
    stale = []
    for page, tables in PAGES.items():
        path = REPO / page
        before = path.read_text(encoding="utf-8")
        for marker, render in tables.items():
            render_between_markers(path, marker, render())
        if args.check and path.read_text(encoding="utf-8") != before:
            path.write_text(before, encoding="utf-8")
            stale.append(page)
    if stale:
        print(f"stale tables in {', '.join(stale)}: run python benchmarks/results.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
