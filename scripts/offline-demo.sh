#!/usr/bin/env bash
# The site-level decision on the paper's data, offline (no cluster, no root needed for the
# commands themselves): each workload's Power Flexibility Index, a replay of the paper's
# §6 experiment (equal-weight vs the paper's PFI rule vs powerflex's calibrated optimiser vs
# an oracle) at 10–40 % grid cuts, and a tiered budget split. The curves are SIMULATED from
# the paper's published PFIs (data/README.md). The main demo is scripts/demo.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install-deps.sh
powerflex_install_deps

echo "==> building powerflexctl (release)" >&2
cargo build --release --quiet -p powerflex-controller
ctl=target/release/powerflexctl
curves=data/curves/paper_h200_synthetic.csv

echo
echo "== PFI of the paper's 29 H200 workloads (SIMULATED curves fitted to the paper's PFIs)"
"$ctl" pfi --curves "$curves"

for cut in 0.1 0.2 0.3 0.4; do
    echo
    echo "== grid event: cut ${cut} of the site's uncapped GPU power (500 random 100-job workloads, SIMULATED curves)"
    "$ctl" evaluate --curves "$curves" --cut "$cut"
done
for cut in 0.1 0.2 0.3; do
    echo
    echo "== grid event: cut ${cut} on REAL measured curves (Zeus NSDI'23: 120 V100/RTX6000 training jobs)"
    "$ctl" evaluate --curves data/curves/zeus_nsdi23_dev.csv --cut "$cut"
done

echo
echo "== one site, 20 % below its uncapped draw: tiers (flex0..flex3 in turn) from the example site config"
tiered=$(mktemp)
trap 'rm -f "$tiered"' EXIT
# Give the workloads tiers in turn: flex0..flex3.
awk -F, 'BEGIN{OFS=","} /^#/ {next} NR==0 {next}
     $1=="job" {print; next}
     { if (!($1 in t)) { t[$1]=n++ % 4 } $6="flex" t[$1]; print }' "$curves" > "$tiered"
budget=$(awk -F, '/^#/||$1=="job"{next} $2==700 {s+=$3} END {printf "%.0f", s*0.8}' "$curves")
"$ctl" allocate --curves "$tiered" --budget-w "$budget" --site slurm-conf/powerflex.toml
