//! Need-to-know on the admin socket: who owns each job, and what of an admin
//! reply a caller may read. Pure: reports and replies in, views out.
//!
//! A job's owner comes only from its agents' reports ([`JobReport::owner_uid`]), which
//! take it from the registration by the step's root `slurmstepd` (Slurm's job uid) or,
//! for a job taken back after an agent restart, from the kernel's owner of the job's
//! processes — never from anything the job's user writes. The caller's uid comes from
//! the admin socket's `SO_PEERCRED`. A job whose owner is unknown (an agent from before
//! the field) or disputed (two nodes name different owners) is shown to root only: an
//! unknown owner must not widen who sees a job.

use std::collections::BTreeMap;
use std::sync::Arc;

use powerflex_proto::admin::{AdminAnswer, AdminReply};
use powerflex_proto::report::JobReport;
use powerflex_proto::status::HistorySample;

/// What a non-root caller reads instead of the reason a site config reload was refused:
/// the reason may quote the site's config (paths, addresses).
pub const CONFIG_ERROR_FOR_USERS: &str =
    "the last site config reload was refused; root reads why (powerflexctl status as root)";

/// The owner of each job in `reports` (one job may be reported by several nodes): the
/// uid every report of it names, or none when one report names none or two disagree.
pub fn agreed<'a>(
    reports: impl IntoIterator<Item = &'a JobReport>,
) -> BTreeMap<String, Option<u32>> {
    let mut owners: BTreeMap<String, Option<u32>> = BTreeMap::new();
    for r in reports {
        owners
            .entry(r.job_id.clone())
            .and_modify(|o| {
                if *o != r.owner_uid {
                    *o = None;
                }
            })
            .or_insert(r.owner_uid);
    }
    owners
}

/// A job's owner as last reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Known {
    uid: Option<u32>,
    /// When it was last reported (controller ms).
    seen_ms: u64,
}

/// Job → the uid that owns it, as [`Owners`] knows them at one time: what the admin
/// threads filter the history with (see [`super::history`]). A job whose owner is unknown
/// or disputed is absent, and so root's only.
pub type OwnerMap = BTreeMap<String, u32>;

/// The owners of jobs reported now and recently: the history and the held-out jobs name
/// jobs that no node reports any more (ended, or requeued by a deep cut), and their
/// owners should still see them there.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Owners {
    known: BTreeMap<String, Known>,
    /// A job's owner was learnt, changed or forgotten since [`Owners::take_changed`] last
    /// answered: the history's copy of the owners is out of date.
    changed: bool,
}

impl Owners {
    /// Records the owners in `reports` (all the nodes' current reports) at `now_ms`.
    pub fn observe<'a>(&mut self, reports: impl IntoIterator<Item = &'a JobReport>, now_ms: u64) {
        for (job, uid) in agreed(reports) {
            let before = self.known.insert(
                job,
                Known {
                    uid,
                    seen_ms: now_ms,
                },
            );
            // Only the owner counts: a job seen again under the same one changes nothing
            // a caller may read.
            if before.and_then(|k| k.uid) != uid {
                self.changed = true;
            }
        }
    }

    /// Forgets jobs last reported before `cutoff_ms`, except those `keep` names (held out
    /// of the allocation: still listed in the status).
    pub fn forget_before(&mut self, cutoff_ms: u64, keep: impl Fn(&str) -> bool) {
        let mut forgot_an_owner = false;
        self.known.retain(|job, k| {
            let kept = k.seen_ms >= cutoff_ms || keep(job);
            forgot_an_owner |= !kept && k.uid.is_some();
            kept
        });
        self.changed |= forgot_an_owner;
    }

    /// The known owners, when they changed since the last time this answered (`None`
    /// otherwise): the I/O edge hands them to the history's readers, and copying the map
    /// only on a change keeps that off most allocations of a site whose jobs are steady.
    pub fn take_changed(&mut self) -> Option<OwnerMap> {
        if !std::mem::take(&mut self.changed) {
            return None;
        }
        Some(
            self.known
                .iter()
                .filter_map(|(job, k)| k.uid.map(|uid| (job.clone(), uid)))
                .collect(),
        )
    }

    /// The owner of `job`, when known.
    pub fn of(&self, job: &str) -> Option<u32> {
        self.known.get(job).and_then(|k| k.uid)
    }

    /// Jobs remembered (for tests and bounds).
    pub fn len(&self) -> usize {
        self.known.len()
    }

    pub fn is_empty(&self) -> bool {
        self.known.is_empty()
    }
}

