"""Faults a user meets while preprocessing: caught at the start, or named in one line when they happen anyway, and
nothing of the failed run left behind.

Real faults through the real command (``python -m preprocessing``, Beam's DirectRunner): a small tmpfs that fills
up, files removed while the run goes (as another run's clean-up, or a user, removes them), and a filesystem
remounted read-only. Permission bits cannot stand for a refusal here: the tests run as root, whom they do not stop;
a read-only mount stops everyone (EROFS), as a disk that fails and is remounted read-only does. Each test asserts the
one line, the exit status, what is left (no spill, stream or partial file, the output directory gone when the run
made it) and the time to the error, and records its row for docs/faults.md's table (``record_fault``).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import (
    REPO,
    SAMPLE_CORPUS,
    TINY_DATASET_SETTINGS,
    preprocess,
    preprocess_command,
    record_fault,
    small_tmpfs,
)

pytestmark = pytest.mark.integration

# The DirectRunner's other mode, for some of the cases: its workers are threads of the command's own process, so a
# fault reaches the command as an exception chained to Beam's, not as a worker process's text (preprocessing/faults).
IN_MEMORY = {"direct_running_mode": "in_memory", "direct_num_workers": 1}
# What may share stderr with the one line: this package's progress lines.
PROGRESS = re.compile(r"\d{4}-\d\d-\d\d [\d:,]+ INFO preprocessing: ")
FULL_LINE = (
    r"error: \[Errno 28\] {stage}: writing (?P<path>\S+) into \S+: no space left on device; it needs about "
    r"(?P<needed>[\d,]+) bytes, (?P<free>[\d,]+) bytes are free there\. Free room there or choose another output=, "
    r"and run again: the whole run needs about (?P<room>[\d,]+) bytes there, (?P<free_now>[\d,]+) are free now\. "
    r"Removed what it wrote under {output}\."
)
GONE_LINE = (
    r"error: \[Errno 2\] {stage}: (?P<path>\S+): no such file or directory\. {why}\. "
    r"Removed what it wrote under {output}\."
)
WRITTEN_AND_REMOVED = (
    "The run wrote it and something removed it meanwhile (another run with this output=, or a clean-up of the disk): "
    "run again"
)


@dataclass
class Outcome:
    code: int
    line: str
    seconds: float
    """From the fault (or, when the fault was there from the start, the command's start) to the exit."""


def number(text: str) -> int:
    return int(text.replace(",", ""))


def preprocess_until_exit(
    out: Path,
    tokenizer: Path,
    corpus: Path,
    inject: Callable[[], None] | None = None,
    as_user: tuple[str, ...] | list[str] = (),
    **overrides: object,
) -> Outcome:
    """The command (run through ``as_user``'s prefix, if any), to its exit; ``inject`` runs meanwhile (it waits for
    its moment, then does the fault). Its stderr must hold one line besides progress lines, no traceback, and its
    stdout nothing."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [*as_user, *preprocess_command(out, tokenizer, corpus, **overrides)]
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if inject is not None:
            inject()
            started = time.monotonic()
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    seconds = time.monotonic() - started
    lines = [line for line in stderr.splitlines() if line.strip() and not PROGRESS.match(line)]
    assert len(lines) == 1 and not stdout.strip(), f"exit {proc.returncode}:\n{stdout[-2000:]}\n{stderr[-6000:]}"
    return Outcome(proc.returncode, lines[0], seconds)


def wait_for(pattern: str, root: Path, deadline_s: float = 60) -> Path:
    """The first file matching ``pattern`` under ``root``, as soon as it is there (polled every 2 ms)."""
    deadline = time.monotonic() + deadline_s
    while True:
        found = sorted(root.glob(pattern))
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"no {pattern} under {root}"
        time.sleep(0.002)


def in_tier(stage: str, full: tuple[str, ...]) -> object:
    """A case of a parametrized test, in the full tier when ``stage`` is in ``full``: the fast tier keeps one case
    per kind of fault and the read, spill and write stages, which is enough to see the mechanism break; the full
    tier adds the other stages (each case is a run of the command, 5-10 s)."""
    return pytest.param(stage, marks=pytest.mark.full) if stage in full else stage


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (its path relative to it) and its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Corpora shaped so that one stage's writes are the ones that do not fit: ``docs`` (the sample's 32 documents,
    0.22 MB), ``small`` (those twice over, each copy marked: 0.45 MB of unique documents), ``bangs`` (0.5 MB of
    ``!!!...``: a token per byte, so the token streams take twice the spills) and ``one`` (a single document)."""
    root = tmp_path_factory.mktemp("fault-corpora")
    with gzip.open(SAMPLE_CORPUS, "rt", encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    shapes = {
        "docs": docs,
        "small": [f"{text} (copy {copy})" for copy in range(2) for text in docs],
        "bangs": ["!" * 500 + f" {i}" for i in range(1000)],
        "one": docs[:1],
    }
    paths = {}
    for name, texts in shapes.items():
        paths[name] = root / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return paths


@pytest.mark.parametrize("before", ["nothing", "a complete dataset"])
def test_too_little_room_is_refused_before_any_work(
    tmp_path: Path, bert_tokenizer_dir: Path, corpora: dict[str, Path], tiny_dataset_dir: Path, before: str
) -> None:
    """The issue's case, small: an output on a filesystem of 1 MB for a 0.45 MB corpus; or of 3 MB holding a
    complete dataset (1.4 MB), replaced with ``overwrite=true``, whose room the run would get back. Preflight
    estimates the room the run needs from the input's size and refuses in one line naming both figures (the free
    one counting what the run's start would clear), the output and the fix, before Beam starts: nothing is
    written, not even the output directory, and the dataset there is intact."""
    with small_tmpfs(tmp_path / "disk", 1 if before == "nothing" else 3) as disk:
        out = disk / "dataset"
        overrides: dict[str, object] = {"max_seq_len": 64}  # about 4.6 MB at the peak
        if before != "nothing":
            shutil.copytree(tiny_dataset_dir, out)
            overrides["overwrite"] = True
        kept, old_bytes = tree(disk), shutil.disk_usage(disk).used
        outcome = preprocess_until_exit(out, bert_tokenizer_dir, corpora["small"], **overrides)
        said = (
            rf"error: output: this run needs about (?P<needed>[\d,]+) bytes on the filesystem of '{out}' \(its "
            r"spills, token streams and shards, estimated from the input's (?P<input>[\d,]+) bytes on disk\), and "
            r"(?P<free>[\d,]+) are free: free room there or choose another output=; check_space=false skips this "
            r"estimate"
        )
        found = re.fullmatch(said, outcome.line)
        assert outcome.code == 2 and found, outcome.line
        assert number(found["input"]) == corpora["small"].stat().st_size
        assert number(found["free"]) == shutil.disk_usage(disk).free + old_bytes < number(found["needed"])
        assert tree(disk) == kept and (before != "nothing" or not out.exists())
        assert outcome.seconds < 20, outcome.seconds  # the tokenizer's load included: no pipeline started
    where = "a 1 MB filesystem" if before == "nothing" else "a 3 MB filesystem holding the dataset to overwrite"
    record_fault(
        "preprocess-room" + ("" if before == "nothing" else "-overwrite"),
        fault=f"preprocessing into too little room ({where}, a 0.45 MB corpus)",
        injected=1,
        kinds={"refused at the start": 1},
        outcome=f"refused in one line before any work: needs about {found['needed']} bytes, {found['free']} free, "
        "names output= and check_space=false; nothing written"
        + ("" if before == "nothing" else "; old dataset intact"),
        data_lost=0,
        stop_s=outcome.seconds,
        recovery_s=None,
        steps_redone=None,
    )


def test_the_room_estimate_covers_a_real_runs_peak_and_not_much_more(tmp_path: Path, bert_tokenizer_dir: Path) -> None:
    """The estimate preflight checks (logged when the run starts) against the most a real run held on its output's
    filesystem (sampled every millisecond: the peak is a plateau, from the last shard to finalize): the sample
    corpus, compressed (.jsonl.gz: the gzip factor), with the tiny dataset's settings. Enough, so that a run it
    lets start does not fill the disk, and at most 1.5 times as much, so that it seldom refuses one that fits."""
    import threading

    with small_tmpfs(tmp_path / "disk", 64) as disk:
        base, peak, stop = shutil.disk_usage(disk).used, [0], threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], shutil.disk_usage(disk).used - base)
                time.sleep(0.001)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            settings = {**TINY_DATASET_SETTINGS, "beam": IN_MEMORY}
            done = preprocess(disk / "dataset", bert_tokenizer_dir, SAMPLE_CORPUS, **settings)
        finally:
            stop.set()
            sampler.join()
    estimate = float(re.search(r"\(about ([\d.]+) MB there at the peak, estimated\)", done.stderr)[1]) * 1e6
    assert peak[0] <= estimate <= 1.5 * peak[0], (estimate, peak[0])


