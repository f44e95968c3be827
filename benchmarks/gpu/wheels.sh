#!/usr/bin/env bash
# Wheels for the offline GPU machine: `make gpu-wheels` (or `bash benchmarks/gpu/wheels.sh [DEST]`).
#
# The GPU machines (docs/gpu-machine.md) run Python 3.12 on x86-64 with CUDA, torch,
# transformers, numpy, pyyaml, psutil, pyarrow, tokenizers, safetensors, ninja, einops, msgpack,
# py-cpuinfo, nvidia-ml-py, tqdm, packaging and pytest already installed, and no package index. What the
# trainer and the GPU tests import beyond that travels as wheels in DEST (default .gpu/wheels, git-ignored),
# installed there by benchmarks/gpu/run.sh with `pip install --no-index --no-deps --target`.
#
# * deepspeed ships only an sdist: built here with DS_BUILD_OPS=0 into a pure-Python wheel (its CUDA ops,
#   such as the CPU Adam of ZeRO-Offload, are compiled on first use there, with the nvcc and ninja it has);
#   its requirements missing there: hjson, pydantic (+ pydantic-core, annotated-types, typing-inspection,
#   and a typing-extensions new enough for this pydantic).
# * webdataset + braceexpand: the trainer's shard reader.
# * textbrewer (PEER): the real peer that benchmarks/peer_step.py times (issue 52). Not a dependency of this
#   project, so not in the virtual environment: pinned here, and built from its sdist (PyPI has no wheel) into
#   a pure-Python wheel (40 kB). Its requirements (numpy, tqdm, tensorboard) are on the GPU machine already.
# Not carried: mlflow and apache-beam (hundreds of MB with their dependencies). The campaign trains with
# mlflow.enabled=false (tracking is imported lazily, only when enabled) and reads shards made here by the
# real preprocessing pipeline (benchmarks/gpu/data.sh) instead of running Beam there.
#
# Versions are the ones installed in this checkout's virtual environment, so the GPU runs the code the
# CPU tests ran. One version of each package: two would stop the whole install there.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:-.gpu/wheels}
PY=${PY:-.venv/bin/python}

version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }

# Pure-Python packages (py3-none-any wheels): any platform, any Python 3.
PURE=(webdataset braceexpand hjson pydantic annotated-types typing-inspection typing-extensions)
# Compiled packages: the CPython 3.12 manylinux x86-64 build.
BINARY=(pydantic-core)

rm -rf "$DEST.tmp" && mkdir -p "$DEST.tmp"
specs=()
for name in "${PURE[@]}" "${BINARY[@]}"; do specs+=("$name==$(version "$name")"); done
echo "downloading: ${specs[*]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$DEST.tmp" "${specs[@]}"

# deepspeed from its sdist, without ops (pure Python); setup.py imports torch, so no build isolation.
ds="deepspeed==$(version deepspeed)"
echo "building: $ds (DS_BUILD_OPS=0)"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-cache-dir --no-deps --no-build-isolation --no-binary deepspeed -w "$DEST.tmp" "$ds"

# the peer library, from its sdist (setuptools only; no build isolation: no index there to fetch one from)
PEER=${PEER:-textbrewer==0.2.1.post1}
echo "building: $PEER"
"$PY" -m pip wheel -q --no-cache-dir --no-deps --no-build-isolation --no-binary :all: -w "$DEST.tmp" "$PEER"

rm -rf "$DEST" && mv "$DEST.tmp" "$DEST"
ls -l "$DEST" | awk 'NR > 1 {printf "%10d  %s\n", $5, $9}'
du -sh "$DEST"