/// Whether a caller with `uid` may read a job owned by `owner`: root reads every job,
/// anyone else only their own, and a job of unknown owner is root's. The one rule behind
/// every job-level filter here.
fn may_read(uid: u32, owner: Option<u32>) -> bool {
    uid == 0 || owner == Some(uid)
}

/// A history sample as a caller with `uid` may read it: the site's figures, and the caps
/// of their own jobs only (every job's for root). Copies only the caps it keeps.
pub fn history_sample_for(
    sample: &HistorySample,
    uid: u32,
    owner_of: impl Fn(&str) -> Option<u32>,
) -> HistorySample {
    let caps = sample
        .caps
        .iter()
        .filter(|(job, _)| may_read(uid, owner_of(job)))
        .map(|(job, cap)| (job.clone(), *cap));
    with_caps(sample, caps.collect())
}

/// [`history_sample_for`] over a page of samples, with the owners as a map (the history
/// board's): a non-root caller's caps are looked up from their own jobs, so a page costs
/// their jobs, not the site's — any local user may ask, as often as the admin gate lets
/// them.
pub fn history_for(
    samples: &[Arc<HistorySample>],
    uid: u32,
    owners: &OwnerMap,
) -> Vec<HistorySample> {
    if uid == 0 {
        // Every job, of unknown owner too: nothing to look up.
        return samples.iter().map(|s| HistorySample::clone(s)).collect();
    }
    let readable: Vec<&str> = owners
        .iter()
        .filter(|(_, owner)| may_read(uid, Some(**owner)))
        .map(|(job, _)| job.as_str())
        .collect();
    samples
        .iter()
        .map(|sample| {
            let caps = readable
                .iter()
                .filter_map(|job| sample.caps.get_key_value(*job))
                .map(|(job, cap)| (job.clone(), *cap));
            with_caps(sample, caps.collect())
        })
        .collect()
}

/// `sample` with `caps` in place of its own.
fn with_caps(sample: &HistorySample, caps: BTreeMap<String, f64>) -> HistorySample {
    // Every field named: one added to the sample must be decided on here.
    let HistorySample {
        t_ms,
        budget_w,
        draw_w,
        caps: _,
        simulated,
        domains,
    } = sample;
    HistorySample {
        t_ms: *t_ms,
        budget_w: *budget_w,
        draw_w: *draw_w,
        caps,
        simulated: *simulated,
        // The site's power, as the rest of the sample: not a user's to hide.
        domains: domains.clone(),
    }
}

/// What a caller with `uid` may read of `reply`. Root reads everything. Anyone else reads
/// the site — budget, draw, headroom, events, nodes with their power and job counts —
/// and only their own jobs: the status's job rows and held-out jobs, and in the history
/// only their jobs' caps. `owner_of` gives the owner of a job that is not in the status's
/// rows (history, held-out jobs). A what-if decision holds every job's curve and cap and
/// stays root's. A refused reload's reason may quote the site's config and is replaced.
pub fn need_to_know(
    mut reply: AdminReply,
    uid: u32,
    owner_of: impl Fn(&str) -> Option<u32>,
) -> AdminReply {
    if uid == 0 {
        return reply;
    }
    let mine = |owner: Option<u32>| may_read(uid, owner);
    match &mut reply {
        AdminReply::Done(AdminAnswer::Status(status)) => {
            status.jobs.retain(|j| mine(j.owner_uid));
            status.preempted.retain(|p| mine(owner_of(&p.job)));
            if status.config_error.is_some() {
                status.config_error = Some(CONFIG_ERROR_FOR_USERS.to_string());
            }
            status.jobs_of_uid = Some(uid);
            // The database's error may name its host and user: the state, not the reason.
            if let Some(db) = &mut status.accounting_db {
                if db.error.is_some() {
                    db.error = Some("unreachable (the reason is shown to root)".to_string());
                }
            }
        }
        AdminReply::Done(AdminAnswer::History(history)) => {
            for sample in history.iter_mut() {
                *sample = history_sample_for(sample, uid, &owner_of);
            }
        }
        AdminReply::Done(AdminAnswer::Records(records)) => {
            // Slurm's owner of each ended job, as the record carries it.
            records.retain(|r| r.uid == uid);
        }
        AdminReply::Done(AdminAnswer::WhatIf(_)) => {
            return AdminReply::error(
                "what-if shows every job's curve and cap: root only (run powerflexctl as root)",
            );
        }
        AdminReply::Done(AdminAnswer::Empty | AdminAnswer::EventAdded(_))
        | AdminReply::Refused { .. } => {}
    }
    reply
}

