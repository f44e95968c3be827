"""``python -m preprocessing``: configuration and environment errors are one line, exit 2, before any work."""

import os
import subprocess
import sys
from pathlib import Path

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.portability.fn_api_runner.fn_runner import FnApiRunner

from common.cli import run_cli
from common.config import load_config
from preprocessing.__main__ import main
from preprocessing.config import PreprocessConfig
from preprocessing.pipeline import make_runner
from preprocessing.preflight import check_beam_options, resolve_inputs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def good_args(sample_corpus, bert_tokenizer_dir, tmp_path):
    return {"input": f"[{sample_corpus}]", "tokenizer": str(bert_tokenizer_dir), "output": str(tmp_path / "out")}


def cli_error(capsys, args: dict[str, str]) -> str:
    assert run_cli(main, [f"{k}={v}" for k, v in args.items()]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bogus": "1"}, "unknown config key 'bogus'"),
        ({"max_seq_len": "abc"}, "max_seq_len: expected an integer"),
        ({"valid_fraction": "1.5"}, "valid_fraction: must be in [0, 1)"),
        ({"invalid_utf8": "ignore"}, "invalid_utf8: must be one of"),
        ({"beam.no_such_option": "1"}, "beam.no_such_option: not a Beam pipeline option"),
        ({"input": "[/nonexistent/*.jsonl]"}, "input[0]: '/nonexistent/*.jsonl' matches no file"),
        ({"input": f"[{__file__}]"}, "cannot tell the format"),
        ({"dataset_splits": "[]"}, "dataset_splits: name at least one split"),
        ({"tokenizer": "/nonexistent-tokenizer"}, "tokenizer: cannot load"),
    ],
)
def test_config_errors_name_the_key(capsys, good_args, change, message):
    assert message in cli_error(capsys, {**good_args, **change})


def test_missing_required_key(capsys, good_args):
    del good_args["tokenizer"]
    assert "missing required config key 'tokenizer'" in cli_error(capsys, good_args)