# The stage whose writes do not fit: the corpus, settings, and a filesystem sized between what the stages before
# it write (the tokenizer's 0.46 MB, then spills ~ the text, streams ~ its tokens, shards) and what it adds.
FULL_DISK_CASES = {  # stage: corpus, settings, MB
    "spill": ("small", {}, 0.75),  # 0.3 MB left for 0.45 MB of spills
    "tokenize": ("bangs", {"beam": IN_MEMORY}, 1.5),  # 0.5 MB of spills fit, 1 MB of streams do not
    "write": ("docs", {"max_seq_len": 8, "beam": IN_MEMORY}, 2),  # 1.2 MB fit before the shards, their 10 MB not
    "finalize": ("one", {"beam": IN_MEMORY}, None),  # sized from the tokenizer: all but token_counts.npy fits
}


@pytest.mark.parametrize("stage", [in_tier(stage, ("tokenize", "finalize")) for stage in FULL_DISK_CASES])
def test_a_disk_that_fills_up_in_any_stage_is_one_line_and_the_run_leaves_nothing(
    tmp_path: Path, bert_tokenizer_dir: Path, corpora: dict[str, Path], stage: str
) -> None:
    """With the estimate skipped (``check_space=false``, as when it was wrong or another process filled the disk),
    the stage whose writes do not fit fails the run in one line: the stage, the file, the bytes it needed and those
    free, the whole run's room; the failed run removes its spills, streams, shards and the output directory it
    made, so the filesystem is as empty as before."""
    corpus, settings, megabytes = FULL_DISK_CASES[stage]
    if megabytes is None:  # the tokenizer's copy, its few small files, and 180 KiB: token_counts.npy needs 240 KiB
        megabytes = ((bert_tokenizer_dir / "tokenizer.json").stat().st_size + 180 * 1024) / 2**20
    with small_tmpfs(tmp_path / "disk", megabytes) as disk:
        out = disk / "dataset"
        overrides: dict[str, object] = {"check_space": False, "max_seq_len": 64, **settings}
        outcome = preprocess_until_exit(out, bert_tokenizer_dir, corpora[corpus], **overrides)
        found = re.fullmatch(FULL_LINE.format(stage=stage, output=re.escape(str(out))), outcome.line)
        assert outcome.code == 2 and found, outcome.line
        assert found["path"].startswith(str(out) + "/"), found["path"]
        assert number(found["free"]) < number(found["needed"])
        assert number(found["free_now"]) == shutil.disk_usage(disk).free < number(found["room"])
        assert tree(disk) == {} and not out.exists()
        assert outcome.seconds < 60, outcome.seconds
    record_fault(
        f"preprocess-full-{stage}",
        fault=f"preprocessing: the output's filesystem fills up in the {stage} stage (check_space=false)",
        injected=1,
        kinds={"ENOSPC": 1},
        outcome=f"one line naming the {stage} stage, {found['path'].removeprefix(str(out) + '/')}, "
        f"{found['needed']} bytes needed, {found['free']} free; nothing left on the filesystem",
        data_lost=0,
        stop_s=outcome.seconds,
        recovery_s=None,
        steps_redone=None,
    )


