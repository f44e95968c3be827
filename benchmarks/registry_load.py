"""docs/mlflow-server.md's load table: a sweep of N training runs registering checkpoints on one MLflow server at once.

    python benchmarks/registry_load.py [--producers 8] [--versions 4] [--backends postgresql,sqlite]
                                       [--out docs/mlflow/registry-load.json] [--docs docs/mlflow-server.md]
    python benchmarks/registry_load.py --from-result --docs docs/mlflow-server.md   # render the committed file

Each producer is a training run as the registry sees it: an MLflow run and the project's own
:class:`~trainer.tracking.checkpoints.CheckpointRegistrar`, which is handed a checkpoint every ``--interval``
seconds (hard links to one real DeepSpeed checkpoint of the tiny CPU distillation, made first, under that step's
name) and registers them through its real worker processes (``python -m trainer register-checkpoints``:
export, upload through the server, version, alias), then is closed as the end of training closes it. All
producers register versions of one model, each moving its own alias. The server is started by
launch/mlflow-server.sh with the same S3 store (moto's server), basic auth and workers for each backend:
PostgreSQL, and SQLite for comparison. Afterwards every version is checked (each due step exactly once, its
tags, in step order within its run, each alias on its run's last step): a loss or a duplicate fails the script.

``--faults pg-restart,s3-down`` measures the same load on PostgreSQL under a fault instead, each its own load,
for docs/mlflow-server.md's "Faults under load" table (``docs/mlflow/registry-faults.json``): ``pg-restart`` is
``pg_ctl restart -m fast`` (every database connection cut), ``s3-down`` makes the store unreachable for
``--outage`` seconds (the server reaches moto through a TCP proxy that then cuts and refuses every connection).
Each begins as the ``--fault-after``-th version is registered: the producers start together, so their first
registrations are then under way (a fault at a fixed time may fall while every worker is still importing).
Besides the check above, per run: the failed attempts its registrar retried (``failed_attempts``), the time
its training spent inside the registrar's calls (``submit``: the snapshot) against its training time, the
statuses its run had while it trained (RUNNING only) and at its end (FINISHED), read from the server's database.

A version's latency is from the hand-over (``submit``) to the version's creation time on the server: it
includes the worker's start (its imports), the export and the upload, as a training run sees it.

``--producer direct`` loads the server instead of the runs' CPU: a registrar's worker spends seconds of CPU on
its imports and the export for each version, so on a small machine N runs' workers bound the load long before
the server does. Each run is then a thread of this process that calls what the worker calls once it has the
student (:func:`~trainer.tracking.registry.register_student`: the same requests, the upload of a student
exported once beforehand included), for one checkpoint due every ``--interval`` seconds, in step order, each
failed attempt retried as the registrar retries (backoff from 1 s doubling to 5 s) until ``--finish-timeout``
after its last checkpoint was due. Every failed attempt is recorded by its cause (the database refused: SQLite's
``database is locked``, which reaches the client as the server's 503; the client's request timeout; anything
else, with examples), and the server's log is searched for ``database is locked``: the load from which SQLite
refuses.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "tests"))
from benchmarks.suite_time import (  # noqa: E402
    add_result_options,
    made_by,
    measured_or_committed,
    provenance,
    write_result,
)

MODEL = "sweep-student"
USER = ("sweep", "sweep-password-1234")


def make_checkpoint(work: Path) -> Path:
    """One real checkpoint: the tiny CPU distillation of tests/helpers' teacher and dataset, 2 steps on 2 ranks."""
    from helpers import (
        SAMPLE_CORPUS,
        TINY_DATASET_SETTINGS,
        bert_tokenizer_dir,
        build_dataset,
        build_tiny_teacher,
        tiny_checkpoint,
    )

    teacher = build_tiny_teacher(work / "teacher", bert_tokenizer_dir())
    data = build_dataset(work / "dataset", bert_tokenizer_dir(), SAMPLE_CORPUS, **TINY_DATASET_SETTINGS)
    return tiny_checkpoint(work / "run", teacher, data)


