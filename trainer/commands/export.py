"""The student as a plain Hugging Face model directory, from any checkpoint.

``python -m trainer export CHECKPOINT_DIR DEST`` takes an output directory, its
``checkpoints/`` directory (the latest checkpoint) or one ``checkpoints/step-N`` directory.
DeepSpeed's ``zero_to_fp32`` consolidates the float32 master weights of any ZeRO stage (ZeRO-3
partitions included) on the CPU, without a process group; the student's weights are picked out
of the distillation module by their prefix, so distillation-only parameters (projections for
layer losses and the like) are dropped. The result (safetensors, config, tokenizer) is written
to a temporary directory and renamed into place, so DEST is either complete or absent.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from common.atomic import atomic_directory, explaining_full_disk
from common.config import ConfigError
from trainer.runtime.checkpoint import HF_DIR, checkpoint_dirs, latest_tag, step_of

log = logging.getLogger(__name__)

STUDENT_PREFIX = "student."  # the Distiller's attribute holding the Hugging Face student


def save_student(model: Any, tokenizer: Any, dest: str | Path) -> Path:
    """Write ``model`` (safetensors + config) and ``tokenizer`` to ``dest`` atomically; on a full disk,
    :class:`common.atomic.OutOfSpace` naming the bytes the weights need, and ``dest`` as it was."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    full_disk = explaining_full_disk(f"the student ({dest} is left as it was)", Path(dest).parent, weights)
    with full_disk, atomic_directory(dest) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return Path(dest)


def resolve_checkpoint(path: str | Path) -> tuple[Path, str]:
    """(checkpoints root, tag) for an output dir, a checkpoints dir or a ``step-N`` dir."""
    path = Path(path)
    if step_of(path) is not None and path.is_dir():
        return path.parent, path.name
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    tag = latest_tag(root)
    if tag is None and checkpoint_dirs(root):  # the newest may be a save that was killed: not guessed
        raise ConfigError(
            f"export: no complete checkpoint in {root}: 'latest' names none; name one of its step-N directories "
            f"to export it (newest: {checkpoint_dirs(root)[-1].name})"
        )
    if tag is None:
        raise ConfigError(f"export: no checkpoint in {path} (expected step-N directories and a 'latest' file)")
    return root, tag


def load_student(checkpoint: str | Path) -> tuple[Any, Any]:
    """The student (float32, CPU) and tokenizer of a checkpoint."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForMaskedLM, AutoTokenizer

    root, tag = resolve_checkpoint(checkpoint)
    hf_dir = root / tag / HF_DIR
    if not (hf_dir / "config.json").is_file():
        raise ConfigError(f"export: {root / tag} has no {HF_DIR}/config.json (not a trainer checkpoint?)")
    config = AutoConfig.from_pretrained(hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    full = get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)
    state = {k[len(STUDENT_PREFIX) :]: v for k, v in full.items() if k.startswith(STUDENT_PREFIX)}
    dropped = sorted(k for k in full if not k.startswith(STUDENT_PREFIX))
    if dropped:
        log.info("export: dropping %d distillation-only tensors (%s, ...)", len(dropped), dropped[0])
    model = AutoModelForMaskedLM.from_config(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(tied_parameter_names(model))
    if unexpected or set(missing) - tied:
        raise RuntimeError(
            f"export: checkpoint {root / tag} does not match the student config: "
            f"missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.tie_weights()
    return model.eval(), tokenizer


def tied_parameter_names(model: Any) -> list[str]:
    """Parameters that alias another (the MLM decoder and the word embeddings): saved once."""
    seen: dict[int, str] = {}
    aliases = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.append(name)
        seen.setdefault(id(param), name)
    return aliases


def export(checkpoint: str | Path, dest: str | Path) -> Path:
    model, tokenizer = load_student(checkpoint)
    return save_student(model, tokenizer, dest)


def main(argv: list[str]) -> int:
    asked = argv[:1] in (["-h"], ["--help"])  # usage asked for: on stdout, success; anything else malformed: exit 2
    if asked or len(argv) != 2 or argv[0].startswith("-"):
        print("usage: python -m trainer export CHECKPOINT_DIR DEST", file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    dest = export(argv[0], argv[1])
    print(f"exported the student to {dest}")
    return 0