def remove_input(out: Path, corpus: Path) -> Callable[[], None]:
    """Once the run has begun (its tokenizer's copy written, after preflight listed the input; the workers take
    seconds to start), remove the input."""

    def inject() -> None:
        wait_for(".work/tokenizer.json", out)
        corpus.unlink()

    return inject


def remove_first(pattern: str, out: Path) -> Callable[[], None]:
    """Remove the first file of ``pattern`` the run writes, as soon as it is there: the stage that reads it
    later finds it gone."""
    return lambda: wait_for(pattern, out).unlink()


VANISHED_CASES = {  # stage: what is removed, the settings that leave the stage time to go on meanwhile, the cause
    "read": (None, {}, "An input the run listed at its start is gone: restore it, and run again"),
    # small spills: 55 of them, the first long before the input is read
    "tokenize": (".work/spill/*.bin", {"spill_bytes": 8192, "beam": IN_MEMORY}, WRITTEN_AND_REMOVED),
    # small shards: 520 of them, the first long before the last
    "finalize": ("train/shard-*.tar", {"samples_per_shard": 4}, WRITTEN_AND_REMOVED),
}


@pytest.mark.parametrize("stage", [in_tier(stage, ("tokenize", "finalize")) for stage in VANISHED_CASES])
def test_a_file_removed_while_the_run_goes_is_one_line_naming_it_and_the_run_leaves_nothing(
    tmp_path: Path, bert_tokenizer_dir: Path, corpora: dict[str, Path], stage: str
) -> None:
    """An input removed after preflight listed it fails the read stage; a spill removed before it is tokenized
    fails the tokenize stage; a shard removed after it was written fails finalize, which checks every shard is
    there before it publishes a manifest listing it. Each is one line naming the stage and the file, and the run
    removes what it wrote."""
    pattern, settings, why = VANISHED_CASES[stage]
    corpus = tmp_path / "corpus.jsonl"
    shutil.copy(corpora["small"], corpus)
    out = tmp_path / "dataset"
    inject = remove_input(out, corpus) if pattern is None else remove_first(pattern, out)
    outcome = preprocess_until_exit(out, bert_tokenizer_dir, corpus, inject, max_seq_len=64, **settings)
    said = GONE_LINE.format(stage=stage, why=re.escape(why), output=re.escape(str(out)))
    found = re.fullmatch(said, outcome.line)
    assert outcome.code == 2 and found, outcome.line
    removed = str(corpus) if pattern is None else str(out / pattern)
    assert re.fullmatch(removed.replace(".", r"\.").replace("*", r"[^/]+"), found["path"]), found["path"]
    assert not out.exists()
    assert outcome.seconds < 30, outcome.seconds
    record_fault(
        f"preprocess-gone-{stage}",
        fault=f"preprocessing: {'the input' if pattern is None else pattern.split('/')[-2] + ' file'} removed "
        f"while the run goes ({stage} stage)",
        injected=1,
        kinds={"ENOENT": 1},
        outcome=f"one line naming the {stage} stage and the file; nothing left of the run",
        data_lost=0,
        stop_s=outcome.seconds,
        recovery_s=None,
        steps_redone=None,
    )


