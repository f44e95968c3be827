"""The GPU ablation's luggage: what the offline GPU machine lacks, packed small enough to carry.

    python benchmarks/quality/gpu_inputs.py pack-data DATASET_DIR ARCHIVE.tar.xz
    python benchmarks/quality/gpu_inputs.py unpack ARCHIVE.tar.xz DEST_DIR
    python benchmarks/quality/gpu_inputs.py pack-model MODEL_DIR DEST_DIR      (float32 -> float16, xz)
    python benchmarks/quality/gpu_inputs.py restore-model PACKED_DIR DEST_DIR  (float16 -> float32)
    python benchmarks/quality/gpu_inputs.py compare MODEL_DIR OTHER_DIR        (max |last hidden state diff|)

The device tool carries at most 64 MiB per call, tracked tree included. The dataset (86 MB of shards)
goes as one xz archive (the machine may lack zstd; Python's tarfile reads xz everywhere). The
all-MiniLM-L6-v2 weights (91 MB in float32) go in float16, xz-compressed (41 MB), and are widened
back to a float32 directory before use: the distillation runs its teacher in bf16, whose 7-bit
mantissa rounds far coarser than float16's 10 bits, so the carried rounding is below what the run
itself applies (``compare`` measures it). The suite fine-tunes that same restored model, the one its
students are compared with. ``unpack`` and ``restore-model`` write into a temporary sibling and rename
it at the end, so a directory that exists is complete: the device script skips them on a warm
machine's next call.
"""

from __future__ import annotations

import argparse
import contextlib
import lzma
import os
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path

WEIGHTS = "model.safetensors"
# xz preset: 9 for the carried files (about a minute for the model here); the CPU test packs at 1.
PRESET = int(os.environ.get("GPU_INPUTS_XZ_PRESET", "9"))
PACKED = "model.fp16.safetensors.xz"


def pack_data(dataset: Path, archive: Path) -> None:
    """``dataset`` as ``data/...`` in one xz archive (preset 9: about a tenth of the shards' size)."""
    if not (dataset / "manifest.json").is_file():
        raise SystemExit(f"{dataset} has no manifest.json: not a finished preprocessing output")
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, "w:xz", preset=PRESET) as tar:
        tar.add(dataset, arcname="data")
    tmp.replace(archive)


def unpack(archive: Path, dest: Path) -> None:
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(archive, "r:*") as tar:
        tar.extractall(tmp, filter="data")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def pack_model(src: Path, dest: Path) -> None:
    """A copy of the model directory ``src`` whose float32 weights are float16, xz-compressed (fp16 weights
    still shrink by a tenth: 45.4 -> 40.8 MB for all-MiniLM-L6-v2)."""
    import torch
    from safetensors.torch import load_file, save

    tensors = {k: t.to(torch.float16) if t.is_floating_point() else t for k, t in load_file(src / WEIGHTS).items()}
    with staged(src, dest) as tmp:
        (tmp / PACKED).write_bytes(lzma.compress(save(tensors, metadata=metadata(src / WEIGHTS)), preset=PRESET))


def restore_model(src: Path, dest: Path) -> None:
    """The model directory ``pack_model`` made, with its weights widened back to float32 (uncompressed)."""
    import torch
    from safetensors.torch import load, save_file

    tensors = load(lzma.decompress((src / PACKED).read_bytes()))
    tensors = {k: t.to(torch.float32) if t.is_floating_point() else t for k, t in tensors.items()}
    with staged(src, dest) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})


def metadata(weights: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as f:
        return f.metadata() or {"format": "pt"}


@contextlib.contextmanager
def staged(src: Path, dest: Path) -> Iterator[Path]:
    """A temporary sibling of ``dest`` holding ``src``'s small files (config, tokenizer; a few hundred kB)
    for the caller to add weights to, renamed to ``dest`` once the caller is done."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(WEIGHTS, PACKED, "*.tmp"))
    yield tmp
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def compare(a: Path, b: Path) -> float:
    """The largest absolute difference between two models' last hidden states (float32, CPU) on a few
    sentences; prints it with the hidden states' scale."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    sentences = [
        "The kernel schedules threads across every available core.",
        "Python's garbage collector frees objects that are no longer referenced.",
        "A student model learns to imitate the outputs of its teacher.",
        "Use the --prefix option to install the package into another directory.",
    ]
    tokenizer = AutoTokenizer.from_pretrained(a)
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    states = []
    for path in (a, b):
        model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            states.append(model(**batch).last_hidden_state)
    mask = batch["attention_mask"].bool()
    diff = (states[0] - states[1])[mask].abs().max().item()
    scale = states[0][mask].abs().max().item()
    print(f"max |last hidden state difference| {diff:.3e} (largest |value| {scale:.2f}; {int(mask.sum())} tokens)")
    return diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("pack-data", "unpack", "pack-model", "restore-model", "compare"):
        p = sub.add_parser(name)
        p.add_argument("src", type=Path)
        p.add_argument("dest", type=Path)
    args = parser.parse_args()
    if args.command == "pack-data":
        pack_data(args.src, args.dest)
    elif args.command == "unpack":
        unpack(args.src, args.dest)
    elif args.command == "pack-model":
        pack_model(args.src, args.dest)
    elif args.command == "restore-model":
        restore_model(args.src, args.dest)
    else:
        compare(args.src, args.dest)


if __name__ == "__main__":
    main()
