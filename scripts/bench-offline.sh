#!/usr/bin/env bash
# The offline-evaluation sections of BENCHMARKS.md (issue 15), as Markdown on stdout:
# REAL measured curves (the Zeus NSDI'23 dev set, whole and in its V100 / RTX6000 halves)
# next to SIMULATED ones (the paper-fitted H200 set), at the issue's cuts, with the
# default calibration design and 1 % noise per window; then the multi-event mode.
# scripts/bench.sh calls it; alone:
#
#   scripts/bench-offline.sh [POWERFLEXCTL]    # default target/release/powerflexctl
#
# The figures are deterministic (seeded): any build of the same commit prints the same.
set -euo pipefail
cd "$(dirname "$0")/.."
ctl=${1:-target/release/powerflexctl}
real=data/curves/zeus_nsdi23_dev.csv
synthetic=data/curves/paper_h200_synthetic.csv
halves=$(mktemp -d)
trap 'rm -rf "$halves"' EXIT
for gpu in V100 RTX6000; do
    { head -1 "$real"; grep "|${gpu}|" "$real"; } >"$halves/$gpu.csv"
done

section() { # title, shown command, then the command to run
    local title=$1 shown=$2
    shift 2
    printf '==> %s\n' "$title" >&2
    printf '\n## %s\n\n`%s`\n\n```\n' "$title" "$shown"
    "$@"
    printf '```\n'
}

for cut in 0.1 0.2 0.3; do
    section "Offline evaluation at a ${cut} cut — REAL measured curves (Zeus NSDI'23 dev set, V100 + RTX6000)" \
        "powerflexctl evaluate --curves data/curves/zeus_nsdi23_dev.csv --cut ${cut}" \
        "$ctl" evaluate --quiet --curves "$real" --cut "$cut"
    section "Offline evaluation at a ${cut} cut — SIMULATED curves fitted to the paper's PFIs (H200)" \
        "powerflexctl evaluate --curves data/curves/paper_h200_synthetic.csv --cut ${cut}" \
        "$ctl" evaluate --quiet --curves "$synthetic" --cut "$cut"
done
section "Offline evaluation at a 0.4 cut — SIMULATED curves fitted to the paper's PFIs (H200)" \
    "powerflexctl evaluate --curves data/curves/paper_h200_synthetic.csv --cut 0.4" \
    "$ctl" evaluate --quiet --curves "$synthetic" --cut 0.4
# Parameters were chosen on the V100 half and checked on the RTX6000 half: both shown.
for gpu in V100 RTX6000; do
    for cut in 0.1 0.3; do
        section "Held-out half: ${gpu} jobs only, ${cut} cut — REAL measured curves" \
            "powerflexctl evaluate --curves <${gpu} rows of zeus_nsdi23_dev.csv> --cut ${cut}" \
            "$ctl" evaluate --quiet --curves "$halves/$gpu.csv" --cut "$cut"
    done
done
section "Learning over events at a 0.3 cut — SIMULATED curves (H200), 200 workloads" \
    "powerflexctl evaluate --curves data/curves/paper_h200_synthetic.csv --cut 0.3 --workloads 200 --events 5" \
    "$ctl" evaluate --quiet --curves "$synthetic" --cut 0.3 --workloads 200 --events 5
section "Learning over events at a 0.2 cut, 3 % noise — REAL measured curves, 200 workloads" \
    "powerflexctl evaluate --curves data/curves/zeus_nsdi23_dev.csv --cut 0.2 --noise 0.03 --workloads 200 --events 5" \
    "$ctl" evaluate --quiet --curves "$real" --cut 0.2 --noise 0.03 --workloads 200 --events 5
