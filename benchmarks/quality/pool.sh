# A pool of slots for shell steps that may run at once, sourced by benchmarks/quality/ablation.sh:
#   pool_init N [LABEL]         N slots (1: every step runs alone, one after another); LABEL names N's
#                               source in the error a bad N gives
#   pool_start NAME COMMAND...  run COMMAND in the background as soon as a slot is free
#   pool_await NAME...          return once none of these steps runs
#   pool_finish                 return once no step runs
# A step whose command ends badly is remembered, and from then on nothing new starts: the next
# pool_start, pool_await or pool_finish waits for the steps still running (each ends as it would have,
# so whatever they record is kept), then exits 1 naming the failed steps. Why not stop them at once:
# on a rented GPU, what already runs is paid for, and a run continued later skips what finished.
# Needs bash 5.1 or later (wait -n -p).

declare -A POOL_RUNNING=()  # the process of each running step -> its name
POOL_FAILED=()
POOL_JOBS=1

pool_init() {
    [[ $1 =~ ^[1-9][0-9]*$ ]] || { echo "${2:-pool_init}: '$1' is not a positive number of slots" >&2; exit 2; }
    POOL_JOBS=$1
}

pool_reap() {  # wait for one running step to end
    local pid status=0
    wait -n -p pid "${!POOL_RUNNING[@]}" || status=$?
    [ "$status" = 0 ] || POOL_FAILED+=("${POOL_RUNNING[$pid]}")
    unset "POOL_RUNNING[$pid]"
}

pool_finish() {
    while [ ${#POOL_RUNNING[@]} -gt 0 ]; do pool_reap; done
    [ ${#POOL_FAILED[@]} -eq 0 ] || { echo "${0##*/}: failed: ${POOL_FAILED[*]}" >&2; exit 1; }
}

pool_start() {
    local name=$1
    shift
    while [ ${#POOL_RUNNING[@]} -ge "$POOL_JOBS" ]; do pool_reap; done
    [ ${#POOL_FAILED[@]} -eq 0 ] || pool_finish
    "$@" &
    POOL_RUNNING[$!]=$name
}

pool_await() {
    local pid
    for pid in "${!POOL_RUNNING[@]}"; do
        if [[ " $* " == *" ${POOL_RUNNING[$pid]} "* ]]; then
            pool_reap
            pool_await "$@"  # the set of running steps changed: look again
            return
        fi
    done
    [ ${#POOL_FAILED[@]} -eq 0 ] || pool_finish
}
