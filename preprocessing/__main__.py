"""``python -m preprocessing [CONFIG.yaml] [key=value ...]``: build a dataset directory."""

from __future__ import annotations

from common.cli import exit_process, run_cli, split_config_args
from common.config import load_config
from common.tokenizer import describe_tokenizer_in_background
from preprocessing.config import PreprocessConfig


def main(argv: list[str]) -> int:
    path, overrides = split_config_args(argv, __doc__)
    cfg = load_config(PreprocessConfig, path, overrides)
    tokenizer = describe_tokenizer_in_background(cfg.tokenizer)
    from preprocessing.pipeline import run  # imports Beam while the tokenizer loads

    run(cfg, tokenizer)
    return 0


if __name__ == "__main__":
    exit_process(run_cli(main))
