"""Hugging Face datasets as input: directories written by the real ``datasets`` library (``save_to_disk`` of a
Dataset and of a DatasetDict, and repositories in the Hub's layout, Parquet and JSON Lines shards) run through the
real pipeline must give the shards the same texts give as one JSONL file, byte for byte; bad rows are counted as
for the other formats; a split that is not there is an error before any work; and the split of a Hub layout's
files agrees with ``datasets``' own resolver."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from helpers import TINY_DATASET_SETTINGS, build_dataset
from test_preprocess_pipeline import manifest_of

from common.cli import run_cli
from common.config import ConfigError
from preprocessing.__main__ import main
from preprocessing.hf_datasets import hub_splits
from preprocessing.preflight import resolve_inputs

pytestmark = pytest.mark.integration
SPLITS = ["train", "validation"]


def other(i: int) -> str:
    """A text of a split that is not read: one of them in the shards would change their bytes."""
    return f"Text {i} of a test split, which the configured dataset_splits leave out of the dataset."


def texts_of(corpus: Path) -> list[str]:
    with gzip.open(corpus, "rt", encoding="utf-8") as handle:
        return [json.loads(line)["text"] for line in handle]


@pytest.fixture(scope="module")
def corpus_texts(sample_corpus: Path) -> list[str]:
    texts = texts_of(sample_corpus)
    assert len(texts) == 32
    return texts


def write_hf_inputs(root: Path, texts: list[str]) -> dict[str, Path]:
    """The sample corpus's 32 texts spread over four dataset directories under ``root``, with bad rows and splits
    not to read (``dataset_splits=[train, validation]`` reads the 32 texts):

    * ``saved``: ``Dataset.save_to_disk`` in 3 shards, one row's text None;
    * ``saved_dict``: ``DatasetDict.save_to_disk``, train (2 shards), validation and test;
    * ``hub_parquet``: Hub layout ``data/{split}-0000i-of-0000n.parquet``, a train shard without the text column;
    * ``hub_jsonl``: Hub layout by file names: ``train.jsonl``, ``my_validation_file.jsonl.gz``, ``test.jsonl``,
      ``training_numbers.jsonl`` (texts that are numbers), and files that are no data (README.md, LICENSE).
    """
    from datasets import Dataset, DatasetDict

    t = texts

    def table(texts: list, column: str = "text") -> Dataset:
        return Dataset.from_dict({column: texts, "id": list(range(len(texts)))})

    paths = {name: root / name for name in ("saved", "saved_dict", "hub_parquet", "hub_jsonl")}
    table([*t[0:3], None, *t[3:6]]).save_to_disk(paths["saved"], num_shards=3)
    saved_dict = DatasetDict({"train": table(t[6:12]), "validation": table(t[12:15]), "test": table([other(0)])})
    saved_dict.save_to_disk(paths["saved_dict"], num_shards={"train": 2, "validation": 1, "test": 1})

    data = paths["hub_parquet"] / "data"
    data.mkdir(parents=True)
    table(t[15:18]).to_parquet(data / "train-00000-of-00003.parquet")
    table(t[18:21]).to_parquet(data / "train-00001-of-00003.parquet")
    table(["no text column", "here either"], column="body").to_parquet(data / "train-00002-of-00003.parquet")
    table(t[21:23]).to_parquet(data / "validation-00000-of-00001.parquet")
    table([other(1), other(2)]).to_parquet(data / "test-00000-of-00001.parquet")
    (paths["hub_parquet"] / "README.md").write_text("---\nlicense: cc0-1.0\n---\n# A dataset card\n")

    hub_jsonl = paths["hub_jsonl"]
    hub_jsonl.mkdir()
    table(t[23:27]).to_json(hub_jsonl / "train.jsonl")
    table(t[27:32]).to_json(hub_jsonl / "my_validation_file.jsonl.gz", compression="gzip")
    table([other(3)]).to_json(hub_jsonl / "test.jsonl")
    table([7, 8]).to_json(hub_jsonl / "training_numbers.jsonl")
    (hub_jsonl / "README.md").write_text("# A dataset card\n")
    (hub_jsonl / "LICENSE").write_text("CC0\n")
    return paths


@pytest.fixture(scope="module")
def hf_inputs(tmp_path_factory: pytest.TempPathFactory, corpus_texts: list[str]) -> dict[str, Path]:
    return write_hf_inputs(tmp_path_factory.mktemp("hf-inputs"), corpus_texts)


@pytest.fixture(scope="module")
def hf_dataset_dir(tmp_path_factory, hf_inputs, bert_tokenizer_dir) -> Path:
    return build_dataset(
        tmp_path_factory.mktemp("hf-dataset") / "dataset",
        bert_tokenizer_dir,
        list(hf_inputs.values()),
        **TINY_DATASET_SETTINGS,
        dataset_splits=SPLITS,
        beam={"direct_num_workers": 2},
    )


def dataset_bytes(dataset: Path) -> dict[str, bytes]:
    """Every file of a dataset but its manifest (which records the config), by relative path."""
    files = sorted(p for p in dataset.rglob("*") if p.is_file() and p.name != "manifest.json")
    return {str(p.relative_to(dataset)): p.read_bytes() for p in files}


def test_the_shards_are_those_of_the_same_texts_as_one_jsonl_file(hf_dataset_dir, tiny_dataset_dir):
    """tiny_dataset_dir is the sample corpus's 32 texts as one .jsonl.gz file, with the same settings."""
    ours, reference = dataset_bytes(hf_dataset_dir), dataset_bytes(tiny_dataset_dir)
    assert sorted(ours) == sorted(reference)
    assert sum(name.endswith(".tar") for name in ours) >= 8
    for name in reference:
        assert ours[name] == reference[name], name
    assert manifest_of(hf_dataset_dir)["splits"] == manifest_of(tiny_dataset_dir)["splits"]


