#!/usr/bin/env bash
# The gpu-scale ablation on the offline GPU machine, in one device call or one teacher family per call:
#   bash benchmarks/quality/gpu_run.sh OUTDIR all|bert|minilm
# Needs the carried .gpu-ablation/ (benchmarks/quality/gpu_prepare.sh, `make gpu-ablation`). Each family is
# self-contained: `bert` pretrains the teacher, distils (a)-(e) from it, writes (f) (its layers as (a) starts,
# untrained) and scores them; `minilm` fits a masked-LM head to all-MiniLM-L6-v2's frozen encoder, then the
# same (a)-(f) from it, and (a4), (f4) with 4 layers. Neither needs the other's output, so a machine that
# went cold between two calls loses nothing (the pretrained teacher, 35M parameters, is too big to bring back
# and carry again). `all` runs both side by side: ABLATION_JOBS (default here 4) steps share the GPU at once
# (ablation.sh), MiniLM's first.
#
# On the device, under runs/gpu-ablation/ (git-ignored: kept while the machine stays warm; the carried
# folder itself is replaced by every call), once each, then skipped:
#   1. the wheels into /tmp/site (benchmarks/gpu/wheels_env.sh, shared with the GPU campaign)
#   2. the dataset unpacked (data.tar.xz) and all-MiniLM-L6-v2 restored to float32 (gpu_inputs.py)
#   3. `ABLATION_RESUME=1 benchmarks/quality/ablation.sh gpu` for the part, under a time guard (GPU_RUN_BUDGET_S,
#      default 540 s from this script's start: the device kills a command at 600 s, and the results must
#      still be copied). The guard stops every process of the run; calling this again on the warm machine
#      continues: finished steps (runs.tsv) are skipped, an interrupted training resumes from its last
#      checkpoint (in the same output_dir), an interrupted suite or probe reuses the runs it finished
#      (evaluate-suite's work_dir), an interrupted evaluate-mlm starts again.
# OUTDIR receives (8 files at most, what the device tool returns): progress.md (what is done, what was
# running), runs.tsv, ablation-FAMILY.json for each family whose scores are done (also when the guard
# stopped the other; under ABLATION_PROTOCOL with the study's comparisons decided, and suite-FAMILY.json beside it,
# the predictions they are decided from) and ablation.md (their table), else scores-FAMILY.tar (a plain tar of the family's
# score reports that are done: mlm-, suite-, probe-FAMILY.json), ablation.log (the script's output),
# logs.txt (the last lines of every step's log) and versions.txt. Back here, `ablation_report.py OUT
# --merge FILES` joins the reports.
# The CPU dry run (tests/test_ablation.py): ABLATION_SCALE=toy SKIP_WHEELS=1 GPU_ABLATION_INPUTS=DIR.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUTDIR=${1:?usage: benchmarks/quality/gpu_run.sh OUTDIR all|bert|minilm}
PART=${2:?usage: benchmarks/quality/gpu_run.sh OUTDIR all|bert|minilm}
case $PART in
    bert | minilm) FAMILIES=$PART ;;
    all) FAMILIES="bert minilm" ;;
    *) echo "gpu_run.sh: unknown part '$PART' (all, bert, minilm)" >&2; exit 2 ;;
esac
BUDGET_S=${GPU_RUN_BUDGET_S:-540}
SCALE=${ABLATION_SCALE:-gpu}
INPUTS=${GPU_ABLATION_INPUTS:-.gpu-ablation}
STATE=${GPU_ABLATION_STATE:-runs/gpu-ablation}
export PY=${PYTHON:-python3} PYTHON=${PYTHON:-python3}
export ABLATION_JOBS=${ABLATION_JOBS:-4}  # small models at 128 tokens: one run alone should leave the GPU idle often
mkdir -p "$OUTDIR" "$STATE"
STATE=$(cd "$STATE" && pwd)
RUN="$STATE/$PART-$SCALE"  # ablation.sh's output directory for this part

source benchmarks/gpu/wheels_env.sh "$INPUTS/wheels" || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the report below imports this repository's common/
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
    "$PY" -c 'import sys, torch, transformers, deepspeed, webdataset
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| deepspeed", deepspeed.__version__, "| transformers", transformers.__version__)
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")'
    "$PY" -m trainer.runtime.cpus  # the CPUs the machine reports and those a command here uses
} >"$OUTDIR/versions.txt" 2>&1

# The inputs, once per machine: a finished unpack or restore is a directory (gpu_inputs.py renames it last).
if [ ! -d "$STATE/dataset" ]; then
    "$PY" benchmarks/quality/gpu_inputs.py unpack "$INPUTS/data.tar.xz" "$STATE/dataset" || exit 1
