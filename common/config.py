"""One configuration mechanism for preprocessing and trainer.

A config is a typed dataclass tree. Users give a YAML file plus ``key=value`` overrides on
the command line (``max_seq_len=128``, ``beam.direct_num_workers=2``, ``input=[a.txt,b.jsonl]``);
each value is parsed as YAML. A YAML file may name ``base: other.yaml`` (relative to itself) to
inherit and override a preset. The merged mapping is checked against the dataclass before any
work starts: an unknown key or a value of the wrong type is a :class:`ConfigError` naming the
dotted key. Dataclasses may add semantic checks in ``validate()``, raising ``ConfigError``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config problem the user must fix; the message names the offending key."""


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Build and validate ``cls`` from an optional YAML file and ``key=value`` overrides."""
    raw: dict[str, Any] = read_yaml(Path(path)) if path is not None else {}
    for item in overrides or []:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
    return from_dict(cls, raw)


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping, following ``base:`` inheritance (deep merge, child wins)."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: 'base' must be a path to a YAML file")
    return deep_merge(read_yaml((path.parent / base).resolve()), data)


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def parse_override(item: str) -> tuple[str, Any]:
    """``a.b=VALUE`` -> ("a.b", yaml-parsed VALUE)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text  # not YAML (e.g. an unbalanced bracket in a path): keep the string
    return key, value


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is not a section, cannot set {key}")
        node = child
    node[parts[-1]] = value


def from_dict(cls: type[T], raw: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys and ill-typed values."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or '<root>'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        known = ", ".join(sorted(fields))
        raise ConfigError(f"unknown config key '{prefix}{unknown[0]}' (known keys here: {known})")
    values: dict[str, Any] = {}
    for name, field in fields.items():
        key = prefix + name
        if name in raw:
            values[name] = coerce(hints[name], raw[name], key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required config key '{key}'")
    obj = cls(**values)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def coerce(tp: Any, value: Any, key: str) -> Any:
    """Check ``value`` against type ``tp`` (converting int->float and list->tuple only)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(arg, value, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: invalid value {value!r}")
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{key}: must be one of {choices}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value if value is not None else {}, prefix=key + ".")
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        item_tp = args[0] if args else Any
        items = [coerce(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        val_tp = args[1] if args else Any
        return {str(k): coerce(val_tp, v, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-4` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if isinstance(value, bool) or value is None or isinstance(value, list | dict):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)  # YAML reads `seed_dir=123` as int: paths and names stay strings
    raise TypeError(f"config type {tp!r} at {key} is not supported")


def to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain data (for manifests, MLflow params and checkpoints)."""
    return dataclasses.asdict(cfg)


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (for MLflow params)."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def require(condition: bool, key: str, message: str) -> None:
    """Raise a ConfigError about ``key`` unless ``condition`` holds (for ``validate()``)."""
    if not condition:
        raise ConfigError(f"{key}: {message}")
