"""The real launcher end to end: ``deepspeed --num_gpus 2 launch/run.sh configs/tiny-cpu.yaml ...``.

Two CPU ranks over gloo (DS_ACCELERATOR=cpu), a tiny BERT teacher and the real preprocessing
output. One uninterrupted ZeRO-2 run is the reference for everything else: a ZeRO-3 run, and a
run whose rank 1 is SIGKILLed mid-way and then relaunched, which must continue from its last
checkpoint and reproduce the reference's losses exactly.

Masked-LM pretraining (``teacher: null``, ``configs/pretrain-bert-mini.yaml`` at toy width) runs the
same way, in one run killed once and relaunched: it trains, the relaunch redoes the killed launch's steps to
the same losses, and it exports a masked LM that then serves as the teacher of a distillation run.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    FP16_OVERFLOW,
    check_fp16_overflows_were_skipped,
    console_log,
    finish_nodes,
    finish_run,
    latest_step,
    launch_run,
    record_fault,
    records,
    run_in_repo,
)
from helpers import kill_and_resume as kill_rank_and_resume
from helpers import train_losses as losses_of
from safetensors.torch import load_file

from common.config import load_config
from trainer.commands.export import load_student
from trainer.config import TrainConfig
from trainer.runtime.data import SAMPLE_TRACE_ENV
from trainer.runtime.optim import lr_factor, warmup_steps

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 20
TEST_SETTINGS = [
    f"max_steps={MAX_STEPS}",
    "checkpoint.every_steps=5",
    "checkpoint.keep_last=2",
    "eval.every_steps=10",
    "logging.every_steps=1",
]
LOSS_KEYS = ("train/loss", "train/ce", "train/mlm", "train/cos")
RUN_TIMEOUT = 300
ZERO3 = "deepspeed.config=configs/deepspeed/zero3.json"


def start(
    teacher: Path, data: Path, output_dir: Path, *overrides: str, config: str = "configs/tiny-cpu.yaml", **how: Any
) -> subprocess.Popen:
    """``deepspeed --num_gpus 2 launch/run.sh configs/tiny-cpu.yaml ...`` in the background (``how``: see
    :func:`launch`)."""
    return launch(config, output_dir, f"teacher={teacher}", f"data={data}", *overrides, **how)


def launch(config: str, output_dir: Path, *overrides: str, **how: Any) -> subprocess.Popen:
    """``deepspeed --num_gpus 2 launch/run.sh CONFIG output_dir=... TEST_SETTINGS ...`` on two CPU ranks
    (``how``: the launcher's arguments, a log name, environment; see :func:`helpers.launch_run`)."""
    return launch_run(config, output_dir, *TEST_SETTINGS, *overrides, **how)


def finish(proc: subprocess.Popen, output_dir: Path, log_name: str = "") -> None:
    finish_run(proc, output_dir, RUN_TIMEOUT, log_name)


def run(teacher: Path, data: Path, output_dir: Path, *overrides: str) -> Path:
    finish(start(teacher, data, output_dir, *overrides), output_dir)
    return output_dir


def train_losses(output_dir: Path, keys: tuple[str, ...] = LOSS_KEYS) -> dict[int, dict[str, float]]:
    return losses_of(output_dir, keys)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, tiny_teacher_dir: Path, tiny_dataset_dir: Path) -> Path:
    """Also traces the sample keys every rank consumed, into ``samples/`` beside the output directory."""
    out = tmp_path_factory.mktemp("zero2") / "run"
    finish(start(tiny_teacher_dir, tiny_dataset_dir, out, env={SAMPLE_TRACE_ENV: str(out.parent / "samples")}), out)
    return out


def consumed_samples(trace: Path, steps_per_rank: int | None = None) -> collections.Counter[str]:
    """The keys of the samples the ranks consumed (``ENCODER_DISTILL_SAMPLE_TRACE``), in the first
    ``steps_per_rank`` micro-batches of each rank's trace if given."""
    keys: collections.Counter[str] = collections.Counter()
    for path in trace.glob("rank-*.jsonl"):
        for line in path.read_text().splitlines()[:steps_per_rank]:
            keys.update(json.loads(line)["keys"])
    return keys


@pytest.fixture(scope="module")
def zero3_runs(tmp_path_factory, tiny_teacher_dir: Path, tiny_dataset_dir: Path) -> tuple[Path, Path]:
    """Two ZeRO-3 runs launched on this machine at once, 2 s apart, neither given a port: the plain one (which
    also profiles steps 3 and 4; the profiler changes no number) and one with ``objective.vocab_multiple=64``.
    Both must finish: on the launcher's fixed default port 29500 the second either died on EADDRINUSE or its
    ranks joined the first run's group and both crashed; each now meets on a port the system picked for it
    (trainer.runtime.engine)."""
    root = tmp_path_factory.mktemp("zero3")
    profile = ("profile.steps=2", "profile.start_step=3", "profile.trace=true")
    plain = root / "run"
    first = start(tiny_teacher_dir, tiny_dataset_dir, plain, ZERO3, *profile)
    time.sleep(2)  # the first run's ranks are meeting by now
    padded = root / "padded"
    try:
        finish(start(tiny_teacher_dir, tiny_dataset_dir, padded, ZERO3, "objective.vocab_multiple=64"), padded)
    finally:
        finish(first, plain)
    return plain, padded


