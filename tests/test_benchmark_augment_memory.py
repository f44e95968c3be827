"""benchmarks/augment_memory.py's claim, held: TinyBERT augmentation's peak memory does not grow with its input.

Two real runs of ``python -m preprocessing.augment`` (DirectRunner, 20 variants), each in a fresh process, on
1x and 4x the examples. The texts are long (about 50 KB each) so that the rows are many times the noise: the
4x run writes about 30 MB more rows, which the design that carried rows through the runner held: at commit
36c135f this same pair of runs peaked at 0.88 and 1.05 GB (+175 MB). The peak may rise by at most 40 MB.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import augment_memory

pytestmark = pytest.mark.full


def test_four_times_the_input_does_not_raise_the_peak(tmp_path: Path) -> None:
    args = argparse.Namespace(variants=20, max_seq_len=16, workers=1)
    mlm = augment_memory.tiny_mlm(tmp_path / "tiny-mlm")
    peaks = {}
    for lines in (10, 40):
        source = tmp_path / f"input-{lines}.jsonl"
        augment_memory.write_input(source, lines, (8000, 9000))
        peaks[lines], _, _ = augment_memory.measure(source, tmp_path / f"out-{lines}", args, mlm)
    assert peaks[40] - peaks[10] < 40 / 1024, f"peak RSS {peaks[10]:.3f} GB at 1x, {peaks[40]:.3f} GB at 4x"
