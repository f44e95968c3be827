"""``python -m preprocessing [--verbose] [CONFIG.yaml] [key=value ...]``: build a dataset directory.

A run that fails on a full disk, a vanished file or a refused permission says so in one line and removes what it
wrote; ``--verbose`` shows the runner's own error records and traceback instead."""

from __future__ import annotations

from common.cli import exit_process, run_cli, split_config_args
from common.config import load_config
from preprocessing.config import PreprocessConfig
from preprocessing.quiet import quiet_beam_logging


def main(argv: list[str]) -> int:
    verbose = "--verbose" in argv
    path, overrides = split_config_args([arg for arg in argv if arg != "--verbose"], __doc__)
    cfg = load_config(PreprocessConfig, path, overrides)
    quiet_beam_logging()
    from preprocessing.pipeline import run  # Beam: imported once the configuration is valid

    run(cfg, verbose=verbose)
    return 0


if __name__ == "__main__":
    exit_process(run_cli(main))
