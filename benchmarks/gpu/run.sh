#!/usr/bin/env bash
# The GPU campaign on a bare, offline GPU machine:
#   bash benchmarks/gpu/run.sh OUTDIR [next|session|fair|tests|cases|steps|all]
#
#   next        the one command of every draw: the open questions of benchmarks/gpu/items.json, most telling first,
#               each started only if its estimate fits the time left to the deadline (GPU_RUN_BUDGET_S, default
#               540 s from this script's start), each answer written into OUTDIR as NAME.json the moment it is
#               complete (benchmarks/gpu/next.py); what docs/gpu-campaign/next/ holds is answered and skipped.
#               OUTDIR: versions.txt, next.log, next.md and the answers. Nothing is kept on the machine.
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
#   session     (the default) all of it, the most telling first, under a time budget (GPU_RUN_BUDGET_S, default
#               540 s from this script's start: the device kills a command at 600 s): the bare step, the
#               naive one and the peer's (the ratios and the profile), the headline case (distilbert-base, 512 x 32), the GPU
#               tests, the compiled bare step, then every other case and step. Its results accumulate in $GPU_CAMPAIGN_STATE
#               (runs/gpu-campaign: git-ignored, kept while the machine stays warm) and are copied to OUTDIR
#               after each piece, so the same command again on the warm machine, with the budget that is
#               left, continues where the last call stopped (what is done is not measured again).
#   fair        (issue 52) as session, from the same state and under the same deadline, but only: the project's bare
#               step, the naive step and the real peer's (TextBrewer) side by side; the compiled engine step's
#               profile (the case distilbert-512-mb32-compiled-profiled); the compiled bare step. A session call
#               after it continues with the rest.
# and writes at most 7 files into OUTDIR (the device tool returns 8 at most): versions.txt, tests.log,
# tests.xml, throughput.log, throughput.json, throughput.md, summary.md. docs/gpu-machine.md.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUTDIR=${1:?usage: benchmarks/gpu/run.sh OUTDIR [next|session|fair|tests|cases|steps|all]}
MODE=${2:-session}
case $MODE in next | session | fair | tests | cases | steps | all) ;; *) echo "unknown mode $MODE (next|session|fair|tests|cases|steps|all)"; exit 2 ;; esac
# fair is a session that measures less: the same state, deadline and continuation
SESSION=false
case $MODE in session | fair) SESSION=true ;; esac
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
DEADLINE=$(($(date +%s) + ${GPU_RUN_BUDGET_S:-540}))
# session: results accumulate across calls, and train_throughput.py continues them under the deadline;
# the other modes write straight into OUTDIR
RESULTS=$OUTDIR SESSION_ARGS=()
if $SESSION; then
    RESULTS=${GPU_CAMPAIGN_STATE:-runs/gpu-campaign} SESSION_ARGS=(--append --deadline "$DEADLINE")
fi
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
# A later session starts on a bare machine: GPU_CAMPAIGN_FROM names the files an earlier session returned
# (committed or carried), and the session continues from them instead of measuring it all again, but for
# GPU_CAMPAIGN_AGAIN: the names of results to measure again (recorded before a change to what they measure).
PY=${PYTHON:-python3}
if $SESSION && [ -n "${GPU_CAMPAIGN_FROM:-}" ] && [ ! -e "$RESULTS/throughput.json" ]; then
    # not versions.txt: this session's device and versions are recorded anew (each result names its device)
    cp "$GPU_CAMPAIGN_FROM"/{tests.log,tests.xml,throughput.json,throughput.log} "$RESULTS"/ 2>/dev/null
    if [ -n "${GPU_CAMPAIGN_AGAIN:-}" ]; then  # before the wheels: forget.py needs none of them
        "$PY" benchmarks/gpu/forget.py "$RESULTS" "$GPU_CAMPAIGN_AGAIN" || { echo "GPU_CAMPAIGN_AGAIN: forget.py failed"; exit 1; }
    fi
fi
INPUTS=${GPU_CAMPAIGN_INPUTS:-.gpu}  # what `make gpu-wheels gpu-data` wrote (the CPU dry run: its own)

# Carried wheels, without an index, into /tmp/site. SKIP_WHEELS=1 where the packages are importable already
# (the CPU dry run: PYTHON=.venv/bin/python SKIP_WHEELS=1 ...).
source benchmarks/gpu/wheels_env.sh "$INPUTS/wheels" || exit 1
INPUTS=$(cd "$INPUTS" && pwd)
export ENCODER_DISTILL_TOKENIZER=$INPUTS/tokenizer ENCODER_DISTILL_GPU_DATA=$INPUTS/data-128
unset DS_ACCELERATOR  # DeepSpeed detects CUDA
# The offload test JIT-builds DeepSpeed's CPU Adam (plain C++): somewhere writable even if $HOME is not.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}

$SESSION && [ -s "$RESULTS/versions.txt" ] || {
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$PY" - <<'EOF'
import sys, torch, transformers, deepspeed, webdataset
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| deepspeed", deepspeed.__version__, "| transformers", transformers.__version__,
      "| webdataset", webdataset.__version__)
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE")
EOF
    "$PY" -m trainer.runtime.cpus || true  # the CPUs the machine reports and those a command here uses
    command -v nvcc ninja c++ || true
    timeout 120 ds_report 2>&1 | grep -E "cpu_adam|fused_adam|torch (version|cuda)|nvcc|deepspeed (info|wheel)" || true
    "$PY" -c "import sysconfig, os; h = sysconfig.get_paths()['include']; print('Python.h', os.path.exists(h + '/Python.h'))"
} 2>&1 | tee "$RESULTS/versions.txt"

