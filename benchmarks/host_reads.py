"""Census of the device-to-host reads, and of all the ops, in steady-state steps of the real training loop's calls.

    .venv/bin/python benchmarks/host_reads.py [--steps N] [CONFIG.yaml] [key=value ...]

Builds the engine as ``trainer.commands.train`` does, in a one-process gloo world on the CPU
(``DS_ACCELERATOR=cpu``), with a random teacher of bert-base's 12 layers at a width of 96 and
``.gpu/data-128`` (``make gpu-data``) unless ``teacher=``/``data=`` say otherwise; runs 2 warm-up
steps, then counts over N steps, by loop phase and by the nearest frame outside torch, every aten op
that needs a tensor's value on the host (``trainer.runtime.host_reads.is_host_read``: on CUDA each
waits for all queued device work). DeepSpeed's explicit syncs are counted too (``watch_syncs``), with
those it skips on the CPU. Counted here but host-only on CUDA: reads of tensors that stay on the host
there (the host batch; the step counter of a non-fused AdamW, while build_engine fuses it on CUDA).

Then it counts every aten op of the same steps, by phase and by the nearest frame outside torch that
issued it. On CUDA each op passes through the dispatcher on the host, and most launch a kernel: a step
whose ops take the host longer to issue than the GPU to run is bound by the host (docs/log/benchmarks.md,
"Host work per step"). The model's backward ops show as issued by DeepSpeed's ``backward``, which calls
autograd. ``compile=true`` is not applied here.
"""

from __future__ import annotations

import argparse
import functools
import linecache
import os
import sys
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.runtime.host_reads import is_host_read

REPO = Path(__file__).resolve().parents[1]
TORCH_DIR = str(Path(torch.__file__).parent)
TOP_ISSUERS = 6  # per phase, in the ops table


def site(frames: traceback.StackSummary) -> tuple[str, str]:
    """``(nearest frame outside torch <- its caller, the last torch frame it went through)``."""
    machinery = ("/_dynamo/", "/_compile.py", "/utils/_python_dispatch.py")
    mine = ("wrapper",)  # this file's phase wrappers, between a phase's caller and callee
    outside = [i for i, f in enumerate(frames) if not f.filename.startswith(TORCH_DIR) and f.name not in mine]
    via = [f for f in frames[outside[-1] + 1 :] if not any(m in f.filename for m in machinery)]
    parent = f" <- {name(frames[outside[-2]])}" if len(outside) > 1 else ""
    return name(frames[outside[-1]]) + parent, name(via[-1]) if via else ""


def name(frame: traceback.FrameSummary) -> str:
    path = frame.filename
    for root in (str(Path(TORCH_DIR).parent) + "/", str(REPO) + "/"):
        path = path.removeprefix(root)
    return f"{path}:{frame.lineno} {frame.name}"