@pytest.fixture(scope="module")
def zero3_run(zero3_runs: tuple[Path, Path]) -> Path:
    return zero3_runs[0]


def check_finished_run(output_dir: Path) -> None:
    losses = train_losses(output_dir)
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    assert all(math.isfinite(v) for step in losses.values() for v in step.values())
    first = sum(losses[s]["train/loss"] for s in range(1, 6)) / 5
    last = sum(losses[s]["train/loss"] for s in range(MAX_STEPS - 4, MAX_STEPS + 1)) / 5
    assert last < first - 0.1, f"loss did not fall: first steps {first:.4f}, last steps {last:.4f}"

    train = [r for r in records(output_dir) if "train/loss" in r]
    assert train[-1]["train/samples"] == MAX_STEPS * 8
    lrs = [r["train/lr"] for r in train]  # 1 warmup step (5% of 20) at the peak, then linear decay
    assert lrs[0] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-3 / 19)
    assert all(a > b for a, b in itertools.pairwise(lrs[1:]))
    assert all(r["train/tokens_per_s"] > 0 and r["train/grad_norm"] > 0 for r in train)
    assert all(0 <= r["train/data_wait_share"] < 1 for r in train)
    assert not any("train/max_memory_gib" in r for r in train)  # CUDA only
    evals = [r for r in records(output_dir) if "eval/student_mlm_loss" in r]
    assert [r["step"] for r in evals] == [10, 20]
    assert "eval/teacher_mlm_loss" in evals[0] and "eval/top1_agreement" in evals[1]
    assert 0 <= evals[1]["eval/student_mlm_accuracy"] <= 1
    # The student's last hidden states against the teacher's, summed over both ranks' batches.
    assert all(-1 <= r["eval/hidden_cosine"] <= 1 and -1 <= r["eval/centred_cosine"] <= 1 for r in evals)

    # keep_last=2 of the checkpoints at steps 5, 10, 15, 20
    checkpoints = sorted(p.name for p in (output_dir / "checkpoints").iterdir() if p.is_dir())
    assert checkpoints == ["step-00000015", "step-00000020"]
    assert latest_step(output_dir) == MAX_STEPS


def check_student(student_dir: Path) -> None:
    from transformers import AutoModelForMaskedLM, pipeline

    assert (student_dir / "model.safetensors").is_file() and (student_dir / "tokenizer.json").is_file()
    model = AutoModelForMaskedLM.from_pretrained(student_dir)
    assert model.config.num_hidden_layers == 2  # every other layer of the 4-layer teacher
    fill = pipeline("fill-mask", model=str(student_dir))
    predictions = fill("The [MASK] module provides regular expression matching.")
    assert len(predictions) == 5 and all(0 <= p["score"] <= 1 for p in predictions)


@pytest.mark.full
def test_zero2_run_trains_checkpoints_and_exports(reference_run: Path) -> None:
    check_finished_run(reference_run)
    check_student(reference_run / "student")


def seconds(text: str) -> int:
    """``42s`` / ``3m07s`` / ``2h05m`` (trainer.runtime.metrics.duration) -> seconds."""
    h, m, s = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text).groups()
    return 3600 * int(h or 0) + 60 * int(m or 0) + int(s or 0)


