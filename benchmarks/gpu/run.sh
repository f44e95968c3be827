#!/usr/bin/env bash
# The GPU campaign on a bare, offline GPU machine: `bash benchmarks/gpu/run.sh OUTDIR [tests|cases|steps|all]`.
#
# Needs .gpu/ from this repository's `make gpu-wheels gpu-data` (carried to the machine): it installs
# .gpu/wheels (deepspeed, webdataset, ...) into /tmp/site without any index, prints the versions, then
#   tests       pytest -m gpu tests/gpu: ZeRO-1/2/3 in bf16, fp16 overflow skipping, ZeRO-2 CPU offload,
#               kill-and-resume, fill-mask on the GPU, no host sync in masking/forward/backward
#   cases       benchmarks/gpu/train_throughput.py --parts cases: the real engine and loader, presets x sequence
#               length x micro-batch, MFU, peak memory, data wait, the 4096 global batch
#   steps       benchmarks/gpu/train_throughput.py --parts steps: the bare step (fused AdamW on/off, compiled)
#               and the naive reference step side by side
# (each part fits one 10-minute device call; `all` runs the three in one go, for a machine without that limit)
# and writes at most 7 files into OUTDIR (the device tool returns 8 at most): versions.txt, tests.log,
# tests.xml, throughput.log, throughput.json, throughput.md, summary.md. docs/benchmarks.md, "GPU campaign".
set -uo pipefail
cd "$(dirname "$0")/../.."
OUTDIR=${1:?usage: benchmarks/gpu/run.sh OUTDIR [tests|cases|steps|all]}
MODE=${2:-all}
case $MODE in tests | cases | steps | all) ;; *) echo "unknown mode $MODE (tests|cases|steps|all)"; exit 2 ;; esac
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}

# Carried wheels, without an index, into /tmp/site. SKIP_WHEELS=1 where the packages are importable already
# (the CPU dry run: PYTHON=.venv/bin/python SKIP_WHEELS=1 ...).
source benchmarks/gpu/wheels_env.sh .gpu/wheels || exit 1
export ENCODER_DISTILL_TOKENIZER=$PWD/.gpu/tokenizer ENCODER_DISTILL_GPU_DATA=$PWD/.gpu/data-128
unset DS_ACCELERATOR  # DeepSpeed detects CUDA
# The offload test JIT-builds DeepSpeed's CPU Adam (plain C++): somewhere writable even if $HOME is not.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$PY" - <<'EOF'
import sys, torch, transformers, deepspeed, webdataset
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| deepspeed", deepspeed.__version__, "| transformers", transformers.__version__,
      "| webdataset", webdataset.__version__)
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE")
EOF
    command -v nvcc ninja c++ || true
    timeout 120 ds_report 2>&1 | grep -E "cpu_adam|fused_adam|torch (version|cuda)|nvcc|deepspeed (info|wheel)" || true
    "$PY" -c "import sysconfig, os; h = sysconfig.get_paths()['include']; print('Python.h', os.path.exists(h + '/Python.h'))"
} 2>&1 | tee "$OUTDIR/versions.txt"

status=0
if [ "$MODE" = tests ] || [ "$MODE" = all ]; then
    echo "=== GPU tests (pytest -m gpu tests/gpu) ==="
    "$PY" -m pytest -m gpu tests/gpu -v -p no:cacheprovider --junitxml="$OUTDIR/tests.xml" 2>&1 | tee "$OUTDIR/tests.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
case $MODE in
    cases | steps) parts=$MODE ;;
    all) parts=cases,steps ;;
    *) parts= ;;
esac
if [ -n "$parts" ]; then
    echo "=== throughput: $parts (benchmarks/gpu/train_throughput.py) ==="
    # THROUGHPUT_ARGS: e.g. "--only distilbert-512-mb32" to repeat one case
    "$PY" benchmarks/gpu/train_throughput.py "$OUTDIR" --parts "$parts" ${THROUGHPUT_ARGS:-} 2>&1 \
        | tee "$OUTDIR/throughput.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
{
    echo "# GPU campaign ($MODE), exit $status"
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUTDIR/tests.log" 2>/dev/null | tail -20
    cat "$OUTDIR/throughput.md" 2>/dev/null
} > "$OUTDIR/summary.md"
cat "$OUTDIR/summary.md"
exit $status
