#!/usr/bin/env bash
# powerflex's main job, end to end on one machine: a local Slurm cluster (slurmctld and
# three `slurmd -N` nodes with 8 SIMULATED H200 GPUs each, as gres), the power_flex.so SPANK
# plugin, a powerflexd agent per node and powerflex-ctld. Seven simulated training jobs of
# different tiers (two on real measured curves) calibrate, a 30 % grid event ramps in,
# holds (one job changes phase in the middle) and ends, and what the allocator bought is
# compared with the paper's baselines (equal-weight and PFI-proportional, tiers ignored),
# the equal split within the tiers and the oracle, on the jobs' true curves. A second, deeper event then comes from a local
# OpenADR 3 VTN the demo starts (openleadr-vtn on PostgreSQL 16, installed into
# /var/cache/powerflex by scripts/install-deps.sh) through powerflex-grid, the site's VEN,
# and one flex3 job is suspended for it and resumed after. Everything started is stopped
# by PID at the end and every simulated GPU is left at its default cap.
#
# Run as root on Debian 12. Installs what is missing (apt, pip, cargo install: on a fresh
# machine the VTN's build takes about 4 minutes, once), builds the workspace (release),
# then runs powerflex-demo. Options pass through:
#   scripts/demo.sh --cut 0.4 --hold-s 120      (see: target/release/powerflex-demo --help)
# The offline replay of the paper's experiment is scripts/offline-demo.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install-deps.sh
powerflex_install_deps

if [[ $(id -u) -ne 0 ]]; then
    echo "powerflex demo: run as root (it starts slurmctld/slurmd and sets simulated GPU power limits)" >&2
    exit 1
fi
echo "==> building the workspace (release): plugin, agent, controller, simulator, demo" >&2
cargo build --release --workspace --quiet
exec target/release/powerflex-demo "$@"
