//! Prints the live A/B's tables for BENCHMARKS.md ("Live A/B on the site harness"): the
//! dev set's real measured curves and the paper's profiles, three seeds, the controller's
//! default policy (`optimal`) beside `equal`, each run's events and jobs, then one summary
//! row per run. An event marked ✗ has a budget below what every job's bound costs on the
//! true curves (the oracle too must let a tier give way).
//!
//! `cargo run --release -p powerflex-site-harness --example live_ab`
//!
//! `-- --new-step` (with or without one run's arguments): the phase-changing job's
//! next phase starts as a new Slurm step, which its agents hear of, instead of running on
//! in its first step.
//!
//! One run only, with where its watts went (each job's grant and the power the
//! controller's model counts for it beside what its GPUs truly drew over the hold):
//! `... --example live_ab -- dev 41 optimal` (set, seed, policy).

// The example's whole job is to print, and to read which run to print from its command
// line (the harness's library takes every setting as an argument).
#![allow(clippy::disallowed_macros, clippy::disallowed_methods)]

use std::process::ExitCode;

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

/// Each event's grants: the controller's modelled power per job (its `what-if` halfway
/// through the hold) beside the job's true mean draw and cap over the hold.
fn watts(run: &AbRun) -> String {
    let mut s = String::new();
    for e in &run.events {
        let Some(decision) = &e.decision else {
            continue;
        };
        s.push_str(&format!(
            "event {}: budget {:.0} W, controller budget {:.0} W, reserved {:.0} W, true draw {:.0} W\n\n\
             | job | grant W/GPU | modelled W | true mean cap W/GPU | true draw W | modelled − drawn W | equal split's cap (true) | oracle's cap (true) |\n\
             | --- | --- | --- | --- | --- | --- | --- | --- |\n",
            e.event, e.budget_w, decision.budget_w, decision.reserved_w, e.draw_w
        ));
        let Some(allocation) = &decision.allocation else {
            continue;
        };
        let mut gap = 0.0;
        for j in &allocation.jobs {
            let drawn = e.mean_draw_w.get(&j.id).copied().unwrap_or(0.0);
            gap += j.power_w.0 - drawn;
            s.push_str(&format!(
                "| {} | {:.0} | {:.0} | {:.0} | {:.0} | {:+.0} | {:.0} | {:.0} |\n",
                j.id,
                j.cap_w.0,
                j.power_w.0,
                e.mean_caps_w.get(&j.id).copied().unwrap_or(0.0),
                drawn,
                j.power_w.0 - drawn,
                e.equal.caps_w.get(&j.id).copied().unwrap_or(f64::NAN),
                e.oracle.caps_w.get(&j.id).copied().unwrap_or(f64::NAN),
            ));
        }
        s.push_str(&format!(
            "\nallocation total {:.0} W, modelled − drawn {gap:+.0} W\n\n",
            allocation.total_power_w.0
        ));
    }
    s
}

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    // `--new-step`: the phase-changing job's next phase starts as a new Slurm step.
    let phase_as_new_step = args.iter().any(|a| a == "--new-step");
    args.retain(|a| a != "--new-step");
    if let [set, seed, policy] = args.as_slice() {
        let jobs = match set.as_str() {
            "dev" => ab::dev_set(),
            "paper" => ab::paper_set(),
            other => {
                eprintln!("live_ab: set {other:?} is neither `dev` nor `paper`");
                return ExitCode::from(2);
            }
        };
        let Ok(seed) = seed.parse::<u64>() else {
            eprintln!("live_ab: seed {seed:?} is not a whole number");
            return ExitCode::from(2);
        };
        let policy = match policy.as_str() {
            "optimal" => Policy::Optimal,
            "equal" => Policy::Equal,
            other => {
                eprintln!("live_ab: policy {other:?} is neither `optimal` nor `equal`");
                return ExitCode::from(2);
            }
        };
        match ab::run(&Scenario {
            seed,
            jobs,
            policy,
            timing: Timing::default(),
            phase_as_new_step,
        }) {
            Ok(run) => {
                println!("{}\n{}", run.table(), watts(&run));
                println!("{}", summary(&run));
            }
            Err(e) => {
                eprintln!("live_ab: the run failed: {e}");
                return ExitCode::FAILURE;
            }
        }
        return ExitCode::SUCCESS;
    }
    if !args.is_empty() {
        eprintln!("usage: live_ab [--new-step] [SET SEED POLICY]  (SET: dev | paper; POLICY: optimal | equal; --new-step: the phase change starts a new Slurm step)");
        return ExitCode::from(2);
    }
    let mut rows = Vec::new();
    for set in [ab::dev_set(), ab::paper_set()] {
        for seed in SEEDS {
            for policy in [Policy::Optimal, Policy::Equal] {
                match ab::run(&Scenario {
                    seed,
                    jobs: set.clone(),
                    policy,
                    timing: Timing::default(),
                    phase_as_new_step,
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
    ExitCode::SUCCESS
}
