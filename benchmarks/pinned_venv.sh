#!/usr/bin/env bash
# A CPU virtual environment with chosen versions of some libraries:
#   bash benchmarks/pinned_venv.sh DEST NAME==VERSION [NAME==VERSION ...]
#   make gpu-venv   the GPU machine's torch and transformers, in .gpu-venv/ (git-ignored)
#   REST=latest bash benchmarks/pinned_venv.sh .floor-venv torch==2.6.0 transformers==5.0.0 tokenizers==0.22.1
#                   a candidate lower floor for pyproject.toml (in a clone whose floors admit it)
# The test suite and the GPU path's dry runs then run against those versions (docs/gpu-machine.md, "Before a
# GPU session"): code that only the .venv's versions ran can stop on an API that came later, on a device call
# (the scarcest thing this project has) or on a user's cluster.
#
# * torch: PyPI's Linux wheel is the CUDA build (about 4.6 GB installed with its nvidia-* libraries); it runs
#   on a machine without a GPU as a CPU build does, which is how an exact torch is tested here.
# * deepspeed, webdataset, pydantic, ...: the wheels the GPU machine gets (benchmarks/gpu/wheels.sh,
#   .gpu/wheels), so the files the device installs are the ones tested.
# * everything else: the .venv's versions (its pip freeze as constraints), so only the pins differ; or, with
#   REST=latest, what pip resolves afresh around the pins (what a user who pins an old torch gets: an old
#   torch pins its own sympy, an old transformers its tokenizers, which the .venv's versions can contradict).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:?usage: benchmarks/pinned_venv.sh DEST NAME==VERSION [NAME==VERSION ...]}
shift
[ $# -gt 0 ] || { echo "pinned_venv.sh: no NAME==VERSION given" >&2; exit 2; }
PY=${PY:-.venv/bin/python}
WHEELS=${WHEELS:-.gpu/wheels}
REST=${REST:-freeze}
case $REST in freeze | latest) ;; *) echo "pinned_venv.sh: REST must be freeze or latest, not '$REST'" >&2; exit 2 ;; esac
[ -d "$WHEELS" ] || { echo "pinned_venv.sh: $WHEELS is missing: run 'make gpu-wheels' first" >&2; exit 1; }

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
if [ "$REST" = freeze ]; then
    pinned=$(printf '%s\n' "$@" | sed 's/==.*//' | tr 'A-Z_' 'a-z-' | paste -sd'|')
    # The .venv's freeze, less this checkout itself and less what is pinned (names compared lower-case, - for _).
    "$PY" -m pip freeze --exclude-editable | grep -v '^encoder-distill' |
        awk -F'==' -v pinned="^($pinned)\$" '{name = tolower($1); gsub("_", "-", name); if (name !~ pinned) print}' \
            >"$constraints"
fi
printf '%s\n' "$@" >>"$constraints"

# Built in place (a venv's scripts name its path, so it cannot be built aside and renamed); DEST/.installed,
# written last, marks a finished one.
rm -rf "$DEST"
"$PY" -m venv "$DEST"
"$DEST/bin/python" -m pip install --quiet --upgrade pip
"$DEST/bin/python" -m pip install --quiet --find-links "$WHEELS" -c "$constraints" -e ".[dev]"
"$DEST/bin/python" -c 'import sys, deepspeed, numpy, tokenizers, torch, transformers
print(f"{sys.prefix}: torch {torch.__version__} | transformers {transformers.__version__} | tokenizers "
      f"{tokenizers.__version__} | numpy {numpy.__version__} | deepspeed {deepspeed.__version__}")'
touch "$DEST/.installed"
