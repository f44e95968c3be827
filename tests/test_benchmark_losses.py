"""benchmarks/losses.py: the output losses eager and compiled, side by side, on a step's shapes.

The GPU campaign reads its times; here it is checked that the two variants compute the same losses and
gradients (so the ratio compares like with like) and that the shapes are a step's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import losses


@pytest.mark.full
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_eager_and_compiled_losses_agree_on_a_steps_shapes(dtype: str, capsys: pytest.CaptureFixture) -> None:
    argv = ["--batch=2", "--seq-len=40", "--vocab=300", "--hidden=16", "--steps=2", "--warmup=1", "--device=cpu"]
    assert losses.main([*argv, f"--dtype={dtype}", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["shapes"] == {"logits": [2, 6, 300], "hidden": [2, 40, 16], "dtype": dtype}  # budget ceil(0.15 x 40)
    assert result["eager_ms"] > 0 and result["compiled_ms"] > 0
    assert result["eager_over_compiled"] == pytest.approx(result["eager_ms"] / result["compiled_ms"])
    # bf16 inputs: both upcast to float32 first, so the float32 arithmetic differs only in its order
    assert result["loss_difference"] < 1e-4
    assert result["max_grad_difference"] < (1e-6 if dtype == "fp32" else 1e-3)
    # the decoder's matmuls at the same positions: padded to 64 rows per call, the same logits and gradients
    decoder = result["decoder"]
    assert (decoder["positions"], decoder["vocab"], decoder["padded_vocab"]) == (12, 300, 320)
    assert min(decoder["as_is_ms"], decoder["padded_ms"], decoder["native_ms"]) > 0
    assert decoder["as_is_over_padded"] == pytest.approx(decoder["as_is_ms"] / decoder["padded_ms"])
    assert decoder["max_logit_difference"] < 1e-5 and decoder["max_grad_difference"] < 1e-5