#[cfg(test)]
mod tests {
    use super::*;
    use powerflex_core::allocate::Maximised;
    use powerflex_core::flex::Preempt;
    use powerflex_proto::status::{
        CtldStatus, DecisionView, HistorySample, NodeStatus, PreemptedView, SiteJobStatus,
    };

    fn report(job: &str, owner_uid: Option<u32>) -> JobReport {
        JobReport {
            job_id: job.into(),
            tier: "flex2".into(),
            gpus: 1,
            owner_uid,
            ..JobReport::default()
        }
    }

    fn row(job: &str, owner_uid: Option<u32>) -> SiteJobStatus {
        SiteJobStatus {
            job: job.into(),
            tier: "flex2".into(),
            nodes: vec!["n1".into()],
            gpus: 1,
            pfi: None,
            pfi_source: None,
            cap_w: Some(500.0),
            floor: None,
            throughput: None,
            uncapped_throughput: None,
            power_w: 450.0,
            points: BTreeMap::new(),
            curve: BTreeMap::new(),
            curve_history: Vec::new(),
            calibration_cost_pct: None,
            drift: None,
            owner_uid,
            below_measured_w: None,
            energy_j: None,
            capped_pct: None,
        }
    }

    const ALICE: u32 = 1001;
    const BOB: u32 = 1002;

    /// A site with alice's job 1, bob's job 2, job 3 of an old agent (owner unknown),
    /// alice's job 4 requeued by a deep cut (no node reports it), and a refused reload.
    fn status_reply() -> AdminReply {
        AdminReply::Done(AdminAnswer::Status(Box::new(CtldStatus {
            base_budget_w: 10_000.0,
            budget_w: 7_000.0,
            allocated_budget_w: Some(7_000.0),
            draw_w: 6_000.0,
            headroom_w: 1_000.0,
            active_event: None,
            events: Vec::new(),
            over_budget_w: Some(0.0),
            shed_reach: None,
            nodes: vec![NodeStatus {
                node: "n1".into(),
                gpus: 8,
                live: true,
                power_w: 6_000.0,
                jobs: 3,
                seen_ms_ago: 10,
                refused_reports: 0,
                refused_gpus: 0,
                domain: None,
                unmanaged_reserve_w: None,
            }],
            jobs: vec![row("1", Some(ALICE)), row("2", Some(BOB)), row("3", None)],
            config_error: Some("/etc/slurm/powerflex.toml: bad key_file".into()),
            preempted: vec![
                PreemptedView {
                    job: "2".into(),
                    how: Preempt::Suspend,
                    since_ms: 5,
                },
                PreemptedView {
                    job: "4".into(),
                    how: Preempt::Requeue,
                    since_ms: 5,
                },
            ],
            jobs_of_uid: None,
            slurm: None,
            accounting_db: None,
            domains: Vec::new(),
            leadership: None,
            refused_by: Default::default(),
            unmanaged_reserve_w: None,
        })))
    }

    fn owner(job: &str) -> Option<u32> {
        match job {
            "1" | "4" => Some(ALICE),
            "2" => Some(BOB),
            _ => None,
        }
    }

    fn jobs(reply: &AdminReply) -> Vec<&str> {
        let status = reply.status().expect("status");
        status.jobs.iter().map(|j| j.job.as_str()).collect()
    }

    fn held(reply: &AdminReply) -> Vec<&str> {
        let status = reply.status().expect("status");
        status.preempted.iter().map(|p| p.job.as_str()).collect()
    }

    #[test]
    fn each_user_sees_their_own_jobs_and_root_sees_all() {
        let full = status_reply();
        assert_eq!(need_to_know(full.clone(), 0, owner), full, "root sees all");

        let alice = need_to_know(full.clone(), ALICE, owner);
        assert_eq!(jobs(&alice), ["1"]);
        assert_eq!(
            held(&alice),
            ["4"],
            "her requeued job, not bob's suspended one"
        );
        let bob = need_to_know(full.clone(), BOB, owner);
        assert_eq!(jobs(&bob), ["2"]);
        assert_eq!(held(&bob), ["2"]);
        // A user with no job sees none; nobody but root sees the job of unknown owner.
        let carol = need_to_know(full.clone(), 1003, owner);
        assert!(jobs(&carol).is_empty() && held(&carol).is_empty());
        for seen in [&alice, &bob, &carol] {
            assert!(!jobs(seen).contains(&"3"), "unknown owner: root only");
        }
    }

