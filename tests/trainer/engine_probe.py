"""What a real DeepSpeed engine keeps on a rank and sends per step; run by the ``deepspeed`` launcher.

``deepspeed --num_gpus N tests/trainer/engine_probe.py OUT.json CONFIG.yaml [key=value ...]`` builds the
engine as ``trainer train`` does (the trainer's own config, model and engine code), trains three optimizer
steps on random batches of 64 tokens and writes, from rank 0, the bytes of every distinct tensor storage
that Python objects reference on the CPU:

* ``held``: after the last optimizer step, the state the engine keeps between steps;
* ``in_backward``: during the last backward, when the word embedding's gradient (the last one
  backward produces) arrives: what the gradient reduction adds on top of ``held``;
* ``word_embedding_grad``: that gradient's own bytes, part of ``in_backward``.

Saved activations live in autograd's C++ graph and are not counted (``plan`` counts them on the meta
device). And, from DeepSpeed's own communication logger (``comms_logger`` in the DeepSpeed config):

* ``comm``: per collective, the bytes of the tensors handed to it in one optimizer step (the mean of steps
  2 and 3; step 1 also carries the engine's first-step set-up), ``{op: {message bytes: calls}}`` beside it
  in ``comm_calls``;
* ``checkpoint_bytes``: the files of one ``save_checkpoint`` (into ``OUT.checkpoint/``), all ranks together.

Used by ``tests/trainer/test_plan.py`` (memory) and ``tests/trainer/test_plan_cluster.py``
(communication, checkpoint size) to check ``plan`` against DeepSpeed.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import sys
from pathlib import Path

import torch

from common.cli import split_config_args
from common.config import load_config
from trainer.config import TrainConfig
from trainer.modeling import build_student, load_teacher, training_dtype
from trainer.objective.distiller import Distiller
from trainer.objective.masking import MaskedBatch, Positions, max_masked
from trainer.runtime.engine import build_engine, deepspeed_config, init_distributed

SEQ_LEN = 64


def storage_bytes() -> int:
    """Bytes of every distinct CPU tensor storage reachable from Python objects (views counted once)."""
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def random_batch(micro_batch_size: int, mask_probability: float) -> MaskedBatch:
    ids = torch.randint(1000, 2000, (micro_batch_size, SEQ_LEN))
    budget = max_masked(mask_probability, SEQ_LEN)
    index = torch.stack([torch.randperm(SEQ_LEN)[:budget] for _ in range(micro_batch_size)])
    return MaskedBatch(ids, ids, Positions(index=index, valid=torch.ones_like(index, dtype=torch.bool)), index)


def main(argv: list[str]) -> None:
    faulthandler.enable()  # a crash in C++ still shows every thread's Python stack in the test's message
    args = [a for a in argv if not a.startswith("--local_rank")]  # the launcher's argument
    out, (path, overrides) = Path(args[0]), split_config_args(args[1:])
    cfg = load_config(TrainConfig, path, overrides)
    world = init_distributed()
    torch.manual_seed(cfg.seed)
    teacher = load_teacher(cfg.teacher, torch.float32)
    student = build_student(cfg.student, teacher)
    teacher.to(dtype=training_dtype(cfg.deepspeed.precision))
    distiller = Distiller(student, teacher, cfg.objective)
    ds = deepspeed_config(cfg, world.world_size)
    ds["comms_logger"] = {"enabled": True, "prof_all": True}
    engine = build_engine(distiller, cfg, ds, world.device)
    from deepspeed.comm.comm import comms_logger  # after deepspeed.initialize configured it

    counted: dict[str, int] = {}

    def during_backward(grad: torch.Tensor) -> torch.Tensor:
        counted["in_backward"] = storage_bytes()
        counted["word_embedding_grad"] = grad.numel() * grad.element_size()
        return grad

    steps = 3 * engine.gradient_accumulation_steps()
    for micro in range(steps):
        loss = engine(batch=random_batch(cfg.micro_batch_size, cfg.masking.probability), attention_mask=None)["loss"]
        last = micro == steps - 1
        hook = student.base_model.embeddings.word_embeddings.weight.register_hook(during_backward) if last else None
        engine.backward(loss)
        if hook is not None:
            hook.remove()
        del loss
        engine.step()
        if micro == engine.gradient_accumulation_steps() - 1:
            comms_logger.comms_dict.clear()  # the first step's set-up is not a step's traffic
    gc.collect()
    counted["held"] = storage_bytes()
    calls = {op: {size: record[0] for size, record in sizes.items()} for op, sizes in comms_logger.comms_dict.items()}
    counted["comm_calls"] = calls
    counted["comm"] = {op: sum(size * n for size, n in sizes.items()) / 2 for op, sizes in calls.items()}
    saved = out.with_suffix(".checkpoint")  # beside OUT.json, the same directory on every rank
    engine.save_checkpoint(str(saved), tag="probe")
    torch.distributed.barrier()
    counted["checkpoint_bytes"] = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())
    if world.is_main:
        out.write_text(json.dumps(counted), encoding="utf-8")
    torch.distributed.barrier()  # every rank is done with the group and the file is written
    # Leave without the interpreter's teardown: a ZeRO-3 engine on gloo now and then aborts there (SIGABRT,
    # "terminate called without an active exception", as gloo's threads are destroyed with work still
    # referencing Python tensors), which would fail a measurement that is complete.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
