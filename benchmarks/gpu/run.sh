#!/usr/bin/env bash
# The GPU campaign on a bare, offline GPU machine:
#   bash benchmarks/gpu/run.sh OUTDIR [next|tests|cases|steps|all]
#
#   next        (the default) the one command of every draw: the open questions of benchmarks/gpu/items.json, most
#               telling first, each started only if its estimate fits the time left to the deadline
#               (GPU_RUN_BUDGET_S, default 540 s from this script's start: the device kills a command at 600 s),
#               each answer written into OUTDIR as NAME.json the moment it is complete (benchmarks/gpu/next.py);
#               what docs/gpu-campaign/next/ holds is answered and skipped. OUTDIR: versions.txt, next.log, next.md
#               and the answers. Nothing is kept on the machine.
#
# Needs .gpu/ from this repository's `make gpu-wheels gpu-data` (carried to the machine): it installs
# .gpu/wheels (deepspeed, webdataset, ...) into /tmp/site without any index, prints the versions, then
#   tests       pytest -m gpu tests/gpu: ZeRO-1/2/3 in bf16, fp16 overflow skipping, ZeRO-2 CPU offload,
#               kill-and-resume, fill-mask on the GPU, no host sync in masking/forward/backward
#   cases       benchmarks/gpu/train_throughput.py --parts cases: the real engine and loader, presets x sequence
#               length x micro-batch, MFU, peak memory, data wait, the 4096 global batch
#   steps       benchmarks/gpu/train_throughput.py --parts steps: the bare step (fused AdamW on/off, compiled),
#               the naive reference step and the real peer's (TextBrewer, carried as a wheel) side by side
#   all         the three in one go, for a machine without a time limit
# tests, cases, steps and all write versions.txt, tests.log, tests.xml, throughput.log, throughput.json,
# throughput.md and summary.md into OUTDIR. docs/gpu-machine.md.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUTDIR=${1:?usage: benchmarks/gpu/run.sh OUTDIR [next|tests|cases|steps|all]}
MODE=${2:-next}
case $MODE in next | tests | cases | steps | all) ;; *) echo "unknown mode $MODE (next|tests|cases|steps|all)"; exit 2 ;; esac
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

status=0
tests() {
    echo "=== GPU tests (pytest -m gpu tests/gpu) ==="
    "$PY" -m pytest -m gpu tests/gpu -v -p no:cacheprovider --junitxml="$OUTDIR/tests.xml" 2>&1 | tee "$OUTDIR/tests.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
}

throughput() {  # throughput PARTS: train_throughput.py's cases, steps or both, into OUTDIR
    echo "=== throughput: $1 (benchmarks/gpu/train_throughput.py) ===" | tee -a "$OUTDIR/throughput.log"
    # THROUGHPUT_ARGS: e.g. "--only distilbert-512-mb32" to repeat one case, or "--quick --work DIR" on CPU
    "$PY" benchmarks/gpu/train_throughput.py "$OUTDIR" --data "$INPUTS" --parts "$1" ${THROUGHPUT_ARGS:-} 2>&1 \
        | tee -a "$OUTDIR/throughput.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
}

case $MODE in
    tests) tests ;;
    cases | steps) throughput "$MODE" ;;
    all)
        tests
        throughput cases,steps
        ;;
esac
{
    echo "# GPU campaign ($MODE), exit $status, this call $SECONDS s"
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUTDIR/tests.log" 2>/dev/null | tail -20
    cat "$OUTDIR/throughput.md" 2>/dev/null
} | tee "$OUTDIR/summary.md"
exit $status
