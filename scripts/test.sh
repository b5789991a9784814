#!/usr/bin/env bash
# The whole test suite, exactly as CI runs it (.ci/run calls this script).
# Installs what it needs, then: format check, clippy with warnings as errors, build,
# every test of every crate (the fault matrix and the demo included), a short fuzz run.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install-deps.sh
powerflex_install_deps

step() { printf '\n==> %s\n' "$*" >&2; }

step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy (warnings are errors)"
cargo clippy --workspace --all-targets --quiet -- -D warnings
step "cargo build"
cargo build --workspace --all-targets --quiet
step "cargo test"
cargo test --workspace --quiet
step "fuzz smoke run: every parser target for 5 s (scripts/fuzz.sh; longer runs: scripts/fuzz.sh 600)"
bash scripts/fuzz.sh 5
