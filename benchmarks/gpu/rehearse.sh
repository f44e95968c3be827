#!/usr/bin/env bash
# The GPU machine's device calls rehearsed on this CPU machine, before a session spends device time on them:
#   bash benchmarks/gpu/rehearse.sh MODE [OUT]
#
#   cpu           .venv: the GPU tests' bodies on a CPU rank (the CUDA-only checks skip), then the draw's `next` call
#                 with --quick models, the wheels skipped (the .venv has those packages) and no answer committed
#                 (every item items.json has for next, in order)
#   gpu-venv      the same against the device's library versions (.gpu-venv: `make gpu-venv`), the campaign's `all`
#   device-venv   the device's own Python 3.12.3 and packages only (.device-venv: `make device-venv`), the carried
#                 wheels installed into /tmp/site as a device call installs them: a first `session` call cut short
#                 at 100 s, a second that continues it, then the ablation's device part (`gpu_run.sh minilm`) on
#                 toy-scale inputs made first by gpu_prepare.sh (with the .venv) and the carried wheels
#   fair          the `fair` call (TextBrewer's carried wheel, tensorboard and absl-py standing in for the device's
#                 own, in $OUT/fair/peer-site), then the fair-step tests with TextBrewer on the path
#   suite VENV    the whole test suite against VENV's libraries: .gpu-venv (the device's versions), or a floor
#                 made by `REST=latest bash benchmarks/pinned_venv.sh .floor-venv torch==... transformers==...`
#                 (in a clone whose pyproject.toml admits those versions: pip refuses versions below its floors)
#   py312-suite   the whole test suite on the device's Python 3.12.3 (.device-venv's interpreter) in a venv of its
#                 own at $OUT/py312-suite/venv: this project's .[dev] around the device's torch, transformers, ...
#
# Each mode starts from an empty $OUT/MODE (default OUT: /tmp/rehearse), as a bare machine does, and leaves there
# each call's OUTDIR (the files a device call returns) and state. PYTHON (default .venv/bin/python) is the
# interpreter of the `cpu` and `fair` modes and of device-venv's toy inputs. Every mode but `suite` needs .gpu/
# (`make gpu-wheels gpu-data`).
# The commands, what they showed when last run, and what only they found: docs/gpu-machine.md ("Before a GPU
# session") and docs/log/gpu-machine.md. `suite` and `py312-suite` take about half an hour on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
USAGE="usage: benchmarks/gpu/rehearse.sh cpu|gpu-venv|device-venv|fair|py312-suite [OUT] | suite VENV [OUT]"
MODE=${1:?$USAGE}
shift
if [ "$MODE" = suite ]; then
    VENV=${1:?$USAGE}
    shift
fi
OUT=${1:-/tmp/rehearse}
# The device's versions (the Makefile's GPU_PINS), for the py312-suite venv.
DEVICE_PINS=(torch==2.11.0 transformers==5.17.0 huggingface_hub==1.33.0 tokenizers==0.23.2 safetensors==0.8.0)

need() {  # need PATH MAKE-TARGETS: stop, saying what makes PATH, where it is missing
    [ -e "$1" ] || { echo "rehearse.sh $MODE: no $1 here: run \`make $2\` first" >&2; exit 2; }
}

case $MODE in
cpu | gpu-venv | device-venv | fair | py312-suite) need .gpu/wheels "gpu-wheels gpu-data" ;;
suite) need "$VENV/bin/python" "gpu-venv (or benchmarks/pinned_venv.sh for a floor)" ;;
*) echo "$USAGE" >&2; exit 2 ;;
esac
WORK=$OUT/$MODE
rm -rf "$WORK"
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
PY=${PYTHON:-.venv/bin/python}
# absolute, since some calls below run from other directories
[ -d "$(dirname "$PY")" ] && PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")

case $MODE in
cpu)
    need .gpu/data-128 gpu-data
    ENCODER_DISTILL_GPU_TESTS_ON=cpu ENCODER_DISTILL_GPU_DATA=.gpu/data-128 "$PY" -m pytest -m gpu tests/gpu
    mkdir -p "$WORK/answers"
    PATH=$(dirname "$PY"):$PATH PYTHON=$PY SKIP_WHEELS=1 THROUGHPUT_ARGS="--quick --work $WORK/tt-work" \
        GPU_NEXT_ANSWERS=$WORK/answers GPU_NEXT_WORK=$WORK/next-work GPU_RUN_BUDGET_S=3000 \
        bash benchmarks/gpu/run.sh "$WORK/next" next
    ;;
