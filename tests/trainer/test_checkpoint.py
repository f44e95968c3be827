"""Checkpoint rotation and discovery, the metrics log on resume, and the atomic student export."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, run_in_repo
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

from common.atomic import size_text
from common.config import ConfigError
from trainer.commands.export import resolve_checkpoint, save_student
from trainer.runtime.checkpoint import Checkpointer, checkpoint_dirs, latest_tag, prune, saved_world_size, tag_for
from trainer.runtime.metrics import MetricsLog, truncate_after


def make_checkpoints(root: Path, steps: list[int], latest: int | None = None) -> None:
    for step in steps:
        (root / tag_for(step)).mkdir(parents=True)
    if latest is not None:
        (root / "latest").write_text(tag_for(latest))


def names(root: Path) -> list[str]:
    return [p.name for p in checkpoint_dirs(root)]


def test_prune_keeps_the_newest_k_in_step_order(tmp_path: Path) -> None:
    make_checkpoints(tmp_path, [5, 10, 100, 15, 20])
    (tmp_path / "unrelated").mkdir()
    prune(tmp_path, keep_last=2, newest_step=100)
    assert names(tmp_path) == [tag_for(20), tag_for(100)]
    assert (tmp_path / "unrelated").is_dir()


def test_prune_after_resume_drops_checkpoints_of_the_abandoned_future(tmp_path: Path) -> None:
    # Killed after saving step 30 but before `latest` moved: resumed from 20, now saving 25.
    make_checkpoints(tmp_path, [10, 20, 25, 30])
    prune(tmp_path, keep_last=3, newest_step=25)
    assert names(tmp_path) == [tag_for(10), tag_for(20), tag_for(25)]


def test_latest_tag_requires_the_file_and_the_directory(tmp_path: Path) -> None:
    assert latest_tag(tmp_path) is None
    make_checkpoints(tmp_path, [10], latest=20)
    assert latest_tag(tmp_path) is None  # `latest` names a checkpoint that is gone
    make_checkpoints(tmp_path, [20], latest=20)
    assert latest_tag(tmp_path) == tag_for(20)
    (tmp_path / "latest").write_text("")  # torn by a kill: once read as the checkpoints directory itself
    assert latest_tag(tmp_path) is None


def test_saved_world_size_counts_the_optimizer_partitions(tmp_path: Path) -> None:
    """One ZeRO optimizer partition per rank that saved (``bf16_``-prefixed under DeepSpeed's BF16 optimizer);
    the model-state files of ZeRO-3 and the universal form beside them do not count."""
    for name in ("zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        (tmp_path / name).touch()
    (tmp_path / "universal").mkdir()
    assert saved_world_size(tmp_path) == 1
    (tmp_path / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").touch()
    assert saved_world_size(tmp_path) == 2
    (tmp_path / "zero_pp_rank_3_mp_rank_00_optim_states.pt").touch()  # rank 2's partition is missing
    with pytest.raises(RuntimeError, match=r"partitions of ranks 0\.\.N-1, found \{0, 1, 3\}"):
        saved_world_size(tmp_path)


def test_resolve_checkpoint_accepts_output_dir_checkpoints_dir_or_one_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    make_checkpoints(root, [10, 20], latest=20)
    assert resolve_checkpoint(tmp_path) == (root, tag_for(20))
    assert resolve_checkpoint(root) == (root, tag_for(20))
    assert resolve_checkpoint(root / tag_for(10)) == (root, tag_for(10))
    (root / "latest").unlink()  # the first save was killed: the newest step-N may be partial, and is not guessed
    with pytest.raises(ConfigError, match=r"no complete checkpoint .* name one of its step-N directories"):
        resolve_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match="no checkpoint"):
        resolve_checkpoint(tmp_path / "elsewhere")


def test_metrics_log_is_cut_back_to_the_resumed_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "train/loss": 1.0 / s}) + "\n" for s in range(1, 8)))
    with path.open("a") as f:
        f.write('{"step": 8, "train/lo')  # torn by the kill
    truncate_after(path, 5)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5]
    truncate_after(tmp_path / "absent.jsonl", 5)  # a fresh run has nothing to cut
    assert not (tmp_path / "absent.jsonl").exists()


def test_the_start_check_refuses_an_output_dir_without_room_or_read_only_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Room for keep_last + 1 checkpoints (less what checkpoints already there hold) and the export, on a real
    8 MB filesystem; then too little, and the filesystem remounted read-only (we are root, whom file modes do
    not stop): each refused in one line naming output_dir, what it has and needs, and the fix, exit status 2,
    nothing written."""
    from helpers import record_fault, refusal, small_tmpfs

    with small_tmpfs(tmp_path / "disk", 8) as disk:
        out = disk / "run"
        checkpoints = Checkpointer(out, every_steps=5, keep_last=2, is_main=True)
        free = size_text(shutil.disk_usage(disk).free)
        assert checkpoints.check_room(2 * 10**6, 10**6) == (
            f"output_dir: {free} free, needs 7 MB for keep_last+1 = 3 checkpoints of 2 MB and the export of 1 MB"
        )
        (checkpoints.root / tag_for(5)).mkdir(parents=True)
        (checkpoints.root / tag_for(5) / "mp_rank_00_model_states.pt").write_bytes(bytes(2 * 10**6))
        free = size_text(shutil.disk_usage(disk).free)
        said, took = refusal(lambda: checkpoints.check_room(4 * 10**6, 10**6), capsys)
        assert said == (
            f"output_dir: {out} has {free} free, but the run needs 11 MB for keep_last+1 = 3 checkpoints of 4 MB "
            "(2 MB of them there already) and the export of 1 MB: free space there, lower checkpoint.keep_last, or "
            "set output_dir to a larger filesystem"
        )
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        refused, refused_s = refusal(lambda: checkpoints.check_room(4 * 10**6, 10**6), capsys)
        assert refused == (
            f"output_dir: cannot write into {out}: read-only file system; make it writable by this user (a "
            "read-only mount?) or set output_dir to a directory that is"
        )
        assert [p.name for p in out.iterdir()] == ["checkpoints"] and max(took, refused_s) < 1.0
    record_fault(
        "output-dir-at-start",
        fault="an output_dir without room for the checkpoints and the export, and one read-only, at the start",
        injected=2,
        kinds={"too little room": 1, "read-only filesystem": 1},
        outcome=f"refused at the start in {max(took, refused_s):.3f} s, before any weight loads: one line naming "
        "output_dir, the free and needed bytes (or the refusal) and the fix; exit status 2; nothing written",
        data_lost=0,
        stop_s=None,
        recovery_s=None,
        steps_redone=None,
    )


def test_the_metrics_file_names_its_stage_when_the_output_directory_is_gone(tmp_path: Path) -> None:
    run = tmp_path / "run"
    metrics = MetricsLog(run, is_main=True, max_steps=10, start_step=0)
    metrics.write(1, {"train/loss": 1.0})
    shutil.rmtree(run)  # removed under the running job
    with pytest.raises(FileNotFoundError) as gone:
        metrics.write(2, {"train/loss": 0.9})
    assert str(gone.value) == (
        f"[Errno 2] writing the metrics of step 2 (metrics.jsonl) into {run}: no such file or directory "
        f"({run / 'metrics.jsonl'}): it was removed while being written"
    )


def test_save_student_replaces_atomically_and_leaves_nothing_behind_on_failure(
    tmp_path: Path, bert_tokenizer_dir: Path
) -> None:
    config = BertConfig(
        vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    tokenizer = AutoTokenizer.from_pretrained(bert_tokenizer_dir)
    dest = tmp_path / "student"
    save_student(BertForMaskedLM(config), tokenizer, dest)
    first = (dest / "model.safetensors").read_bytes()
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in dest.iterdir()}

    save_student(BertForMaskedLM(config), tokenizer, dest)  # replaces the previous export whole
    assert (dest / "model.safetensors").read_bytes() != first
    second = (dest / "model.safetensors").read_bytes()

    with pytest.raises(AttributeError):
        save_student(BertForMaskedLM(config), None, dest)  # fails after writing the weights
    assert (dest / "model.safetensors").read_bytes() == second
    assert sorted(p.name for p in tmp_path.iterdir()) == ["student"]
    assert BertForMaskedLM.from_pretrained(dest).config.hidden_size == 16


# Saves through a real DeepSpeed engine (a world of one, gloo), its output directory a small real filesystem: the
# second into a step directory that a killed save of two ranks left, with rank 1's partition and no `latest` naming
# it; then one into the filesystem remounted read-only, and one into it filled up. Each failed save's error, how long
# it took, the step directories it left and the free bytes before and after go to the last line, as JSON.
SAVES = """
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, "tests")
from helpers import fill

from common.config import load_config
from trainer.config import TrainConfig
from trainer.runtime.checkpoint import Checkpointer, checkpoint_dirs, saved_world_size
from trainer.runtime.engine import build_engine, deepspeed_config, init_distributed

out = Path(sys.argv[1])
overrides = ["data=unused", f"output_dir={out}", "global_batch_size=2", "micro_batch_size=2"]
cfg = load_config(TrainConfig, "configs/tiny-cpu.yaml", overrides)
world = init_distributed()
engine = build_engine(torch.nn.Linear(4, 4), cfg, deepspeed_config(cfg, world.world_size), world.device)
checkpoints = Checkpointer(out, every_steps=1, keep_last=3, is_main=True, save_bytes=2**16)


def save(step):
    engine.backward(engine(torch.ones(2, 4)).square().mean())
    engine.step()
    checkpoints.save(engine, step, {"step": step}, lambda dest: dest.mkdir())


def failed_save(step):
    free, started = shutil.disk_usage(out).free, time.monotonic()
    try:
        save(step)
    except OSError as err:
        seconds = time.monotonic() - started
        left = [p.name for p in checkpoint_dirs(checkpoints.root)]
        return {"error": str(err), "seconds": seconds, "left": left, "free": [free, shutil.disk_usage(out).free]}
    raise AssertionError(f"the save of step {step} did not fail")


for step in (1, 2):
    if step == 2:
        (checkpoints.root / "step-00000002").mkdir()
        (checkpoints.root / "step-00000002" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"torn")
    save(step)
print(checkpoints.latest().name, saved_world_size(checkpoints.latest()))
subprocess.run(["mount", "-o", "remount,ro", str(out)], check=True)
refused = failed_save(3)
subprocess.run(["mount", "-o", "remount,rw", str(out)], check=True)
ballast = fill(out, leave_bytes=4096)
full = failed_save(4)
ballast.unlink()
print(json.dumps({"refused": refused, "full": full, "latest": checkpoints.latest().name}))
"""


# Three saves of a real engine in one process (killed, refused, out of room): about 11 s on 2 idle cores.
@pytest.mark.fast_budget(30)
def test_a_failed_save_leaves_no_partial_checkpoint_whether_killed_refused_or_out_of_room(tmp_path: Path) -> None:
    """A save into the step directory a killed save left keeps none of its files: rank 1's partition from the
    killed save would make the checkpoint look saved by two ranks, and a resume on one rank would convert it to
    the universal form from two training states (or fail on a torn file). A save into a read-only filesystem (a
    real one: we are root, whom file modes do not stop, so the filesystem is remounted read-only) and one into a
    full filesystem each fail within a second in one line naming the stage, the path, and for the full disk the
    bytes; the partial step directory is gone, the free space is what it was before the attempt, and `latest`
    still names the last complete checkpoint."""
    from helpers import record_fault, small_tmpfs

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    with small_tmpfs(tmp_path / "disk", 8) as disk:
        proc = run_in_repo([sys.executable, "-c", SAVES, str(disk)], env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = proc.stdout.splitlines()
        assert lines[-2].split()[-2:] == [tag_for(2), "1"]
        assert (disk / "checkpoints" / "latest").read_text() == tag_for(2)
    faults = json.loads(lines[-1])
    root, then = disk / "checkpoints", f"`latest` still names {tag_for(2)}: relaunch to resume from it"
    assert faults["refused"]["error"] == (
        f"[Errno 30] writing checkpoint {tag_for(3)} into {root}: read-only file system ({root / tag_for(3)}): make "
        f"it writable by this user; {then}"
    )
    said = rf"\[Errno 28\] writing checkpoint {tag_for(4)} into {root}: .+; it needs about 65,536 bytes, ([\d,]+) "
    free = re.fullmatch(said + rf"bytes are free there; {re.escape(then)}", faults["full"]["error"])
    assert free is not None, faults["full"]["error"]
    for fault in ("refused", "full"):
        assert faults[fault]["left"] == [tag_for(1), tag_for(2)] and faults["latest"] == tag_for(2)
        assert faults[fault]["free"][1] >= faults[fault]["free"][0]  # as before the attempt: its partial removed
        assert faults[fault]["seconds"] < 1.0
    record_fault(
        "failed-save",
        fault="a checkpoint save into a read-only filesystem, and into a full one (a real 8 MB filesystem)",
        injected=2,
        kinds={"EROFS on a save": 1, "ENOSPC on a save": 1},
        outcome="one line each naming the checkpoint, the directory and for the full disk the bytes needed and "
        f"free, within {max(faults[f]['seconds'] for f in ('refused', 'full')):.2f} s; no partial step directory "
        "left, the free space as before the attempt, `latest` intact",
        data_lost=0,
        stop_s=None,
        recovery_s=None,
        steps_redone=None,
    )


def test_a_user_without_write_access_to_output_dir_is_refused_at_the_start_in_one_line(tmp_path: Path) -> None:
    """output_dir under a directory this user may not write (mode 0555), checked by a process without root's
    override of file modes (:data:`helpers.WITHOUT_WRITE_ACCESS`): the start check's one line, exit status 2."""
    from helpers import REPO, WITHOUT_WRITE_ACCESS

    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    check = (
        "import sys; from common.cli import run_cli; from trainer.runtime.checkpoint import Checkpointer\n"
        "checkpoints = Checkpointer(sys.argv[1], every_steps=5, keep_last=2, is_main=True)\n"
        "raise SystemExit(run_cli(lambda argv: checkpoints.check_room(10**6, 10**6), []))"
    )
    done = subprocess.run(
        [*WITHOUT_WRITE_ACCESS, sys.executable, "-c", check, str(locked / "run")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == (
        f"error: output_dir: cannot write into {locked / 'run'}: permission denied; make it writable by this user "
        "(a read-only mount?) or set output_dir to a directory that is"
    )
    assert list(locked.iterdir()) == []
