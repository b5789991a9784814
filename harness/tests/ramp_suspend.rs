//! Ramps the grid can rely on and cuts deeper than caps, on the site harness: the
//! scenarios of the Slurm tests (`tests/ramp_suspend.rs`) whose subject is
//! logic. Samples are compared with the stepped budget in force at their instant, with
//! no tolerance, as there. What stays on Slurm: that `scontrol suspend` and
//! `requeuehold` do what the controller asks of them.

// The tests print what they measured, as the Slurm tests do.
#![allow(clippy::disallowed_macros)]

use powerflex_proto::admin::AdminOp;
use powerflex_proto::event::Cut;
use powerflex_site_harness::site::test_bed_site;
use powerflex_site_harness::site::{DrawWatch, JobSpec, JobState, Site, SiteOptions};

const HEAVY: &str = "synthetic-compute-bound";
const RATE_W_PER_S: f64 = 100.0;
const PERIOD_S: f64 = 1.0;
/// One 10 W cap step on each of the 8 GPUs, W.
const CAP_STEPS_W: f64 = 80.0;

fn granted(site: &Site, ids: &[&str]) -> bool {
    site.controller_status().is_some_and(|st| {
        ids.iter()
            .all(|id| st.jobs.iter().any(|j| j.job == *id && j.cap_w.is_some()))
    })
}

/// A ramped event: no 50 ms sample above the stepped budget, and the rebound after it
/// within the facility's ramp rate.
#[test]
fn a_ramped_event_stays_below_every_step_and_the_rebound_keeps_the_rate_limit() {
    let base_w = 5600.0;
    let mut raw = test_bed_site(base_w, 10);
    raw.facility.max_ramp_w_per_s = Some(RATE_W_PER_S);
    let mut site = Site::new(SiteOptions {
        site: raw,
        ..SiteOptions::new(16, base_w)
    })
    .expect("site");
    site.submit(JobSpec::training("a", "flex3,calibrate=off", 0, 4, HEAVY))
        .expect("a");
    site.submit(JobSpec::training("b", "flex3,calibrate=off", 1, 4, HEAVY))
        .expect("b");
    assert!(site.run_until(60_000, |s| granted(s, &["a", "b"])));
    assert!(
        site.run_until(30_000, |s| s.draw_w() > 5000.0),
        "both jobs loading"
    );
    let start_ms = site.now_ms() + 8_000;
    let reply = site
        .admin(AdminOp::EventAdd {
            cut: Cut::Reduce { fraction: 0.3 },
            start_ms,
            duration_ms: 40_000,
            ramp_ms: 10_000,
            domain: None,
        })
        .expect("reply");
    assert!(reply.is_ok(), "{reply:?}");
    let from = site.now_ms();
    let end_ms = start_ms + 40_000;
    site.run_until(80_000, |s| s.now_ms() >= end_ms + 22_000);
    let samples = site.samples_since(from).to_vec();
    let watch = DrawWatch::of(&samples, 0.0);
    println!("ramp: {watch}");
    assert!(watch.over_s == 0.0, "over the stepped budget: {watch}");
    assert!(
        samples
            .iter()
            .any(|s| s.budget_w <= base_w * 0.7 + 1.0 && s.draw_w > base_w * 0.6),
        "the full cut was in force and the jobs kept running under it"
    );
    // The rebound: over any window of at least 1 s after the end, the draw rises no
    // faster than the limit allows (a period's head start and one cap step on every
    // GPU; the meter here has no noise, so none of the Slurm test's 1 % for it).
    let after: Vec<_> = samples
        .iter()
        .filter(|s| s.t_ms >= end_ms - 10_000)
        .collect();
    let mut worst: Option<(f64, f64, f64)> = None;
    for (i, s) in after.iter().enumerate() {
        for later in &after[i + 1..] {
            let w_s = (later.t_ms - s.t_ms) as f64 / 1000.0;
            if w_s < 1.0 {
                continue;
            }
            let rise = later.draw_w - s.draw_w;
            let allowed = RATE_W_PER_S * (w_s + PERIOD_S) + CAP_STEPS_W;
            if worst.is_none_or(|(r, a, _)| rise - allowed > r - a) {
                worst = Some((rise, allowed, w_s));
            }
        }
    }
    if let Some((rise, allowed, w_s)) = worst {
        assert!(
            rise <= allowed,
            "rose {rise:.0} W in {w_s:.2} s, allowed {allowed:.0} W"
        );
    }
    let settled = after.last().map_or(0.0, |s| s.draw_w);
    assert!(
        settled > base_w * 0.9,
        "the jobs got their watts back: {settled} W"
    );
    assert!(
        site.ends_clean(60_000),
        "the jobs end clean: every GPU back at its default, no agent holding a job"
    );
}

/// The logic of the Slurm test of the same name (`tests/ramp_suspend.rs`), on
/// the site's clock.
#[test]
fn a_cut_deeper_than_caps_suspends_the_right_job_and_resumes_it() {
    let base_w = 8400.0;
    let mut site = Site::new(SiteOptions {
        nodes: 3,
        site: test_bed_site(base_w, 10),
        ..SiteOptions::new(16, base_w)
    })
    .expect("site");
    site.submit(JobSpec::training(
        "flex0",
        "flex0,calibrate=off",
        0,
        4,
        HEAVY,
    ))
    .expect("flex0");
    site.submit(JobSpec::training(
        "pausable",
        "flex3,calibrate=off,preempt=suspend",
        1,
        4,
        HEAVY,
    ))
    .expect("pausable");
    site.submit(JobSpec::training(
        "steady",
        "flex3,calibrate=off",
        2,
        4,
        HEAVY,
    ))
    .expect("steady");
    assert!(site.run_until(60_000, |s| granted(s, &["flex0", "pausable", "steady"])));
    assert!(
        site.run_until(30_000, |s| s.draw_w() > 7500.0),
        "every job loading"
    );
    // flex0 4 x 690 W and each flex3 job at the 200 W minimum: 4360 W; one flex3 job
    // suspended: 3860 W. At 4100 W one suspension is needed, and one job allows it.
    let target_w = 4100.0;
    let start_ms = site.now_ms() + 10_000;
    let reply = site
        .admin(AdminOp::EventAdd {
            cut: Cut::Target { budget_w: target_w },
            start_ms,
            duration_ms: 30_000,
            ramp_ms: 0,
            domain: None,
        })
        .expect("reply");
    assert!(reply.is_ok(), "{reply:?}");
    let from = site.now_ms();
    assert!(
        site.run_until(10_000, |s| s.job_state("pausable")
            == Some(JobState::Suspended)),
        "the job that allows it is suspended before the start"
    );
    assert!(site.now_ms() <= start_ms);
    assert_eq!(site.job_state("steady"), Some(JobState::Running));
    assert_eq!(site.job_state("flex0"), Some(JobState::Running));
    site.run_until(40_000, |s| s.now_ms() >= start_ms + 30_000);
    let during = DrawWatch::of(site.samples_since(from), 0.0);
    assert!(
        during.over_s == 0.0,
        "the budget holds at every sample: {during}"
    );
    assert!(
        site.job_caps_w("flex0").iter().all(|&c| c >= 700.0),
        "flex0 is never capped"
    );
    assert!(
        site.run_until(20_000, |s| s.job_state("pausable")
            == Some(JobState::Running)),
        "resumed when the event ends"
    );
    let after = site.watch_for(5_000, 0.0);
    assert!(after.over_s == 0.0, "{after}");
    assert!(
        site.ends_clean(60_000),
        "the jobs end clean: every GPU back at its default, no agent holding a job"
    );
}
