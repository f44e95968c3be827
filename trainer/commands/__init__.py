"""The commands of ``python -m trainer``: one module each, with ``main(argv) -> int``."""