def direct_student(checkpoint: Path, dest: Path) -> Path:
    """The student that direct producers register, exported once as a registrar's worker exports each; and
    this process's MLflow client set up as the worker's is (one attempt per request, the request timeout)."""
    import mlflow.transformers  # noqa: F401  (imported once here, and shared by the producers' forks)

    from trainer.commands.export import export
    from trainer.tracking.config import MlflowConfig, limit_http_retries

    limit_http_retries(MlflowConfig())
    return export(checkpoint, dest)


def start_server(backend: str, work: Path, moto, stack: list, fault: str | None, auth: bool = True) -> tuple:
    """launch/mlflow-server.sh on ``backend`` (postgresql or sqlite), artifacts in S3, basic auth unless not
    ``auth``; ``stack`` collects what to stop. Returns the server and what injects ``fault``: the PostgreSQL server for
    ``pg-restart``, a cuttable proxy in front of S3 for ``s3-down``."""
    from helpers import S3_CREDENTIALS, MlflowServer, PostgresServer, TcpProxy

    name = f"{backend}-{fault}" if fault else backend
    root = work / name
    root.mkdir()
    bucket = f"load-{name}"
    moto.client().create_bucket(Bucket=bucket)
    stores: dict[str, str] = {}
    postgres = None
    if backend == "postgresql":
        postgres = PostgresServer()
        stack.append(postgres.remove)
        postgres.start()
        stores = {"backend": postgres.create_database("mlflow"), "auth_db": postgres.create_database("mlflow_auth")}
    proxy = TcpProxy(moto.port) if fault == "s3-down" else None
    server = MlflowServer(
        root,
        app_name="basic-auth" if auth else None,
        artifacts=f"s3://{bucket}/artifacts",
        env={**S3_CREDENTIALS, "MLFLOW_S3_ENDPOINT_URL": proxy.url if proxy else moto.url},
        workers=2,
        **stores,
    )
    stack.append(server.stop)
    server.start()
    if auth:
        server.add_client_user(*USER)
    return server, {"pg-restart": postgres, "s3-down": proxy, None: None}[fault]


def inject(fault: str | None, target, statuses, after: int, outage_s: float, began: float, log: dict) -> None:
    """Once ``after`` versions are registered: ``pg-restart``, ``pg_ctl restart -m fast`` (every connection
    cut); ``s3-down``, every connection to S3 cut and refused for ``outage_s``."""
    if fault is None:
        return
    while statuses.versions() < after:
        time.sleep(0.5)
    log.update(after_versions=after, at_s=round(time.time() - began, 1))
    cut = time.monotonic()
    if fault == "pg-restart":
        target.restart()
    else:
        target.down()
        time.sleep(outage_s)
        target.restore()
    log["down_s"] = round(time.monotonic() - cut, 1)


def produce(index: int, root: Path, checkpoint: Path, run_id: str, uri: str, args, submitted: dict, statuses,
            measured: dict) -> None:  # fmt: skip
    """One training run's registrar: a checkpoint every ``args.interval`` s, then the end of training (the
    registrar's wait for its queue, then the run ended FINISHED, as the trainer's tracker ends it). ``measured``
    gets the run's time inside the registrar while training, its training time and its wait at the end."""
    from mlflow import MlflowClient

    from trainer.tracking.checkpoints import CheckpointRegistrar
    from trainer.tracking.config import MlflowConfig

    cfg = MlflowConfig(register_as=MODEL, register_checkpoints=True, checkpoint_alias=f"run{index}",
                       retry_initial_s=1.0, retry_max_s=5.0)  # fmt: skip
    run = SimpleNamespace(run_id=run_id, created=True, tracking_uri=uri)
    out = root / f"run{index}"
    statuses.watch(run_id)
    registrar = CheckpointRegistrar(cfg, out, run, save_every_steps=1, max_steps=10**9)
    inside = 0.0
    training = time.perf_counter()
    for step in range(1, args.versions + 1):
        made = out / "checkpoints" / f"step-{step:08d}"
        shutil.copytree(checkpoint, made, copy_function=os.link)  # the trainer's save: here, links to one
        submitted[run_id, step] = time.time()
        handed = time.perf_counter()
        registrar.submit(made, {"step": step, "samples": step * 8, "eval/loss": 1.0 / step})
        inside += time.perf_counter() - handed
        time.sleep(args.interval)
    ending = time.perf_counter()
    registrar.close(args.finish_timeout)
    measured.update(in_registrar_s=inside, training_s=ending - training, end_wait_s=time.perf_counter() - ending)
    statuses.unwatch(run_id)
    MlflowClient(uri).set_terminated(run_id)


