"""Masked-LM evaluation: loss and accuracy on the valid split under one fixed mask.

The first ``max_batches`` valid batches are masked once, from a seed no training step uses, and
kept on the device; every evaluation scores the same tokens, so its numbers are comparable across
steps, and across runs on any numbers of ranks that divide the batches evenly (a batch's mask does
not depend on the rank that scores it). :class:`Evaluation` is the periodic evaluation of a training
run (each rank evaluates its share and the sums are all-reduced); ``python -m trainer evaluate-mlm`` scores
finished models on the same batches with :func:`fixed_masked_batches` and :func:`masked_lm_batch_sums`.
The teacher's loss and accuracy never change, so a run reports them once; student-teacher top-1
agreement is reported every time.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from trainer.config import TrainConfig
from trainer.objective.distiller import Distiller, eval_metrics
from trainer.objective.masking import DynamicMasker, MaskedBatch, seeded_generator
from trainer.runtime.data import DEFAULT_READER, Dataset, ShardReader, padding_mask, valid_batches

if TYPE_CHECKING:  # a type only: `evaluate-mlm` builds no engine and need not import DeepSpeed (~2.6 s)
    from trainer.runtime.engine import Distributed

log = logging.getLogger(__name__)

EVAL_STREAM = 2**31 - 1  # seeds the fixed evaluation mask apart from every training step's

EvalBatch = tuple[MaskedBatch, torch.Tensor | None]  # (the masked batch, its attention mask)


def fixed_masked_batches(
    dataset: Dataset,
    masker: DynamicMasker,
    *,
    micro_batch_size: int,
    max_batches: int,
    seed: int,
    rank: int,
    world_size: int,
    device: torch.device,
    reader: ShardReader = DEFAULT_READER,
) -> list[EvalBatch]:
    """This rank's share of the first ``max_batches`` valid batches, each masked once from ``seed``.

    A batch's mask depends only on (seed, the batch's index among them) and the masking config, not on
    which rank scores it: two models, or two runs on any numbers of ranks that divide the batches
    evenly, are scored on exactly the same tokens.
    """
    batches = []
    shares = valid_batches(
        dataset,
        micro_batch_size=micro_batch_size,
        max_batches=max_batches,
        rank=rank,
        world_size=world_size,
        reader=reader,
    )
    for index, ids in shares:
        host_mask = padding_mask(ids, dataset.pad_id)
        ids = ids.to(device)
        attention_mask = None if host_mask is None else host_mask.to(device)
        # 0 where the rank once was: every batch is drawn as a single-rank run always drew it
        generator = seeded_generator(seed, EVAL_STREAM, 0, index, device=device)
        batches.append((masker(ids, attention_mask, generator), attention_mask))
    return batches


def masked_lm_sums(distiller: Distiller, batches: list[EvalBatch]) -> dict[str, torch.Tensor]:
    """:meth:`Distiller.evaluate`'s sums over ``batches`` (float32, on the device); feed to ``eval_metrics``."""
    return {key: per_batch.sum() for key, per_batch in masked_lm_batch_sums(distiller, batches).items()}


def masked_lm_batch_sums(distiller: Distiller, batches: list[EvalBatch]) -> dict[str, torch.Tensor]:
    """:meth:`Distiller.evaluate`'s sums, one per batch: ``{key: [batches]}`` (float32, on the device).
    ``evaluate-mlm`` keeps them apart for its intervals, which resample batches."""
    rows = [distiller.evaluate(masked, attention_mask) for masked, attention_mask in batches]
    return {key: torch.stack([row[key].float() for row in rows]) for key in rows[0]} if rows else {}


class Evaluation:
    def __init__(self, cfg: TrainConfig, dataset: Dataset, masker: DynamicMasker, world: Distributed) -> None:
        self.batches = fixed_masked_batches(
            dataset,
            masker,
            micro_batch_size=cfg.micro_batch_size,
            max_batches=cfg.eval.max_batches,
            seed=cfg.seed,
            rank=world.rank,
            world_size=world.world_size,
            device=world.device,
            reader=ShardReader.from_config(cfg.loader),
        )
        if not self.batches and world.is_main:
            log.warning("data: %s has no valid samples; evaluation is skipped", dataset.root)
        self.teacher_reported = False

    def run(self, distiller: Distiller) -> dict[str, float]:
        """``{"eval/<metric>": value}``; empty without a valid split. All ranks call it together."""
        if not self.batches:
            return {}
        totals = masked_lm_sums(distiller, self.batches)
        keys = sorted(totals)
        summed = torch.stack([totals[k] for k in keys])
        dist.all_reduce(summed)
        metrics = eval_metrics(dict(zip(keys, summed.tolist(), strict=True)))
        if self.teacher_reported:
            metrics = {k: v for k, v in metrics.items() if not k.startswith("teacher_")}
        self.teacher_reported = True
        return {f"eval/{k}": v for k, v in metrics.items()}
