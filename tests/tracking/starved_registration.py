"""A checkpoint registration on a node that other work keeps busy, from submit to the end of training.

Run by ``test_registry_auth.py::test_a_registration_starved_by_a_busy_node_runs_once_training_ends`` as its own
process, so that the test can take CAP_SYS_NICE away from it (``setpriv``): a registrar that may not raise its
worker's priority has to start it again instead.

    python tests/tracking/starved_registration.py OUT_DIR TRACKING_URI FINISH_TIMEOUT_S

One CPU, this process pinned to it with a busy loop beside it (what a training rank or another job does to a
core); the registrar's thread and its worker inherit the pin. A snapshot is submitted as during training, and
five seconds later the worker's policy and its log are read; then ``close`` (the end of training) runs. The
registry is a real MLflow server that refuses the caller's credentials, so a worker that gets to run ends
quickly with one line saying so, and the registrar stops (no retries to wait out). Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from trainer.tracking.checkpoints import WORKER_LOG, CheckpointRegistrar
from trainer.tracking.config import MlflowConfig


class Run:
    """The training run the versions would belong to (what the registrar reads of a Tracker)."""

    created = True
    run_id = "0" * 32

    def __init__(self, tracking_uri: str) -> None:
        self.tracking_uri = tracking_uri


def main(out: Path, uri: str, finish_timeout_s: float) -> dict:
    checkpoint = out / "checkpoints" / "step-00000010"
    (checkpoint / "hf").mkdir(parents=True)
    (checkpoint / "mp_rank_00_model_states.pt").write_bytes(os.urandom(4096))
    (checkpoint / "hf" / "config.json").write_text("{}")

    # One CPU for this thread; the threads and processes it starts from now on inherit that.
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        cfg = MlflowConfig(register_as="starved", register_checkpoints=True, retry_initial_s=1.0)
        registrar = CheckpointRegistrar(cfg, out, Run(uri), save_every_steps=10, max_steps=20)
        registrar.submit(checkpoint, {"step": 10})
        time.sleep(5.0)  # training goes on
        worker = registrar.worker
        during = {
            "worker_running": worker is not None and worker.poll() is None,
            "policy": os.sched_getscheduler(worker.pid) if worker is not None else None,
            "log": (out / WORKER_LOG).read_text() if (out / WORKER_LOG).exists() else "",
        }
        start = time.monotonic()
        registrar.close(finish_timeout_s)  # the end of training
        closed_after_s = time.monotonic() - start
    finally:
        busy.kill()
    return {
        "during": during,
        "idle_policy": os.SCHED_IDLE,
        "closed_after_s": closed_after_s,
        "log": (out / WORKER_LOG).read_text(),
        "left": sorted(p.name for p in (out / "registering").iterdir() if not p.name.startswith(".")),
    }


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]))))
