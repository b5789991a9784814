//! Prints the live A/B's tables for BENCHMARKS.md ("Live A/B on the site harness"): the
//! dev set's real measured curves and the paper's profiles, three seeds, the controller's
//! default policy (`optimal`) beside `equal`, each run's events and jobs, then one summary
//! row per run. An event marked ✗ has a budget below what every job's bound costs on the
//! true curves (the oracle too must let a tier give way).
//!
//! `cargo run --release -p powerflex-site-harness --example live_ab`

// The example's whole job is to print.
#![allow(clippy::disallowed_macros)]

use powerflex_core::allocate::Policy;
use powerflex_site_harness::ab::{self, AbRun, Scenario, Timing};

const SEEDS: [u64; 3] = [41, 42, 43];

fn summary(run: &AbRun) -> String {
    let shares: Vec<String> = run
        .events
        .iter()
        .map(|e| {
            format!(
                "{} ({:+.1} %){}",
                e.gap_share
                    .map_or("—".to_string(), |g| format!("{:.0} %", 100.0 * g)),
                100.0 * e.over_equal(),
                // The budget is below the tiers' floors on the true curves.
                if e.bounds_affordable() { "" } else { " ✗" }
            )
        })
        .collect();
    let draw: Vec<String> = run
        .events
        .iter()
        .map(|e| format!("{:.1}", 100.0 * e.draw_of_budget()))
        .collect();
    let tiers: Vec<String> = run
        .worst_per_tier()
        .iter()
        .map(|(tier, bound, worst, _)| format!("{tier} {:.1}/{:.0}", 100.0 * worst, 100.0 * bound))
        .collect();
    format!(
        "| {} | {} | {} | {:.0} | {} | {} | {} | {} |",
        run.set,
        run.seed,
        run.policy,
        run.calibration_s,
        shares.join(" · "),
        draw.join(" · "),
        tiers.join(", "),
        run.broken().count(),
    )
}

fn main() {
    let mut rows = Vec::new();
    for set in [ab::dev_set(), ab::paper_set()] {
        for seed in SEEDS {
            for policy in [Policy::Optimal, Policy::Equal] {
                match ab::run(&Scenario {
                    seed,
                    jobs: set.clone(),
                    policy,
                    timing: Timing::default(),
                }) {
                    Ok(run) => {
                        println!("{}", run.table());
                        rows.push(summary(&run));
                    }
                    Err(e) => rows.push(format!(
                        "| {} | {seed} | {policy} | failed: {e} | | | | |",
                        set.name
                    )),
                }
            }
        }
    }
    println!(
        "| set | seed | policy | calibration s | gap share per event (vs equal) | draw % of budget per event | worst true slowdown / bound per tier, % | jobs past bound |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    for row in rows {
        println!("{row}");
    }
}
