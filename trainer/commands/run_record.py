"""What a distillation (or pretraining) run records in MLflow: its params, tags and artifacts, as a :class:`RunSpec`.

The MLflow package (``trainer/tracking/``) records whatever a spec says; this module says what
makes a distillation run reproducible and comparable: the resolved config, the teacher, the
dataset (a fingerprint of its shards and tokenizer, and its manifest), the DeepSpeed setup and
the code's git commit.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

import yaml

from common.config import flatten, to_dict
from trainer.config import TrainConfig
from trainer.runtime.data import read_manifest
from trainer.tracking.tracker import RunSpec

REPO = Path(__file__).resolve().parents[2]


def training_run_spec(
    cfg: TrainConfig, config_path: str | None, deepspeed_config: dict[str, Any], world_size: int
) -> RunSpec:
    """Params (the resolved config, flattened), tags and artifacts of a distillation run."""
    manifest = read_manifest(cfg.data) or {}
    zero = deepspeed_config.get("zero_optimization", {})
    commit = git_commit()
    tags = {
        "teacher": cfg.teacher if cfg.teacher is not None else "none",  # none: masked-LM pretraining
        "dataset": str(cfg.data),
        "dataset_fingerprint": dataset_fingerprint(manifest) if manifest else "unknown",
        "tokenizer_fingerprint": manifest.get("tokenizer", {}).get("fingerprint", "unknown"),
        "world_size": str(world_size),
        "deepspeed_stage": str(zero.get("stage", 0)),
        "deepspeed_offload": str(zero.get("offload_optimizer", {}).get("device", "none")),
        "precision": cfg.deepspeed.precision,
        "git_commit": commit or "unknown",
    }
    if cfg.student.model is not None:
        tags["student_model"] = cfg.student.model  # what the student was built (random) or loaded (pretrained) from
    if commit:
        tags["mlflow.source.git.commit"] = commit
    files = [("config", path) for path in config_chain(Path(config_path))] if config_path else []
    params = {key: str(value) for key, value in flatten(to_dict(cfg)).items()}
    params["world_size"] = str(world_size)
    return RunSpec(
        experiment=cfg.mlflow.experiment,
        run_name=cfg.mlflow.run_name,
        params=params,
        tags=tags,
        files=files,
        texts={
            "config/resolved.yaml": yaml.safe_dump(to_dict(cfg), sort_keys=False),
            "deepspeed/ds_config.json": json.dumps(deepspeed_config, indent=2),
            **({"dataset/manifest.json": json.dumps(manifest, indent=2)} if manifest else {}),
        },
    )


def dataset_fingerprint(manifest: dict[str, Any]) -> str:
    """A hash of every shard's sha256 and the tokenizer: equal exactly when the training data is."""
    content = {"tokenizer": manifest.get("tokenizer", {}).get("fingerprint"), "splits": manifest.get("splits")}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def config_chain(path: Path) -> list[Path]:
    """The config file and the ``base:`` files it inherits from."""
    chain = []
    while path.is_file() and path not in chain:
        chain.append(path)
        base = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("base")
        if not isinstance(base, str):
            break
        path = (path.parent / base).resolve()
    return chain


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None