@pytest.mark.full
def test_step_lines_show_elapsed_time_and_a_sane_eta(reference_run: Path) -> None:
    log = (reference_run.parent / f"{reference_run.name}.log").read_text()
    lines = re.findall(rf"^step (\d+)/{MAX_STEPS} \| loss .* \| elapsed (\w+) \| eta (\w+)$", log, re.MULTILINE)
    assert [int(step) for step, _, _ in lines] == list(range(1, MAX_STEPS + 1))
    elapsed = [seconds(e) for _, e, _ in lines]
    eta = [seconds(e) for _, _, e in lines]
    assert elapsed == sorted(elapsed) and elapsed[-1] > 0
    assert eta[-1] == 0 and eta[MAX_STEPS // 2] > 0
    total = elapsed[-1]  # halfway, elapsed + eta predicts the end within a factor of 3
    assert total / 3 <= elapsed[MAX_STEPS // 2 - 1] + eta[MAX_STEPS // 2 - 1] <= total * 3


@pytest.mark.full
def test_zero3_run_trains_like_zero2_and_exports(zero3_run: Path, reference_run: Path) -> None:
    check_finished_run(zero3_run)
    check_student(zero3_run / "student")
    zero2, zero3 = train_losses(reference_run), train_losses(zero3_run)
    for step in zero2:
        assert zero3[step]["train/loss"] == pytest.approx(zero2[step]["train/loss"], rel=1e-4)


@pytest.mark.full
def test_a_padded_vocabulary_trains_like_the_plain_one_under_zero3_and_exports_a_plain_student(
    zero3_runs: tuple[Path, Path],
) -> None:
    """``objective.vocab_multiple=64`` through the real engine, with ZeRO-3 partitioning the decoder's (tied)
    weight: the plain ZeRO-3 run's losses, and a student exported with the tokenizer's 30,522 rows. The two
    ran at once (``zero3_runs``): two launches on one machine, neither given a port, both finish."""
    zero3_run, out = zero3_runs
    check_finished_run(out)
    check_student(out / "student")
    plain, padded = train_losses(zero3_run), train_losses(out)
    for step in plain:
        assert padded[step]["train/loss"] == pytest.approx(plain[step]["train/loss"], rel=1e-5), step
    assert load_file(out / "student" / "model.safetensors")["bert.embeddings.word_embeddings.weight"].shape[0] == 30522


@pytest.mark.full
def test_profiled_steps_say_where_each_ranks_time_went(zero3_run: Path) -> None:
    """``profile.steps``: each rank writes its summary (JSON and Markdown) and its timeline."""
    for rank in (0, 1):
        summary = json.loads((zero3_run / f"profile-rank{rank}.json").read_text())
        assert summary["steps"] == 2 and summary["first_step"] == 3 and summary["time"] == "cpu"
        assert summary["categories_ms_per_step"]["matmul"] > 0 and summary["wall_ms_per_step"] > 0
        assert any(name.startswith("aten::") for name, _, _ in summary["top_ops"])
        assert "| category | ms/step | share |" in (zero3_run / f"profile-rank{rank}.md").read_text()
        assert json.loads((zero3_run / f"profile-rank{rank}-trace.json").read_text())["traceEvents"]


@pytest.mark.full
def test_export_command_from_a_zero3_checkpoint(zero3_run: Path, tmp_path: Path) -> None:
    dest = tmp_path / "exported"
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "export", str(zero3_run), str(dest)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_student(dest)
    # The latest checkpoint's partitions consolidate to exactly the weights the run exported...
    final, exported = load_file(zero3_run / "student" / "model.safetensors"), load_file(dest / "model.safetensors")
    assert final.keys() == exported.keys()
    assert all(torch.equal(final[k], exported[k]) for k in final)
    # ... and an earlier checkpoint to the earlier weights.
    earlier, _ = load_student(zero3_run / "checkpoints" / "step-00000015")
    assert any(not torch.equal(final[k], v) for k, v in earlier.state_dict().items() if k in final)


@pytest.mark.full
def test_zero_steps_export_the_student_as_a_run_starts_it(
    tmp_path: Path, tiny_teacher_dir: Path, tiny_dataset_dir: Path, reference_run: Path
) -> None:
    """``max_steps=0`` through the real launcher on two ranks: the student a run with this config starts
    from (the baseline a distilled student has to beat), exported where a run exports, and nothing else."""
    out = run(tiny_teacher_dir, tiny_dataset_dir, tmp_path / "run", "max_steps=0")
    check_student(out / "student")
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
    untrained = load_file(out / "student" / "model.safetensors")
    teacher = load_file(tiny_teacher_dir / "model.safetensors")
    teacher_layer = [0, 3]  # DistilBERT's map for 4 -> 2 layers: the first and the last
    for key, value in untrained.items():  # copied exactly, the embeddings and the MLM head too
        layer = re.fullmatch(r"bert\.encoder\.layer\.(\d+)\.(.+)", key)
        source = f"bert.encoder.layer.{teacher_layer[int(layer[1])]}.{layer[2]}" if layer else key
        expected = teacher[source][:1] if key.endswith("token_type_embeddings.weight") else teacher[source]
        assert torch.equal(value, expected), key
    # The same tensors a trained run exports: the baseline fine-tunes like any student.
    assert untrained.keys() == load_file(reference_run / "student" / "model.safetensors").keys()


@pytest.mark.full
def test_a_compiled_run_trains_like_the_reference_and_exports_a_plain_student(
    reference_run: Path, tiny_teacher_dir: Path, tiny_dataset_dir: Path, tmp_path: Path
) -> None:
    """``compile=true`` through the real engine: the same training (the first loss differs from the eager run's
    only by the compiled dropout's own random stream), checkpoints, and a student exported without traces of
    the compiler (no ``_orig_mod`` keys: it loads and fills masks)."""
    out = run(tiny_teacher_dir, tiny_dataset_dir, tmp_path / "run", "compile=true")
    check_finished_run(out)
    check_student(out / "student")
    first, reference = train_losses(out)[1]["train/loss"], train_losses(reference_run)[1]["train/loss"]
    assert first == pytest.approx(reference, rel=0.01)


@pytest.mark.full
@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_fp16_supported(),
    reason="DeepSpeed's CPU accelerator trains in fp16 only where oneDNN has fp16 kernels (AVX512-FP16 or AMX)",
)
def test_fp16_overflowing_steps_are_skipped_not_fatal(
    tmp_path: Path, tiny_teacher_dir: Path, tiny_dataset_dir: Path
) -> None:
    """fp16 on two CPU ranks with a loss scale of 2**32: the loss scaler skips the overflowing steps (on every
    rank: the overflow is all-reduced) and halves the scale, and the run trains on to the end, where the
    non-finite guard would have stopped it. The same check runs on a GPU in tests/gpu."""
    out = run(tiny_teacher_dir, tiny_dataset_dir, tmp_path / "run", *FP16_OVERFLOW, "max_steps=30")
    check_fp16_overflows_were_skipped(out, 30)


# The fast tier's one real launcher run, killed and resumed (tests/tiers.py): about 30 s on 2 cores.
@pytest.mark.fast_budget(90)
def test_killed_rank_resumes_from_last_checkpoint_with_identical_losses(
    tmp_path: Path, tiny_teacher_dir: Path, tiny_dataset_dir: Path, reference_run: Path
) -> None:
    out = tmp_path / "run"
    kill_and_resume(lambda: start(tiny_teacher_dir, tiny_dataset_dir, out), out)
    # Same steps, same samples, same masks, same dropout: the losses are bit-identical.
    assert train_losses(out) == train_losses(reference_run)
    check_student(out / "student")


@pytest.mark.full
def test_a_dataset_in_an_object_store_trains_and_waits_out_an_outage_like_its_local_copy(
    tmp_path: Path,
    tiny_teacher_dir: Path,
    tiny_dataset_dir: Path,
    reference_run: Path,
    moto_server,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``data=s3://...`` on a real S3 server, reached through boto3's usual environment and a proxy that can cut it
    off: the launch starts while the store is away (back once a read has failed), waits it out, and trains to the
    losses of the reference run over the local dataset, step for step. The dataset is the local one uploaded:
    ``python -m preprocessing ... output=s3://...`` writes the same bytes and manifest
    (tests/preprocessing/test_preprocess_s3.py), and a loader restarted from its state on the store goes on as the
    local one does (tests/trainer/test_storage.py), as a relaunch's does (the fast tier's killed rank)."""
    import threading

    from helpers import S3_CREDENTIALS, TcpProxy

    from trainer.commands import plan as plan_command
    from trainer.runtime import storage

    url = moto_server.upload(tiny_dataset_dir, "launcher", "tiny")
    proxy = TcpProxy(moto_server.port)
    env = {**S3_CREDENTIALS, "AWS_ENDPOINT_URL": proxy.url}
    out = tmp_path / "run"

    def restore_after_a_failed_read() -> None:
        deadline = time.monotonic() + 120
        while f"reading {url}/manifest.json failed" not in console_log(out).read_text():
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        proxy.restore()

    proxy.down()  # away when the run starts, back once a read of it has failed
    proc = start(tiny_teacher_dir, url, out, env=env)
    threading.Thread(target=restore_after_a_failed_read, daemon=True).start()
    finish(proc, out)
    assert train_losses(out) == train_losses(reference_run)
    log = console_log(out).read_text()
    assert f"reading {url}/manifest.json failed" in log and "retry in" in log
    # `trainer plan` finds it there too (in this process: the command's own start is tests/trainer/test_plan.py's)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    storage.CLIENTS.clear()  # a client reads the environment when it is made
    try:
        capsys.readouterr()
        assert plan_command.main([str(REPO / "configs" / "tiny-cpu.yaml"), f"data={url}", f"teacher={tiny_teacher_dir}",
                                  "--json"]) == 0  # fmt: skip
        assert json.loads(capsys.readouterr().out)["data"]["found"] is True
    finally:
        storage.CLIENTS.clear()


def two_nodes(out: Path, teacher: Path, data: Path, *overrides: str, log_name: str = "") -> list[subprocess.Popen]:
    """Two launcher invocations acting as two machines of one CPU rank each: one hostfile, ``--no_ssh``, each
    its ``--node_rank``, the first node's address and an explicit port."""
    from helpers import free_port

    hostfile = out.parent / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    first_node = ("--master_addr=127.0.0.1", f"--master_port={free_port()}")
    return [
        launch(
            "configs/tiny-cpu.yaml",
            out,
            f"teacher={teacher}",
            f"data={data}",
            *overrides,
            launcher=("--hostfile", str(hostfile), "--no_ssh", f"--node_rank={node}", *first_node),
            log_name=f"node{node}{log_name}",
        )
        for node in (0, 1)
    ]


# The faults one two-node run meets in turn, one per checkpoint interval: (the node lost, how).
NODE_FAULTS = [(1, "killed"), (1, "frozen"), (0, "frozen")]
PEER_TIMEOUT_S = 5  # deepspeed.peer_timeout_s's least value: a survivor waits this long plus a heartbeat


def until(done: Callable[[], bool], nodes: list[subprocess.Popen], what: str) -> None:
    """Poll ``done`` while every node runs; fail saying that ``what`` never happened if one ends first or the time
    (RUN_TIMEOUT) is up."""
    deadline = time.monotonic() + RUN_TIMEOUT
    while not done():
        assert all(p.poll() is None for p in nodes) and time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.02)


