"""Registered checkpoints: a long run's students appear in the registry while it trains.

With ``mlflow.register_checkpoints`` (true, or K: every K-th checkpoint save), rank 0 hands each such
completed checkpoint to a :class:`CheckpointRegistrar` and goes on training. The hand-over is a
*snapshot*: the checkpoint's files hard-linked (no bytes copied, a few milliseconds) into
``OUTPUT_DIR/registering/step-N/`` beside a ``registration.json`` (step, samples, tokens, the last
evaluation's metrics), made under a temporary name and renamed, so a snapshot is complete or absent.
``checkpoint.keep_last`` may delete the checkpoint meanwhile: the links keep its bytes until the
snapshot is registered and removed, and the registered copy is the exported student, not a link.

A background thread registers the queue, oldest first, through a separate process
(``python -m trainer register-checkpoints``, :mod:`trainer.commands.register_checkpoints`): exporting
a student reads every ZeRO partition, which in the training process would take the GIL and the cores
the loop needs; while training runs, the process runs only on CPU time the ranks leave idle (Linux's
SCHED_IDLE), on no GPU. A registry that is down or slow only delays the thread, which retries with backoff
(``mlflow.retry_initial_s`` doubling to ``mlflow.retry_max_s``). The loop never waits for it, except
once at the end, at most ``mlflow.finish_timeout_s``, so that the versions appear in step order before
the final student (which the end of training registers, as without this setting); what is still
queued then is reported with the command that registers it.

At that end the training no longer needs the cores, so the worker stops yielding them: on a node that
other jobs keep busy, an idle-time worker gets almost no CPU at all (Linux gives SCHED_IDLE a weight of 3
against a nice-0 thread's 1,024: its imports alone would take an hour), and every registration would
wait for the end and then time out. The worker in flight is raised to the normal policy; where this user
may not do that (leaving SCHED_IDLE needs CAP_SYS_NICE), it is stopped and started again at the normal
policy, which is safe for the reason below.

A killed run's snapshots stay queued, and its relaunch registers them. A registration killed half way
leaves no version (MLflow creates a version in one request) or a complete one; the process looks for a
version with the same run and step before registering, so none is registered twice.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from common.atomic import FULL, explaining_full_disk
from trainer.tracking.config import MlflowConfig

if TYPE_CHECKING:
    from trainer.tracking.tracker import NullTracker, Tracker

log = logging.getLogger(__name__)

QUEUE_DIR = "registering"  # under the run's output directory
REQUEST = "registration.json"  # in each snapshot: what the version is tagged with
WORKER_LOG = "registering.log"  # the worker processes' output, beside the queue
REFUSED = 3  # a worker's exit status when the registry refused it (no permission): not an outage to wait out
# A rank's distributed identity must not reach the worker: it is no rank, and joins no process group.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK")

# Starting a worker and forking take turns. Popen learns that its child has started through a pipe it reads until
# every copy of the pipe's write end is closed; a process forked in between (a data-loader worker: the main thread
# forks those while this thread starts a worker) keeps a copy for as long as it lives, which for a rank's loader is
# the whole run. The registrar then sat in Popen holding its lock, close() waited on that lock at the end of training,
# and the other ranks timed out in their next collective. So every os.fork (multiprocessing's, the data loader's)
# waits for a start in flight, and a start waits for a fork in flight (subprocess's own fork runs no such hooks).
STARTING = threading.Lock()
os.register_at_fork(before=STARTING.acquire, after_in_parent=STARTING.release, after_in_child=STARTING.release)


def pending_snapshots(queue: Path) -> list[Path]:
    """The complete snapshots in ``queue``, oldest step first (names starting with a dot are in the making
    or being removed)."""
    if not queue.is_dir():
        return []
    found = [p for p in queue.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / REQUEST).is_file()]
    return sorted(found, key=lambda p: json.loads((p / REQUEST).read_text(encoding="utf-8"))["step"])


def snapshot(checkpoint: Path, queue: Path, request: dict[str, Any]) -> Path:
    """``queue/<checkpoint's name>``: ``checkpoint``'s files hard-linked (copied where the filesystem has no
    hard links) and ``request`` as ``registration.json``; complete or absent. A snapshot of the same
    checkpoint already queued is kept as it is. A full disk, a refused write or a queue removed meanwhile fails
    in one line naming the snapshot (common.atomic), and leaves no partial one."""
    dest = queue / checkpoint.name
    if dest.is_dir():
        return dest
    tmp = queue / f".{checkpoint.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # what a killed snapshot left
    then = f"{checkpoint.name} itself is saved: relaunch to resume from it and register it"
    with explaining_full_disk(f"the registration snapshot of {checkpoint.name}", queue, None, then, partial=tmp):
        queue.mkdir(parents=True, exist_ok=True)
        shutil.copytree(checkpoint, tmp, copy_function=link_or_copy)
        (tmp / REQUEST).write_text(json.dumps(request, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, dest)
    return dest


def link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError as err:  # a filesystem without hard links: the bytes are copied, in the loop (say so once)
        if err.errno in (*FULL, errno.EROFS):  # no room or no write at all: a copy cannot help
            raise
        if not getattr(link_or_copy, "warned", False):
            log.warning("registering checkpoints: no hard links on this filesystem; snapshots are copies")
            link_or_copy.warned = True  # type: ignore[attr-defined]
        shutil.copy2(src, dst)


def remove_snapshot(path: Path) -> None:
    """Delete a registered snapshot: renamed first, so that a kill half way never leaves it looking pending."""
    doomed = path.with_name(f".{path.name}.done")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def worker_command(queue: Path, cfg: MlflowConfig, run_id: str, tracking_uri: str) -> list[str]:
    """``python -m trainer register-checkpoints ...``: what the registrar runs, and what a person runs later."""
    command = ["python", "-m", "trainer", "register-checkpoints", str(queue), "--name", str(cfg.register_as)]
    command += ["--run-id", run_id, "--tracking-uri", tracking_uri]
    if cfg.checkpoint_alias:
        command += ["--alias", cfg.checkpoint_alias]
    return command


class CheckpointRegistrar:
    """Rank 0's queue of checkpoints to register, and the thread that empties it (module docstring).

    A checkpoint of step ``s`` is registered when ``s`` is a multiple of K x ``checkpoint.every_steps``
    (the K-th saves, the same steps whatever the resumes), except the last step's: the end of training
    registers that student itself."""

    def __init__(self, cfg: MlflowConfig, output_dir: Path, run: Tracker, *, save_every_steps: int, max_steps: int):
        self.cfg = cfg
        self.run = run
        self.queue = Path(output_dir) / QUEUE_DIR
        self.log_path = Path(output_dir) / WORKER_LOG
        self.every_steps = cfg.checkpoint_every * save_every_steps
        self.max_steps = max_steps
        self.wakeup = threading.Event()
        self.closing = threading.Event()
        self.deadline = float("inf")
        self.failing_since: float | None = None
        self.worker: subprocess.Popen | None = None
        self.lock = threading.Lock()  # between starting a worker (thread) and stopping it at the deadline (close)
        self.stopped = False
        self.restarting = False  # close() stopped the worker only to start it again at the normal policy
        self.refused = False  # the registry refused this user: no more tries in this run
        self.thread = threading.Thread(target=self.work, name="mlflow-registrar", daemon=True)
        self.thread.start()  # a relaunch's first job: the snapshots its killed predecessor left

    def submit(self, checkpoint: Path, request: dict[str, Any]) -> None:
        """Queue ``checkpoint`` (complete on every rank) if its step is due; returns once it is snapshotted."""
        step = request["step"]
        if step % self.every_steps or step == self.max_steps:
            return
        snapshot(checkpoint, self.queue, request)
        self.wakeup.set()

    def close(self, timeout: float) -> None:
        """Wait at most ``timeout`` seconds for the queue to be registered; report what is left."""
        self.deadline = time.monotonic() + timeout
        with self.lock:  # training is over: the worker in flight need not yield the cores any more (docstring)
            self.closing.set()  # under the lock: a worker started from now on does not yield
            if self.worker is not None and not stop_yielding(self.worker.pid):
                self.restarting = True
                self.worker.terminate()
        self.wakeup.set()
        self.thread.join(timeout)
        with self.lock:  # past the deadline with a worker in flight: stop it (what it registers is whole or absent)
            self.stopped = True
            if self.worker is not None:
                self.worker.terminate()
        self.thread.join(30)
        left = pending_snapshots(self.queue)
        if left:
            steps = ", ".join(str(json.loads((p / REQUEST).read_text())["step"]) for p in left)
            run_id = self.run.run_id or "RUN_ID"
            command = shlex.join(worker_command(self.queue, self.cfg, run_id, self.run.tracking_uri))
            log.error("MLflow: the students of steps %s are not registered yet (%s)", steps, self.log_path)
            print(f"Their snapshots stay in {self.queue}. Register them later with:\n  {command}", file=sys.stderr)

    # ------------------------------------------------------------------------------ the background thread
    def work(self) -> None:
        backoff = self.cfg.retry_initial_s
        while True:
            self.wakeup.clear()  # before looking: a submit from now on wakes the wait below
            pending = pending_snapshots(self.queue)
            if self.closing.is_set() and (not pending or time.monotonic() >= self.deadline):
                return
            if self.refused:  # the registry said no: nothing to retry; close() says what is left
                return
            if not pending or not self.run.created:  # nothing to do, or no run to log into yet
                self.wakeup.wait(None if not pending else 1.0)
                continue
            if self.register_pending():
                backoff = self.cfg.retry_initial_s
                continue
            self.wakeup.wait(min(backoff, max(0.0, self.deadline - time.monotonic())))
            backoff = min(backoff * 2, self.cfg.retry_max_s)

    def register_pending(self) -> bool:
        """One worker process over the whole queue; whether it registered everything."""
        command = [sys.executable, *worker_command(self.queue, self.cfg, self.run.run_id, self.run.tracking_uri)[1:]]
        command += ["--parent-pid", str(os.getpid())]
        env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        with self.lock, self.log_path.open("a", encoding="utf-8") as out:
            if self.stopped:
                return False
            self.worker = start_worker(command, out, env)
            if not self.closing.is_set():  # training runs: at once, as its imports alone are seconds of CPU
                yield_to_training(self.worker.pid)
        # A blocking wait: polling with a timeout would wake this thread 20 times a second, and each wake takes
        # the GIL from the training loop. close() stops the worker at the deadline.
        rc = self.worker.wait()
        self.worker = None
        if self.restarting:  # stopped by close() to run again at the normal policy: not a failure
            self.restarting = False
            return self.register_pending()
        if rc == REFUSED:  # no permission: one line, and no more tries in this run (the snapshots stay)
            refused = last_line(self.log_path).removeprefix("error: ")
            log.error("MLflow: %s; no more checkpoints are registered in this run", refused)
            self.refused = True
            return False
        if rc == 0:
            if self.failing_since is not None:
                log.info("MLflow: registering checkpoints again after %.0fs", time.monotonic() - self.failing_since)
            self.failing_since = None
            return True
        if self.failing_since is None:  # warn once per outage, not once per retry
            self.failing_since = time.monotonic()
            log.warning(
                "MLflow: registering a checkpoint failed (%s); training goes on, retrying in the background",
                last_line(self.log_path),
            )
        return False


class NullRegistrar:
    """The registrar of a process that registers nothing during training: the same calls, doing nothing."""

    def submit(self, checkpoint: Path, request: dict[str, Any]) -> None:
        """Nothing to register."""

    def close(self, timeout: float) -> None:
        """Nothing to wait for."""


def start_registrar(
    cfg: MlflowConfig,
    output_dir: Path,
    run: Tracker | NullTracker,
    *,
    is_main: bool,
    save_every_steps: int,
    max_steps: int,
) -> CheckpointRegistrar | NullRegistrar:
    """Rank 0's registrar when ``mlflow.register_checkpoints`` is set; everyone else's does nothing."""
    if not is_main or not cfg.checkpoint_every:
        return NullRegistrar()
    return CheckpointRegistrar(cfg, output_dir, run, save_every_steps=save_every_steps, max_steps=max_steps)


def start_worker(command: list[str], out: IO[str], env: dict[str, str]) -> subprocess.Popen:
    """``command`` started with its output into ``out``, not while a fork is in flight (:data:`STARTING`)."""
    with STARTING:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)


def yield_to_training(pid: int) -> None:
    """Let process ``pid`` run only on CPU time the training ranks leave idle: Linux's SCHED_IDLE class, below
    any nice level (nice 19 still takes a share of a busy core). Elsewhere, nice 19."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or the process has ended already
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, pid, 19)


def stop_yielding(pid: int) -> bool:
    """Undo :func:`yield_to_training` for process ``pid``: the normal policy for each of its threads (the
    policy is per thread, and threads started since inherited it; the main thread first, as it starts the
    others). False where this user may not (an unprivileged user cannot leave SCHED_IDLE or lower a nice
    level); True also when the process has ended."""
    try:
        threads = sorted(os.listdir(f"/proc/{pid}/task"), key=lambda tid: int(tid) != pid)
    except OSError:  # ended and reaped, or no /proc (not Linux: nice 19, which only a privileged user lowers)
        threads = None
    try:
        if threads is None:
            os.setpriority(os.PRIO_PROCESS, pid, 0)
        for tid in threads or []:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
    except PermissionError:
        return False
    except (ProcessLookupError, AttributeError):  # ended; or a platform without these calls: nothing to undo
        return True
    return True


def last_line(path: Path) -> str:
    lines = path.read_text(encoding="utf-8", errors="replace").strip().splitlines() if path.exists() else []
    return lines[-1][-300:] if lines else "no output"