fi
if [ ! -d "$STATE/minilm" ]; then
    "$PY" benchmarks/quality/gpu_inputs.py restore-model "$INPUTS/minilm-fp16" "$STATE/minilm" || exit 1
fi
echo "inputs ready after $SECONDS s" >>"$OUTDIR/versions.txt"

CORPORA_LABEL="../shared/corpora, preprocessed before the run by gpu_prepare.sh"
# The run, stopped by `timeout` (TERM to the whole process group: the launcher and its ranks too, then KILL
# 15 s later) before the device's own limit.
left=$((BUDGET_S - SECONDS))
[ "$left" -ge 1 ] || left=1  # `timeout 0` would mean no limit at all
ABLATION_OUTPUT=$RUN ABLATION_RESUME=1 ABLATION_FAMILIES=$FAMILIES ABLATION_DATA=$STATE/dataset/data \
    ABLATION_MINILM=$STATE/minilm timeout -k 15 "$left" \
    bash benchmarks/quality/ablation.sh "$SCALE" "$CORPORA_LABEL" \
    >"$OUTDIR/ablation.log" 2>&1
status=$?
case $status in
    0) outcome="finished" ;;
    124 | 137) outcome="stopped by the time guard after $SECONDS s: call again on the warm machine to continue" ;;
    *) outcome="FAILED (exit $status): see ablation.log and logs.txt" ;;
esac

cp "$RUN/runs.tsv" "$OUTDIR/" 2>/dev/null
# Each family whose scores are done gets its own report, also when the guard stopped the run: the device
# keeps nothing, and a family finished is a family that need not run again.
done_families=()
partial=()
for family in $FAMILIES; do
    if [ -f "$RUN/mlm-$family.json" ] && [ -f "$RUN/suite-$family.json" ] && [ -f "$RUN/probe-$family.json" ] &&
        "$PY" benchmarks/quality/ablation_report.py "$RUN" --scale "$SCALE" --corpora "$CORPORA_LABEL" \
            --wall-seconds "$SECONDS" --families "$family" --jobs "$ABLATION_JOBS" --into "$RUN/report-$family" \
            ${ABLATION_PROTOCOL:+--protocol "$ABLATION_PROTOCOL"} >/dev/null; then
        cp "$RUN/report-$family/ablation.json" "$OUTDIR/ablation-$family.json"
        done_families+=("ablation-$family.json")
        # a study's decision is recomputed here from the suite's predictions (results.py --check): they come back
        # too; a protocol names one family, so this is the call's 8th file at most
        [ -z "${ABLATION_PROTOCOL:-}" ] || cp "$RUN/suite-$family.json" "$OUTDIR/"
    else  # its scores that are done, in its file's place: measured device minutes are not thrown away
        scores=()
        for kind in mlm suite probe; do [ -f "$RUN/$kind-$family.json" ] && scores+=("$kind-$family.json"); done
        [ ${#scores[@]} -gt 0 ] && tar -cf "$OUTDIR/scores-$family.tar" -C "$RUN" "${scores[@]}" &&
            partial+=("scores-$family.tar (${scores[*]})")
    fi
done
if [ ${#done_families[@]} -gt 0 ]; then  # their table, as it will read once merged here
    "$PY" benchmarks/quality/ablation_report.py "$RUN/report" --merge "${done_families[@]/#/$OUTDIR/}" >/dev/null &&
        cp "$RUN/report/ablation.md" "$OUTDIR/"
fi
for log in "$RUN"/logs/*.log; do
    [ -e "$log" ] && printf '\n===== %s =====\n' "$(basename "$log")" && tail -n 25 "$log"
done >"$OUTDIR/logs.txt"
{
    echo "# gpu_run.sh $PART (scale $SCALE): $outcome"
    echo
    echo "This call: $SECONDS s. Steps done (runs.tsv: name, seconds):"
    awk -F'\t' 'NR > 1 {printf "- %s: %s s\n", $1, $4}' "$RUN/runs.tsv" 2>/dev/null
    echo
    echo "Reports returned: ${done_families[*]:-none}"
    [ ${#partial[@]} -eq 0 ] || echo "Finished scores of an unfinished family: ${partial[*]}"
    if [ "$status" != 0 ]; then
        # The steps that were running: a log and no runs.tsv row; each log's last progress line says how far.
        for log in "$RUN"/logs/*.log; do
            name=$(basename "$log" .log)
            [[ -e $log && $name != plan-* ]] || continue
            cut -f1 "$RUN/runs.tsv" 2>/dev/null | grep -qxF "$name" && continue
            echo
            echo "Interrupted in $name:"
            grep -E '^step [0-9]+/[0-9]+|resumed from|checkpoint' "$log" | tail -n 3
        done
    fi
} >"$OUTDIR/progress.md"
cat "$OUTDIR/progress.md"
exit "$status"