def lose_a_node(out: Path, nodes: list[subprocess.Popen], log_name: str, lost: int, how: str) -> dict[str, Any]:
    """Once the run has saved a checkpoint newer than the one it started from and logged a step past it, every
    process of node ``lost`` (of the launches ``nodes``, logged as ``node0LOG_NAME`` and ``node1LOG_NAME``) is
    SIGKILLed (``killed``) or SIGSTOPped (``frozen``); the other node must stop, within the peer timeout, with one
    line naming the rank (and node) it lost. Returns what happened: the seconds the survivor took (``stop_s``), the
    checkpoint a relaunch resumes from and the last step logged."""
    import psutil

    started_from = latest_step(out)

    def past_a_new_checkpoint() -> bool:
        saved = latest_step(out)
        return saved not in (None, started_from) and max(train_losses(out), default=0) > saved

    until(past_a_new_checkpoint, nodes, "a checkpoint and a step past it")
    frozen = [psutil.Process(nodes[lost].pid), *psutil.Process(nodes[lost].pid).children(recursive=True)]
    for p in frozen:
        p.send_signal(signal.SIGSTOP if how == "frozen" else signal.SIGKILL)
    stopped_at = time.monotonic()
    survivor = nodes[1 - lost]
    assert survivor.wait(timeout=120) != 0
    took = time.monotonic() - stopped_at
    for p in frozen:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    nodes[lost].wait(timeout=60)
    log = console_log(out, f"node{1 - lost}{log_name}").read_text()
    if how == "killed":
        said = r"rank 0: rank 1 \(node 1\) stopped answering: a collective failed \(\w+Error: .*\); stopping this rank"
    elif lost == 1:
        said = r"rank 0: rank 1 \(node 1\) has not answered for \d+ s: its node died or froze; stopping this rank"
    else:
        # rank 0 hosts the rendezvous store: whichever falls silent first in the watch's eyes is named
        store = r"(the rendezvous store at 127\.0\.0\.1:\d+ \()?"
        said = rf"rank 1: {store}rank 0 \(node 0\)('s process\))? has not answered"
    assert re.search(said, log), log[-3000:]
    # the peer timeout + a heartbeat + the launcher's teardown, on a loaded machine
    assert took < PEER_TIMEOUT_S + 35, f"the surviving node took {took:.0f} s to stop"
    return {"stop_s": took, "resume_from": latest_step(out), "logged": max(train_losses(out))}


