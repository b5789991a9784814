//! The step on a fake clock: the helpers every test shares, and the tests by the input
//! they exercise.

mod admin;
mod agents;
mod allocation;
mod durable;
mod unheard;

use std::time::Duration;

use powerflex_core::allocate::Policy;
use powerflex_core::config::{BudgetMode, LeaseRollout, Objective};
use powerflex_core::flex::TierTable;
use powerflex_core::Watts;
use powerflex_decide::SiteSettings;
use powerflex_proto::admin::Refusal;
use powerflex_proto::event::Cut;
use powerflex_proto::status::CurvePoint;
use powerflex_proto::usage::ThroughputUnit;

use super::*;
use crate::controller::history::HistoryBoard;

/// A fake clock's start: an ordinary Unix time in ms.
const T0: u64 = 1_800_000_000_000;

const TTL_S: f64 = 30.0;

fn options() -> CtldSettings {
    CtldSettings {
        base_budget: Watts(10_000.0),
        period: Duration::from_secs(10),
        lease_ttl_s: TTL_S,
        site: SiteSettings {
            tiers: TierTable::default_table(),
            policy: Policy::Optimal,
            cap_step: Watts(10.0),
            failsafe_cap: Watts(500.0),
            default_pfi: 1.3,
            budget_mode: BudgetMode::Metered { margin: 0.0 },
            objective: Objective::Tokens,
            tier_bounds: powerflex_decide::TierBounds::Honoured,
            domains: None,
        },
        lease_rollout: LeaseRollout::TwoStep,
        max_ramp_w_per_s: None,
        job_placement: JobPlacement::Reports,
        max_gpu_power_w: 700.0,
    }
}

fn fresh() -> Controller {
    Controller::new(options(), Loaded::default(), UnixMs(T0))
}

fn gpus(n: u32) -> Vec<GpuInfo> {
    (0..n)
        .map(|i| GpuInfo {
            uuid: format!("GPU-{i}"),
            name: "NVIDIA H200".into(),
            min_w: 200.0,
            max_w: 700.0,
            default_w: 700.0,
        })
        .collect()
}

fn job(id: &str, pfi: Option<f64>) -> JobReport {
    JobReport {
        job_id: id.into(),
        tier: "flex2".into(),
        gpus: 4,
        cap_w: Some(700.0),
        // On its curve: 4 GPUs at 700 W.
        power_w: Some(2800.0),
        throughput: Some(1000.0),
        throughput_unit: Some(ThroughputUnit::Tokens),
        pfi,
        pfi_source: None,
        points: [700.0, 500.0, 300.0]
            .iter()
            .map(|&c| [c, c * 4.0, 1000.0 * (1.0 - (1.0 - c / 700.0) / 2.0)])
            .map(powerflex_proto::point::from_array)
            .collect(),
        gpu_uuids: Vec::new(),
        power_cap_w: None,
        power_cap_steady_s: Some(10.0),
        calibrating: false,
        curve_in_question: false,
        curve: Vec::new(),
        calibration_cost_pct: None,
        owner_uid: None,
        usage: None,
    }
}

/// Room for two of [`job`]'s 4-GPU jobs.
fn hello(node: &str) -> Input {
    Input::Hello {
        node: node.into(),
        gpus: gpus(8),
    }
}

fn report(node: &str, jobs: Vec<JobReport>) -> Input {
    Input::Report {
        ended: Vec::new(),
        observe_only: false,
        node: node.into(),
        power_w: 2800.0 * jobs.len() as f64,
        jobs,
    }
}

fn admin(op: AdminOp, uid: u32) -> Input {
    Input::Admin { op, uid }
}

/// Root sets the site's budget (`domain: None`) or a domain's.
fn budget_set(budget_w: f64, domain: Option<&str>) -> Input {
    admin(
        AdminOp::BudgetSet {
            budget_w,
            domain: domain.map(str::to_string),
        },
        0,
    )
}

/// Root announces a cut to 3.3 kW 4.5 s ahead of `T0 + 5 s`, for 30 s: deeper than the
/// caps of [`flex0_beside_a_suspendable_job`] reach.
fn cut_below_the_caps_announced() -> Input {
    admin(
        AdminOp::EventAdd {
            cut: Cut::Target { budget_w: 3300.0 },
            start_ms: T0 + 5_000,
            duration_ms: 30_000,
            ramp_ms: 0,
            domain: None,
        },
        0,
    )
}