status=0
left() { echo $((DEADLINE - $(date +%s))); }
# train_throughput.py starts nothing with less than this to the deadline; read from it, its one owner
MIN_START_S=$(sed -n 's/^MIN_START_S = \([0-9][0-9]*\).*/\1/p' benchmarks/gpu/train_throughput.py)
NOT_STARTED=()  # the pieces run.sh did not start, too close to the deadline

tests() {  # the GPU tests; in a session under the deadline (timeout stops pytest's whole process group)
    echo "=== GPU tests (pytest -m gpu tests/gpu) ==="
    local guard=()
    $SESSION && guard=(timeout -k 15 "$(left)")
    "${guard[@]}" "$PY" -m pytest -m gpu tests/gpu -v -p no:cacheprovider --junitxml="$RESULTS/tests.xml" 2>&1 \
        | tee "$RESULTS/tests.log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        echo "GPU tests stopped by the time guard: the next session call runs them again" | tee -a "$RESULTS/tests.log"
        rm -f "$RESULTS/tests.xml"
    fi
    [ "$rc" = 0 ] || status=1
}

throughput() {  # throughput() PARTS [train_throughput.py arguments]: appends to the results
    local parts=$1
    shift
    local piece="$parts${*:+ $*}"
    local title="=== throughput: $piece (benchmarks/gpu/train_throughput.py) ==="
    if $SESSION && [ "$(left)" -lt "${MIN_START_S:?}" ]; then  # it would start nothing, after ~10 s of imports
        echo "$title not started: $(left) s to the deadline" | tee -a "$RESULTS/throughput.log"
        NOT_STARTED+=("$piece")
        return
    fi
    echo "$title" | tee -a "$RESULTS/throughput.log"
    # THROUGHPUT_ARGS: e.g. "--only distilbert-512-mb32" to repeat one case with `cases` (not with `session`,
    # whose own --only it would override), or "--quick --work DIR" for the CPU dry run
    "$PY" benchmarks/gpu/train_throughput.py "$RESULTS" --data "$INPUTS" --parts "$parts" "${SESSION_ARGS[@]}" "$@" \
        ${THROUGHPUT_ARGS:-} 2>&1 | tee -a "$RESULTS/throughput.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
}

report() {  # summary.md from what RESULTS holds, and every file copied to OUTDIR
    {
        echo "# GPU campaign ($MODE), exit $status, this call $SECONDS s"
        grep -E "^(FAILED|ERROR)|passed|failed|stopped by the time guard" "$RESULTS/tests.log" 2>/dev/null | tail -20
        cat "$RESULTS/throughput.md" 2>/dev/null
        [ ${#NOT_STARTED[@]} -eq 0 ] || printf '\nPieces not started by run.sh, under %s s to the deadline: %s.\n' \
            "$MIN_START_S" "$(IFS=';' && echo "${NOT_STARTED[*]}" | sed 's/;/; /g')"
    } >"$RESULTS/summary.md"
    [ "$RESULTS" = "$OUTDIR" ] || cp "$RESULTS"/*.txt "$RESULTS"/*.log "$RESULTS"/*.xml "$RESULTS"/*.json \
        "$RESULTS"/*.md "$OUTDIR"/ 2>/dev/null
}

case $MODE in
    next)  # its own report (next.md), rewritten after every item; THROUGHPUT_ARGS: the CPU dry run's --quick
        "$PY" benchmarks/gpu/next.py "$OUTDIR" --deadline "$DEADLINE" --inputs "$INPUTS" \
            --work "${GPU_NEXT_WORK:-/tmp/gpu-next}" --throughput-args "${THROUGHPUT_ARGS:-}" \
            ${GPU_NEXT_ANSWERS:+--answers "$GPU_NEXT_ANSWERS"} 2>&1 \
            | tee -a "$OUTDIR/next.log"
        exit "${PIPESTATUS[0]}"
        ;;
    tests) tests ;;
    fair)
        # the three steps side by side (one process each, one after another on the same GPU), then the compiled
        # engine step's profile (--only's "compiled-profiled": the case of that name at this size), then the
        # compiled bare step
        throughput steps --only project,naive,peer
        report
        throughput cases --only compiled-profiled
        report
        throughput steps --only project-compiled
        ;;
    cases | steps) throughput "$MODE" ;;
    all)
        tests
        throughput cases,steps
        ;;
    session)
        throughput steps --only project,project-unpadded,naive,peer,tinybert-memory
        report
        throughput cases --only headline
        report
        if [ -f "$RESULTS/tests.xml" ]; then
            echo "=== GPU tests: done in an earlier call (tests.log) ==="
        elif [ "$(left)" -ge 60 ]; then
            tests
        fi
        report
        # compile is what is left for the kernel-bound step (docs/log/benchmarks.md, "What bounds the engine"): its
        # bare step before the rest, so that a short call still says whether it pays
        throughput steps --only project-compiled
        report
        throughput cases,steps
        ;;
esac
report
cat "$RESULTS/summary.md"
exit $status