def test_bad_rows_are_counted_as_for_the_other_formats(hf_dataset_dir, tiny_dataset_dir):
    documents, reference = manifest_of(hf_dataset_dir)["documents"], manifest_of(tiny_dataset_dir)["documents"]
    bad = {"null_text": 1, "missing_text_field": 2, "non_string_text": 2}
    assert documents["kept"] == reference["kept"] == 32
    assert documents["dropped"] == {**reference["dropped"], **bad}
    assert documents["read"] == documents["kept"] + sum(documents["dropped"].values())
    # 3 saved shards, 2 + 1 of the DatasetDict's train and validation, 3 + 1 Parquet shards, 3 JSON Lines files
    assert manifest_of(hf_dataset_dir)["files"] == {"read": 13}


def test_the_chosen_splits_files_are_listed_and_no_others(hf_inputs):
    files, total = resolve_inputs([str(p) for p in hf_inputs.values()], SPLITS)
    relative = {str(Path(f).relative_to(hf_inputs["saved"].parent)) for f in files}
    assert relative == {
        *(f"saved/data-0000{i}-of-00003.arrow" for i in range(3)),
        "saved_dict/train/data-00000-of-00002.arrow",
        "saved_dict/train/data-00001-of-00002.arrow",
        "saved_dict/validation/data-00000-of-00001.arrow",
        *(f"hub_parquet/data/train-0000{i}-of-00003.parquet" for i in range(3)),
        "hub_parquet/data/validation-00000-of-00001.parquet",
        "hub_jsonl/train.jsonl",
        "hub_jsonl/training_numbers.jsonl",
        "hub_jsonl/my_validation_file.jsonl.gz",
    }
    assert total == sum(Path(f).stat().st_size for f in files)
    # The default, train alone; a single saved Dataset has no splits and is read whole.
    files, _ = resolve_inputs([str(hf_inputs["saved_dict"]), str(hf_inputs["saved"])])
    assert sorted(Path(f).parent.name for f in files) == ["saved", "saved", "saved", "train", "train"]


@pytest.mark.parametrize(
    ("name", "splits"), [("saved_dict", "train, validation, test"), ("hub_jsonl", "train, validation, test")]
)
def test_a_split_that_is_not_there_is_an_error_naming_the_key_the_input_and_the_splits(hf_inputs, name, splits):
    with pytest.raises(ConfigError) as caught:
        resolve_inputs([str(hf_inputs["saved"]), str(hf_inputs[name])], ["train", "dev"])
    assert str(caught.value) == (
        f"dataset_splits: input[1] {str(hf_inputs[name])!r} has no split 'dev'; its splits: {splits}"
    )


def test_the_command_line_refuses_a_missing_split_in_one_line_before_any_work(
    capsys, hf_inputs, bert_tokenizer_dir, tmp_path
):
    args = [
        f"input=[{hf_inputs['hub_parquet']}]",
        f"tokenizer={bert_tokenizer_dir}",
        f"output={tmp_path / 'out'}",
        "dataset_splits=[train, test, dev]",
    ]
    assert run_cli(main, args) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: dataset_splits: input[0] {str(hf_inputs['hub_parquet'])!r} has no split 'dev'; "
        "its splits: train, validation, test"
    )
    assert not (tmp_path / "out").exists()