/// A 5.6 kW site: job 101 (flex0) on n1 and job 102 (flex3, suspendable) on n2, both at
/// 700 W; `n2_job` may wrap job 102's report (observe mode, say).
fn flex0_beside_a_suspendable_job(n2_job: impl FnOnce(Input) -> Input) -> Vec<Input> {
    vec![
        budget_set(5600.0, None),
        hello("n1"),
        at_cap("n1", "101", "flex0", 700.0),
        hello("n2"),
        n2_job(at_cap("n2", "102", "flex3,preempt=suspend", 700.0)),
    ]
}

fn slurm_placed(jobs: &[(&str, &[&str], u32)]) -> Input {
    use powerflex_core::slurm_record::{SlurmJob, SlurmJobState};
    Input::Placement(Box::new(Ok(Placement {
        jobs: jobs
            .iter()
            .map(|(id, nodes, uid)| {
                (
                    id.to_string(),
                    SlurmJob {
                        nodes: nodes.iter().map(|n| n.to_string()).collect(),
                        uid: *uid,
                        state: SlurmJobState::OnItsNodes,
                        admin_comment: String::new(),
                        account: "physics".to_string(),
                        start_unix_s: Some(T0 / 1000 - 60),
                    },
                )
            })
            .collect(),
        node_gpus: [("n1".to_string(), 8), ("n2".to_string(), 8)].into(),
        read_at_ms: T0,
    })))
}

fn usage(job: &str, node: &str, energy_mj: u64, ended: bool) -> NodeUsage {
    NodeUsage {
        job_id: job.into(),
        node: node.into(),
        uid: 0,
        tier: "flex2".into(),
        gpus: vec![],
        energy_mj,
        energy_source: powerflex_proto::usage::EnergySource::Counter,
        from_unix_ms: T0,
        to_unix_ms: T0 + 10_000,
        peak_power_w: 2800.0,
        observed_s: 10.0,
        capped_s: 5.0,
        event_s: 0.0,
        power_throttled_s: 0.0,
        throttle_known_s: 10.0,
        caps: vec![],
        slowdown_pct: Some(2.0),
        bound_pct: Some(25.0),
        bound_held: Some(true),
        bound_judgement: None,
        saved_estimate_j: None,
        work: None,
        work_unit: None,
        pfi: Some(1.5),
        ended,
        simulated: true,
    }
}

/// Two nodes with one job each, allocated at T0.
fn running() -> Controller {
    let mut core = fresh();
    core.step_saved(
        UnixMs(T0),
        vec![
            hello("n1"),
            report("n1", vec![job("101", None)]),
            hello("n2"),
            report("n2", vec![job("102", None)]),
        ],
    );
    core
}

fn allocations(core: &Controller) -> u64 {
    core.allocations()
}

/// `core.step`, with what it made for the history published on `board`, as the I/O
/// edge does.
fn step_published(
    core: &mut Controller,
    board: &HistoryBoard,
    now_ms: u64,
    inputs: Vec<Input>,
) -> Output {
    let mut out = core.step_saved(UnixMs(now_ms), inputs);
    board.publish(out.history.take(), out.owners.take());
    out
}

fn reply(out: &Output) -> &AdminReply {
    assert_eq!(out.replies.len(), 1, "{out:?}");
    &out.replies[0].1
}

/// Two racks under one feed: n1 in rack-a, n2 in rack-b, 10 kW each, 20 kW the feed.
/// The settings with a feed of 20 kW over rack-a (n1, 10 kW) and rack-b (n2,
/// `rack_b_w`).
fn with_racks(rack_b_w: f64) -> CtldSettings {
    use powerflex_core::domains::{DomainTree, RawDomain};
    let raw = |name: &str, parent: Option<&str>, nodes: Option<&str>, limit: f64| RawDomain {
        name: name.into(),
        parent: parent.map(Into::into),
        gpu_limit_w: limit,
        nodes: nodes.map(Into::into),
    };
    let tree = DomainTree::build(&[
        raw("feed-a", None, None, 20_000.0),
        raw("rack-a", Some("feed-a"), Some("n1"), 10_000.0),
        raw("rack-b", Some("feed-a"), Some("n2"), rack_b_w),
    ])
    .expect("valid");
    let mut o = options();
    o.site.domains = powerflex_decide::SiteDomains::configured(&tree);
    o
}