@pytest.mark.full
def test_a_node_that_freezes_mid_step_stops_the_other_within_the_peer_timeout_and_both_resume(
    tmp_path: Path, tiny_teacher_dir: Path, tiny_dataset_dir: Path, reference_run: Path
) -> None:
    """Two launcher invocations act as two machines of one CPU rank each (:func:`two_nodes`), as a cluster without
    passwordless ssh starts them; they form one world of two ranks (not two runs of one: the free-port rendezvous
    of a one-node launch must stand aside) whose losses are the one-node run's.

    A node frozen mid-step (SIGSTOP: its sockets stay open, as a node that lost power or its network leaves
    them) would hold the other inside a collective until the process group's 10-minute timeout. With
    ``deepspeed.peer_timeout_s`` set the other node stops within about that plus a heartbeat, with one line naming
    the lost rank and node: for node 1, its heartbeat counter stopped; for node 0, the rendezvous store it hosts
    stopped answering (or its counter). A node whose processes are killed (SIGKILL: its connections close) fails
    the collective at once; the other names it in the same kind of line instead of the transport's traceback.

    One run meets the three faults in turn (:data:`NODE_FAULTS`), one per checkpoint interval: each relaunch of
    both nodes resumes from the last complete checkpoint before its fault, and the steps of all four launches
    together are the uninterrupted one-node run's, loss for loss."""
    out = tmp_path / "run"
    settings = (tiny_teacher_dir, tiny_dataset_dir, f"deepspeed.peer_timeout_s={PEER_TIMEOUT_S}")
    name, faults = "", []
    nodes = two_nodes(out, *settings)
    for n, (lost, how) in enumerate([*NODE_FAULTS, (None, None)]):
        if faults:  # relaunch both nodes: back to training once they log a step, from the fault's last checkpoint
            relaunched, logged, name = time.monotonic(), len(records(out)), f"-relaunch{n}"
            nodes = two_nodes(out, *settings, log_name=name)
            until(lambda: len(records(out)) > logged, nodes, "a step of the relaunch")  # noqa: B023
            faults[-1]["recovery_s"] = time.monotonic() - relaunched
            for node in (0, 1):
                log = console_log(out, f"node{node}{name}").read_text()
                assert f"nnodes=2, num_local_procs=1, node_rank={node}" in log and "dist_world_size=2" in log
            assert f"resumed from step {faults[-1]['resume_from']}" in console_log(out, f"node0{name}").read_text()
        if lost is not None:
            faults.append({"lost": lost, "how": how, **lose_a_node(out, nodes, name, lost, how)})
    finish_nodes({f"node{node}{name}": proc for node, proc in enumerate(nodes)}, out, RUN_TIMEOUT)
    assert [f["resume_from"] for f in faults] == [5, 10, 15]  # one fault per checkpoint interval
    # All launches' steps together, as two nodes of one rank each: the one-node two-rank run's losses.
    assert train_losses(out) == train_losses(reference_run)
    check_student(out / "student")
    for fault in faults:
        lost, how = fault["lost"], fault["how"]
        signal_name = "SIGSTOP" if how == "frozen" else "SIGKILL"
        store = ", the rendezvous store with it" if lost == 0 else ""
        record_fault(
            f"node-{lost}-{how}",
            fault=f"node {lost} of 2 {how} mid-step ({signal_name}{store})",
            injected=1,
            kinds={signal_name: 1},
            outcome=f"the other node stopped with one line naming rank {lost} (node {lost}); both relaunched, resumed "
            f"from step {fault['resume_from']}, losses equal to the uninterrupted run's",
            data_lost=0,
            stop_s=fault["stop_s"],
            recovery_s=[fault["recovery_s"]] * 2,  # relaunch to its first step logged
            steps_redone=[fault["logged"] - fault["resume_from"]] * 2,
        )


