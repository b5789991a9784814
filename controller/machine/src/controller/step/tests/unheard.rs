//! Nodes the site names whose agents never spoke: UNMANAGED, paid for at their worst
//! case until they do.

use super::*;

/// Slurm's placement: job 101 on n1 (8 GPUs); n2 has 4 GPUs and runs nothing known.
fn placement_with_n2() -> Input {
    use powerflex_core::slurm_record::{SlurmJob, SlurmJobState};
    Input::Placement(Box::new(Ok(Placement {
        jobs: [(
            "101".to_string(),
            SlurmJob {
                nodes: ["n1".to_string()].into(),
                uid: 1001,
                state: SlurmJobState::OnItsNodes,
                admin_comment: String::new(),
                account: String::new(),
                start_unix_s: Some(T0 / 1000 - 60),
            },
        )]
        .into(),
        node_gpus: [("n1".to_string(), 8), ("n2".to_string(), 4)].into(),
        read_at_ms: T0,
    })))
}

/// The cap the last allocation granted `job`, W.
fn granted(out: &Output, job: &str) -> f64 {
    let m = out.metrics.as_ref().expect("an allocation");
    let a = m.decision.allocation.as_ref().expect("allocated");
    a.jobs
        .iter()
        .find(|j| j.id == job)
        .expect("the job")
        .cap_w
        .0
}

#[test]
fn a_node_slurm_lists_but_never_heard_from_is_reserved_at_its_gpus_times_the_largest_model() {
    let mut o = options();
    o.job_placement = JobPlacement::Slurm;
    let mut core = Controller::new(o, Loaded::default(), UnixMs(T0));
    let out = core.step(
        UnixMs(T0),
        vec![
            budget_set(5000.0, None),
            placement_with_n2(),
            hello("n1"),
            report("n1", vec![job("101", None)]),
        ],
    );
    // n2: 4 GPUs × 700 W (the site's largest model) off the 5 kW: n1's 4-GPU job gets
    // at most the 2.2 kW left.
    let cap_w = granted(&out, "101");
    assert!(cap_w * 4.0 <= 5000.0 - 4.0 * 700.0 + 1e-6, "{cap_w} W");
    let m = out.metrics.as_ref().expect("metrics");
    assert_eq!((m.unmanaged_nodes, m.unmanaged_reserve_w), (1, 2800.0));
    assert!(m.decision.reserved_w >= 2800.0);
    assert!(
        !out.leases.contains_key("n2"),
        "no lease for a node never heard from"
    );
    // The status names it UNMANAGED, with what it takes off the budget.
    let status = core.status(UnixMs(T0 + 1));
    assert_eq!(status.unmanaged_reserve_w, Some(2800.0));
    let n2 = status
        .nodes
        .iter()
        .find(|n| n.node == "n2")
        .expect("n2 listed");
    assert_eq!(
        (n2.gpus, n2.live, n2.unmanaged_reserve_w),
        (4, false, Some(2800.0))
    );
    let n1 = status.nodes.iter().find(|n| n.node == "n1").expect("n1");
    assert_eq!(n1.unmanaged_reserve_w, None);

    // n2's agent says hello and reports its 4 idle GPUs at 60 W each: it is paid for
    // at what it draws (metered budget), and the job gets the rest of the budget.
    let out = core.step(
        UnixMs(T0 + 10_000),
        vec![
            hello_with("n2", 4),
            Input::Report {
                ended: Vec::new(),
                observe_only: false,
                node: "n2".into(),
                power_w: 240.0,
                jobs: Vec::new(),
            },
            report("n1", vec![job("101", None)]),
            Input::Tick,
        ],
    );
    let m = out.metrics.as_ref().expect("metrics");
    assert_eq!((m.unmanaged_nodes, m.unmanaged_reserve_w), (0, 0.0));
    assert!(
        granted(&out, "101") > cap_w,
        "the reserve is replaced by n2's own draw: {} W",
        granted(&out, "101")
    );
    let status = core.status(UnixMs(T0 + 10_001));
    assert_eq!(status.unmanaged_reserve_w, None);
    assert!(status.nodes.iter().all(|n| n.unmanaged_reserve_w.is_none()));
}

