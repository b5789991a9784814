#!/usr/bin/env bash
# The developer's loop: format check, clippy with warnings as errors, the pure unit
# tests of every crate and the site harness's logic checks (no running Slurm, no root,
# no daemons; building the plugin needs libslurm-dev's spank.h and libclang all the
# same). Under two minutes on a 2-core machine once built. The whole suite, with the whole-system
# tests on a local Slurm cluster, is scripts/test.sh.
#
#   scripts/quick.sh            check
#   scripts/quick.sh --fix      run cargo fmt first instead of only checking it
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/steps.sh

if [[ ${1:-} == --fix ]]; then
    run_step "cargo fmt" cargo fmt --all
else
    run_step "cargo fmt --check" cargo fmt --all -- --check
fi
run_step "cargo clippy (warnings are errors)" \
    cargo clippy --workspace --all-targets --quiet -- -D warnings
run_step "unit tests (every crate's lib and bins)" \
    cargo test --workspace --lib --bins --quiet
# The site harness's logic checks: the budget, faults and ramps on a fake clock, in about
# a second (its 1,000- and 10,000-node scale tests are the suite's).
run_step "site harness: budget, faults, ramps (fake clock)" \
    cargo test -p powerflex-site-harness --test budget --test faults --test ramp_suspend --quiet
if command -v cargo-machete >/dev/null 2>&1; then
    run_step "unused dependencies (cargo machete)" cargo machete
fi
steps_summary
