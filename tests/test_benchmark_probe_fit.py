"""benchmarks/probe_fit.py: the probe's cross-validated ridge fit, a fresh fit per penalty against the
probe's own (a fold's Gram matrix once for every penalty), side by side.

The script stops when the two disagree; here it is checked that they agree (the same penalty and the same
predictions, on features where the grid's penalties score differently) and that it reports both times.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import probe_fit


def test_the_probes_fit_chooses_and_predicts_as_a_fresh_fit_per_penalty(capsys: pytest.CaptureFixture) -> None:
    argv = ["--examples=300", "--features", "8", "96", "--repeats=1", "--device=cpu", "--json"]
    assert probe_fit.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"].startswith("cpu")
    assert [r["features"] for r in report["results"]] == [8, 96]
    for r in report["results"]:
        assert r["fresh_s"] > 0 and r["shared_s"] > 0 and r["speedup"] == pytest.approx(r["fresh_s"] / r["shared_s"])
        assert 0.5 < r["accuracy"] <= 1  # the labels follow a linear rule of the features: the fit reads it
    # with 96 features from 240 rows a fold, the penalty matters: a weak one overfits
    assert report["results"][1]["penalty"] > min(probe_fit.PENALTIES)


def test_a_fit_that_predicts_otherwise_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agreement check is real: the probe's fit made to predict its classes the other way round stops the script."""
    predict = probe_fit.Ridge.predict
    monkeypatch.setattr(probe_fit.Ridge, "predict", lambda self, x, penalty: 1 - predict(self, x, penalty))
    with pytest.raises(SystemExit, match="the two ways disagree"):
        probe_fit.main(["--examples=200", "--features", "8", "--repeats=1", "--device=cpu"])