@pytest.mark.full
def test_a_full_disk_fails_the_save_in_one_line_keeps_latest_and_the_relaunch_resumes(
    tmp_path: Path, tiny_teacher_dir: Path, tiny_dataset_dir: Path, reference_run: Path
) -> None:
    """The run's output on a 200 MB filesystem that fills up after the first checkpoint (a ballast file leaves 4 MB,
    less than a save's ~33 MB): the next save fails the run with one line naming the checkpoint, the bytes it
    needs and those free; its partial step directory is removed (the free space is what it was before the save),
    and ``latest`` still names the last complete checkpoint, intact. Relaunched before any space is freed, the run
    stops at its start check, in seconds and before any weight loads, with one line saying what the checkpoints
    and the export need. With the space back, the same command resumes from it and trains as the uninterrupted
    run did. An export into the full filesystem fails the same way and publishes nothing."""
    from helpers import check_latest_is_complete, fill, small_tmpfs

    with small_tmpfs(tmp_path / "disk", 200) as disk:
        out = disk / "run"
        proc = start(tiny_teacher_dir, tiny_dataset_dir, out)
        deadline = time.monotonic() + RUN_TIMEOUT
        while latest_step(out) is None:
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.005)
        ballast = fill(disk, leave_bytes=4 * 2**20)
        filled, before = time.monotonic(), shutil.disk_usage(disk).free
        assert proc.wait(timeout=RUN_TIMEOUT) != 0
        stopped = time.monotonic() - filled
        log = console_log(out).read_text()
        said = (
            r"error: \[Errno 28\] writing checkpoint step-0*(\d+) into \S+: .+; it needs about ([\d,]+) bytes, "
            r"([\d,]+) bytes are free there; `latest` still names step-0*(\d+): relaunch to resume from it\n"
        )
        failed, needed, free, kept = re.search(said, log).groups()
        assert latest_step(out) == int(kept) < int(failed) and int(free.replace(",", "")) < int(needed.replace(",", ""))
        check_latest_is_complete(out)
        assert not (out / "checkpoints" / f"step-{int(failed):08d}").exists()  # the partial save went with it
        assert shutil.disk_usage(disk).free >= before - 2**20  # its bytes too (a metrics line or two stay)

        started = time.monotonic()  # the same command, no space freed: refused at the start
        refused = start(tiny_teacher_dir, tiny_dataset_dir, out, log_name="refused")
        assert refused.wait(timeout=RUN_TIMEOUT) != 0
        took = time.monotonic() - started
        log = console_log(out, "refused").read_text()
        room = re.search(r"error: output_dir: \S+ has [\d.]+ [kMG]?B free, but the run needs .+\n", log)
        assert room is not None and "free space there, lower checkpoint.keep_last" in room.group(0), log[-3000:]
        assert "distilling" not in log and latest_step(out) == int(kept)  # stopped before any weight loaded
        assert took < 120  # the launcher's start and the ranks' imports: the check itself takes under a second

        ballast.unlink()
        relaunched = time.monotonic()
        finish(start(tiny_teacher_dir, tiny_dataset_dir, out), out)
        log = console_log(out).read_text()
        assert f"resumed from step {kept}" in log
        assert re.search(r"data: 8 train \+ 2 valid shards present, .+; output_dir: .+ free, needs .+\n", log)
        assert train_losses(out) == train_losses(reference_run)
        record_fault(
            "full-disk",
            fault="the checkpoint filesystem fills up mid-run (a real 200 MB filesystem, 4 MB left)",
            injected=1,
            kinds={"ENOSPC on a save": 1, "ENOSPC on an export": 1},
            outcome=f"one line naming checkpoint step {failed}, {needed} bytes needed, {free} free, {stopped:.0f} s "
            f"after the disk filled; its partial directory removed, `latest` kept step {kept}, intact; relaunched "
            f"without room: refused at the start in {took:.0f} s, one line, no weight loaded; relaunched with room: "
            "resumed, losses equal to the uninterrupted run's; the export published nothing",
            data_lost=0,
            stop_s=None,
            recovery_s=[time.monotonic() - relaunched] * 2,
            steps_redone=[int(failed) - int(kept)] * 2,
        )

        fill(disk, leave_bytes=2**20)
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        done = run_in_repo([sys.executable, "-m", "trainer", "export", str(out), str(disk / "again")], env, 120)
        assert done.returncode == 2 and "error: [Errno 28] writing the student" in done.stderr, done.stderr[-2000:]
        assert not [p for p in disk.iterdir() if "again" in p.name]  # neither the student nor a partial one


OPTIMIZER_LINE = r"optimizer step (\d+), \|exp_avg\| (\S+), \|exp_avg_sq\| (\S+)"


