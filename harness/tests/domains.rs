//! Power domains at site scale: nodes of 8 GPUs in racks of `nodes / 100`, 10
//! racks to a row, 5 rows to a feed, 2 feeds, every node running one 8-GPU job. The site's
//! budget and every domain's limit leave the jobs uncapped; then an event on feed B asks it
//! down to 70 % of what its GPUs may draw. In `hard` mode (the sum of caps is what a
//! breaker sees), every cap in feed B is cut within one second of site time, the sum of
//! feed B's caps never passes its budget after that, and no GPU outside feed B is
//! touched: every cap there is the same in every quantum from the event to its end.

// The tests print what they measured, as the other scale tests do.
#![allow(clippy::disallowed_macros)]

use powerflex_core::config::RawSiteConfig;
use powerflex_core::domains::RawDomain;
use powerflex_proto::admin::AdminOp;
use powerflex_proto::event::Cut;
use powerflex_site_harness::site::{JobSpec, Site, SiteOptions};

const GPUS_PER_NODE: u32 = 8;
const MAX_CAP_W: f64 = 700.0;

/// 2 feeds → 10 rows → 100 racks; rack `r` holds nodes `n{r*k+1}..n{(r+1)*k}`. Limits at
/// every GPU's maximum: nothing binds until an event.
fn tree(nodes: u32) -> Vec<RawDomain> {
    let per_rack = nodes / 100;
    let gpu_w = |n: u32| f64::from(n * GPUS_PER_NODE) * MAX_CAP_W;
    let mut out = Vec::new();
    for feed in 0..2 {
        out.push(RawDomain {
            name: format!("feed-{}", ["a", "b"][feed]),
            parent: None,
            gpu_limit_w: gpu_w(nodes / 2),
            nodes: None,
        });
    }
    for row in 0..10u32 {
        out.push(RawDomain {
            name: format!("row-{row}"),
            parent: Some(format!("feed-{}", ["a", "b"][(row / 5) as usize])),
            gpu_limit_w: gpu_w(nodes / 10),
            nodes: None,
        });
    }
    for rack in 0..100u32 {
        out.push(RawDomain {
            name: format!("rack-{rack:02}"),
            parent: Some(format!("row-{}", rack / 10)),
            gpu_limit_w: gpu_w(per_rack),
            nodes: Some(format!(
                "n[{}-{}]",
                rack * per_rack + 1,
                (rack + 1) * per_rack
            )),
        });
    }
    out
}

fn site_config(nodes: u32) -> RawSiteConfig {
    let budget_w = f64::from(nodes * GPUS_PER_NODE) * MAX_CAP_W;
    let mut raw = powerflex_site_harness::site::test_bed_site(budget_w, 60);
    raw.facility.budget_mode = Some("hard".into());
    // The site config's default allocation period (10 s): the event must not wait for it.
    raw.controller.allocation_period_s = None;
    raw.domains = tree(nodes);
    raw
}

