"""Teacher -> student masked-LM distillation on DeepSpeed ZeRO."""

import sys


class _NoMlflowForDeepSpeedsAutotuner:
    """Answers DeepSpeed's autotuner's ``try: import mlflow`` (run at ``import deepspeed``) with "not installed".

    That probe makes every process that imports DeepSpeed import mlflow too (pandas, its GenAI judges, ...): about
    1.9 s of CPU of the 4.7 s that ``import deepspeed`` costs on this project's 2-core machine, in every rank of every
    launch and in ``plan`` and ``export``, for an autotuner this trainer never runs. Only that importer is refused
    (the frame that asks, past importlib's own): the trainer's tracking imports mlflow itself, when it is used."""

    @staticmethod
    def find_spec(name: str, path: object = None, target: object = None) -> None:
        if name == "mlflow":
            frame = sys._getframe(1)
            while frame is not None and frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen")):
                frame = frame.f_back
            if frame is not None and frame.f_globals.get("__name__") == "deepspeed.autotuning.autotuner":
                raise ModuleNotFoundError("mlflow is not imported for DeepSpeed's autotuner (trainer/__init__.py)")
        return None  # everything else: the next finder's


sys.meta_path.insert(0, _NoMlflowForDeepSpeedsAutotuner)  # once: a module runs once per process