@pytest.mark.full
@pytest.mark.parametrize("stages", [(1, 2, 1), (3, 3, 3)], ids=["zero1-zero2-zero1", "zero3"])
def test_a_run_resumes_on_fewer_and_on_more_ranks_with_its_optimizer_and_data_position(
    tmp_path: Path, tiny_teacher_dir: Path, tiny_dataset_dir: Path, reference_run: Path, stages: tuple[int, ...]
) -> None:
    """3 steps on 2 ranks, 3 more on 1 (from a checkpoint of 2), 3 more on 2 (from a checkpoint of 1), each
    launch resuming through the universal checkpoint, under the ZeRO stage ``stages`` names for it. ZeRO-1 and
    -2 share one optimizer, checkpoint layout, conversion and universal loader (DeepSpeed's stage_1_and_2.py;
    they differ in how gradients are reduced, which no checkpoint holds): one sequence saves and loads under
    each, across both changes of world size. ZeRO-3 (its own layout and loader) has a sequence of its own.
    Adam's state comes along each time (the same step count and moment norms after the load as at the save,
    and 9 steps at the end), and the three launches together consume exactly the samples of the reference
    run's first 9 steps: within the epoch no sample is skipped or seen twice across either change."""
    out, trace = tmp_path / "run", tmp_path / "samples"
    for stage, (ranks, max_steps) in zip(stages, ((2, 3), (1, 6), (2, 9)), strict=True):
        proc = start(
            tiny_teacher_dir,
            tiny_dataset_dir,
            out,
            f"deepspeed.config=configs/deepspeed/zero{stage}.json",
            f"max_steps={max_steps}",
            launcher=("--num_gpus", str(ranks)),
            env={SAMPLE_TRACE_ENV: str(trace)},
        )
        finish(proc, out)

    log = console_log(out).read_text()
    assert "saved by 2 rank(s), this launch has 1: loading its universal form" in log
    assert "saved by 1 rank(s), this launch has 2: loading its universal form" in log
    saved = {m[0]: m[1:] for m in re.findall(rf"saved checkpoint \S+/step-0*(\d+) in [\d.]+ s: {OPTIMIZER_LINE}", log)}
    resumed = {m[0]: m[1:] for m in re.findall(rf"resumed from step (\d+) in \S+: {OPTIMIZER_LINE}", log)}
    assert sorted(resumed, key=int) == ["3", "6"]
    for step, (adam_step, exp_avg, exp_avg_sq) in resumed.items():
        assert adam_step == step == saved[step][0]
        assert float(exp_avg) == pytest.approx(float(saved[step][1]), rel=1e-5) and float(exp_avg) > 0
        assert float(exp_avg_sq) == pytest.approx(float(saved[step][2]), rel=1e-5)
    assert saved["9"][0] == "9"  # the resumed optimizer kept counting from the loaded step

    assert sorted(train_losses(out)) == list(range(1, 10))
    assert all(math.isfinite(v) for step in train_losses(out).values() for v in step.values())
    # Each launch follows its own schedule (max_steps 3, 6, 9) from the step it resumed at, although the
    # checkpoint's optimizer held the last launch's lr (zero at its last step).
    opt = load_config(TrainConfig, REPO / "configs" / "tiny-cpu.yaml").optimizer
    lrs = {r["step"]: r["train/lr"] for r in records(out) if "train/lr" in r}
    for step, lr in lrs.items():
        max_steps = 3 * math.ceil(step / 3)
        expected = opt.lr * lr_factor(step - 1, max_steps, warmup_steps(max_steps, opt.warmup_fraction))
        assert lr == pytest.approx(expected, rel=1e-6), (step, lr, expected)
    assert lrs[4] > 0 and lrs[7] > 0
    # 9 steps of 8 samples; the reference's 2 ranks take 2 micro-batches each per step.
    assert consumed_samples(trace) == consumed_samples(reference_run.parent / "samples", 9 * 2)
    assert sum(consumed_samples(trace).values()) == 9 * 8


def kill_and_resume(launch_run: Callable[[], subprocess.Popen], out: Path) -> list[dict]:
    """SIGKILL rank 1 two steps after a checkpoint, relaunch, check that it resumed from that checkpoint; the
    records the killed launch logged."""
    return kill_rank_and_resume(launch_run, out, rank=1, max_steps=MAX_STEPS, timeout=RUN_TIMEOUT)


# ----------------------------------------------------------------------- pretraining, no teacher
PRETRAIN_LOSS_KEYS = ("train/loss", "train/mlm")


def start_pretraining(tokenizer: Path, data: Path, output_dir: Path, *overrides: str) -> subprocess.Popen:
    """The BERT-Mini pretraining preset at toy width, with the settings of ``configs/tiny-cpu.yaml``."""
    toy = ["student.num_layers=2", "student.hidden_size=64", "student.num_attention_heads=4"]
    toy += ["student.intermediate_size=128", "global_batch_size=8", "micro_batch_size=2", "loader.shuffle_buffer=64"]
    toy += ["loader.num_workers=1", "eval.max_batches=2", "mlflow.enabled=false", "optimizer.warmup_fraction=0.05"]
    return launch(
        "configs/pretrain-bert-mini.yaml", output_dir, f"tokenizer={tokenizer}", f"data={data}", *toy, *overrides
    )


@pytest.fixture(scope="module")
def pretrain_run(tmp_path_factory, bert_tokenizer_dir: Path, tiny_dataset_dir: Path) -> Path:
    """Tracked in a local SQLite MLflow store next to the output directory, and registered. Its rank 1 is SIGKILLed
    two steps after a checkpoint and the run relaunched (:func:`kill_and_resume`): what the killed launch logged is
    kept beside the output directory, in ``killed.json``."""
    out = tmp_path_factory.mktemp("pretrain") / "run"
    mlflow = [f"mlflow.tracking_uri=sqlite:///{out.parent / 'mlflow.db'}", "mlflow.enabled=true"]
    mlflow += ["mlflow.register_as=bert-mini-toy", "mlflow.alias=candidate", "mlflow.system_metrics=false"]
    killed = kill_and_resume(lambda: start_pretraining(bert_tokenizer_dir, tiny_dataset_dir, out, *mlflow), out)
    (out.parent / "killed.json").write_text(json.dumps(killed))
    return out