#[test]
fn a_node_a_domain_places_but_slurm_does_not_list_is_as_large_as_the_largest_node() {
    // Rack B places n2; no Slurm placement here (`job_placement = "reports"`), and n2
    // never speaks: it counts n1's 8 GPUs at 700 W, in rack B and in the feed.
    let mut core = Controller::new(with_racks(10_000.0), Loaded::default(), UnixMs(T0));
    let out = core.step(
        UnixMs(T0),
        vec![
            budget_set(8000.0, Some("feed-a")),
            hello("n1"),
            report("n1", vec![job("101", None)]),
        ],
    );
    let m = out.metrics.as_ref().expect("metrics");
    assert_eq!((m.unmanaged_nodes, m.unmanaged_reserve_w), (1, 5600.0));
    let a = m.decision.allocation.as_ref().expect("allocated");
    let feed = a.domains.iter().find(|d| d.name == "feed-a").expect("feed");
    assert!(
        feed.power_w.0 <= 8000.0 - 5600.0 + 1e-6,
        "the feed pays n2's worst case: {} W planned",
        feed.power_w.0
    );
    let status = core.status(UnixMs(T0 + 1));
    let by_name = |name: &str| {
        status
            .domains
            .iter()
            .find(|d| d.name == name)
            .expect("domain")
            .clone()
    };
    assert_eq!(by_name("feed-a").unmanaged_reserve_w, Some(5600.0));
    assert_eq!(by_name("rack-b").unmanaged_reserve_w, Some(5600.0));
    assert_eq!(
        (by_name("rack-b").nodes, by_name("rack-b").live_nodes),
        (1, 0),
        "its draw is not known while n2 is unheard"
    );
    assert_eq!(by_name("rack-a").unmanaged_reserve_w, None);
    let n2 = status.nodes.iter().find(|n| n.node == "n2").expect("n2");
    assert_eq!(n2.domain.as_deref(), Some("rack-b"));
    assert_eq!(n2.unmanaged_reserve_w, Some(5600.0));
}

fn hello_with(node: &str, n: u32) -> Input {
    Input::Hello {
        node: node.into(),
        gpus: gpus(n),
    }
}

/// Under Slurm's placement a node's hello counts only the GPUs Slurm bears out: root on n1
/// announcing 256 GPUs (Slurm lists 8) does not make n2, which only rack B places and which
/// never spoke, cost 256 GPUs at 700 W.
#[test]
fn an_inflated_hello_does_not_inflate_the_reserve_of_a_node_only_a_domain_places() {
    use powerflex_core::slurm_record::{SlurmJob, SlurmJobState};
    let mut core = Controller::new(
        CtldSettings {
            job_placement: JobPlacement::Slurm,
            ..with_racks(10_000.0)
        },
        Loaded::default(),
        UnixMs(T0),
    );
    let n1_only = Input::Placement(Box::new(Ok(Placement {
        jobs: [(
            "101".to_string(),
            SlurmJob {
                nodes: ["n1".to_string()].into(),
                uid: 1001,
                state: SlurmJobState::OnItsNodes,
                admin_comment: String::new(),
                account: String::new(),
                start_unix_s: Some(T0 / 1000 - 60),
            },
        )]
        .into(),
        node_gpus: [("n1".to_string(), 8)].into(),
        read_at_ms: T0,
    })));
    let out = core.step(
        UnixMs(T0),
        vec![
            n1_only,
            hello_with("n1", 256),
            report("n1", vec![job("101", None)]),
        ],
    );
    let m = out.metrics.as_ref().expect("metrics");
    assert_eq!((m.unmanaged_nodes, m.unmanaged_reserve_w), (1, 8.0 * 700.0));
}
