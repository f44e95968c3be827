"""``python benchmarks/gpu/forget.py RESULTS NAME[,NAME...]``: drop results from a campaign's throughput.json.

``GPU_CAMPAIGN_AGAIN`` (benchmarks/gpu/run.sh) names the results of an earlier session that were recorded before
a change to what they measure; dropped here, the session's ``--append`` calls measure them again. The names are
cases, steps, ``losses`` and ``sdpa``. Only the standard library and ``common.atomic``: run.sh calls it on a bare
GPU machine, and a campaign's other code (train_throughput.py: DeepSpeed through ``trainer.planning.plan``) would
need the carried wheels first. When it failed on their absence the session went on, and measured nothing again.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.atomic import write_text_atomically

# Items of earlier reports, measured by scripts since retired (benchmarks/README.md, Retired): kept, rendered and
# forgotten like the rest, never measured again.
LOSSES = "losses"  # benchmarks/losses.py: the compiled losses, the decoder's matmuls padded or not
SDPA = "sdpa"  # benchmarks/sdpa_backends.py: which attention kernel each preset's encoders get


def forget(outdir: Path, names: set[str]) -> list[str]:
    """Drop the results of ``names`` from OUTDIR/throughput.json; returns the names dropped."""
    path = outdir / "throughput.json"
    report = json.loads(path.read_text())
    dropped = [r["name"] for kind in ("cases", "steps") for r in report[kind] if r["name"] in names]
    for kind in ("cases", "steps"):
        report[kind] = [r for r in report[kind] if r["name"] not in names]
    for item in (LOSSES, SDPA):
        if item in names and report.pop(item, None) is not None:
            dropped.append(item)
    write_text_atomically(path, json.dumps(report, indent=2) + "\n")
    return dropped


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    dropped = forget(Path(argv[0]), set(argv[1].split(",")))
    print(f"measured again by the next call: {', '.join(dropped) or 'nothing (none of those names was recorded)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
