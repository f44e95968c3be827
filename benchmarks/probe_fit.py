"""The linear probe's cross-validated ridge fit two ways, timed side by side: a fresh fit for every
penalty and fold, and as ``trainer.commands.probe`` fits (a fold's Gram matrix once for every penalty).

    python benchmarks/probe_fit.py [--examples 2000] [--features 384 1536] [--device auto|cpu|cuda]
        [--repeats 3] [--json]

The features are random float64 ``[examples, features]`` (the probe's own size: about 2,000 training
examples a task; 384 features for a MiniLM-sized model's single text, 1536 for its sentence pair, 4 x the
width), standardised as the probe does, with binary class labels that a linear rule of the features
decides up to noise. Both ways choose the penalty from the same grid by the same 5 folds and then score
the whole fit on held-out rows; the script checks that they choose the same penalty and predict the same
classes, and reports each one's best time of ``--repeats``, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.cli import run_cli
from trainer.commands.probe import FOLDS, PENALTIES, Ridge, cross_validated_penalty, metric, standardise
from trainer.runtime.profiling import synchronize


def fresh_fit(x: torch.Tensor, y: torch.Tensor, x_eval: torch.Tensor, penalty: float) -> torch.Tensor:
    """The reference: one ridge classifier fitted from scratch, its Gram matrix formed for this penalty alone."""
    one_hot = torch.nn.functional.one_hot(y, int(y.max()) + 1).to(x.dtype)
    x_mean, y_mean = x.mean(0), one_hot.mean(0)
    xc = x - x_mean
    gram = xc.T @ xc + penalty * torch.eye(x.shape[1], dtype=x.dtype, device=x.device)
    weight = torch.linalg.solve(gram, xc.T @ (one_hot - y_mean))
    return ((x_eval - x_mean) @ weight + y_mean).argmax(-1)


def fresh_penalty(x: torch.Tensor, y: torch.Tensor) -> float:
    """The grid's best penalty, every (penalty, fold) fitted afresh: 40 Gram matrices where the probe forms 5."""
    fold = torch.arange(len(x), device=x.device) % FOLDS

    def held_out(penalty: float) -> float:
        return (
            sum(
                metric(fresh_fit(x[fold != k], y[fold != k], x[fold == k], penalty), y[fold == k]) for k in range(FOLDS)
            )
            / FOLDS
        )

    return max(reversed(PENALTIES), key=held_out)


def problem(examples: int, features: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(features)
    x = torch.randn(examples + examples // 4, features, generator=generator, dtype=torch.float64)
    rule = torch.randn(features, generator=generator, dtype=torch.float64)
    y = ((x @ rule) + 3 * torch.randn(len(x), generator=generator, dtype=torch.float64) > 0).long()
    x_train, x_eval = standardise(x[:examples], x[examples:])
    return x_train.to(device), y[:examples].to(device), x_eval.to(device), y[examples:].to(device)


def best_time(fn: Any, repeats: int, device: torch.device) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        out = fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times), out


def measure(examples: int, features: int, device: torch.device, repeats: int) -> dict[str, Any]:
    x, y, x_eval, y_eval = problem(examples, features, device)

    def fresh() -> tuple[float, torch.Tensor]:
        penalty = fresh_penalty(x, y)
        return penalty, fresh_fit(x, y, x_eval, penalty)

    def shared() -> tuple[float, torch.Tensor]:
        penalty = cross_validated_penalty(x, y)
        return penalty, Ridge(x, y).predict(x_eval, penalty)

    fresh_s, (fresh_penalty_, fresh_predicted) = best_time(fresh, repeats, device)
    shared_s, (shared_penalty, shared_predicted) = best_time(shared, repeats, device)
    if fresh_penalty_ != shared_penalty or not torch.equal(fresh_predicted, shared_predicted):
        raise SystemExit(
            f"probe_fit.py: the two ways disagree at {features} features (penalty {fresh_penalty_} vs {shared_penalty})"
        )
    return {
        "examples": examples,
        "features": features,
        "penalty": shared_penalty,
        "accuracy": metric(shared_predicted, y_eval),
        "fresh_s": fresh_s,
        "shared_s": shared_s,
        "speedup": fresh_s / shared_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--features", type=int, nargs="+", default=[384, 1536])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    device = torch.device(
        "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    )
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    results = [measure(args.examples, n, device, args.repeats) for n in args.features]
    if args.json:
        print(json.dumps({"device": where, "results": results}, indent=2))
        return 0
    print(
        f"device: {where}; {args.examples} examples, {len(PENALTIES)} penalties x {FOLDS} folds, best of {args.repeats}"
    )
    for r in results:
        print(
            f"{r['features']:>5} features: a fresh fit each {r['fresh_s']:.3f} s"
            f" | the fold's Gram once {r['shared_s']:.3f} s | {r['speedup']:.2f}x"
            f" | same penalty ({r['penalty']:g}) and predictions"
        )
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
