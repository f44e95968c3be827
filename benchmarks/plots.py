"""The docs' figures, drawn from committed result files only, as PNG files in docs/img/.

    python benchmarks/plots.py [--out docs/img]

Reads ``docs/gpu-campaign/throughput.json`` (throughput and MFU against micro-batch size) and the latest
``docs/gpu-ablation/*/`` directory (each family's held-out masked-LM figures and fine-tuned suite, with the
seeds' range), and prints, for each figure, the Markdown line that embeds it from docs/ and its caption (also
drawn under the figure). A figure whose data no committed file holds is skipped and the script says why:
loss curves need the per-step losses the GPU ablation's reports carry from its next run on.
The output is byte-for-byte the same on every
run (Agg, fixed sizes and dpi, matplotlib's own fonts, no timestamp); tests/test_benchmark_plots.py holds
docs/img/ to what this script draws now.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import textwrap
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display, the same raster everywhere
import matplotlib.font_manager as font_manager
import matplotlib.pyplot as plt

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
DPI = 110
CAPTION_PT = 7.5
TEACHER_COLOUR, STUDENT_COLOUR = "0.35", "tab:blue"


@dataclass
class Figure:
    name: str  # the PNG's file name
    alt: str  # the Markdown image's alt text
    caption: str  # what the picture shows and where it came from; also drawn under it


def use_matplotlib_fonts() -> None:
    """Only the fonts matplotlib ships, so that a system's own DejaVu (another version) never draws the text;
    and fixed sizes, whatever a matplotlibrc says."""
    mpl_fonts = Path(matplotlib.get_data_path()) / "fonts"
    manager = font_manager.fontManager
    manager.ttflist = [font for font in manager.ttflist if Path(font.fname).is_relative_to(mpl_fonts)]
    matplotlib.rcdefaults()  # not a user's matplotlibrc
    matplotlib.rcParams.update(
        {
            "font.family": "DejaVu Sans",
            "font.size": 9,
            "axes.titlesize": 9.5,
            "figure.titlesize": 11,
            "legend.fontsize": 8,
            "savefig.dpi": DPI,
        }
    )


def relative(path: Path) -> str:
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)


def new_figure(width: float, height: float, title: str, **subplots) -> tuple[plt.Figure, object]:
    fig, axes = plt.subplots(figsize=(width, height), layout="constrained", **subplots)
    fig.suptitle(title, fontweight="bold")
    return fig, axes


def save(fig: plt.Figure, out: Path, figure: Figure) -> Figure:
    """The caption under the plots, then the PNG without the metadata that changes (matplotlib's version)."""
    width = fig.get_size_inches()[0]
    lines = textwrap.wrap(figure.caption, width=int(width * 72 / (CAPTION_PT * 0.52)))
    # supxlabel: the constrained layout keeps room for it under everything else
    fig.supxlabel("\n".join(lines), x=0.008, ha="left", fontsize=CAPTION_PT, color="0.25", linespacing=1.3)
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / figure.name, dpi=DPI, metadata={"Software": None})
    plt.close(fig)
    return figure


# --- 1. throughput against micro-batch size (the GPU campaign) ---------------------------------------------


def series_of(case: dict) -> str | None:
    """The line a case belongs on: preset, sequence length, compiled or not, global batch. ``None``: the
    profiled run, whose rate is the profiler's. Cases with other overrides share one line-less series."""
    overrides = case["overrides"]
    if any(o.startswith("profile.") for o in overrides):
        return None
    label = f"{case['preset']}, seq {case['seq']}"
    if overrides == ["compile=true"]:
        label += ", compiled"
    elif overrides:
        return f"{label}, other overrides (one run each)"
    if case.get("global_batch"):
        label += f", global batch {case['global_batch']} (accumulated)"
    return label


