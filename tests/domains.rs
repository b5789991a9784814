//! A power domain's event on the local Slurm cluster: two racks under one feed,
//! a node each (n1 in rack-a, n2 in rack-b), a training job on each, nothing binding. An
//! event on rack-a alone (`powerflexctl event add --domain rack-a`) brings n1's metered
//! draw within rack-a's budget at every 50 ms sample once it has settled, while no cap
//! on n2 moves from its default at any sample. `event add` naming a domain the config
//! does not declare is refused with the domains it does; `powerflexctl domains` shows the
//! rack's budget and event; cancelled, rack-a's caps come back.

use std::time::{Duration, Instant};

use powerflex::needs::{can_run, Need};
use powerflex::site_config::SiteBuilder;
use powerflex::stack::{Stack, StackOptions, DEFAULT_CAP_W, METER_TOLERANCE};
use powerflex::wait_until;
use powerflex_core::domains::RawDomain;
use powerflex_proto::status::DomainStatus;
use powerflex_sim::state::Node;

const TRAIN: &str = "qwen3-30b-a3b-moe-ft-8g";
/// Rack-a's budget during the event, W (its node's four GPUs draw about 2.6 kW uncapped).
const RACK_A_EVENT_W: f64 = 1600.0;

fn racks(site: SiteBuilder) -> SiteBuilder {
    site.edit(|raw| {
        let domain =
            |name: &str, parent: Option<&str>, limit: f64, nodes: Option<&str>| RawDomain {
                name: name.into(),
                parent: parent.map(Into::into),
                gpu_limit_w: limit,
                nodes: nodes.map(Into::into),
            };
        raw.domains = vec![
            domain("feed-a", None, 6000.0, None),
            domain("rack-a", Some("feed-a"), 3000.0, Some("n1")),
            domain("rack-b", Some("feed-a"), 3000.0, Some("n2")),
        ];
    })
}

/// One node's metered draw: its simulated GPUs' power readings, summed, W.
fn node_draw_w(sim: &Node, gpus: u32) -> f64 {
    (0..gpus)
        .map(|g| f64::from(sim.reading(g).expect("reading").1.power_mw) / 1000.0)
        .sum()
}

fn node_caps_w(sim: &Node, gpus: u32) -> Vec<f64> {
    (0..gpus)
        .map(|g| f64::from(sim.gpu(g).expect("gpu").power_limit_mw) / 1000.0)
        .collect()
}

#[test]
fn an_event_on_one_rack_cuts_that_rack_and_leaves_the_other_untouched() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let stack = Stack::start(
        "domains",
        StackOptions {
            site: Some(racks),
            ..StackOptions::default()
        },
    );
    let gpus = stack.gpus_per_node;
    let jobs: Vec<u32> = (0..2)
        .map(|_| stack.submit("flex3,calibrate=off", 1, gpus, TRAIN))
        .collect();
    wait_until("both jobs run", Duration::from_secs(60), || {
        jobs.iter().all(|&id| stack.running(id)).then_some(())
    });
    wait_until(
        "both nodes drawing, nothing capped",
        Duration::from_secs(60),
        || {
            let busy = stack
                .sims
                .iter()
                .all(|sim| node_draw_w(sim, gpus) > 1000.0 * f64::from(gpus) / 4.0);
            (busy && stack.caps_w().iter().all(|&c| c == DEFAULT_CAP_W)).then_some(())
        },
    );
    // A domain the config does not declare is refused, naming the ones it does.
    let refused = stack
        .try_ctl(&[
            "event",
            "add",
            "--target",
            "1kW",
            "--duration",
            "1m",
            "--domain",
            "rack-z",
        ])
        .expect_err("an unknown domain");
    let said = refused.to_string();
    assert!(
        said.contains("rack-z") && said.contains("feed-a, rack-a, rack-b"),
        "{said}"
    );
    // Rack-a to 1.6 kW for two minutes.
    let added = stack
        .try_ctl(&[
            "event",
            "add",
            "--target",
            &format!("{RACK_A_EVENT_W}W"),
            "--duration",
            "2m",
            "--domain",
            "rack-a",
        ])
        .expect("event add");
    assert!(added.contains("for domain rack-a"), "{added}");
    let (rack_a, rack_b) = (&stack.sims[0], &stack.sims[1]);
    let started = Instant::now();
    wait_until(
        "rack-a's draw within its event's budget",
        Duration::from_secs(30),
        || (node_draw_w(rack_a, gpus) <= RACK_A_EVENT_W * (1.0 + METER_TOLERANCE)).then_some(()),
    );
    println!(
        "rack-a within {RACK_A_EVENT_W} W {:.1} s after the event was added",
        started.elapsed().as_secs_f64()
    );
    // Settled: 15 s of 50 ms samples. Rack-a within its budget at every one; rack-b's
    // caps at their default at every one.
    std::thread::sleep(Duration::from_secs(3));
    let watch_until = Instant::now() + Duration::from_secs(15);
    let (mut samples, mut highest_a) = (0u32, 0.0f64);
    while Instant::now() < watch_until {
        let a = node_draw_w(rack_a, gpus);
        highest_a = highest_a.max(a);
        assert!(
            a <= RACK_A_EVENT_W * (1.0 + METER_TOLERANCE),
            "rack-a drew {a} W against {RACK_A_EVENT_W} W"
        );
        let b = node_caps_w(rack_b, gpus);
        assert!(
            b.iter().all(|&c| c == DEFAULT_CAP_W),
            "a cap on rack-b moved: {b:?}"
        );
        samples += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    println!("rack-a: highest {highest_a:.0} W over {samples} samples; rack-b untouched");
    assert!(
        node_caps_w(rack_a, gpus).iter().all(|&c| c < DEFAULT_CAP_W),
        "every GPU of rack-a capped"
    );
    let domains: Vec<DomainStatus> = stack.ctl_json(&["domains"]).expect("domains");
    let a = domains
        .iter()
        .find(|d| d.name == "rack-a")
        .expect("rack-a listed");
    assert_eq!(a.budget_w, RACK_A_EVENT_W);
    assert!(a.event.is_some(), "{a:?}");
    let b = domains.iter().find(|d| d.name == "rack-b").expect("rack-b");
    assert_eq!((b.budget_w, b.event), (3000.0, None));
    let table = stack.try_ctl(&["domains"]).expect("domains table");
    assert!(table.lines().any(|l| l.starts_with("  rack-a")), "{table}");
    // Cancelled: rack-a's caps come back.
    let event = a.event.expect("event").to_string();
    stack
        .try_ctl(&["event", "cancel", &event])
        .expect("event cancel");
    wait_until(
        "rack-a back at its default caps",
        Duration::from_secs(60),
        || {
            node_caps_w(rack_a, gpus)
                .iter()
                .all(|&c| c == DEFAULT_CAP_W)
                .then_some(())
        },
    );
    stack.ends_clean(&jobs, Duration::from_secs(30));
}
