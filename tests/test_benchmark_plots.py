"""benchmarks/plots.py: every figure drawn from the committed result files is a whole PNG, and docs/img/ holds
exactly what the script draws now, so a result file changed without its figures redrawn fails here.

The comparison is byte for byte: the script's output is deterministic for one matplotlib version (pinned in
pyproject.toml's test extra, as the figures were drawn with it).
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "docs" / "img"
EXPECTED = {
    "gpu-throughput.png",  # docs/gpu-campaign/throughput.json
    "ablation-mlm-bert.png",  # docs/gpu-ablation/<latest>/mlm-bert.json
    "ablation-mlm-minilm.png",
    "ablation-suite-bert.png",  # docs/gpu-ablation/<latest>/suite-bert.json
    "ablation-suite-minilm.png",
}
REDRAW = "python benchmarks/plots.py"


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a whole PNG: its signature, every chunk's CRC, IHDR first, image data, IEND last."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    chunks, offset = [], 8
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind, body = data[offset + 4 : offset + 8], data[offset + 8 : offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length : offset + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in a {kind!r} chunk"
        chunks.append((kind, body))
        offset += 12 + length
    kinds = [kind for kind, _ in chunks]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds, kinds
    assert b"tEXt" not in kinds and b"iTXt" not in kinds, "metadata that may change between runs"
    return struct.unpack(">II", chunks[0][1][:8])


def test_the_figures_are_whole_pngs_and_the_committed_ones_are_what_the_script_draws_now(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "plots.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    drawn = {path.name: path.read_bytes() for path in tmp_path.glob("*.png")}
    assert set(drawn) == EXPECTED
    for name, data in drawn.items():
        width, height = png_size(data)
        assert width >= 800 and height >= 300, f"{name}: {width} x {height}"
        assert f"](img/{name})" in run.stdout, f"{name}: no Markdown line printed for it"
    assert "skipped: loss curves" in run.stdout  # no per-step metrics are committed: said, not drawn

    committed = {path.name: path.read_bytes() for path in COMMITTED.glob("*.png")}
    assert set(committed) == set(drawn), f"docs/img/ does not hold the figures {REDRAW} draws: run it"
    stale = sorted(name for name in drawn if committed[name] != drawn[name])
    assert not stale, f"{', '.join(stale)} in docs/img/ no longer match what {REDRAW} draws: run it, commit them"


def test_loss_curves_are_drawn_from_the_ablation_reports_once_a_gpu_ablation_returns_them(tmp_path):
    """The next GPU ablation's reports carry each run's logged train/loss (ablation_report.loss_curve, read from
    the run's metrics.jsonl); each family gets one figure of every run's curve against step."""
    sys.path.insert(0, str(REPO))
    from benchmarks import plots
    from benchmarks.quality.ablation_report import loss_curve

    runs = tmp_path / "runs"
    for name, start in (("bert-a", 9.0), ("bert-e", 11.0), ("minilm-a", 7.0)):
        (runs / name).mkdir(parents=True)
        lines = [{"step": step, "train/loss": start / step, "train/lr": 1e-4} for step in range(1, 60, 10)]
        lines.insert(1, {"step": 5, "eval/loss": 3.0})  # an evaluation record: not on the training curve
        (runs / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    curve = loss_curve(runs / "bert-a")
    assert curve == {
        "step": [1, 11, 21, 31, 41, 51],
        "train/loss": [round(9.0 / s, 5) for s in (1, 11, 21, 31, 41, 51)],
    }
    assert loss_curve(runs / "bert-f") is None  # written untrained: no log
    ablation = tmp_path / "docs" / "gpu-ablation" / "2027-01-01-h200"
    ablation.mkdir(parents=True)
    for family, names in (("bert", ["bert-a", "bert-e", "bert-f"]), ("minilm", ["minilm-a"])):
        rows = [{"name": n, "variant": n[-1], "curve": loss_curve(runs / n)} for n in names]
        (ablation / f"ablation-{family}.json").write_text(json.dumps({"rows": rows}))
    plots.use_matplotlib_fonts()
    figures, skipped = plots.loss_curve_figures(tmp_path / "docs", tmp_path / "img")
    assert [f.name for f in figures] == ["ablation-curves-bert.png", "ablation-curves-minilm.png"] and not skipped
    assert all(png_size((tmp_path / "img" / f.name).read_bytes())[0] > 500 for f in figures)
    assert plots.loss_curve_figures(tmp_path / "nothing", tmp_path / "img")[1]  # none returned yet: said, not drawn