def test_an_output_remounted_read_only_is_one_line_and_says_what_is_left(
    tmp_path: Path, bert_tokenizer_dir: Path, corpora: dict[str, Path]
) -> None:
    """The output's filesystem remounted read-only once the run began (as a failing disk is): the first spill
    fails in one line naming the stage, the file and the cause; nothing can be removed there, so the line says
    what is left and that the next run removes it, and no spill or partial file is there."""
    with small_tmpfs(tmp_path / "disk", 16) as disk:
        out = disk / "dataset"

        def remount_read_only() -> None:
            wait_for(".work/tokenizer.json", out)
            subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)

        try:
            outcome = preprocess_until_exit(out, bert_tokenizer_dir, corpora["small"], remount_read_only)
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
        said = (
            rf"error: \[Errno 30\] spill: (?P<path>{re.escape(str(out))}/\.work/spill\S*): read-only file system\. "
            r"The output stopped accepting writes \(a filesystem remounted read-only, permissions changed\): make it "
            r"writable or choose another output=, and run again\. "
            rf"Could not remove its files under {re.escape(str(out))} \(read-only file system\): the next run with "
            r"this output= removes them\."
        )
        assert outcome.code == 2 and re.fullmatch(said, outcome.line), outcome.line
        assert list(tree(disk)) == ["dataset/.work/tokenizer.json"]
        assert outcome.seconds < 30, outcome.seconds
    record_fault(
        "preprocess-readonly-spill",
        fault="preprocessing: the output's filesystem remounted read-only as the run begins (spill stage)",
        injected=1,
        kinds={"EROFS": 1},
        outcome="one line naming the spill stage, the file, and what is left (the tokenizer's copy in .work/, which "
        "the next run removes)",
        data_lost=0,
        stop_s=outcome.seconds,
        recovery_s=None,
        steps_redone=None,
    )


def test_a_user_without_write_access_is_refused_before_any_work(
    tmp_path: Path, bert_tokenizer_dir: Path, corpora: dict[str, Path]
) -> None:
    """output= under a directory this user may not write (mode 0555; the command run without root's override of
    file modes, :data:`helpers.WITHOUT_WRITE_ACCESS`): refused at the start in one line naming the path and the
    cause, exit status 2, nothing written."""
    from helpers import WITHOUT_WRITE_ACCESS

    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    out = locked / "dataset"
    outcome = preprocess_until_exit(out, bert_tokenizer_dir, corpora["small"], as_user=WITHOUT_WRITE_ACCESS)
    assert outcome.code == 2
    assert outcome.line == f"error: output: cannot write to '{out}': [Errno 13] Permission denied: '{out}'"
    assert list(locked.iterdir()) == [] and outcome.seconds < 30
