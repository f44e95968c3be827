from __future__ import annotations

import dataclasses
from typing import Any, Literal

import pytest

from common.config import ConfigError, flatten, load_config, require, to_dict


@dataclasses.dataclass
class Inner:
    runner: str = "DirectRunner"
    workers: int = 0
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Outer:
    input: list[str]
    max_seq_len: int = 512
    ratio: float = 0.1
    mode: Literal["a", "b"] = "a"
    name: str | None = None
    flag: bool = False
    inner: Inner = dataclasses.field(default_factory=Inner)

    def validate(self) -> None:
        require(self.max_seq_len >= 8, "max_seq_len", "must be at least 8")


def write(tmp_path, text: str, name: str = "c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_yaml_plus_overrides_parsed_as_yaml(tmp_path):
    path = write(tmp_path, "input: [x.txt]\ninner:\n  workers: 1\n")
    cfg = load_config(Outer, path, ["max_seq_len=128", "input=[a.txt,b.jsonl]", "inner.workers=2", "ratio=1"])
    assert cfg.input == ["a.txt", "b.jsonl"]
    assert cfg.max_seq_len == 128
    assert cfg.inner.workers == 2
    assert cfg.ratio == 1.0 and isinstance(cfg.ratio, float)
    assert to_dict(cfg)["inner"]["runner"] == "DirectRunner"


def test_base_inheritance_deep_merges(tmp_path):
    write(tmp_path, "input: [x.txt]\ninner: {workers: 3, runner: R}\n", "base.yaml")
    path = write(tmp_path, "base: base.yaml\ninner: {workers: 4}\n")
    cfg = load_config(Outer, path)
    assert (cfg.inner.runner, cfg.inner.workers, cfg.input) == ("R", 4, ["x.txt"])


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["input=[a]", "max_seqlen=3"], "max_seqlen"),
        (["input=[a]", "inner.wrkers=3"], "inner.wrkers"),
        (["input=[a]", "max_seq_len=abc"], "max_seq_len"),
        (["input=[a]", "max_seq_len=4"], "max_seq_len: must be at least 8"),
        (["input=[a]", "mode=c"], "mode"),
        (["input=[a]", "flag=maybe"], "flag"),
        (["input=a"], "input"),
        ([], "missing required config key 'input'"),
        (["input=[a]", "novalue"], "key=value"),
    ],
)
def test_bad_keys_and_values_are_named(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[")):
        load_config(Outer, None, overrides)


def test_strings_stay_strings_and_options_pass_through():
    cfg = load_config(Outer, None, ["input=[1]", "name=123", "inner.options={project: p, num_workers: 4}"])
    assert cfg.input == ["1"] and cfg.name == "123"
    assert cfg.inner.options == {"project": "p", "num_workers": 4}


def test_flatten():
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": 3}) == {"a.b": 1, "a.c.d": 2, "e": 3}


def test_exponent_floats_without_a_dot(tmp_path):
    path = write(tmp_path, "input: [x]\nratio: 5e-4\n")
    assert load_config(Outer, path).ratio == 5e-4
    assert load_config(Outer, None, ["input=[a]", "ratio=1e-2"]).ratio == 0.01
    with pytest.raises(ConfigError, match="ratio"):
        load_config(Outer, None, ["input=[a]", "ratio=fast"])


def test_cli_help_and_unknown_options(capsys):
    from common.cli import split_config_args

    assert split_config_args(["c.yaml", "a=1"]) == ("c.yaml", ["a=1"])
    assert split_config_args(["a=1"]) == (None, ["a=1"])
    with pytest.raises(SystemExit) as exited:
        split_config_args(["--help"], "usage: python -m thing [CONFIG.yaml]")
    assert exited.value.code == 0 and "usage: python -m thing" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="unknown option '--workers'"):
        split_config_args(["--workers", "2"])


def test_model_commands_take_models_an_optional_config_and_overrides(capsys):
    from common.cli import split_model_args

    assert split_model_args(["m1", "models:/s@a", "seeds=[0]"]) == (None, ["seeds=[0]", 'models=["m1", "models:/s@a"]'])
    assert split_model_args(["m1", "suite.yaml", "lr=1e-4"]) == ("suite.yaml", ["lr=1e-4", 'models=["m1"]'])
    assert split_model_args(["a.yaml"]) == ("a.yaml", [])
    with pytest.raises(ConfigError, match=r"at most one CONFIG\.yaml"):
        split_model_args(["m", "a.yaml", "b.yml"])
    with pytest.raises(ConfigError, match=r"arguments are MODEL \[MODEL \.\.\.\]"):
        split_model_args(["m", "--seeds", "2"])
    with pytest.raises(SystemExit) as exited:
        split_model_args(["-h"], "usage: python -m trainer evaluate-x MODEL")
    assert exited.value.code == 0 and "evaluate-x MODEL" in capsys.readouterr().out