def test_unwritable_output(capsys, good_args, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert "output: cannot write to" in cli_error(capsys, {**good_args, "output": str(blocker / "dataset")})


def test_a_complete_dataset_is_not_overwritten(capsys, good_args, tiny_dataset_dir):
    before = {p: p.stat().st_mtime_ns for p in tiny_dataset_dir.rglob("*")}
    err = cli_error(capsys, {**good_args, "output": str(tiny_dataset_dir)})
    assert "already holds a complete dataset; set overwrite=true" in err
    assert {p: p.stat().st_mtime_ns for p in tiny_dataset_dir.rglob("*")} == before


@pytest.mark.parametrize("where", ["input", "foreign"])
def test_a_run_deletes_nothing_it_did_not_write(capsys, good_args, sample_corpus, tmp_path, where):
    """Each run first clears an earlier run's split folders; an input there, or a file of the user's, is an error
    before anything is deleted (``input=[data/train/*.jsonl] output=data`` once deleted its own corpus)."""
    output = tmp_path / "out"
    kept = output / ("train" if where == "input" else "valid") / f"notes{''.join(Path(sample_corpus).suffixes)}"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(Path(sample_corpus).read_bytes())
    args = {**good_args, "output": str(output), "overwrite": "true"}
    if where == "input":
        args["input"] = f"[{kept}]"
        assert f"input: '{kept}' lies in '{output}', where each run first deletes" in cli_error(capsys, args)
    else:
        assert f"output: '{output / 'valid'}' holds 1 file(s) this tool did not write" in cli_error(capsys, args)
    assert kept.read_bytes() == Path(sample_corpus).read_bytes()


def test_the_command_line_prints_no_traceback(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "preprocessing", "input=[/nonexistent.txt]", "tokenizer=x", f"output={tmp_path}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "error: input[0]: '/nonexistent.txt' matches no file"
    assert "Traceback" not in proc.stderr


def test_example_config_and_overrides():
    cfg = load_config(
        PreprocessConfig, REPO / "configs/preprocess/example.yaml", ["max_seq_len=128", "beam.direct_num_workers=3"]
    )
    assert cfg.max_seq_len == 128 and cfg.input == ["demo/corpus.jsonl.gz"]
    options = cfg.beam_options()
    assert options["runner"] == "DirectRunner" and options["direct_num_workers"] == 3
    assert options["direct_running_mode"] == "multi_processing"
    flink = load_config(
        PreprocessConfig, overrides=["input=[a.txt]", "tokenizer=t", "output=o", "beam.runner=FlinkRunner"]
    )
    assert "direct_num_workers" not in flink.beam_options()


def test_direct_runner_runs_the_configured_workers_not_prism(tmp_path):
    """The DirectRunner would first try Prism (a binary downloaded at run time); the local
    runner is its FnApiRunner, with the pipeline options for its worker processes."""
    cfg = load_config(PreprocessConfig, overrides=["input=[a.txt]", "tokenizer=t", "output=o"])
    options = PipelineOptions(flags=[], **cfg.beam_options())
    runner = make_runner(options)
    assert isinstance(runner, FnApiRunner)
    encoded = runner._provision_info.provision_info.pipeline_options
    assert encoded["beam:option:direct_running_mode:v1"] == "multi_processing"
    assert encoded["beam:option:direct_num_workers:v1"] == str(os.cpu_count())
    with beam.Pipeline(runner=runner, options=options) as pipeline:
        pids = pipeline | beam.Create([1, 2, 3]) | beam.Map(lambda _: os.getpid())
        _ = pids | beam.io.WriteToText(str(tmp_path / "pids"))
    pids = [int(line) for path in tmp_path.glob("pids*") for line in path.read_text().split()]
    assert len(pids) == 3 and os.getpid() not in pids  # ran in worker processes
    dataflow = cfg.beam | {"runner": "DataflowRunner", "project": "p"}
    assert type(make_runner(PipelineOptions(flags=[], **dataflow))).__name__ == "DataflowRunner"


def test_inputs_are_dealt_largest_first(tmp_path):
    for name, size in (("a.txt", 10), ("b.txt", 30), ("c.txt", 20), ("d.txt", 30)):
        (tmp_path / name).write_text("x" * size)
    files, total = resolve_inputs([str(tmp_path / "*.txt"), str(tmp_path / "a.txt")])
    assert [Path(f).name for f in files] == ["b.txt", "d.txt", "c.txt", "a.txt"]
    assert total == 90


def test_an_unknown_runner_is_one_line_naming_the_valid_ones(capsys, good_args, tmp_path):
    err = cli_error(capsys, {**good_args, "beam.runner": "DirectRuner"})
    assert err.startswith("error: beam.runner: Unexpected pipeline runner: DirectRuner")
    assert "DirectRunner" in err and "DataflowRunner" in err and "FlinkRunner" in err and "DaskRunner" in err
    assert not (tmp_path / "out").exists()  # refused before anything is written


@pytest.mark.parametrize("name", ["DaskRunner", "dask", "apache_beam.runners.dask.dask_runner.DaskRunner"])
def test_the_dask_runner_is_chosen_by_name_with_its_options(name):
    """Beam knows the DaskRunner only by its full path, and its options (``address``) only once
    its module is imported: choosing it by any name registers them. (The run itself is tested
    on a real cluster in test_preprocess_dask.py.)"""
    cfg = load_config(PreprocessConfig, overrides=["input=[a.txt]", "tokenizer=t", "output=o", f"beam.runner={name}"])
    cfg.beam["address"] = "tcp://127.0.0.1:8786"
    options = PipelineOptions(flags=[], **cfg.beam_options())
    assert type(make_runner(options)).__name__ == "DaskRunner"
    check_beam_options(cfg.beam_options())  # address is now a known option
    assert cfg.beam_options()["partition_size"] == 1  # one dask.bag partition per input file
