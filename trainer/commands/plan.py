"""``python -m trainer plan CONFIG.yaml [key=value ...] [--json] [--world-size N] [--seq-len N]``.

The command line of :mod:`trainer.planning.plan` (what a plan holds and how it is sized) and of
:mod:`trainer.planning.cluster` (a cluster run's communication, step time, scaling and cost).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from common.cli import split_config_args
from common.config import ConfigError, load_config
from trainer.config import TrainConfig
from trainer.planning.cluster import ASSUMPTIONS, Cluster, Sizing
from trainer.planning.plan import build_plan, render


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.add_argument("--world-size", type=int, default=None, help="GPUs in all (default: $WORLD_SIZE, or 1)")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length when the dataset does not exist yet")
    cluster = parser.add_argument_group("sizing a cluster run (docs/training.md, 'Sizing a cluster run')")
    cluster.add_argument("--nodes", type=int, default=None, help="nodes (sets the world size with --gpus-per-node)")
    cluster.add_argument("--gpus-per-node", type=int, default=None)
    cluster.add_argument("--gpu-tokens-per-s", type=float, default=None, help="your single-GPU throughput")
    cluster.add_argument("--tokens", default=None, help="token budget: a number, or 'data' (one pass; else max_steps)")
    cluster.add_argument("--intra-node-gbs", type=float, default=None, help="all-reduce bus GB/s within a node")
    cluster.add_argument("--inter-node-gbs", type=float, default=None, help="all-reduce bus GB/s across nodes")
    cluster.add_argument("--overlap", default=None, metavar="LOW,HIGH", help="share of overlappable comm hidden")
    cluster.add_argument("--storage-gbs", type=float, default=None, help="checkpoint write GB/s, all ranks")
    cluster.add_argument("--gpu-hour-price", type=float, default=None)
    options = parser.parse_intermixed_args(argv)
    sizing = sizing_from(options)
    path, overrides = split_config_args(options.args)
    cfg = load_config(TrainConfig, path, overrides)
    preset = "" if path is None else Path(path).stem
    plan = build_plan(cfg, sizing.cluster.world, options.seq_len, sizing, preset)
    print(json.dumps(plan, indent=2) if options.json else render(plan))
    return 0


def sizing_from(options: argparse.Namespace) -> Sizing:
    """The cluster the options describe: ``--nodes`` x ``--gpus-per-node`` GPUs, or ``--world-size`` GPUs in one
    node; the options not given keep :class:`Cluster`'s assumed defaults."""
    world = options.world_size
    if options.nodes is not None or options.gpus_per_node is not None:
        nodes, per_node = options.nodes or 1, options.gpus_per_node or 1
        if world is not None and world != nodes * per_node:
            raise ConfigError(f"--world-size {world} is not --nodes x --gpus-per-node = {nodes * per_node}")
    else:
        nodes, per_node = 1, world if world is not None else int(os.environ.get("WORLD_SIZE", 1))
    if nodes < 1 or per_node < 1:
        raise ConfigError("--world-size: must be >= 1")
    given = {key: getattr(options, key) for key in ASSUMPTIONS if getattr(options, key) is not None}
    if "overlap" in given:
        try:
            low, high = (float(x) for x in given["overlap"].split(","))
        except ValueError:
            raise ConfigError("--overlap: LOW,HIGH, two shares between 0 and 1 (e.g. 0,0.8)") from None
        given["overlap"] = (low, high)
    if options.tokens is not None and options.tokens != "data":
        try:
            float(options.tokens)
        except ValueError:
            raise ConfigError(f"--tokens: a number of tokens or 'data', not {options.tokens!r}") from None
    cluster = Cluster(nodes=nodes, gpus_per_node=per_node, gpu_hour_price=options.gpu_hour_price, **given)
    return Sizing(cluster, frozenset(given), options.gpu_tokens_per_s, options.tokens)