def run_direct(runs: list[str], student: Path, uri: str, args, submitted: dict, measured: list[dict]) -> None:
    """Each run's :func:`produce_direct` in a process of its own, forked from this one (its imports shared, not
    repeated; threads would not do: transformers loads a model through process-wide state, the meta device, so
    loading one while another thread saves one fails), at nice 10, so that the server's processes get the CPU
    first: in a real deployment the runs are on other machines. Fills ``submitted`` and ``measured``."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    results = context.Queue()
    producers = [
        context.Process(target=produce_direct_process, args=(i, student, run_id, uri, args, results))
        for i, run_id in enumerate(runs)
    ]
    for producer in producers:
        producer.start()
    for _ in producers:  # before joining: a process exits only once what it put in the queue is read
        index, its_submitted, its_measured = results.get()
        submitted.update(its_submitted)
        measured[index].update(its_measured)
    for producer in producers:
        producer.join()


def produce_direct_process(index: int, student: Path, run_id: str, uri: str, args, results) -> None:
    """:func:`produce_direct` in a forked process, at nice 10; puts (index, submitted, measured) in ``results``."""
    os.nice(10)
    submitted: dict = {}
    measured: dict = {}
    try:
        produce_direct(index, student, run_id, uri, args, submitted, measured)
    finally:
        results.put((index, submitted, measured))


def produce_direct(index: int, student: Path, run_id: str, uri: str, args, submitted: dict, measured: dict) -> None:
    """One run as ``--producer direct`` makes it (module docstring): its checkpoints due every ``args.interval``
    s, each registered by :func:`register_student` as the registrar's worker registers it, failed attempts
    retried with the registrar's backoff until ``args.finish_timeout`` after the last was due. ``measured`` gets
    the failed attempts by cause and a few of their messages."""
    from mlflow import MlflowClient

    failed: collections.Counter = collections.Counter()
    examples: dict[str, str] = {}
    began = time.time()
    deadline = began + (args.versions - 1) * args.interval + args.finish_timeout
    for step in range(1, args.versions + 1):
        due = began + (step - 1) * args.interval
        time.sleep(max(0.0, due - time.time()))
        submitted[run_id, step] = due  # a run's queue: a checkpoint due while the last registers waits for it
        tags = {"step": str(step), "samples": str(step * 8), "eval/loss": f"{1.0 / step:.6g}", "kind": "checkpoint"}
        backoff = 1.0
        while not registered(student, run_id, uri, index, {**tags, "run_id": run_id}, failed, examples):
            if time.time() + backoff > deadline:  # what is left stays unregistered: the check counts it lost
                measured.update(failed=dict(failed), examples=examples)
                return
            time.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
    measured.update(failed=dict(failed), examples=examples)
    for _ in range(10):  # the end of training ends the run, retried as the tracker retries
        try:
            MlflowClient(uri).set_terminated(run_id)
            return
        except Exception:
            time.sleep(2)


def registered(student: Path, run_id: str, uri: str, index: int, tags: dict, failed, examples: dict) -> bool:
    """One attempt of the worker's registration; a failure is counted in ``failed`` by :func:`cause`."""
    from trainer.tracking.registry import register_student

    try:
        register_student(student, name=MODEL, alias=None, run_id=run_id, tracking_uri=uri, attempts=1, tags=tags,
                         run_metrics=False, follow_alias=f"run{index}")  # fmt: skip
        return True
    except Exception as err:
        why = cause(err)
        failed[why] += 1
        examples.setdefault(why, f"{type(err).__name__}: {err}"[:600])
        return False


def cause(err: Exception | str) -> str:
    """A failed registration's cause as the load table counts it: the database refused (SQLite's ``database is
    locked``, or the server's 503 that carries it, :func:`~trainer.tracking.registry.database_refused`), the
    client's request timeout, or other."""
    from trainer.tracking.registry import database_refused

    said = str(err)
    if database_refused(err) or "database refused" in said:  # an exception, or a worker's line that explained it
        return "database refused"
    if "timed out" in said.lower() or "timeout" in type(err).__name__.lower():
        return "request timeout"
    return "other"