fn racks() -> Controller {
    let o = with_racks(10_000.0);
    let mut core = Controller::new(o, Loaded::default(), UnixMs(T0));
    core.step_saved(
        UnixMs(T0),
        vec![
            hello("n1"),
            report("n1", vec![job("101", None)]),
            hello("n2"),
            report("n2", vec![job("102", None)]),
        ],
    );
    core
}

fn restarted_with(nodes: &[&str]) -> Controller {
    let state = CtldState {
        nodes: nodes.iter().map(|n| (n.to_string(), gpus(8))).collect(),
        ..CtldState::default()
    };
    Controller::new(options(), Loaded { state, lost: false }, UnixMs(T0))
}

fn leadership(role: LeadershipRole, epoch: u64, holder: Option<&str>) -> Input {
    Input::Leadership(LeadershipView {
        role,
        name: Some("ctld-a".into()),
        epoch,
        holder: holder.map(str::to_string),
        reason: None,
        since_unix_ms: T0,
    })
}

/// A report of one 4-GPU job at `cap_w` (read back), drawing what its curve says.
fn at_cap(node: &str, id: &str, tier: &str, cap_w: f64) -> Input {
    let mut j = job(id, None);
    j.tier = tier.into();
    j.cap_w = Some(cap_w);
    j.power_w = Some(cap_w * 4.0);
    Input::Report {
        ended: Vec::new(),
        observe_only: false,
        node: node.into(),
        power_w: cap_w * 4.0,
        jobs: vec![j],
    }
}

fn cap(out: &Output, node: &str, job: &str) -> Option<f64> {
    out.leases.get(node).and_then(|l| l.caps.get(job)).copied()
}

/// At T0: a 4 kW budget and two nodes, each with one job at 500 W: n1's job 101
/// (flex3) and n2's job 102 (`tier_of_102`).
fn two_jobs_at_500_w(core: &mut Controller, tier_of_102: &str) {
    core.step_saved(
        UnixMs(T0),
        vec![
            budget_set(4000.0, None),
            hello("n1"),
            at_cap("n1", "101", "flex3", 500.0),
            hello("n2"),
            at_cap("n2", "102", tier_of_102, 500.0),
        ],
    );
}

/// A report of a 4-GPU job on a prior (no walked curve) at `cap_w`, its cap held 10 s,
/// drawing `per_gpu_w` per GPU.
fn on_prior(node: &str, id: &str, tier: &str, cap_w: f64, per_gpu_w: f64) -> Input {
    let mut j = job(id, None);
    j.tier = tier.into();
    j.points = Vec::new();
    j.cap_w = Some(cap_w);
    j.power_cap_w = Some(cap_w);
    j.power_w = Some(per_gpu_w * 4.0);
    // Few tokens for its watts; a prior, so a curve in doubt: it gets its equal-split cap.
    j.throughput = Some(10.0);
    Input::Report {
        ended: Vec::new(),
        observe_only: false,
        node: node.into(),
        power_w: per_gpu_w * 4.0,
        jobs: vec![j],
    }
}

/// A step as an edge whose saves are durable at once sees it: when the step hands out a
/// state to save, the next step (at the same time) is told it is durable, and what that
/// releases is merged into this step's answer (the replies at their inputs' indices).
/// The tests of other inputs use it; `durable` tests the holding itself.
trait SavedAtOnce {
    fn step_saved(&mut self, now: UnixMs, inputs: Vec<Input>) -> Output;
}

impl SavedAtOnce for Controller {
    fn step_saved(&mut self, now: UnixMs, inputs: Vec<Input>) -> Output {
        let mut out = self.step(now, inputs);
        if out.persist.is_none() {
            return out;
        }
        let later = self.step(
            now,
            vec![Input::Durable {
                version: out.persist_version,
            }],
        );
        for (index, ticket) in std::mem::take(&mut out.wait_replies) {
            let reply = later
                .late_replies
                .iter()
                .find(|(t, _)| *t == ticket)
                .map(|(_, r)| r.clone())
                .expect("a reply for each waiting admin once durable");
            out.replies.push((index, reply));
        }
        out.replies.sort_by_key(|(index, _)| *index);
        out.leases.extend(later.leases);
        out.preempt.extend(later.preempt);
        out.annotations.extend(later.annotations);
        out
    }
}