def throughput_figure(source: Path, out: Path) -> Figure:
    result = json.loads(source.read_text(encoding="utf-8"))
    cases = [c for c in result["cases"] if c.get("rc") == 0 and c.get("tokens_per_s")]
    series: dict[str, list[dict]] = {}
    for case in cases:
        key = series_of(case)
        if key is not None:
            series.setdefault(key, []).append(case)
    series = dict(sorted(series.items(), key=lambda kv: "other overrides" in kv[0]))  # the one-run cases last
    left_out = [c["name"] for c in cases if series_of(c) is None]
    peak_tflops = result["peak_flops"] / 1e12

    fig, (rate_ax, mfu_ax) = new_figure(
        13, 5, f"Training throughput against micro-batch size, one {result['device']}", ncols=2
    )
    markers = "osD^vP*Xh<>"
    for index, (label, members) in enumerate(series.items()):
        one_each = "other overrides" in label
        colour = "0.55" if one_each else f"C{index}"
        marker = "x" if one_each else markers[index % len(markers)]
        for ax, field, scale in ((rate_ax, "tokens_per_s", 1e-3), (mfu_ax, "mfu", 100)):
            xs = [c["micro"] for c in members]
            ys = [c[field] * scale for c in members]
            ax.scatter(xs, ys, color=colour, marker=marker, s=30, zorder=3, label=label)
            if not one_each and len(set(xs)) > 1:
                micros = sorted(set(xs))
                means = [statistics.fmean(y for x, y in zip(xs, ys, strict=True) if x == m) for m in micros]
                ax.plot(micros, means, color=colour, linewidth=1.3, zorder=2)
    micros = sorted({c["micro"] for c in cases})
    for ax in (rate_ax, mfu_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(micros, [str(m) for m in micros])
        ax.minorticks_off()
        ax.set_xlabel("micro-batch size (sequences per GPU per micro-step)")
        ax.set_ylim(bottom=0)
        ax.grid(True, color="0.9", zorder=0)
    rate_ax.set_ylabel("throughput (thousand tokens/s)")
    rate_ax.set_title("throughput over the log intervals after the first")
    mfu_ax.set_ylabel(f"MFU (% of {peak_tflops:g} TFLOP/s dense bf16 peak)")
    mfu_ax.set_title("model FLOPs utilisation (each preset's own model FLOPs)")
    fig.legend(*rate_ax.get_legend_handles_labels(), loc="outside right upper", frameon=False)

    spreads = [c["spread"] for c in cases if c.get("spread") is not None]
    twice = sorted({c["micro"] for m in series.values() for c in m if sum(d["micro"] == c["micro"] for d in m) > 1})
    caption = (
        f"Source: {relative(source)} ({result['device']}; {result['versions']}; the file records no date). "
        f"Each point is one run of the real engine and loader; a line joins one configuration's sizes"
        + (
            f", through the mean where a size ran more than once (micro-batch {', '.join(map(str, twice))})"
            if twice
            else ""
        )
        + ". No error bars: the file keeps only each run's spread between log intervals (fastest less slowest over "
        f"the rate), recorded for {len(spreads)} of {len(cases)} runs, {min(spreads):.0%} to {max(spreads):.0%}. "
        + (f"Left out: {', '.join(left_out)} (profiler on)." if left_out else "")
    )
    return save(fig, out, Figure("gpu-throughput.png", "Throughput and MFU against micro-batch size", caption))


# --- 2. the ablation: masked-LM figures and the suite, per family ------------------------------------------


def latest_ablation(docs: Path) -> Path | None:
    """The newest ``docs/gpu-ablation/DATE-MACHINE`` directory that holds a family's mlm- or suite- file."""
    runs = [
        d
        for d in sorted((docs / "gpu-ablation").glob("*"))
        if list(d.glob("mlm-*.json")) + list(d.glob("suite-*.json"))
    ]
    return runs[-1] if runs else None


def machine_and_date(run: Path) -> tuple[str, str]:
    """The device and date that the run's ``versions.txt`` recorded (its first line is ``date``'s output)."""
    versions = run / "versions.txt"
    if not versions.is_file():
        return "device not recorded", "date not recorded"
    lines = versions.read_text(encoding="utf-8").splitlines()
    device = next(
        (line.split(":", 1)[1].strip() for line in lines if line.startswith("device:")), "device not recorded"
    )
    try:
        date = datetime.strptime(lines[0].strip(), "%a %b %d %I:%M:%S %p %Z %Y").date().isoformat()
    except (IndexError, ValueError):
        date = "date not recorded"
    return device, date


def variants(run: Path) -> dict[str, str]:
    """Each training step's variant as ``runs.tsv`` names it: ``bert-c`` -> ``(c) without L_ce``."""
    table = run / "runs.tsv"
    if not table.is_file():
        return {}
    with table.open(encoding="utf-8", newline="") as rows:
        return {row["name"]: row["variant"] for row in csv.DictReader(rows, delimiter="\t")}


def row_label(model: str, names: dict[str, str]) -> str:
    """``.../bert-c/student`` -> ``bert-c: (c) without L_ce``; a teacher not trained here says so."""
    path = Path(model)
    key = path.parent.name if path.name == "student" else path.name
    variant = names.get(key, "pretrained teacher (not trained here)")
    return textwrap.fill(variant if variant.startswith(key) else f"{key}: {variant}", width=34)


def bars(ax, labels: list[str], values: list[float | None], teacher_rows: int, fmt: str) -> None:
    """Horizontal bars, the first model on top, each with its value; a missing figure reads n/a."""
    positions = range(len(labels))
    colours = [TEACHER_COLOUR if i < teacher_rows else STUDENT_COLOUR for i in positions]
    ax.barh(positions, [v or 0.0 for v in values], color=colours, height=0.65, zorder=2)
    high = max(abs(v) for v in values if v is not None)
    for i, value in zip(positions, values, strict=True):
        text = "n/a" if value is None else format(value, fmt)
        ax.text(max(value or 0.0, 0.0) + high * 0.02, i, text, va="center", fontsize=7.5)
    ax.set_xlim(min(0.0, *(v for v in values if v is not None)) * 1.1, high * 1.22)
    ax.axvline(0, color="0.3", linewidth=0.8)
    ax.set_yticks(list(positions), labels)
    ax.grid(True, axis="x", color="0.9", zorder=0)


def mlm_figure(source: Path, out: Path, family: str, names: dict[str, str], machine: str, date: str) -> Figure:
    result = json.loads(source.read_text(encoding="utf-8"))
    rows = ([result["teacher"]] if result.get("teacher") else []) + result["models"]
    teacher_rows = len(rows) - len(result["models"])
    labels = [row_label(r["model"], names) for r in rows]
    panels = [
        ("mlm_loss", "masked-LM loss (nats per masked token)", "held-out MLM loss (lower is better)", ".2f"),
        ("mlm_accuracy", "accuracy (share of masked tokens)", "MLM accuracy", ".3f"),
        ("top1_agreement", "agreement (share of masked tokens)", "top-1 agreement with the teacher", ".3f"),
        ("hidden_cosine", "mean cosine of last hidden states", "cosine with the teacher (\u25c6 centred)", ".3f"),
    ]
    height = 1.6 + 0.42 * len(rows)
    fig, axes = new_figure(
        13,
        height,
        f"Held-out masked-LM figures of the {family} ablation, {machine}, {date}",
        ncols=len(panels),
        sharey=True,
    )
    for ax, (field, xlabel, title, fmt) in zip(axes, panels, strict=True):
        bars(ax, labels, [r.get(field) for r in rows], teacher_rows, fmt)
        if field == "hidden_cosine":  # the centred cosine beside it: the common direction taken out
            centred = [(r["centred_cosine"], i) for i, r in enumerate(rows) if r.get("centred_cosine") is not None]
            ax.scatter(*zip(*centred, strict=True), marker="D", s=16, color="black", zorder=4)
        ax.set_xlabel(xlabel)
        ax.set_title(title)
    axes[0].invert_yaxis()  # the axes share y: inverting each would undo it
    config = result.get("config", {})
    masked = {r.get("masked_tokens") for r in result["models"]}
    caption = (
        f"Source: {relative(source)} (trainer evaluate-mlm on {result.get('device', 'a device not recorded')}; "
        f"{machine} and {date} from {relative(source.parent / 'versions.txt')}; labels from runs.tsv). "
        f"Every model scored on the same held-out tokens: {config.get('max_batches')} batches of "
        f"{config.get('batch_size')} sequences masked once at seed {config.get('seed')}"
        + (f", {masked.pop():,} masked tokens" if len(masked) == 1 and None not in masked else "")
        + ". One masking, so no interval: the file has none. Grey: the family's teacher, which has no agreement "
        "or cosine with itself."
    )
    return save(fig, out, Figure(f"ablation-mlm-{family}.png", f"The {family} ablation's masked-LM figures", caption))


def suite_figure(source: Path, out: Path, family: str, names: dict[str, str], machine: str, date: str) -> Figure:
    result = json.loads(source.read_text(encoding="utf-8"))
    models, tasks, config = result["models"], result["tasks"], result.get("config", {})
    labels = [row_label(m["model"], names) for m in models]
    positions = list(range(len(models)))
    height = 1.9 + 0.42 * len(models)
    seeds = ", ".join(str(s) for s in config.get("seeds", []))
    fig, axes = new_figure(
        13,
        height,
        f"Evaluation suite of the {family} ablation ({config.get('method', 'finetune')}), {machine}, {date}",
        ncols=len(tasks) + 1,
        sharey=True,
    )
    teacher = models[0]
    for ax, (task, spec) in zip(axes, tasks.items(), strict=False):
        means = [m["tasks"][task]["mean"] for m in models]
        lows = [min(m["tasks"][task]["seeds"].values()) for m in models]
        highs = [max(m["tasks"][task]["seeds"].values()) for m in models]
        for i in positions:
            colour = TEACHER_COLOUR if i == 0 else STUDENT_COLOUR
            ax.errorbar(
                means[i],
                i,
                xerr=[[means[i] - lows[i]], [highs[i] - means[i]]],
                fmt="o",
                color=colour,
                markersize=5,
                capsize=3,
                zorder=3,
            )
        ax.axvline(teacher["tasks"][task]["mean"], color=TEACHER_COLOUR, linestyle="--", linewidth=0.9, zorder=1)
        if spec.get("bow_baseline") is not None:
            ax.axvline(spec["bow_baseline"], color="tab:red", linestyle=":", linewidth=1.2, zorder=1)
        ax.set_title(f"{task} ({spec['kind']})")
        unit = {"pearson": "Pearson r", "accuracy": "accuracy (fraction correct)"}.get(spec["metric"], spec["metric"])
        ax.set_xlabel(f"{unit}\non {spec['validation_size']} validation examples")
        ax.grid(True, axis="x", color="0.9", zorder=0)
    average_ax = axes[-1]
    averages = [m["average"] for m in models]
    average_ax.scatter(averages, positions, color=[TEACHER_COLOUR] + [STUDENT_COLOUR] * (len(models) - 1), zorder=3)
    for i, model in enumerate(models):
        average_ax.annotate(
            f"{model['share']:.1%}",
            (averages[i], i),
            xytext=(6, 0),
            textcoords="offset points",
            va="center",
            fontsize=7.5,
        )
    bow = [spec.get("bow_baseline") for spec in tasks.values()]
    if None not in bow:
        average_ax.axvline(statistics.fmean(bow), color="tab:red", linestyle=":", linewidth=1.2, zorder=1)
    average_ax.axvline(teacher["average"], color=TEACHER_COLOUR, linestyle="--", linewidth=0.9, zorder=1)
    drawn = [*averages, teacher["average"], *([statistics.fmean(bow)] if None not in bow else [])]
    low, high = min(drawn), max(drawn)
    average_ax.set_xlim(low - 0.08 * (high - low), high + 0.25 * (high - low))
    average_ax.set_title("average (share of the teacher's)")
    average_ax.set_xlabel("mean of the task scores\n(teacher's = 100 %)")
    average_ax.grid(True, axis="x", color="0.9", zorder=0)
    axes[0].set_yticks(positions, labels)
    axes[0].invert_yaxis()
    lrs = " and ".join(f"{lr:g}" for lr in config.get("lrs", [])) or f"{config.get('lr')}"
    caption = (
        f"Source: {relative(source)} (trainer evaluate-suite; {machine} and {date} from "
        f"{relative(source.parent / 'versions.txt')}; labels from runs.tsv). Dot: the mean over seeds {seeds}; "
        f"bar: their range (lowest to highest seed). Each task fine-tuned {config.get('epochs')} epochs on "
        f"{config.get('train_size')} examples at the better of lr {lrs}. Dashed grey: the teacher (top row); "
        "dotted red: the bag-of-words baseline (its mean on the average). The average has no interval in the file."
    )
    return save(fig, out, Figure(f"ablation-suite-{family}.png", f"The {family} ablation's evaluation suite", caption))


def ablation_figures(docs: Path, out: Path) -> tuple[list[Figure], list[str]]:
    run = latest_ablation(docs)
    if run is None:
        return [], ["the ablation's figures: no docs/gpu-ablation/*/ directory holds mlm-*.json or suite-*.json"]
    machine, date = machine_and_date(run)
    names = variants(run)
    figures = []
    for kind, draw in (("mlm", mlm_figure), ("suite", suite_figure)):
        for source in sorted(run.glob(f"{kind}-*.json")):
            family = source.stem.removeprefix(f"{kind}-")
            figures.append(draw(source, out, family, names, machine, date))
    return figures, []


# --- 3. loss curves -----------------------------------------------------------------------------------------


def loss_curve_figures(docs: Path, out: Path) -> tuple[list[Figure], list[str]]:
    """Each family's training loss against step, the recipe and its ablations on one axes, from the ``curve``
    of every row of the latest GPU ablation's ``ablation-FAMILY.json`` reports (benchmarks/quality/
    ablation_report.py carries each run's logged ``train/loss``). The terms' weights differ between variants,
    so the totals compare within a run's shape, not in level: what the figure shows is each run converging."""
    reports = sorted(
        path
        for path in (docs / "gpu-ablation").glob("*/ablation-*.json")
        if any(row.get("curve") for row in json.loads(path.read_text(encoding="utf-8"))["rows"])
    )
    if not reports:
        return [], ["loss curves (training loss against step): no docs/gpu-ablation/*/ablation-*.json has them yet"]
    run = reports[-1].parent
    machine, date = machine_and_date(run)
    figures = []
    for path in sorted(run.glob("ablation-*.json")):
        rows = [row for row in json.loads(path.read_text(encoding="utf-8"))["rows"] if row.get("curve")]
        if not rows:
            continue
        family = path.stem.removeprefix("ablation-")
        fig, ax = new_figure(7.5, 4.2, f"Training loss of the {family} ablation, {machine}, {date}")
        for row in rows:
            label = f"{row['name']}: {row['variant']}"
            ax.plot(row["curve"]["step"], row["curve"]["train/loss"], label=label, linewidth=1.2)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("train/loss (the run's weighted sum of its terms)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=7)
        caption = (
            f"Source: {relative(path)} (each run's train/loss at every logged step). Variants weigh different "
            "terms, so compare shapes, not levels."
        )
        figure = Figure(f"ablation-curves-{family}.png", f"The {family} ablation's training loss", caption)
        figures.append(save(fig, out, figure))
    return figures, []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Draw the docs' figures from committed result files.")
    parser.add_argument("--out", type=Path, default=DOCS / "img", help="where the PNG files go (default: docs/img)")
    args = parser.parse_args(argv)
    use_matplotlib_fonts()
    figures = [throughput_figure(DOCS / "gpu-campaign" / "throughput.json", args.out)]
    ablation, skipped = ablation_figures(DOCS, args.out)
    figures += ablation
    curves, no_curves = loss_curve_figures(DOCS, args.out)
    figures += curves
    skipped += no_curves
    for figure in figures:
        print(f"![{figure.alt}](img/{figure.name})\n  {figure.caption}\n")
    for reason in skipped:
        print(f"skipped: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
