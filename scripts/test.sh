#!/usr/bin/env bash
# The whole test suite, exactly as CI runs it (.ci/run calls this script).
# Installs what it needs, then: format check, clippy with warnings as errors, the
# dependency checks (licences, bans, sources, unused dependencies, the locked crates'
# rust-version), the docs with warnings as errors, build, every test of every crate
# (the fault matrix and the demo included), a short fuzz run. Each step's time and the
# total are printed at the end (and after a failing step).
#
# Under CI (CI=true) a test that needs root or Slurm fails rather than skips when they
# are missing (powerflex::needs).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/steps.sh
source scripts/install-deps.sh

# A clean clone builds everything once: cargo's incremental caches only cost time there
# (they pay off on a developer's rebuilds, so only CI turns them off). Exported, so the
# cargo the test runner and the tests' freshness checks start builds the same way.
if [[ ${CI:-} == true ]]; then
    export CARGO_INCREMENTAL=0
fi

# The fuzz smoke run in the background, in a session of its own (its process group),
# with no terminal or CI pipe held open: its PID in target/fuzz-smoke.pid, its status
# written atomically to target/fuzz-smoke.status when it ends. If the suite stops early,
# the EXIT trap ends that group and prints the tail of its log.
#
# A new session is a new scheduler autogroup where the kernel has them
# (/proc/sys/kernel/sched_autogroup_enabled), and autogroups share the CPU evenly
# whatever their processes' nice values: `nice -n 19` alone left the AddressSanitizer
# build with more CPU than all three test lanes together (measured here: a niced loop
# in its own session ran 5x as many iterations as each of three loops beside it). The
# agents' control loops then stalled for seconds, and the demo's and the grid event's
# PFIs came out 20-30 % off. The group's own nice value (/proc/self/autogroup) puts it
# behind the tests (the same loop: 2 % of the others' share); writing it is allowed
# for one's own group, and a kernel without autogroups has nothing to write.
rm -f target/fuzz-smoke.pid target/fuzz-smoke.status
start_fuzz_smoke() {
    local log=$1
    setsid bash -c 'if { echo 19 >/proc/self/autogroup; } 2>/dev/null; then : >"$1"; else echo "fuzz smoke: its autogroup could not be niced (no autogroups here, or the kernel refused); it may take CPU from the tests" >"$1"; fi; nice -n 19 bash scripts/fuzz.sh --smoke 5 >>"$1" 2>&1; echo $? >target/fuzz-smoke.status.tmp && mv target/fuzz-smoke.status.tmp target/fuzz-smoke.status' \
        fuzz-smoke "$log" </dev/null >/dev/null 2>&1 &
    echo $! >target/fuzz-smoke.pid
}

stop_fuzz_smoke() {
    local pid
    pid=$(cat target/fuzz-smoke.pid 2>/dev/null) || return 0
    if [[ ! -f target/fuzz-smoke.status ]] && kill -0 "$pid" 2>/dev/null; then
        echo "stopping the fuzz smoke run (process group $pid); its log so far:" >&2
        kill -TERM -- "-$pid" 2>/dev/null || true
        tail -20 target/fuzz-smoke.log >&2 2>/dev/null || true
    fi
}
trap stop_fuzz_smoke EXIT

# Waits for the status file, not the PID: the job was orphaned, and a PID that stays a
# zombie (or is reused) must not hold the suite. A job gone without a status failed.
wait_fuzz_smoke() {
    local log=$1 pid
    pid=$(cat target/fuzz-smoke.pid)
    while [[ ! -f target/fuzz-smoke.status ]]; do
        if ! kill -0 "$pid" 2>/dev/null; then
            sleep 1
            [[ -f target/fuzz-smoke.status ]] && break
            cat "$log" >&2
            echo "the fuzz smoke run ended without a status" >&2
            return 1
        fi
        sleep 1
    done
    cat "$log" >&2
    return "$(cat target/fuzz-smoke.status)"
}
run_step "install what is missing (scripts/install-deps.sh)" powerflex_install_deps
run_step "install the test suite's tools (cargo-deny, cargo-fuzz, cargo-machete, cargo-deb, cargo-generate-rpm, rpm; once per machine)" \
    powerflex_install_test_tools
# The installer ran in a subshell: find cargo here too when it is not on PATH.
command -v cargo >/dev/null 2>&1 || export PATH="$HOME/.cargo/bin:$PATH"

run_step "cargo fmt --check" cargo fmt --all -- --check
run_step "cargo clippy (warnings are errors; incompatible_msrv checks std use against rust-version)" \
    cargo clippy --workspace --all-targets --quiet -- -D warnings
run_step "cargo deny: licences, bans, sources (advisories need GitHub: see deny.toml)" \
    cargo deny --workspace --log-level error check licenses bans sources
run_step "cargo machete: unused dependencies" cargo machete
run_step "locked crates within the MSRV (scripts/msrv-deps.sh)" bash scripts/msrv-deps.sh
run_step "cargo doc (warnings are errors)" \
    env RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
# Every target the tests run, not the benches: clippy has checked those, scripts/bench.sh
# builds them optimised, and nine bench binaries linked unoptimised bought the suite nothing.
run_step "cargo build (every target but the benches)" \
    cargo build --workspace --lib --bins --tests --examples --quiet
run_step "doc tests" cargo test --workspace --doc --quiet
# The fuzz smoke run builds every target with AddressSanitizer (minutes of CPU) while
# the test lanes mostly wait on simulated time: it runs beside them, niced so the tests'
# daemons keep the CPU they need, and its log is printed once the tests are done.
fuzz_log=target/fuzz-smoke.log
mkdir -p target
run_step "fuzz smoke run started beside the tests (log: $fuzz_log)" start_fuzz_smoke "$fuzz_log"
# Every test binary (unit, integration, whole-system) in parallel lanes; what runs at
# once shares no cluster, directory or port (src/lanes.rs). POWERFLEX_TEST_LANES sets
# how many.
# The runner the build step just built, run directly, so nothing of `cargo run`'s
# environment reaches the cargo it starts (see powerflex::cargo_command).
run_step "cargo test in ${POWERFLEX_TEST_LANES:-3} lanes (powerflex-test-lanes)" \
    target/debug/powerflex-test-lanes --lanes "${POWERFLEX_TEST_LANES:-3}" -- --workspace
run_step "fuzz smoke run: every parser target for 5 s (scripts/fuzz.sh --smoke; the long runs: scripts/fuzz.sh 600)" \
    wait_fuzz_smoke "$fuzz_log"
steps_summary