def worker_failures(worker_log: Path) -> dict[str, int]:
    """A registrar's failed attempts by :func:`cause`, from its workers' ``error: registering ...`` lines."""
    from helpers import FAILED_REGISTRATION

    lines = worker_log.read_text(encoding="utf-8").splitlines() if worker_log.exists() else []
    return dict(collections.Counter(cause(line) for line in lines if line.startswith(FAILED_REGISTRATION)))


def load(backend: str, work: Path, source: Path, moto, args, fault: str | None = None) -> dict:
    """Start the server, run the producers at once (with ``fault`` injected mid-load), check every version, and
    measure. ``source``: the checkpoint the registrars' runs hand over, or with ``--producer direct`` the
    student exported from it."""
    from helpers import RunStatuses
    from mlflow import MlflowClient

    name = f"{backend}-{fault}" if fault else backend
    direct = args.producer == "direct"
    stack: list = []
    injected: dict = {}
    try:
        server, target = start_server(backend, work, moto, stack, fault, auth=args.auth == "basic")
        os.environ.update(server.client_env)  # the registrars' workers sign in as the team's account
        # The runs' statuses, read from the database: not for direct producers, whose load is the server's alone
        statuses = None if direct else RunStatuses(server.backend)
        if statuses is not None:
            stack.append(statuses.stop)
        client = MlflowClient(server.uri)
        experiment = client.create_experiment(f"load-{name}")
        client.create_registered_model(MODEL)
        runs = [client.create_run(experiment).info.run_id for _ in range(args.producers)]
        submitted: dict[tuple[str, int], float] = {}
        measured: list[dict] = [{} for _ in runs]
        began = time.time()
        if direct:
            run_direct(runs, source, server.uri, args, submitted, measured)
        else:
            producers = [
                threading.Thread(
                    target=produce,
                    args=(i, work / name, source, run_id, server.uri, args, submitted, statuses, measured[i]),
                )
                for i, run_id in enumerate(runs)
            ]
            faulty = threading.Thread(
                target=inject, args=(fault, target, statuses, args.fault_after, args.outage, began, injected)
            )
            for thread in [*producers, faulty]:
                thread.start()
            for thread in [*producers, faulty]:
                thread.join()
        versions = client.search_model_versions(f"name = '{MODEL}'", max_results=10000)
        per_run = [run_figures(i, run_id, versions, measured[i], work / name, statuses, client)
                   for i, run_id in enumerate(runs)]  # fmt: skip
        problems = check(client, versions, runs, args.versions) + status_problems(per_run)
        status_reads = {"reads": statuses.reads, "failed": statuses.failed_reads} if statuses else None
        server_log = server.log.read_text(encoding="utf-8", errors="replace")
    finally:
        for stop in reversed(stack):
            stop()
    latencies = sorted(int(v.creation_timestamp) / 1000 - submitted[v.run_id, int(v.tags["step"])] for v in versions)
    ended = max((int(v.creation_timestamp) / 1000 for v in versions), default=time.time())  # none: until now
    failed = sum((collections.Counter(r["failed"]) for r in per_run), collections.Counter())
    examples = {why: said for r in per_run for why, said in r.pop("examples", {}).items()}
    steps = collections.Counter((v.run_id, v.tags.get("step")) for v in versions)
    return {
        "backend": backend,
        "auth": args.auth,
        "producer": args.producer,
        "interval_s": args.interval,
        "fault": {"kind": fault, **injected} if fault else None,
        "producers": args.producers,
        "versions_per_producer": args.versions,
        "expected": args.producers * args.versions,
        "registered": len(versions),
        "lost": args.producers * args.versions - len(steps),
        "duplicated": len(versions) - len(steps),
        "problems": problems,
        "failed_attempts": sum(r["failed_attempts"] for r in per_run),
        "failed_by_cause": dict(failed),
        "failure_examples": examples,
        "server_log_locked_lines": server_log.count("database is locked"),
        "step_time_share_max": max((r["step_time_share"] for r in per_run if "step_time_share" in r), default=None),
        "status_reads": status_reads,
        "runs": per_run,
        "seconds": round(ended - began, 2),
        "registrations_per_s": round(len(versions) / (ended - began), 3),
        "latency_s": {
            "p50": round(statistics.median(latencies), 2),
            "p95": round(latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))], 2),
            "max": round(latencies[-1], 2),
        }
        if latencies
        else None,
    }


