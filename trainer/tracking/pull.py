"""``python -m trainer pull MODEL_URI DEST``: a registered student as a plain Hugging Face directory.

``MODEL_URI`` is ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION`` (any MLflow model URI of a
student logged by ``trainer.tracking.registry``). MLflow's transformers flavor stores the weights and
config under ``model/`` and the tokenizer under ``components/tokenizer/``; DEST gets both side by
side, so ``AutoModelForMaskedLM`` / ``AutoModelForSequenceClassification`` / ``AutoTokenizer``
load it with ``from_pretrained(DEST)``. DEST appears complete or not at all (``common.atomic``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from common.atomic import atomic_directory
from common.config import ConfigError
from trainer.tracking.config import MlflowConfig, check_access, limit_http_retries, resolve_tracking_uri

log = logging.getLogger(__name__)

SOURCE_FILE = "mlflow_source.json"  # which registered version DEST came from


def pull(model_uri: str, dest: Path, tracking_uri: str) -> Path:
    """Download ``model_uri`` and lay it out as a Hugging Face model directory at ``dest``."""
    import mlflow

    if dest.exists() and any(dest.iterdir()):
        raise ConfigError(f"{dest}: destination exists and is not empty")
    # Globally: MLflow resolves models:/ URIs with the global registry, whatever else it is passed.
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(os.environ.get("MLFLOW_REGISTRY_URI") or tracking_uri)
    source = describe(model_uri)
    # Download the version the alias points at now, even if the alias moves meanwhile.
    exact = f"models:/{source['name']}/{source['version']}" if "version" in source else model_uri
    with atomic_directory(dest) as out, tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{dest.name}.") as tmp:
        local = Path(mlflow.artifacts.download_artifacts(exact, dst_path=tmp))
        if not (local / "model" / "config.json").is_file():
            raise ConfigError(f"{model_uri}: not a student logged by `python -m trainer register` (no model/)")
        shutil.copytree(local / "model", out, dirs_exist_ok=True)
        tokenizer = local / "components" / "tokenizer"
        if tokenizer.is_dir():
            shutil.copytree(tokenizer, out, dirs_exist_ok=True)
        (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
    return dest


def describe(model_uri: str) -> dict[str, str]:
    """Name, version and run behind a ``models:/`` URI (the alias resolved now)."""
    from mlflow import MlflowClient

    source = {"model_uri": model_uri}
    match = re.fullmatch(r"models:/([^/@]+)(?:@(.+)|/(\d+))", model_uri)
    if not match:
        return source
    name, alias, number = match.groups()
    client = MlflowClient()
    version = client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, number)
    source.update(name=name, version=str(version.version), run_id=version.run_id or "")
    return source


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer pull", description=__doc__.splitlines()[0])
    parser.add_argument("model_uri", help="models:/NAME@ALIAS or models:/NAME/VERSION")
    parser.add_argument("dest", type=Path, help="new (or empty) directory")
    parser.add_argument("--tracking-uri", help="default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db")
    ns = parser.parse_args(argv)
    cfg = MlflowConfig(tracking_uri=ns.tracking_uri)
    limit_http_retries(cfg)
    check_access(cfg, way_out=None)  # wrong credentials: one line, not MLflow's response body
    from mlflow.exceptions import MlflowException

    try:
        pull(ns.model_uri, ns.dest, resolve_tracking_uri(cfg))
    except MlflowException as err:
        print(f"error: pull {ns.model_uri}: {err.message}", file=sys.stderr)
        return 1
    source = json.loads((ns.dest / SOURCE_FILE).read_text(encoding="utf-8"))
    version = f" (version {source['version']})" if "version" in source else ""
    print(f"pulled {ns.model_uri}{version} to {ns.dest}")
    return 0
