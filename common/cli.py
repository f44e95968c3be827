"""Command-line plumbing shared by ``python -m preprocessing`` and ``python -m trainer``."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from common.atomic import IOFault
from common.config import ConfigError
from common.fast_exit import skip_final_collection

# One format for every line our processes log, the Beam workers' included (preprocessing/quiet.py).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def split_config_args(args: list[str], usage: str | None = None) -> tuple[str | None, list[str]]:
    """``[CONFIG.yaml] [key=value ...]`` -> (config path or None, overrides).

    ``-h``/``--help`` prints ``usage`` (the command's docstring) and exits, as argparse would.
    """
    if args and args[0] in ("-h", "--help"):
        print((usage or "").strip() + "\n\nEvery config key is listed in docs/config.md.")
        raise SystemExit(0)
    if args and args[0].startswith("-"):
        raise ConfigError(f"unknown option {args[0]!r}: arguments are [CONFIG.yaml] [key=value ...] (see --help)")
    if args and "=" not in args[0]:
        return args[0], list(args[1:])
    return None, list(args)


def split_model_args(args: list[str], usage: str | None = None) -> tuple[str | None, list[str]]:
    """``MODEL [MODEL ...] [CONFIG.yaml] [key=value ...]`` -> (config path or None, overrides), the
    models handed on as one more override, ``models=[...]``. ``-h``/``--help`` as for
    :func:`split_config_args`."""
    if args and args[0] in ("-h", "--help"):
        split_config_args(args, usage)
    if any(arg.startswith("-") for arg in args):
        raise ConfigError("arguments are MODEL [MODEL ...] [CONFIG.yaml] [key=value ...] (see --help)")
    positional = [arg for arg in args if "=" not in arg]
    configs = [arg for arg in positional if arg.endswith((".yaml", ".yml"))]
    if len(configs) > 1:
        raise ConfigError(f"at most one CONFIG.yaml, got {configs}")
    models = [arg for arg in positional if arg not in configs]
    overrides = [arg for arg in args if "=" in arg] + ([f"models={json.dumps(models)}"] if models else [])
    return (configs[0] if configs else None), overrides


def quiet_libraries() -> None:
    """Silence, at their source, the library output a user cannot act on: transformers' and the Hub's
    progress bars (``Loading weights``, ``Writing model shards``: a redraw per step, for loads that take
    milliseconds) and MLflow's ``Downloading artifacts`` bars. Each is a switch the library reads when it
    draws, so a user who wants them back sets the variable in their shell (``setdefault``)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    if "transformers" in sys.modules:  # imported before the switch was read: tell it directly
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def run_cli(main: Callable[[list[str]], int | None], argv: list[str] | None = None) -> int:
    """Run ``main``; a ConfigError (or other user error) becomes one line on stderr, exit 2."""
    quiet_libraries()
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    try:
        return int(main(sys.argv[1:] if argv is None else argv) or 0)
    except (ConfigError, FileNotFoundError, PermissionError, IOFault) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def exit_process(code: int) -> NoReturn:
    """Exit with ``code``, without the last garbage collection (see :mod:`common.fast_exit`)."""
    skip_final_collection()
    sys.exit(code)