def test_a_data_file_of_another_format_is_an_error_naming_it(tmp_path):
    (tmp_path / "ds" / "data").mkdir(parents=True)
    (tmp_path / "ds" / "data" / "train.jsonl").write_text('{"text": "a document"}\n')
    (tmp_path / "ds" / "data" / "train-extra.csv").write_text("text\na document\n")
    (tmp_path / "ds" / "data" / "test.json").write_text('[{"text": "a document"}]')
    with pytest.raises(ConfigError, match=r"train-extra\.csv'.*not one of \.txt, \.jsonl, \.parquet or \.arrow"):
        resolve_inputs([str(tmp_path / "ds")])
    (tmp_path / "ds" / "data" / "train-extra.csv").unlink()  # the test split's .json is not read: no error
    assert resolve_inputs([str(tmp_path / "ds")])[0] == [str(tmp_path / "ds" / "data" / "train.jsonl")]


# Layouts of a dataset repository: the split of their files by datasets' resolver and by hub_splits must agree.
LAYOUTS = {
    "sharded": [
        "data/train-00000-of-00002.parquet",
        "data/train-00001-of-00002.parquet",
        "data/validation-00000-of-00001.jsonl.gz",
        "data/test-00000-of-00001.parquet",
        "data/random-00000-of-00001.parquet",
        "data/notes.parquet",
        "train.jsonl",
        "README.md",
    ],
    "file names": [
        "train.jsonl",
        "training_data.parquet",
        "my_validation_file.jsonl.gz",
        "dev.jsonl",
        "val-0.jsonl",
        "test-0.jsonl",
        "eval_set.jsonl",
        "sub/more-train.txt",
        "extra.jsonl",
        "retrain.jsonl",
        "trainer.jsonl",
        "TRAIN.jsonl",
        ".hidden/test.jsonl",
        "dataset_info.json",
    ],
    "directory names": [
        "data/train/a.parquet",
        "data/train/deeper/b.parquet",
        "data/my-valid-set/c.parquet",
        "data/dev_2/d.parquet",
        "data/test/e.parquet",
        "other/f.parquet",
        "train.jsonl",
        "__pycache__/train/g.parquet",
    ],
    "no split named": [
        "a.jsonl",
        "sub/b.parquet",
        "pretraining.txt",
        "retest/c.jsonl",
        ".cache/train.jsonl",
        "__special__/test.jsonl",
        ".gitattributes",
        "README.md",
    ],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_split_of_a_hub_layout_agrees_with_datasets(tmp_path, layout):
    from datasets.data_files import DataFilesDict, get_data_patterns

    for rel in LAYOUTS[layout]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x\n")
    theirs = DataFilesDict.from_patterns(get_data_patterns(str(tmp_path)), base_path=str(tmp_path))
    theirs = {split: sorted({str(Path(f).relative_to(tmp_path)) for f in files}) for split, files in theirs.items()}
    ours = hub_splits(LAYOUTS[layout])
    assert list(ours) == list(theirs)
    assert ours == theirs
    assert all(files for files in ours.values())


def test_a_sharded_split_name_that_is_not_a_word_is_refused_as_by_datasets(tmp_path):
    from datasets.data_files import get_data_patterns

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "my-split-00000-of-00001.parquet").write_text("x")
    with pytest.raises(ValueError, match="Split name should match"):
        get_data_patterns(str(tmp_path))
    with pytest.raises(ValueError, match="'my-split', which is not a valid split name"):
        hub_splits(["data/my-split-00000-of-00001.parquet"])


@pytest.mark.full
def test_dataset_directories_in_a_bucket(moto_server, hf_inputs, tiny_dataset_dir, bert_tokenizer_dir, tmp_path):
    """The same directories uploaded to an S3-compatible server (moto's) and named by s3:// URLs: listed and read
    through Beam's filesystem layer alone, they give the same shards."""
    pytest.importorskip("boto3")
    urls = [moto_server.upload(path, "hf-inputs", name) for name, path in hf_inputs.items()]
    credentials = {"s3_access_key_id": "testing", "s3_secret_access_key": "testing", "s3_region_name": "us-east-1"}
    dataset = build_dataset(
        tmp_path / "dataset",
        bert_tokenizer_dir,
        urls,
        **TINY_DATASET_SETTINGS,
        dataset_splits=SPLITS,
        beam={"direct_num_workers": 2, "s3_endpoint_url": moto_server.url, **credentials},
    )
    assert dataset_bytes(dataset) == dataset_bytes(tiny_dataset_dir)
    assert manifest_of(dataset)["files"] == {"read": 13}
