"""benchmarks/plots.py: every figure drawn from the committed result files is a whole PNG, and docs/img/ holds
exactly what the script draws now, so a result file changed without its figures redrawn fails here.

The comparison is byte for byte: the script's output is deterministic for one matplotlib version (pinned in
pyproject.toml's test extra, as the figures were drawn with it).
"""

from __future__ import annotations

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