def run_figures(index: int, run_id: str, versions: list, measured: dict, root: Path, statuses, client) -> dict:
    """One run's figures: its versions, its failed attempts (by cause), and for a registrar's run the training's
    time inside it and the statuses the run had while it trained."""
    from helpers import failed_attempts

    figures = {"run": f"run{index}", "registered": sum(v.run_id == run_id for v in versions)}
    if statuses is None:  # a direct producer (--producer direct)
        figures.update(failed=measured.get("failed", {}), examples=measured.get("examples", {}))
        figures["failed_attempts"] = sum(figures["failed"].values())
        figures["status_while_training"] = []
    else:
        worker_log = root / f"run{index}" / "registering.log"
        figures.update(
            failed_attempts=failed_attempts(worker_log),
            failed=worker_failures(worker_log),
            in_registrar_s=round(measured["in_registrar_s"], 4),
            training_s=round(measured["training_s"], 2),
            step_time_share=measured["in_registrar_s"] / measured["training_s"],
            end_wait_s=round(measured["end_wait_s"], 1),
            status_while_training=sorted(statuses.seen[run_id]),
        )
    figures["status_at_end"] = client.get_run(run_id).info.status
    return figures


def check(client, versions: list, runs: list[str], per_run: int) -> list[str]:
    """What is wrong with the registry after the load: lost or duplicated steps, tags, order, aliases."""
    problems = []
    for index, run_id in enumerate(runs):
        mine = [v for v in versions if v.run_id == run_id]
        steps = sorted(int(v.tags["step"]) for v in mine)
        if steps != list(range(1, per_run + 1)):
            problems.append(f"run{index}: steps {steps}, expected 1..{per_run} once each")
            continue
        by_step = sorted(mine, key=lambda v: int(v.tags["step"]))
        if [int(v.version) for v in by_step] != sorted(int(v.version) for v in by_step):
            problems.append(f"run{index}: versions not in step order")
        if any(
            v.tags.get("kind") != "checkpoint" or v.tags.get("samples") != str(8 * int(v.tags["step"])) for v in mine
        ):
            problems.append(f"run{index}: a version lacks its tags")
        if client.get_model_version_by_alias(MODEL, f"run{index}").version != by_step[-1].version:
            problems.append(f"run{index}: alias run{index} is not on step {per_run}")
    return problems


def status_problems(per_run: list[dict]) -> list[str]:
    """A run that read other than RUNNING while it trained (a registration ended it), or did not end FINISHED."""
    return [
        f"{r['run']}: status {r['status_while_training']} while training, {r['status_at_end']} at its end"
        for r in per_run
        if r["status_while_training"] not in (["RUNNING"], []) or r["status_at_end"] != "FINISHED"
    ]


def fault_words(fault: dict | None) -> str:
    if fault is None:
        return "-"
    when = f"at {fault['at_s']:g} s"
    if "after_versions" in fault:
        when += f", once version {fault['after_versions']} was in"
    if fault["kind"] == "pg-restart":
        return f"`pg_ctl restart -m fast` {when} (over in {fault['down_s']:.1f} s)"
    return f"S3 unreachable for {fault['down_s']:.0f} s {when}"


# --producer, as the table says it
PRODUCERS = {"registrar": "registrar's workers", "direct": "direct (a process each, no export)"}