    #[test]
    fn users_read_the_site_figures_but_not_its_config_error() {
        let full = status_reply();
        let seen = need_to_know(full.clone(), ALICE, owner);
        let (s, f) = (
            seen.status().expect("status"),
            full.status().expect("status"),
        );
        assert_eq!(
            (s.budget_w, s.base_budget_w, s.draw_w, s.headroom_w),
            (f.budget_w, f.base_budget_w, f.draw_w, f.headroom_w)
        );
        assert_eq!(s.nodes, f.nodes, "node aggregates stay");
        assert_eq!(s.events, f.events);
        assert_eq!(s.jobs_of_uid, Some(ALICE), "the reply says it is filtered");
        let error = s.config_error.as_deref().expect("a reload was refused");
        assert!(!error.contains("powerflex.toml"), "{error}");
        assert!(error.contains("root"), "{error}");
    }

    #[test]
    fn the_history_shows_a_user_only_their_jobs_caps() {
        let sample = HistorySample {
            t_ms: 1,
            budget_w: 1000.0,
            draw_w: 900.0,
            caps: [("1", 500.0), ("2", 400.0), ("3", 300.0), ("4", 200.0)]
                .map(|(j, c)| (j.to_string(), c))
                .into(),
            simulated: false,
            domains: BTreeMap::new(),
        };
        let reply = AdminReply::Done(AdminAnswer::History(vec![sample]));
        let seen = need_to_know(reply.clone(), ALICE, owner);
        let history = seen.history().expect("history");
        assert_eq!(
            history[0]
                .caps
                .keys()
                .map(String::as_str)
                .collect::<Vec<_>>(),
            ["1", "4"]
        );
        assert_eq!(history[0].draw_w, 900.0, "site totals stay");
        assert_eq!(
            need_to_know(reply.clone(), 0, owner),
            reply,
            "root sees all"
        );
    }

    #[test]
    fn what_if_stays_root_s() {
        let reply = AdminReply::Done(AdminAnswer::WhatIf(Box::new(DecisionView {
            leases: BTreeMap::new(),
            budget_w: 1000.0,
            reserved_w: 0.0,
            allocation: None,
            rejected: Vec::new(),
            drifted: Vec::new(),
            start_cap_w: 300.0,
            objective: Maximised::RelativeSpeed,
        })));
        let seen = need_to_know(reply.clone(), ALICE, owner);
        assert!(!seen.is_ok() && seen.what_if().is_none());
        assert!(seen.error_message().expect("why").contains("root only"));
        assert_eq!(need_to_know(reply.clone(), 0, owner), reply);
    }

    #[test]
    fn an_owner_needs_every_report_to_agree() {
        let owners = agreed([
            &report("1", Some(ALICE)),
            &report("1", Some(ALICE)),
            &report("2", Some(BOB)),
            &report("2", Some(ALICE)),
            &report("3", Some(BOB)),
            &report("3", None),
            &report("5", None),
            &report("5", Some(BOB)),
            &report("5", None),
        ]);
        assert_eq!(owners["1"], Some(ALICE), "two nodes agree");
        assert_eq!(owners["2"], None, "two nodes disagree: nobody's but root's");
        assert_eq!(owners["3"], None, "an older agent says nothing: unknown");
        assert_eq!(owners["5"], None);
    }

    #[test]
    fn owners_are_remembered_after_the_job_leaves_and_then_forgotten() {
        let mut owners = Owners::default();
        owners.observe([&report("1", Some(ALICE)), &report("2", Some(BOB))], 1_000);
        owners.observe([&report("2", Some(BOB))], 5_000);
        assert_eq!(owners.of("1"), Some(ALICE), "ended, still in the history");
        owners.forget_before(2_000, |job| job == "9");
        assert_eq!(owners.of("1"), None, "older than the history");
        assert_eq!(owners.of("2"), Some(BOB));
        owners.observe([&report("9", Some(ALICE))], 1_500);
        owners.forget_before(6_000, |job| job == "9");
        assert_eq!(owners.of("9"), Some(ALICE), "held out: kept");
        assert_eq!(owners.len(), 1);
    }
}
