#!/usr/bin/env bash
# The GPU campaign on a bare, offline GPU machine:
#   bash benchmarks/gpu/run.sh OUTDIR [next|tests]
#
#   next        (the default) the one command of every draw: the open questions of benchmarks/gpu/items.json, most
#               telling first, each started only if its estimate fits the time left to the deadline
#               (GPU_RUN_BUDGET_S, default 540 s from this script's start: the device kills a command at 600 s),
#               each answer written into OUTDIR as NAME.json the moment it is complete (benchmarks/gpu/next.py);
#               what docs/gpu-campaign/next/ holds is answered and skipped. OUTDIR: versions.txt, next.log, next.md
#               and the answers. Nothing is kept on the machine.
#   tests       pytest -m gpu tests/gpu: ZeRO-1/2/3 in bf16, fp16 overflow skipping, ZeRO-2 CPU offload,
#               kill-and-resume, fill-mask on the GPU, no host sync in masking/forward/backward; OUTDIR:
#               versions.txt, tests.log, tests.xml
#
# Needs .gpu/ from this repository's `make gpu-wheels gpu-data` (carried to the machine): it installs
# .gpu/wheels (deepspeed, webdataset, ...) into /tmp/site without any index and prints the versions first.
# docs/gpu-machine.md.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUTDIR=${1:?usage: benchmarks/gpu/run.sh OUTDIR [next|tests]}
MODE=${2:-next}
case $MODE in next | tests) ;; *) echo "unknown mode $MODE (next|tests)"; exit 2 ;; esac
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
DEADLINE=$(($(date +%s) + ${GPU_RUN_BUDGET_S:-540}))
PY=${PYTHON:-python3}
INPUTS=${GPU_CAMPAIGN_INPUTS:-.gpu}  # what `make gpu-wheels gpu-data` wrote (the CPU dry run: its own)

# Carried wheels, without an index, into /tmp/site. SKIP_WHEELS=1 where the packages are importable already
# (the CPU dry run: PYTHON=.venv/bin/python SKIP_WHEELS=1 ...).
source benchmarks/gpu/wheels_env.sh "$INPUTS/wheels" || exit 1
INPUTS=$(cd "$INPUTS" && pwd)
export ENCODER_DISTILL_TOKENIZER=$INPUTS/tokenizer ENCODER_DISTILL_GPU_DATA=$INPUTS/data-128
unset DS_ACCELERATOR  # DeepSpeed detects CUDA
# The offload test JIT-builds DeepSpeed's CPU Adam (plain C++): somewhere writable even if $HOME is not.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$PY" - <<'PY'
import sys, torch, transformers, deepspeed, webdataset
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| deepspeed", deepspeed.__version__, "| transformers", transformers.__version__,
      "| webdataset", webdataset.__version__)
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE")
PY
    "$PY" -m trainer.runtime.cpus || true  # the CPUs the machine reports and those a command here uses
    command -v nvcc ninja c++ || true
    timeout 120 ds_report 2>&1 | grep -E "cpu_adam|fused_adam|torch (version|cuda)|nvcc|deepspeed (info|wheel)" || true
    "$PY" -c "import sysconfig, os; h = sysconfig.get_paths()['include']; print('Python.h', os.path.exists(h + '/Python.h'))"
} 2>&1 | tee "$OUTDIR/versions.txt"

if [ "$MODE" = next ]; then  # its own report (next.md), rewritten after every item; THROUGHPUT_ARGS: --quick on CPU
    "$PY" benchmarks/gpu/next.py "$OUTDIR" --deadline "$DEADLINE" --inputs "$INPUTS" \
        --work "${GPU_NEXT_WORK:-/tmp/gpu-next}" --throughput-args "${THROUGHPUT_ARGS:-}" \
        ${GPU_NEXT_ANSWERS:+--answers "$GPU_NEXT_ANSWERS"} 2>&1 \
        | tee -a "$OUTDIR/next.log"
    exit "${PIPESTATUS[0]}"
fi

echo "=== GPU tests (pytest -m gpu tests/gpu) ==="
"$PY" -m pytest -m gpu tests/gpu -v -p no:cacheprovider --junitxml="$OUTDIR/tests.xml" 2>&1 | tee "$OUTDIR/tests.log"
exit "${PIPESTATUS[0]}"
