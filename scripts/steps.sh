#!/usr/bin/env bash
# Timed steps for scripts/quick.sh and scripts/test.sh (sourced, not run).
#
#   run_step "what it checks" command args...
#
# prints "==> what it checks", runs the command, then "<-- 12.3 s: what it checks".
# steps_summary prints every step's time and the total; a failing step prints the
# summary so far and exits with the step's status. The times go to stderr, so they are
# in CI's log next to each step's output. A step runs in a subshell: what it exports
# does not reach the steps after it.

PF_STEP_NAMES=()
PF_STEP_MS=()
PF_STEPS_START_MS=$(date +%s%3N)

pf_seconds() { printf '%d.%d' $(($1 / 1000)) $((($1 % 1000) / 100)); }

steps_summary() {
    local i total_ms=$(($(date +%s%3N) - PF_STEPS_START_MS))
    printf '\n==> step times\n' >&2
    for i in "${!PF_STEP_NAMES[@]}"; do
        printf '%8s s  %s\n' "$(pf_seconds "${PF_STEP_MS[$i]}")" "${PF_STEP_NAMES[$i]}" >&2
    done
    printf '%8s s  total\n' "$(pf_seconds "$total_ms")" >&2
}

run_step() {
    local name=$1
    shift
    printf '\n==> %s\n' "$name" >&2
    local start_ms status
    start_ms=$(date +%s%3N)
    # In a subshell with errexit on and outside any `||`: bash ignores `set -e` inside a
    # command that is part of a `||` list, so a failing line inside a shell function
    # (the installer's) would otherwise be skipped over.
    set +e
    (
        set -e
        "$@"
    )
    status=$?
    set -e
    local ms=$(($(date +%s%3N) - start_ms))
    PF_STEP_NAMES+=("$name")
    PF_STEP_MS+=("$ms")
    printf '<-- %s s: %s\n' "$(pf_seconds "$ms")" "$name" >&2
    if ((status != 0)); then
        echo "FAILED (exit $status): $name" >&2
        steps_summary
        exit "$status"
    fi
}
