"""``sbatch launch/slurm.sbatch`` on a real Slurm cluster of one machine, started by the test.

The fixture starts Debian's daemons (``munge``, ``slurm-wlm``) as a user's cluster runs them: munged
with a key generated for the test, slurmctld (the controller) and two slurmd (two nodes of 2 CPUs,
both this machine), all from one generated ``slurm.conf`` in a temporary directory, on ports the
system picks. The job is the user's command with CPU settings: one node, two tasks (ranks over
gloo), no GPU. It must train, export a student, and continue from its checkpoint when submitted
again with a larger ``max_steps`` - the resubmission a user makes when a job ends at its time
limit - here on two nodes of one task each, through the multi-node path of the script.

No accounting daemon runs: a job is followed with ``scontrol show job`` while the controller
remembers it (``MinJobAge``). The daemons need root (slurmd starts job steps as the submitting
user) and the packages; ``make setup`` installs them from apt when it runs as root, and elsewhere
the test skips and says which is missing.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from helpers import free_port, latest_step, records
from safetensors.torch import load_file
from test_launcher import check_student

REPO = Path(__file__).resolve().parents[2]
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "scancel")
JOB_TIMEOUT = 300
UNFINISHED = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}
# The user's command with the CPU test settings: sbatch options override the script's GPU defaults.
CPU_JOB = ["--cpus-per-task=1", "--gpus-per-node=0", "--time=10"]
ONE_NODE = ["--nodes=1", "--ntasks-per-node=2"]
TWO_NODES = ["--nodes=2", "--ntasks-per-node=1"]
NODES = ("node1", "node2")
SETTINGS = ["checkpoint.every_steps=3", "checkpoint.keep_last=2", "eval.every_steps=5", "logging.every_steps=1"]


# The daemons live in /usr/sbin, which not every user's PATH holds.
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def binary(name: str) -> str | None:
    return shutil.which(name, path=SEARCH_PATH)


def missing_requirement() -> str | None:
    """Why Slurm cannot be started here, or None."""
    missing = [name for name in DAEMONS + CLIENTS if binary(name) is None]
    if missing:
        return f"Slurm is not installed (no {', '.join(missing)}): `make setup` as root installs slurm-wlm and munge"
    if os.geteuid() != 0:
        return "slurmd must run as root to start job steps"
    return None


def slurm_conf(root: Path, host: str) -> str:
    """A controller and two nodes of 2 CPUs (``NODES``, one slurmd each, sharing this machine's cores,
    one job at a time) on 127.0.0.1, without cgroups (proctrack/linuxproc, task/none, which need
    nothing from the host) or accounting; every path inside ``root``. The node names resolve to no
    address, as on a cluster whose nodes are reached by the address in ``NodeAddr``.

    Job ids start at a random number: the script derives its rendezvous port from the job id, and
    two of these clusters on one machine (two test sessions) must not both number their first job 1.
    """
    first_job_id = random.randrange(1, 20000)
    nodes = "".join(f"NodeName={node} NodeAddr=127.0.0.1 Port={free_port()} CPUs=2\n" for node in NODES)
    return f"""\
ClusterName=encoder-distill-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
MinJobAge=600
FirstJobId={first_job_id}
{nodes}PartitionName=test Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


UNAVAILABLE = missing_requirement()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))]


@dataclass
class SlurmCluster:
    root: Path
    env: dict[str, str]
    jobs: list[str] = field(default_factory=list)

    def sbatch(self, *args: str) -> str:
        """Submit from the repository root, as the script's usage says; returns the job id."""
        proc = self.run("sbatch", "--parsable", *args)
        job = proc.stdout.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def wait(self, job: str) -> dict[str, str]:
        """Poll ``scontrol show job`` until the job has ended; returns its fields (JobState, ExitCode, ...)."""
        deadline = time.monotonic() + JOB_TIMEOUT
        while True:
            fields = dict(re.findall(r"(\w+)=(\S*)", self.run("scontrol", "--oneliner", "show", "job", job).stdout))
            if fields["JobState"] not in UNFINISHED:
                return fields
            if time.monotonic() > deadline:
                output = Path(fields["StdOut"])
                tail = output.read_text()[-6000:] if output.is_file() else "(no output)"
                pytest.fail(f"job {job} still {fields['JobState']} ({fields['Reason']}) after {JOB_TIMEOUT} s:\n{tail}")
            time.sleep(1)

    def run(self, *cmd: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(cmd, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}: {proc.stderr}\n{self.logs()}"
        return proc

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((self.root / "log").glob("*.log")))