def table(result: dict) -> str:
    """docs/mlflow-server.md's load table: per load, what was registered, lost or duplicated, the failed attempts
    (retried) and how many of them SQLite refused as locked, the rate and the latency."""
    rows = [
        "| backend | runs registering through | fault mid-load | concurrent runs | checkpoint every (s) | versions "
        "| registered | lost | duplicated | failed attempts (retried) | of which the database refused (503) "
        "| of which request timeouts | 'database is locked' in the server's log (lines) | registrations/s "
        "| latency p50 (s) | p95 (s) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["loads"]:
        lost, duplicated = lost_and_duplicated(r)
        failed = r.get("failed_by_cause", {})
        rows.append(
            f"| {backend_words(r)} | {PRODUCERS[r.get('producer', 'registrar')]} | {fault_words(r.get('fault'))} | "
            f"{r['producers']} | {r.get('interval_s', result['interval_s']):g} | {r['expected']} | "
            f"{r['registered']} | {lost} | {duplicated} | {r['failed_attempts']} | "
            f"{failed.get('database refused', 0)} | {failed.get('request timeout', 0)} | "
            f"{r.get('server_log_locked_lines', '-')} | "
            f"{r['registrations_per_s']:.2f} | {latency(r, 'p50')} | {latency(r, 'p95')} |"
        )
    machine = result["machine"]
    measured = [part["machine"] for part in result.get("parts", [])] or [machine]  # a merged file: each part's
    averages = " and ".join(f"{m['load_average_at_end'][1]:.0f}" for m in measured)
    load = f"load average {averages} over the last 5 minutes (shared with other jobs)"
    setup = f"{result['server_workers']} server workers"
    where = "the server, the stores and the runs on one machine"
    rows += ["", made_by(result, f"{machine['cpus']} CPUs ({machine['cpu']})", load, setup, where)]
    if "parts" in result:  # merged: each backend's own measurement
        rows[-1] += "; measured by " + " and ".join(f"`{part['command']}`" for part in result["parts"])
    return "\n".join(rows)


def latency(load: dict, percentile: str) -> str:
    return f"{load['latency_s'][percentile]:.1f}" if load["latency_s"] else "-"  # none registered: no latency


def backend_words(load: dict) -> str:
    """The load's backend, and whether its server checked passwords (a load measured before --auth did)."""
    return load["backend"] + ("" if load.get("auth", "basic") == "basic" else ", no auth")


def lost_and_duplicated(load: dict) -> tuple[int, int]:
    """A load's lost and duplicated steps (a load measured before they were counted apart found neither)."""
    if "lost" in load:
        return load["lost"], load["duplicated"]
    assert not load["problems"], "a load with problems records its lost and duplicated steps"
    return 0, 0


def faults_table(result: dict) -> str:
    """docs/mlflow-server.md's "Faults under load": each fault's load, its checks and what training saw."""
    rows = [
        "| fault mid-load | concurrent runs | versions | registered | lost, duplicated, misordered or untagged "
        "| failed attempts (retried) | training time inside the registrar (max of runs) | run status while training "
        "/ at its end | latency p50 / p95 (s) | end of training's wait for the queue, max (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in result["loads"]:
        runs = r["runs"]
        fault = fault_words(r["fault"])
        if r["fault"]["at_s"] < min(run["training_s"] for run in runs):  # else in the end's wait for the queue
            fault += ", while every run trained"
        during = "/".join(sorted({s for run in runs for s in run["status_while_training"]})) or "-"
        ended = "/".join(sorted({run["status_at_end"] for run in runs}))
        latency, end_wait = r["latency_s"], max(run["end_wait_s"] for run in runs)
        rows.append(
            f"| {fault} | {r['producers']} | {r['expected']} | {r['registered']} | "
            f"{len(r['problems'])} | {r['failed_attempts']} | {r['step_time_share_max']:.4%} | {during} / {ended} | "
            f"{latency['p50']:.0f} / {latency['p95']:.0f} | {end_wait:.0f} |"
        )
    machine = result["machine"]
    load = f"load average {machine['load_average_at_end'][1]:.0f} over the last 5 minutes (shared with other jobs)"
    setup = (
        f"PostgreSQL, S3 (moto) and basic auth, {result['server_workers']} server workers, a checkpoint every "
        f"{result['interval_s']:g} s per run, the server, the stores and the runs on one machine"
    )
    rows += ["", made_by(result, f"{machine['cpus']} CPUs ({machine['cpu']})", load, setup)]
    return "\n".join(rows)


def is_faults(result: dict) -> bool:
    """Whether ``result`` measured faults (``--faults``): its table is :func:`faults_table`."""
    return all(r.get("fault") for r in result["loads"])


def shown(path: Path) -> str:
    """``path`` as the docs name it: from the repository's root when inside it."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--producers", type=int, default=8, help="concurrent training runs")
    parser.add_argument("--versions", type=int, default=4, help="checkpoint versions each run registers")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between a run's checkpoints")
    parser.add_argument("--finish-timeout", type=float, default=900.0, help="each registrar's wait at the end")
    parser.add_argument("--backends", default="postgresql,sqlite")
    parser.add_argument(
        "--faults", default="", help="instead, each its own load on PostgreSQL: pg-restart,s3-down (module docstring)"
    )
    parser.add_argument("--fault-after", type=int, default=1, help="a fault begins once this many versions are in")
    parser.add_argument("--outage", type=float, default=20.0, help="how long S3 stays unreachable (s3-down)")
    parser.add_argument("--checkpoint", type=Path, help="a DeepSpeed checkpoint (default: made by a tiny run)")
    parser.add_argument(
        "--auth",
        choices=["basic", "none"],
        default="basic",
        help="the server's basic-auth app (the team's server), or none: its password check of every request "
        "costs the server more CPU than the rest of a registration, which on a small machine bounds the load first",
    )
    parser.add_argument(
        "--producer",
        choices=sorted(PRODUCERS),
        default="registrar",
        help="each run: the project's registrar and its worker processes, or direct: the worker's registration "
        "in a thread, so that the server and not the runs' CPU bounds the load (module docstring)",
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        help="write --out from result files measured at the same "
        "time, one backend each (side by side): their loads, each file's command and machine",
    )
    add_result_options(parser, None)
    args = parser.parse_args()
    faults = [fault for fault in args.faults.split(",") if fault]
    if faults and args.producer == "direct":
        parser.error("--faults measures the registrars' runs: --producer registrar")
    args.out = args.out or REPO / "docs" / "mlflow" / ("registry-faults.json" if faults else "registry-load.json")
    if args.merge:
        files = [json.loads(path.read_text(encoding="utf-8")) for path in args.merge]
        for file in files:  # a load measured before loads recorded their interval and producer: its file's
            for measured in file["loads"]:
                measured.setdefault("interval_s", file["interval_s"])
                measured.setdefault("producer", "registrar")
        parts = [part for file in files for part in file.get("parts", [file])]  # a merged file: its own parts
        write_result(args.out, {
            **provenance(" ".join(["python benchmarks/registry_load.py", *sys.argv[1:]])),
            "result_file": shown(args.out),
            "server_workers": files[0]["server_workers"],
            "interval_s": files[0]["interval_s"],
            "parts": [{key: part[key] for key in ("command", "commit", "dirty", "machine")} for part in parts],
            "loads": [measured for file in files for measured in file["loads"]],
        })  # fmt: skip
        args.from_result = True

    def measure() -> dict:
        from helpers import MotoServer

        header = provenance(" ".join(["python benchmarks/registry_load.py", *sys.argv[1:]]))
        with tempfile.TemporaryDirectory(prefix="registry-load-") as tmp:
            work = Path(tmp)
            checkpoint = args.checkpoint or make_checkpoint(work / "checkpoint")
            source = checkpoint if args.producer == "registrar" else direct_student(checkpoint, work / "student")
            moto = MotoServer(work / "moto.log")
            try:
                moto.start()
                if faults:
                    loads = [load("postgresql", work, source, moto, args, fault) for fault in faults]
                else:
                    loads = [load(backend, work, source, moto, args) for backend in args.backends.split(",")]
            finally:
                moto.stop()
        return {
            **header,
            "result_file": shown(args.out),
            "server_workers": 2,
            "interval_s": args.interval,
            "loads": loads,
        }

    committed = json.loads(args.out.read_text(encoding="utf-8")) if args.from_result else None
    faulty = bool(faults) or (committed is not None and is_faults(committed))
    render, marker = (faults_table, "registry-faults") if faulty else (table, "registry-load")
    result = measured_or_committed(args, measure, render, marker)
    print(render(result))
    bad = [f"{r['backend']}: {p}" for r in result["loads"] for p in r["problems"]]
    if bad:  # recorded in the result (SQLite's limit is a finding), and a failure of this script
        print("error: the registry lost, duplicated or misordered versions:\n" + "\n".join(bad), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
