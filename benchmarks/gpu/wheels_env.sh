# Sourced by the device scripts (benchmarks/gpu/run.sh, benchmarks/quality/gpu_run.sh):
#   PY=python3 source benchmarks/gpu/wheels_env.sh WHEELS_DIR
# installs the wheels that benchmarks/gpu/wheels.sh made into WHEELS_DIR, without any index; --target keeps
# the machine's own packages untouched, and --upgrade makes a second call on a warm machine harmless.
# /tmp/site then goes on PYTHONPATH, its bin (the `deepspeed` launcher) on PATH. SKIP_WHEELS=1 where the
# packages are importable already (the CPU dry runs): nothing installed, and no /tmp/site on the paths.
# Either way, the environment of an offline run: no hub access.
if [ "${SKIP_WHEELS:-0}" != 1 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$1"/*.whl || { echo "installing $1 failed"; return 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    export PATH=/tmp/site/bin:$PATH
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
