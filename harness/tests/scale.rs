//! A site at scale: every node of `nodes` × 8 GPUs runs one 8-GPU job, under a budget
//! that caps them, through allocation periods and a grid event announced ahead, on the
//! site config's defaults (10 s allocation period, 60 s lease, agents sampling every
//! second). The meter (every GPU's draw, summed, every 50 ms) never passes the budget in
//! force once the first caps are confirmed: not before the event (the caps are cut
//! before it starts), not during its ramp down, hold and ramp up.

// The tests print what they measured, as the Slurm tests do.
#![allow(clippy::disallowed_macros)]

use powerflex_core::config::RawSiteConfig;
use powerflex_proto::admin::AdminOp;
use powerflex_proto::event::Cut;
use powerflex_site_harness::site::T0_MS;
use powerflex_site_harness::site::{DrawWatch, JobSpec, Site, SiteOptions};

/// The workloads the jobs run, in turn: the test bed's training profile and the two
/// synthetic extremes.
const WORKLOADS: [&str; 3] = [
    "qwen3-30b-a3b-moe-ft-8g",
    "synthetic-compute-bound",
    "synthetic-memory-bound",
];
const TIERS: [&str; 3] = ["flex1", "flex2", "flex3"];

/// The site config's defaults but for the budget and the GPU model (the test bed's
/// H200 with a 300 W fail-safe).
fn defaults(budget_w: f64) -> RawSiteConfig {
    let mut raw = powerflex_site_harness::site::test_bed_site(budget_w, 60);
    raw.controller.allocation_period_s = None;
    raw.controller.lease_ttl_s = None;
    raw.agent.calibration_warmup_s = None;
    raw.agent.calibration_settle_s = None;
    raw.agent.calibration_hold_s = None;
    raw.agent.calibration_budget_pct = None;
    raw
}

/// The scenario; returns the site for the digest.
#[allow(clippy::disallowed_types, clippy::disallowed_methods)] // timing on the host's clock, printed only
fn site_at_scale(nodes: u32, seed: u64) -> Site {
    let started = std::time::Instant::now();
    let gpus = nodes as f64 * 8.0;
    // About three quarters of what the jobs draw uncapped (560 to 690 W per GPU).
    let budget_w = (gpus * 470.0).round();
    let mut site = Site::new(SiteOptions {
        nodes,
        gpus_per_node: 8,
        sample_interval_ms: 1000,
        site: defaults(budget_w),
        ..SiteOptions::new(seed, budget_w)
    })
    .expect("site");
    for i in 0..nodes as usize {
        let job = JobSpec::training(
            &(i + 1).to_string(),
            &format!("{},calibrate=off", TIERS[i % TIERS.len()]),
            i,
            8,
            WORKLOADS[i % WORKLOADS.len()],
        );
        site.submit(job).expect("submit");
    }
    println!(
        "{nodes} nodes: built and submitted in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    // The first allocation, its leases applied and reported, and one more period.
    let phase = std::time::Instant::now();
    assert!(
        site.run_until(60_000, |s| s.allocations() >= 2),
        "two allocations within a minute"
    );
    site.run_for(10_000);
    let settled_ms = site.now_ms();
    println!(
        "{nodes} nodes: {} allocations by {:.0} s of site time, {:.1} s of wall time",
        site.allocations(),
        (settled_ms - T0_MS) as f64 / 1000.0,
        phase.elapsed().as_secs_f64()
    );
    assert!(
        site.caps_w().iter().all(|&c| c < 700.0),
        "every GPU capped by a lease"
    );
    // A 20 % cut announced 25 s ahead, ramped over 10 s, held 30 s.
    let phase = std::time::Instant::now();
    let start_ms = site.now_ms() + 25_000;
    let reply = site
        .admin(AdminOp::EventAdd {
            cut: Cut::Reduce { fraction: 0.2 },
            start_ms,
            duration_ms: 30_000,
            ramp_ms: 10_000,
            domain: None,
        })
        .expect("a reply");
    assert!(reply.is_ok(), "{reply:?}");
    site.run_until(80_000, |s| s.now_ms() >= start_ms + 40_000);
    println!(
        "{nodes} nodes: the event and its rebound in {:.1} s of wall time ({} allocations in all)",
        phase.elapsed().as_secs_f64(),
        site.allocations()
    );
    let watch = DrawWatch::of(site.samples_since(settled_ms), 0.0);
    println!("{nodes} nodes: {watch}");
    assert!(
        watch.over_s == 0.0,
        "the draw went over the budget: {watch}"
    );
    let deepest = site
        .samples_since(settled_ms)
        .iter()
        .map(|s| s.budget_w)
        .fold(f64::INFINITY, f64::min);
    assert!(
        (deepest - budget_w * 0.8).abs() < 1.0,
        "the full cut was in force: {deepest} W"
    );
    // Pre-positioning: before the event's first step the draw is already below it.
    let first_step_w = site
        .samples_since(start_ms)
        .iter()
        .find(|s| s.budget_w < budget_w - 0.5)
        .map(|s| s.budget_w)
        .expect("a step");
    let at_start = site
        .samples_since(start_ms - 50)
        .first()
        .map(|s| s.draw_w)
        .expect("a sample at the start");
    assert!(
        at_start <= first_step_w,
        "caps cut before the event: {at_start} W at its start, first step {first_step_w} W"
    );
    assert!(
        watch.highest_w > 0.9 * budget_w,
        "the budget is used: {watch}"
    );
    println!(
        "{nodes} nodes: {:.1} s of wall time in all",
        started.elapsed().as_secs_f64()
    );
    site
}

/// The same scenario at a size the default suite can afford, twice from one seed: the
/// runs are identical.
#[test]
fn a_thousand_nodes_hold_the_budget_through_an_event_and_replay_from_their_seed() {
    let a = site_at_scale(1_000, 20);
    let b = site_at_scale(1_000, 20);
    assert_eq!(a.digest(), b.digest(), "the same seed gives the same trace");
    assert_eq!(a.samples(), b.samples());
}

/// The scale a site must hold at: 10,000 nodes × 8 GPUs, in every suite run (about 2
/// minutes of one core in a debug build, 36 s in release: BENCHMARKS.md).
#[test]
fn ten_thousand_nodes_of_eight_gpus_hold_the_budget_through_an_event() {
    site_at_scale(10_000, 20);
}