gpu-venv)
    need .gpu-venv/bin/python gpu-venv
    need .gpu/data-128 gpu-data
    export PATH=$ROOT/.gpu-venv/bin:$PATH DS_ACCELERATOR=cpu
    ENCODER_DISTILL_GPU_TESTS_ON=cpu ENCODER_DISTILL_GPU_DATA=.gpu/data-128 .gpu-venv/bin/python -m pytest -m gpu tests/gpu
    PYTHON=.gpu-venv/bin/python SKIP_WHEELS=1 THROUGHPUT_ARGS=--quick GPU_CAMPAIGN_STATE=$WORK/state \
        bash benchmarks/gpu/run.sh "$WORK/all" all
    ;;
device-venv)
    need .device-venv/bin/python device-venv
    # the ablation's toy-scale inputs, made with PYTHON's environment (Beam, MiniLM) as `make gpu-ablation` makes the real
    # ones, the carried wheels beside them as in .gpu-ablation/
    PATH=$(dirname "$PY"):$PATH PYTHON=$PY PY=$PY ABLATION_SCALE=toy SKIP_WHEELS=1 \
        GPU_ABLATION_WORK=$WORK/prepare GPU_INPUTS_XZ_PRESET=1 bash benchmarks/quality/gpu_prepare.sh "$WORK/abl-inputs"
    cp -r .gpu/wheels "$WORK/abl-inputs/wheels"
    export PATH=$ROOT/.device-venv/bin:$PATH PYTHON=$ROOT/.device-venv/bin/python ENCODER_DISTILL_GPU_TESTS_ON=cpu
    # the first call, its budget cut short; the second continues from the same state
    THROUGHPUT_ARGS="--quick --work $WORK/w" GPU_CAMPAIGN_STATE=$WORK/state GPU_RUN_BUDGET_S=100 \
        bash benchmarks/gpu/run.sh "$WORK/out1" session || echo "the first call stopped at its budget (as designed)"
    THROUGHPUT_ARGS="--quick --work $WORK/w" GPU_CAMPAIGN_STATE=$WORK/state GPU_RUN_BUDGET_S=500 \
        bash benchmarks/gpu/run.sh "$WORK/out2" session
    # the ablation's device part: the wheels installed into /tmp/site, the device's Python and packages only
    ABLATION_SCALE=toy GPU_ABLATION_INPUTS=$WORK/abl-inputs GPU_ABLATION_STATE=$WORK/abl-state GPU_RUN_BUDGET_S=3000 \
        bash benchmarks/quality/gpu_run.sh "$WORK/abl" minilm
    ;;
fair)
    "$PY" -m pip install -q --no-deps --target "$WORK/peer-site" .gpu/wheels/textbrewer-*.whl tensorboard absl-py
    PATH=$(dirname "$PY"):$PATH PYTHONPATH=$WORK/peer-site PYTHON=$PY SKIP_WHEELS=1 \
        THROUGHPUT_ARGS="--quick --work $WORK/tt-work" GPU_CAMPAIGN_STATE=$WORK/state GPU_RUN_BUDGET_S=900 \
        bash benchmarks/gpu/run.sh "$WORK/out" fair
    PYTHONPATH=$WORK/peer-site:. "$PY" -m pytest tests/test_benchmark_fair_steps.py
    ;;
suite)
    PATH=$(cd "$VENV/bin" && pwd):$PATH DS_ACCELERATOR=cpu "$VENV/bin/python" -m pytest -q
    ;;
py312-suite)
    need .device-venv/interpreter/usr/bin/python3.12 device-venv
    I=$ROOT/.device-venv/interpreter V=$WORK/venv
    "$I/usr/bin/python3.12" -m venv --without-pip "$V"
    PIP_WHEEL=$(ls "$I"/usr/share/python-wheels/pip-*.whl)
    "$V/bin/python" "$PIP_WHEEL/pip" install -q --upgrade pip
    "$V/bin/python" -m pip install -q --find-links .gpu/wheels "${DEVICE_PINS[@]}" -e ".[dev]"
    PATH=$V/bin:$PATH DS_ACCELERATOR=cpu "$V/bin/python" -m pytest -q
    ;;
esac
echo "rehearse.sh $MODE: done; the returned files are under $WORK"