/// The scenario; returns the site time from the event's addition to the last cap of
/// feed B cut, ms.
#[allow(clippy::disallowed_types, clippy::disallowed_methods)] // wall time, printed only
fn feed_event(nodes: u32) -> u64 {
    let started = std::time::Instant::now();
    let budget_w = f64::from(nodes * GPUS_PER_NODE) * MAX_CAP_W;
    let mut site = Site::new(SiteOptions {
        nodes,
        gpus_per_node: GPUS_PER_NODE,
        sample_interval_ms: 1000,
        site: site_config(nodes),
        ..SiteOptions::new(7, budget_w)
    })
    .expect("site");
    for i in 0..nodes as usize {
        let tier = ["flex2", "flex3"][i % 2];
        site.submit(JobSpec::training(
            &(i + 1).to_string(),
            &format!("{tier},calibrate=off"),
            i,
            GPUS_PER_NODE,
            "qwen3-30b-a3b-moe-ft-8g",
        ))
        .expect("submit");
    }
    assert!(
        site.run_until(60_000, |s| s.allocations() >= 2),
        "two allocations within a minute"
    );
    site.run_for(2_000);
    let half = nodes as usize / 2;
    let (feed_a, feed_b): (Vec<usize>, Vec<usize>) = (0..nodes as usize).partition(|&n| n < half);
    let caps_of = |site: &Site, nodes: &[usize]| -> Vec<Vec<f64>> {
        nodes.iter().map(|&n| site.node_caps_w(n)).collect()
    };
    let before_a = caps_of(&site, &feed_a);
    assert!(
        site.caps_w().iter().all(|&c| c >= MAX_CAP_W),
        "nothing binds before the event"
    );
    // Feed B to 70 % of what its GPUs may draw, from now, for 30 s.
    let target_w = 0.7 * f64::from(half as u32 * GPUS_PER_NODE) * MAX_CAP_W;
    let added_ms = site.now_ms();
    let reply = site
        .admin(AdminOp::EventAdd {
            cut: Cut::Target { budget_w: target_w },
            start_ms: added_ms,
            duration_ms: 30_000,
            ramp_ms: 0,
            domain: Some("feed-b".into()),
        })
        .expect("a reply");
    assert!(reply.is_ok(), "{reply:?}");
    let status = site.controller_status().expect("status");
    assert_eq!(
        status.budget_w, budget_w,
        "the site's own budget is not cut"
    );
    let sum_b = |site: &Site| -> f64 {
        feed_b
            .iter()
            .map(|&n| site.node_caps_w(n).iter().sum::<f64>())
            .sum()
    };
    let phase = std::time::Instant::now();
    assert!(
        site.run_until(10_000, |s| sum_b(s) <= target_w + 1e-6),
        "feed B's caps within its budget"
    );
    let cut_ms = site.now_ms() - added_ms;
    println!(
        "{nodes} nodes: feed B's caps cut {cut_ms} ms of site time after the event was added ({:.1} s of wall time)",
        phase.elapsed().as_secs_f64()
    );
    for &n in &feed_b {
        assert!(
            site.node_caps_w(n).iter().all(|&c| c < MAX_CAP_W),
            "every cap in feed B cut: {} {:?}",
            site.node_name(n),
            site.node_caps_w(n)
        );
    }
    // Through the rest of the event: feed B within its budget, feed A untouched.
    while site.now_ms() < added_ms + 29_000 {
        site.run_for(50);
        let b = sum_b(&site);
        assert!(b <= target_w + 1e-6, "feed B at {b} W over {target_w} W");
        if site.now_ms() % 1000 == 0 {
            assert_eq!(
                caps_of(&site, &feed_a),
                before_a,
                "a cap outside feed B moved"
            );
        }
    }
    let status = site.controller_status().expect("status");
    let feed = status
        .domains
        .iter()
        .find(|d| d.name == "feed-b")
        .expect("feed-b in status");
    assert!((feed.budget_w - target_w).abs() < 0.5, "{feed:?}");
    assert!(feed.event.is_some(), "{feed:?}");
    let rack = status
        .domains
        .iter()
        .find(|d| d.name == "rack-00")
        .expect("rack-00");
    assert_eq!(rack.event, None, "feed A's racks are not in the event");
    println!(
        "{nodes} nodes: {:.1} s of wall time in all",
        started.elapsed().as_secs_f64()
    );
    cut_ms
}

#[test]
fn an_event_on_one_feed_cuts_that_feed_within_a_second_and_leaves_the_other_alone() {
    let cut_ms = feed_event(1_000);
    assert!(cut_ms <= 1_000, "{cut_ms} ms of site time");
}

/// The scale a site's domains must hold at: 10,000 nodes × 8 GPUs in 100 racks, 10 rows
/// and 2 feeds.
#[test]
fn ten_thousand_nodes_in_two_feeds_a_feed_event_cuts_only_that_feed() {
    let cut_ms = feed_event(10_000);
    assert!(cut_ms <= 1_000, "{cut_ms} ms of site time");
}