@pytest.mark.full
def test_pretraining_without_a_teacher_trains_evaluates_the_student_alone_and_exports(pretrain_run: Path) -> None:
    from transformers import AutoModelForMaskedLM

    losses = train_losses(pretrain_run, PRETRAIN_LOSS_KEYS)
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    assert all(step["train/loss"] == step["train/mlm"] and math.isfinite(step["train/mlm"]) for step in losses.values())
    first = sum(losses[s]["train/mlm"] for s in range(1, 6)) / 5
    last = sum(losses[s]["train/mlm"] for s in range(MAX_STEPS - 4, MAX_STEPS + 1)) / 5
    assert last < first - 0.25, f"the MLM loss did not fall: first steps {first:.4f}, last steps {last:.4f}"
    train = [r for r in records(pretrain_run) if "train/loss" in r]
    assert not any(key in r for r in train for key in ("train/ce", "train/cos", "train/mse"))
    evals = [r for r in records(pretrain_run) if "eval/student_mlm_loss" in r]
    assert [r["step"] for r in evals] == [10, 20]
    assert all(set(r) == {"step", "eval/student_mlm_loss", "eval/student_mlm_accuracy"} for r in evals)
    assert evals[1]["eval/student_mlm_loss"] < evals[0]["eval/student_mlm_loss"]
    assert latest_step(pretrain_run) == MAX_STEPS

    student = pretrain_run / "student"
    model = AutoModelForMaskedLM.from_pretrained(student)
    assert model.config.architectures == ["BertForMaskedLM"] and type(model).__name__ == "BertForMaskedLM"
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size) == (2, 64, 30522)
    assert (student / "tokenizer.json").is_file()


@pytest.mark.full
def test_pretraining_is_tracked_and_registered_in_mlflow(pretrain_run: Path) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{pretrain_run.parent / 'mlflow.db'}")
    (tracked,) = client.search_runs([client.get_experiment_by_name("pretraining").experiment_id])
    assert tracked.info.status == "FINISHED"
    assert tracked.data.tags["teacher"] == "none"
    assert tracked.data.tags["student_model"] == "configs/teachers/bert-base-uncased"
    assert tracked.data.params["teacher"] == "None" and tracked.data.params["student.init"] == "random"
    assert {"train/mlm", "eval/student_mlm_loss"} <= set(tracked.data.metrics)
    assert not any(key.startswith(("train/ce", "eval/teacher", "eval/top1")) for key in tracked.data.metrics)
    version = client.get_model_version_by_alias("bert-mini-toy", "candidate")
    assert version.run_id == tracked.info.run_id and version.tags["teacher"] == "none"


@pytest.mark.full
def test_killed_pretraining_resumes_with_identical_losses(pretrain_run: Path) -> None:
    """The steps the killed launch took past its last checkpoint, redone by the relaunch from it: the same losses,
    bit for bit (same weights, optimizer state, samples, masks and dropout), as the fast tier's killed
    distillation shows against an uninterrupted run over all its steps."""
    logged = json.loads((pretrain_run.parent / "killed.json").read_text())
    killed = {r["step"]: {k: r[k] for k in PRETRAIN_LOSS_KEYS} for r in logged if "train/loss" in r}
    resumed_from = int(re.search(r"resumed from step (\d+)", console_log(pretrain_run).read_text())[1])
    assert max(killed) > resumed_from, "the killed launch took no step past its checkpoint"
    relaunched = train_losses(pretrain_run, PRETRAIN_LOSS_KEYS)  # a step logged twice: the relaunch's record
    assert {step: relaunched[step] for step in killed} == killed


@pytest.mark.full
def test_a_pretrained_export_is_a_teacher_with_an_mlm_head(
    tmp_path: Path, tiny_dataset_dir: Path, pretrain_run: Path
) -> None:
    """The pretrained model distils a student with L_ce (its logits) through the same launcher."""
    out = tmp_path / "distil"
    finish(start(pretrain_run / "student", tiny_dataset_dir, out, "max_steps=4"), out)
    losses = train_losses(out)
    assert sorted(losses) == [1, 2, 3, 4]
    assert all(math.isfinite(v) and v > 0 for step in losses.values() for k, v in step.items() if k != "train/cos")
    evals = [r for r in records(out) if "eval/teacher_mlm_loss" in r]
    assert len(evals) == 1 and 0 <= evals[0]["eval/top1_agreement"] <= 1
    assert (out / "student" / "model.safetensors").is_file()


def test_run_sh_also_runs_under_bash() -> None:
    """The launcher's ``python -u launch/run.sh --local_rank=N`` form runs in every test above; run by
    bash, the script re-executes itself with Python and hands the arguments on intact."""
    env = {**os.environ, "PYTHON": sys.executable, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(
        ["bash", "launch/run.sh", "configs/tiny-cpu.yaml", "max_steps=-1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "error: max_steps: must be >= 0" in proc.stderr


def test_more_streams_than_samples_fail_before_the_teacher_is_read(
    tmp_path: Path, tiny_teacher_dir: Path, tiny_dataset_dir: Path
) -> None:
    """A new run's streams come from its config: checked against the dataset before the teacher's weights load
    (here unreadable) and the engine is built, as every other cheap check is."""
    teacher = Path(shutil.copytree(tiny_teacher_dir, tmp_path / "teacher"))
    (teacher / "model.safetensors").write_bytes(b"not weights")
    env = {**os.environ, "PYTHON": sys.executable, "DS_ACCELERATOR": "cpu"}
    overrides = [f"teacher={teacher}", f"data={tiny_dataset_dir}", f"output_dir={tmp_path / 'out'}"]
    overrides += ["loader.streams=100000", "mlflow.enabled=false"]
    proc = run_in_repo(["bash", "launch/run.sh", "configs/tiny-cpu.yaml", *overrides], env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "fewer than its 100000 streams" in proc.stderr
