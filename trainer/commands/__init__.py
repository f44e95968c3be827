"""The commands of ``python -m trainer``: one module each, with ``main(argv) -> int``, that parses its arguments,
loads its config and calls into its role package (``finetuning``, ``evaluation``, ``planning``); ``train`` (with
``run_record`` and ``export``) is the one that still holds its run's machinery, the distillation loop."""