def start_daemon(cmd: list[str], root: Path, name: str) -> subprocess.Popen:
    """In the foreground of its own process, so that the fixture can stop it and nothing outlives it."""
    log = (root / "log" / f"{name}.out").open("w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    # Not under pytest's temporary directory: munged serves its socket only from a directory that
    # everyone may traverse, and pytest's is private to its user.
    root = Path(tempfile.mkdtemp(prefix="encoder-distill-slurm-"))
    root.chmod(0o755)
    for sub in ("munge", "state", "log"):
        (root / sub).mkdir()
    (root / "munge").chmod(0o755)
    (root / "key").mkdir(mode=0o700)
    key = root / "key" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, host=socket.gethostname().split(".")[0]))  # slurmctld checks its own name
    # The submitting shell's environment, which sbatch passes on to every task: the cluster's
    # config, the project's python, CPU ranks.
    env = {**os.environ, "SLURM_CONF": str(conf), "PYTHON": sys.executable, "DS_ACCELERATOR": "cpu"}
    cluster = SlurmCluster(root, env)

    munge = [f"--socket={root}/munge/munge.socket", f"--key-file={key}", f"--log-file={root}/log/munged.log"]
    munge += [f"--pid-file={root}/munge/munged.pid", f"--seed-file={root}/munge/munged.seed"]
    daemons = [start_daemon([binary("munged"), "--foreground", *munge], root, "munged")]
    try:
        wait_for(lambda: (root / "munge" / "munge.socket").exists(), "munged's socket", cluster, daemons)
        daemons.append(start_daemon([binary("slurmctld"), "-D", "-f", str(conf)], root, "slurmctld"))
        for node in NODES:
            (root / "spool" / node).mkdir(parents=True)
            daemons.append(start_daemon([binary("slurmd"), "-D", "-f", str(conf), "-N", node], root, f"slurmd-{node}"))
        for node in NODES:
            wait_for(lambda node=node: node_state(cluster, node) == "IDLE", f"node {node} to be IDLE", cluster, daemons)
        yield cluster
    finally:
        stop(cluster, daemons)


def node_state(cluster: SlurmCluster, node: str) -> str | None:
    proc = subprocess.run(["scontrol", "show", "node", node], env=cluster.env, capture_output=True, text=True)
    found = re.search(r"State=(\w+)", proc.stdout)
    return found.group(1) if found else None


def wait_for(
    ready: Callable[[], bool], what: str, cluster: SlurmCluster, daemons: list[subprocess.Popen], timeout: float = 60
) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        dead = [p.args[0] for p in daemons if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            outs = "\n".join(p.read_text() for p in (cluster.root / "log").glob("*.out"))
            pytest.fail(f"waiting for {what}: {dead or 'timed out'}\n{outs}\n{cluster.logs()}")
        time.sleep(0.2)


def stop(cluster: SlurmCluster, daemons: list[subprocess.Popen]) -> None:
    """Cancel what is left of the jobs (their tasks belong to slurmstepd, not to slurmd), then stop
    the daemons, newest first, and remove the cluster's directory."""
    try:
        if cluster.jobs and all(proc.poll() is None for proc in daemons):
            subprocess.run(["scancel", *cluster.jobs], env=cluster.env, capture_output=True)
            for job in cluster.jobs:
                cluster.wait(job)
    finally:
        for proc in reversed(daemons):
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(cluster.root, ignore_errors=True)


def submit(
    slurm: SlurmCluster, layout: list[str], teacher: Path, data: Path, output_dir: Path, max_steps: int
) -> tuple[str, str]:
    """``sbatch [CPU_JOB + layout] launch/slurm.sbatch configs/tiny-cpu.yaml ...``; waits for the job to
    complete and returns its id and output."""
    output = output_dir.parent / "slurm-%j.out"
    args = [*CPU_JOB, *layout, f"--output={output}", "launch/slurm.sbatch", "configs/tiny-cpu.yaml"]
    args += [f"teacher={teacher}", f"data={data}", f"output_dir={output_dir}", f"max_steps={max_steps}", *SETTINGS]
    job = slurm.sbatch(*args)
    fields = slurm.wait(job)
    log = Path(str(output).replace("%j", job)).read_text()
    state = (fields["JobState"], fields["ExitCode"])
    assert state == ("COMPLETED", "0:0"), f"job {job}: {state}, reason {fields['Reason']}\n{log[-6000:]}"
    return job, log


def rendezvous(job: str) -> str:
    """The job's line naming where its ranks meet: node1's NodeAddr, on the port derived from the job id."""
    return f"rendezvous at 127.0.0.1:{10000 + int(job) % 20000} (node node1)"


@pytest.mark.full
def test_sbatch_trains_exports_and_resumes_when_resubmitted_on_two_nodes(
    slurm: SlurmCluster, tmp_path: Path, tiny_teacher_dir: Path, tiny_dataset_dir: Path
) -> None:
    out = tmp_path / "run"
    job, log = submit(slurm, ONE_NODE, tiny_teacher_dir, tiny_dataset_dir, out, max_steps=6)
    # srun started two ranks on one node, which formed one process group.
    assert f"2 task(s) on 1 node(s) (node1), {rendezvous(job)}" in log
    assert "on 2 rank(s)" in log
    assert [r["step"] for r in records(out) if "train/loss" in r] == list(range(1, 7))
    assert latest_step(out) == 6
    check_student(out / "student")
    first_export = load_file(out / "student" / "model.safetensors")

    # The same command with a larger max_steps, on two nodes of one task each (the same world of two
    # ranks, so the same data layout), continues from the checkpoint of step 6.
    job, log = submit(slurm, TWO_NODES, tiny_teacher_dir, tiny_dataset_dir, out, max_steps=10)
    assert f"2 task(s) on 2 node(s) (node[1-2]), {rendezvous(job)}" in log
    assert "resumed from step 6" in log and "data order changed" not in log
    train = [r for r in records(out) if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, 11))
    assert train[-1]["train/samples"] == 10 * 8
    assert latest_step(out) == 10
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir())
    assert checkpoints == ["step-00000009", "step-00000010"]
    check_student(out / "student")
    final = load_file(out / "student" / "model.safetensors")
    assert any(not torch.equal(final[k], first_export[k]) for k in final)
