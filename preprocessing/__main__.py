"""``python -m preprocessing [CONFIG.yaml] [key=value ...]``: build a dataset directory."""

from __future__ import annotations

from common.cli import exit_process, run_cli, split_config_args
from common.config import load_config
from preprocessing.config import PreprocessConfig
from preprocessing.quiet import quiet_beam_logging


def main(argv: list[str]) -> int:
    path, overrides = split_config_args(argv, __doc__)
    cfg = load_config(PreprocessConfig, path, overrides)
    quiet_beam_logging()
    from preprocessing.pipeline import run  # Beam: imported once the configuration is valid

    run(cfg)
    return 0


if __name__ == "__main__":
    exit_process(run_cli(main))
