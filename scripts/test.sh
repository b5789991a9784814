#!/usr/bin/env bash
# The whole test suite, exactly as CI runs it (.ci/run calls this script).
# Installs what it needs, then: format check, clippy with warnings as errors, the
# dependency checks (licences, bans, sources, unused dependencies, the locked crates'
# rust-version), the docs with warnings as errors, build, every test of every crate
# (the fault matrix and the demo included), a short fuzz run. Each step's time and the
# total are printed at the end (and after a failing step).
#
# Under CI (CI=true) a test that needs root or Slurm fails rather than skips when they
# are missing (powerflex_testbed::needs).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/steps.sh
source scripts/install-deps.sh
run_step "install what is missing (scripts/install-deps.sh)" powerflex_install_deps
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
run_step "cargo build" cargo build --workspace --all-targets --quiet
run_step "cargo test" cargo test --workspace --quiet
run_step "fuzz smoke run: every parser target for 5 s (scripts/fuzz.sh; longer runs: scripts/fuzz.sh 600)" \
    bash scripts/fuzz.sh 5
steps_summary
