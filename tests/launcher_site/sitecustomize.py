"""Run at the start of every Python process the tests start (tests/conftest.py puts this folder first on
``PYTHONPATH``). It matters to the DeepSpeed launcher's own two processes, ``deepspeed`` and
``deepspeed.launcher.launch``: one after the other, before any rank starts, each imports ``deepspeed`` and, through
its autotuner's ``try: import mlflow``, all of mlflow (about 1.5 s of CPU each) for an autotuner it never runs. The
ranks refuse that probe themselves (trainer/__init__.py); this gives every other process the same refusal, from that
same file, executed by path (nothing is put on ``sys.path``). The launcher runs as it does for a user in every other
respect; only its unused ``autotuner.has_mlflow`` reads False."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "_refusal_of_deepspeeds_autotuner_mlflow", Path(__file__).resolve().parents[2] / "trainer" / "__init__.py"
)
_spec.loader.exec_module(importlib.util.module_from_spec(_spec))