def issuer(frame: FrameType | None, line: bool = False) -> str:
    """``path function`` (``path:line function`` with ``line``) of the nearest frame outside torch (and this
    file), from ``frame`` outwards: who issued the op being dispatched. On CPU the model's backward ops show
    as the frame that called ``backward``; on CUDA autograd runs the backward on a thread of its own, whose
    stack holds no frame of ours at all."""
    while frame is not None and (
        frame.f_code.co_filename.startswith(TORCH_DIR) or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back
    if frame is None:
        return "autograd engine thread (backward)"
    path = frame.f_code.co_filename
    for root in (str(Path(TORCH_DIR).parent) + "/", str(REPO) + "/"):
        path = path.removeprefix(root)
    return f"{path}{f':{frame.f_lineno}' if line else ''} {frame.f_code.co_name}"


class PhasedReads(TorchDispatchMode):
    """Counts host reads by (phase, op, site), and every op by (phase, issuer), while ``counting``;
    :meth:`phased` names the phases."""

    def __init__(self) -> None:
        super().__init__()
        self.phase, self.counting = "loop, other lines", False
        self.counts: Counter[tuple[str, str, str, str]] = Counter()
        self.ops: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if self.counting:  # every op: on CUDA, a kernel launch or at least a pass through the dispatcher
            self.ops[(self.phase, issuer(sys._getframe(1)))] += 1
        if is_host_read(func, args, kwargs or {}):
            self.note(func.__name__.removesuffix(".default"))
        return func(*args, **(kwargs or {}))

    def note(self, op: str) -> None:
        if self.counting:  # [:-2]: this method and its caller (__torch_dispatch__ or the synchronize wrapper)
            self.counts[(self.phase, op, *site(traceback.extract_stack()[:-2]))] += 1

    def phased(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        """``fn``, counting the reads made while it runs under ``phase``."""

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            outer, self.phase = self.phase, phase
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase = outer

        return wrapper


def watch_syncs(accelerator: Any, reads: PhasedReads) -> None:
    """Count DeepSpeed's explicit syncs: ``accelerator.synchronize()``, and the ``synchronize()`` calls it makes
    only on CUDA, behind ``if not get_accelerator().resolves_data_dependency():`` (True on the CPU)."""
    synchronize, resolves = accelerator.synchronize, accelerator.resolves_data_dependency

    def synchronize_counted(*args: Any, **kwargs: Any) -> Any:
        reads.note("accelerator.synchronize")
        return synchronize(*args, **kwargs)

    def resolves_counted() -> bool:
        caller = traceback.extract_stack()[-2]
        if "synchronize()" in linecache.getline(caller.filename, caller.lineno + 1):
            reads.note("CUDA-only synchronize")
        return resolves()

    accelerator.synchronize, accelerator.resolves_data_dependency = synchronize_counted, resolves_counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="steps counted after the 2 warm-up steps")
    parser.add_argument("args", nargs="*", help="[CONFIG.yaml] [key=value ...] (default configs/distilbert-base.yaml)")
    ns = parser.parse_args()
    config = ns.args.pop(0) if ns.args and "=" not in ns.args[0] else str(REPO / "configs/distilbert-base.yaml")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from deepspeed.accelerator import get_accelerator
    from helpers import bert_tokenizer_dir

    import trainer.commands.train as train_module
    from benchmarks.gpu.train_throughput import random_teacher
    from common.config import load_config
    from common.tokenizer import load_tokenizer
    from trainer.commands.train import Stepper, reseed
    from trainer.config import TrainConfig
    from trainer.modeling import build_student, load_teacher, training_dtype
    from trainer.objective.distiller import Distiller
    from trainer.objective.masking import DynamicMasker
    from trainer.runtime.data import TrainLoader, load_token_counts, open_dataset
    from trainer.runtime.engine import build_engine, deepspeed_config, init_distributed
    from trainer.runtime.guard import FiniteGuard
    from trainer.runtime.metrics import StepMeter

    tmp = Path(tempfile.mkdtemp(prefix="host-reads-"))
    defaults = [f"data={REPO / '.gpu/data-128'}", "student.teacher_layers=null", "micro_batch_size=4"]
    defaults += ["global_batch_size=4", "loader.num_workers=0", f"output_dir={tmp / 'run'}", "mlflow.enabled=false"]
    if not any(a.startswith("teacher=") for a in ns.args):
        # bert-base's 12 layers at a width of 96: the preset's depth and parameter count, so its number of ops
        teacher_config = REPO / "configs" / "teachers" / "bert-base-uncased"
        defaults.append(f"teacher={random_teacher(teacher_config, bert_tokenizer_dir(), tmp / 'teacher', quick=True)}")
    cfg = load_config(TrainConfig, config, [*defaults, *ns.args])
    # As trainer.commands.train.train builds them (no resume, tracker, evaluation or checkpoints).
    world = init_distributed()
    ds_config = deepspeed_config(cfg, world.world_size)
    dataset = open_dataset(cfg.data)
    torch.manual_seed(cfg.seed)
    teacher = load_teacher(cfg.teacher, torch.float32)
    student = build_student(cfg.student, teacher)
    teacher.to(device=world.device, dtype=training_dtype(cfg.deepspeed.precision))
    engine = build_engine(Distiller(student, teacher, cfg.objective), cfg, ds_config, world.device)
    shard = {"micro_batch_size": cfg.micro_batch_size, "rank": world.rank, "world_size": world.world_size}
    loader = TrainLoader(dataset, **shard, loader_cfg=cfg.loader, seed=cfg.seed)
    token_counts = load_token_counts(cfg.data) if cfg.masking.frequency_smoothing is not None else None
    masker = DynamicMasker.from_tokenizer(cfg.masking, load_tokenizer(cfg.teacher), token_counts, device=world.device)
    meter, guard = StepMeter(cfg.global_batch_size), FiniteGuard(world.device)

    stepper = Stepper(
        engine, masker, guard, meter, world, cfg.seed, dataset.pad_id, cfg.deepspeed.skips_nonfinite_steps
    )

    reads = PhasedReads()
    for method in ("forward", "backward", "step", "get_global_grad_norm", "was_step_applied"):
        setattr(engine, method, reads.phased(getattr(engine, method), f"engine.{method}"))
    guard.observe = reads.phased(guard.observe, "loop: guard.observe")
    meter.add_micro = reads.phased(meter.add_micro, "loop: meter.add_micro")
    meter.end_step = reads.phased(meter.end_step, "loop: meter.end_step")
    stepper.masker = reads.phased(masker, "loop: masker")
    # the Stepper's padding_mask is the train module's
    train_module.padding_mask = reads.phased(train_module.padding_mask, "loop: padding_mask (host tensors)")
    watch_syncs(get_accelerator(), reads)

    with reads:  # train()'s step loop, less its data-wait meter, profiler, logs, evaluation and checkpoints
        for step in range(2 + ns.steps):
            reads.counting = step >= 2
            reseed(cfg.seed, step, world.rank)
            lr = engine.get_lr()[0]
            for micro in range(engine.gradient_accumulation_steps()):
                stepper.micro_step(next(loader)["input_ids"], step, micro)
            stepper.end_step(step + 1, lr)

    stage, optimizer = ds_config["zero_optimization"]["stage"], type(engine.optimizer).__name__
    print(f"\n{Path(config).name} {cfg.deepspeed.precision} ZeRO-{stage} ({cfg.deepspeed.config}, {optimizer})")
    print(f"host reads per step, over {ns.steps} steps after 2 warm-up steps")
    print(f"{'per step':>8}  {'phase':<34} {'op':<24} nearest frame outside torch <- its caller [last torch frame]")
    for (phase, op, caller, via), n in sorted(reads.counts.items()):
        print(f"{n / ns.steps:>8g}  {phase:<34} {op:<24} {caller}" + (f" [{via}]" if via else ""))
    print(f"{sum(reads.counts.values()) / ns.steps:>8g}  total")

    print(f"\naten ops per step by phase, over the same steps (the {TOP_ISSUERS} largest issuers; the rest as 'other')")
    print(f"{'per step':>8}  {'phase':<34} issued by (nearest frame outside torch)")
    for phase in sorted({phase for phase, _ in reads.ops}):
        issued = Counter({who: n for (p, who), n in reads.ops.items() if p == phase})
        top = issued.most_common(TOP_ISSUERS)
        rest = sum(issued.values()) - sum(n for _, n in top)
        for who, n in top + ([("other", rest)] if rest else []):
            print(f"{n / ns.steps:>8g}  {phase:<34} {who}")
    print(f"{sum(reads.ops.values()) / ns.steps:>8g}  total")


if __name__ == "__main__":
    main()
