"""Periodic evaluation: masked-LM loss and accuracy on the valid split under one fixed mask.

The first ``eval.max_batches`` valid batches are masked once, from a seed no training step
uses, and kept on the device; every evaluation scores the same tokens, so its numbers are
comparable across steps and runs. Each rank evaluates its share and the sums are all-reduced.
The teacher's loss and accuracy never change, so they are reported once; student-teacher top-1
agreement is reported every time.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from trainer.config import TrainConfig
from trainer.objective.distiller import Distiller, eval_metrics
from trainer.objective.masking import DynamicMasker, seeded_generator
from trainer.runtime.data import Dataset, padding_mask, valid_batches
from trainer.runtime.engine import Distributed

log = logging.getLogger(__name__)

EVAL_STREAM = 2**31 - 1  # seeds the fixed evaluation mask apart from every training step's


class Evaluation:
    def __init__(self, cfg: TrainConfig, dataset: Dataset, masker: DynamicMasker, world: Distributed) -> None:
        self.batches = []
        shares = valid_batches(
            dataset,
            micro_batch_size=cfg.micro_batch_size,
            max_batches=cfg.eval.max_batches,
            rank=world.rank,
            world_size=world.world_size,
        )
        if not shares and world.is_main:
            log.warning("data: %s has no valid samples; evaluation is skipped", dataset.root)
        for i, ids in enumerate(shares):
            host_mask = padding_mask(ids, dataset.pad_id)
            ids = ids.to(world.device)
            attention_mask = None if host_mask is None else host_mask.to(world.device)
            generator = seeded_generator(cfg.seed, EVAL_STREAM, world.rank, i, device=world.device)
            self.batches.append((masker(ids, attention_mask, generator), attention_mask))
        self.teacher_reported = False

    def run(self, distiller: Distiller) -> dict[str, float]:
        """``{"eval/<metric>": value}``; empty without a valid split. All ranks call it together."""
        if not self.batches:
            return {}
        totals: dict[str, torch.Tensor] = {}
        for masked, attention_mask in self.batches:
            for key, value in distiller.evaluate(masked, attention_mask).items():
                totals[key] = totals.get(key, 0) + value.float()
        keys = sorted(totals)
        summed = torch.stack([totals[k] for k in keys])
        dist.all_reduce(summed)
        metrics = eval_metrics(dict(zip(keys, summed.tolist(), strict=True)))
        if self.teacher_reported:
            metrics = {k: v for k, v in metrics.items() if not k.startswith("teacher_")}
        self.teacher_reported = True
        return {f"eval/{k}": v for k, v in metrics.items()}
