# The ablation's student variants, sourced by benchmarks/quality/ablation.sh: each is one change to DistilBERT's
# full recipe (the students' config), named here once, so that ablation.sh trains exactly what
# tests/test_ablation.py validates against the trainer's config without training it.
#   variant VARIANT TEACHER LAYERS: sets VARIANT_LABEL (the table's words) and VARIANT_ARGS (the overrides of
#   the students' config) for VARIANT's student of TEACHER; LAYERS: the depth of a student not copied from it
#   (half the teacher's, as init=from_teacher chooses by default). Reads MINILM (the tokenizer of (e), which has
#   no teacher) and, for a5x, PYTHON and STUDENT (the students' config, whose max_steps it multiplies).

VARIANT_NAMES=(a b c d e f a4 f4 a5x a0 h al)  # what ABLATION_VARIANTS may name

student_steps() {  # the students' max_steps, read through the trainer's own config loader (base: included)
    "$PYTHON" -c 'import sys; from common.config import load_config; from trainer.config import TrainConfig
print(load_config(TrainConfig, sys.argv[1], ["data=unused", "output_dir=unused"]).max_steps)' "$STUDENT"
}

variant() {
    local teacher=$2
    local random=(student.init=random student.teacher_layers=null student.num_layers="$3")
    case $1 in
        a) VARIANT_LABEL="(a) L_ce + L_mlm + L_cos, teacher init" VARIANT_ARGS=() ;;
        b) VARIANT_LABEL="(b) without L_cos" VARIANT_ARGS=(objective.cos=0) ;;
        c) VARIANT_LABEL="(c) without L_ce" VARIANT_ARGS=(objective.ce=0) ;;
        d) VARIANT_LABEL="(d) random init" VARIANT_ARGS=("${random[@]}") ;;
        e)
            VARIANT_LABEL="(e) L_mlm only, from scratch"
            VARIANT_ARGS=(tokenizer="$MINILM" "${random[@]}" student.model="$teacher" objective.ce=0 objective.cos=0
                objective.mlm=1)
            ;;
        f) VARIANT_LABEL="(f) teacher layers, no training" VARIANT_ARGS=(max_steps=0) ;;
        a5x) VARIANT_LABEL="(a) on 5x the tokens" VARIANT_ARGS=(max_steps=$((5 * $(student_steps)))) ;;
        a0) VARIANT_LABEL="(a) without attention dropout" VARIANT_ARGS=(student.attention_dropout=0) ;;
        h) VARIANT_LABEL="(h) L_cos alone, teacher init" VARIANT_ARGS=(objective.ce=0 objective.mlm=0) ;;
        al) VARIANT_LABEL="(a) at lr 1e-4" VARIANT_ARGS=(optimizer.lr=1e-4) ;;
        a4) VARIANT_LABEL="(a) with 4 layers" VARIANT_ARGS=(student.num_layers=4) ;;
        f4) VARIANT_LABEL="(f) with 4 layers, no training" VARIANT_ARGS=(student.num_layers=4 max_steps=0) ;;
        *)
            echo "ablation.sh: unknown variant '$1' (${VARIANT_NAMES[*]})" >&2
            return 2
            ;;
    esac
    # every student but (e) learns from the teacher; (e) has none and starts from the teacher's architecture
    if [ "$1" = e ]; then
        VARIANT_ARGS=(teacher=null "${VARIANT_ARGS[@]}")
    else
        VARIANT_ARGS=(teacher="$teacher" "${VARIANT_ARGS[@]}")
    fi
}
