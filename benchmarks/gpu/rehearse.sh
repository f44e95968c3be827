#!/usr/bin/env bash
# A draw's device calls rehearsed on this CPU machine, on the device's own Python 3.12.3 and packages, before a
# session spends device time on them:
#   bash benchmarks/gpu/rehearse.sh [OUT]
#
# What the full tier's dry run (tests/test_gpu_campaign.py, tests/test_ablation.py: .venv's Python 3.11 with every
# dependency, the wheels skipped) cannot show: that the carried wheels install into /tmp/site and import on the
# device's Python, that they are all it lacks, and that nothing on the device path imports a package it does not
# have (how the device-only bugs in docs/log/gpu-machine.md were found). .device-venv (`make device-venv`) is that
# Python with the device's packages and only those. From an empty OUT/device-venv (default OUT: /tmp/rehearse),
# as on a bare machine:
#   1. `run.sh OUT next`, --quick models, no answer committed: every item items.json has for next, in order
#      (the fair-steps item's peer step on TextBrewer's carried wheel);
#   2. the ablation's device part, `benchmarks/quality/gpu_run.sh OUT minilm`, on toy-scale inputs made first by
#      gpu_prepare.sh with PYTHON's environment (Beam, MiniLM; default .venv/bin/python), the wheels beside them.
# Needs .gpu/ (`make gpu-wheels gpu-data`) and .device-venv/. Exits non-zero if an item or a step failed.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
for need in .gpu/wheels:"gpu-wheels gpu-data" .gpu/data-128:gpu-data .device-venv/bin/python:device-venv; do
    [ -e "${need%%:*}" ] || { echo "rehearse.sh: no ${need%%:*} here: run \`make ${need#*:}\` first" >&2; exit 2; }
done
WORK=${1:-/tmp/rehearse}/device-venv
rm -rf "$WORK"
mkdir -p "$WORK/answers"
WORK=$(cd "$WORK" && pwd)
PY=${PYTHON:-.venv/bin/python}
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")  # absolute: gpu_prepare.sh runs from other directories

# the ablation's toy-scale inputs, made as `make gpu-ablation` makes the real ones, the carried wheels beside them
PATH=$(dirname "$PY"):$PATH PYTHON=$PY PY=$PY ABLATION_SCALE=toy SKIP_WHEELS=1 \
    GPU_ABLATION_WORK=$WORK/prepare GPU_INPUTS_XZ_PRESET=1 bash benchmarks/quality/gpu_prepare.sh "$WORK/abl-inputs"
cp -r .gpu/wheels "$WORK/abl-inputs/wheels"

# from here on, the device's Python and packages only
export PATH=$ROOT/.device-venv/bin:$PATH PYTHON=$ROOT/.device-venv/bin/python
THROUGHPUT_ARGS="--quick --work $WORK/tt-work" GPU_NEXT_ANSWERS=$WORK/answers GPU_NEXT_WORK=$WORK/next-work \
    GPU_RUN_BUDGET_S=3000 bash benchmarks/gpu/run.sh "$WORK/next" next
if grep -q "| FAILED" "$WORK/next/next.md"; then  # next.py exits 0 and names a failed item in its report
    echo "rehearse.sh: an item failed (next.md above; next.log says why)" >&2
    exit 1
fi
ABLATION_SCALE=toy GPU_ABLATION_INPUTS=$WORK/abl-inputs GPU_ABLATION_STATE=$WORK/abl-state GPU_RUN_BUDGET_S=3000 \
    bash benchmarks/quality/gpu_run.sh "$WORK/abl" minilm
echo "rehearse.sh: done; the returned files are under $WORK"
