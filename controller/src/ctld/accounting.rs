//! Per-job energy records, pure: the nodes' shares of each job (running totals in their
//! reports, final ones after the job's end there) are summed into one
//! [`JobEnergyRecord`] per job once every node that held it has sent its final share,
//! or [`FINAL_WAIT_MS`] after the first final share (then naming the nodes still
//! missing). The I/O edge appends the records to the accounting log.
//!
//! Only shares of jobs the controller believes on the sending node (Slurm's placement
//! bears them out) are taken: a running share arrives inside a believed job report, and
//! a final share only from a node whose running share of the job was taken before. A
//! rogue node cannot charge another node's job, nor invent one.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use powerflex_proto::link::JobReport;
use powerflex_proto::usage::{JobEnergyRecord, NodeUsage};

/// Longest wait for the other nodes' final shares after a job's first, ms.
pub const FINAL_WAIT_MS: u64 = 60_000;
/// A job none of whose nodes has reported it for this long, without a final share
/// (its agents gone), is written from its last running shares, ms.
pub const STALE_MS: u64 = 600_000;
/// Records kept in memory for `powerflexctl accounting` and `report --job` (the log
/// on disk keeps all).
pub const RECENT_RECORDS: usize = 10_000;
/// Finished jobs remembered, so a final share re-sent after its record is ignored.
const FINISHED_REMEMBERED: usize = 20_000;

#[derive(Debug, Clone, Default, PartialEq)]
struct Pending {
    /// Node → its latest share.
    shares: BTreeMap<String, NodeUsage>,
    first_final_ms: Option<u64>,
    last_update_ms: u64,
}

/// The shares of running jobs and the records of ended ones.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Ledger {
    pending: BTreeMap<String, Pending>,
    finished: BTreeSet<String>,
    finished_order: VecDeque<String>,
    recent: VecDeque<JobEnergyRecord>,
}

impl Ledger {
    /// A node's believed job reports: their running shares.
    pub fn running<'a>(
        &mut self,
        node: &str,
        believed: impl Iterator<Item = &'a JobReport>,
        now_ms: u64,
    ) {
        for report in believed {
            let Some(share) = &report.usage else {
                continue;
            };
            if share.job_id != report.job_id || self.finished.contains(&report.job_id) {
                continue;
            }
            let pending = self.pending.entry(report.job_id.clone()).or_default();
            // A final share already taken from this node is not replaced by a running
            // one (a report built before the end, delivered after).
            if pending.shares.get(node).is_some_and(|s| s.ended) {
                continue;
            }
            // The owner is the believed report's (Slurm's uid, set by the placement
            // check), never the share's own word; a job of unknown owner is not taken.
            let Some(owner) = report.owner_uid else {
                continue;
            };
            let mut share = share.clone();
            share.node = node.to_string();
            share.uid = owner;
            share.ended = false;
            pending.shares.insert(node.to_string(), share);
            pending.last_update_ms = now_ms;
        }
    }

    /// A node's final shares (each re-sent for a while: repeats are ignored).
    pub fn ended(&mut self, node: &str, shares: Vec<NodeUsage>, now_ms: u64) {
        for mut share in shares {
            if !share.ended || self.finished.contains(&share.job_id) {
                continue;
            }
            let Some(pending) = self.pending.get_mut(&share.job_id) else {
                continue;
            };
            // Only a node whose running share was believed may end the job's share.
            let Some(before) = pending.shares.get(node) else {
                continue;
            };
            if before.ended {
                continue;
            }
            // The owner and tier stay those of the believed running share.
            share.node = node.to_string();
            share.uid = before.uid;
            share.tier = before.tier.clone();
            pending.shares.insert(node.to_string(), share);
            pending.first_final_ms.get_or_insert(now_ms);
            pending.last_update_ms = now_ms;
        }
    }

    /// The records due at `now_ms`, each once. `owner` gives Slurm's uid of a job when
    /// known (it then replaces the agents' word).
    pub fn due(
        &mut self,
        now_ms: u64,
        owner: impl Fn(&str) -> Option<u32>,
    ) -> Vec<JobEnergyRecord> {
        let ready: Vec<String> = self
            .pending
            .iter()
            .filter(|(_, p)| {
                let all_final = p.shares.values().all(|s| s.ended);
                let waited = p
                    .first_final_ms
                    .is_some_and(|t| now_ms.saturating_sub(t) >= FINAL_WAIT_MS);
                let stale = now_ms.saturating_sub(p.last_update_ms) >= STALE_MS;
                all_final || waited || stale
            })
            .map(|(id, _)| id.clone())
            .collect();
        let mut out = Vec::new();
        for id in ready {
            let Some(pending) = self.pending.remove(&id) else {
                continue;
            };
            let incomplete: Vec<String> = pending
                .shares
                .values()
                .filter(|s| !s.ended)
                .map(|s| s.node.clone())
                .collect();
            let shares: Vec<NodeUsage> = pending.shares.into_values().collect();
            if let Some(mut record) = JobEnergyRecord::from_shares(shares, incomplete, now_ms) {
                if let Some(uid) = owner(&id) {
                    record.uid = uid;
                }
                self.remember(&id);
                self.recent.push_back(record.clone());
                while self.recent.len() > RECENT_RECORDS {
                    self.recent.pop_front();
                }
                out.push(record);
            }
        }
        out
    }

    fn remember(&mut self, id: &str) {
        if self.finished.insert(id.to_string()) {
            self.finished_order.push_back(id.to_string());
        }
        while self.finished_order.len() > FINISHED_REMEMBERED {
            if let Some(old) = self.finished_order.pop_front() {
                self.finished.remove(&old);
            }
        }
    }

    /// Records written by this controller since it started (and loaded back from the
    /// log at start), oldest first.
    pub fn recent(&self) -> impl DoubleEndedIterator<Item = &JobEnergyRecord> {
        self.recent.iter()
    }

    /// Records read back from the log at start: known, never written again.
    pub fn load(&mut self, records: Vec<JobEnergyRecord>) {
        for r in records {
            self.remember(&r.job_id.clone());
            self.recent.push_back(r);
        }
        while self.recent.len() > RECENT_RECORDS {
            self.recent.pop_front();
        }
    }

    /// Running shares by job, for status.
    pub fn running_share(&self, job_id: &str) -> Vec<&NodeUsage> {
        self.pending
            .get(job_id)
            .map(|p| p.shares.values().collect())
            .unwrap_or_default()
    }
}

/// The `AdminComment` that keeps what a site wrote there and puts powerflex's own
/// segment (`powerflex;…`) after it, replacing any earlier powerflex segment.
pub fn merge_admin_comment(existing: &str, ours: &str) -> String {
    let site = match powerflex_core::slurm_record::powerflex_segment_start(existing) {
        Some(at) => existing[..at].trim_end_matches(ADMIN_COMMENT_SEPARATOR),
        None => existing,
    }
    .trim();
    if site.is_empty() {
        ours.to_string()
    } else {
        format!("{site}{ADMIN_COMMENT_SEPARATOR}{ours}")
    }
}

/// What separates a site's own `AdminComment` text from powerflex's segment.
pub const ADMIN_COMMENT_SEPARATOR: &str = " | ";

#[cfg(test)]
mod tests {
    use super::*;
    use powerflex_proto::usage::EnergySource;

    fn share(job: &str, energy_mj: u64, ended: bool) -> NodeUsage {
        NodeUsage {
            job_id: job.into(),
            node: "whatever-the-agent-says".into(),
            uid: 1000,
            tier: "flex2".into(),
            gpus: vec![],
            energy_mj,
            energy_source: EnergySource::Counter,
            from_unix_ms: 0,
            to_unix_ms: 10_000,
            peak_power_w: 0.0,
            observed_s: 10.0,
            capped_s: 0.0,
            event_s: 0.0,
            power_throttled_s: 0.0,
            throttle_known_s: 0.0,
            caps: vec![],
            slowdown_pct: None,
            bound_pct: None,
            bound_held: None,
            saved_estimate_j: None,
            work: None,
            work_unit: None,
            pfi: None,
            ended,
            simulated: false,
        }
    }

    fn report(job: &str, energy_mj: u64) -> JobReport {
        JobReport {
            job_id: job.into(),
            tier: "flex2".into(),
            owner_uid: Some(1000),
            usage: Some(share(job, energy_mj, false)),
            ..JobReport::default()
        }
    }

    #[test]
    fn a_two_node_job_is_written_once_both_final_shares_are_in() {
        let mut l = Ledger::default();
        l.running("n1", [report("7", 10)].iter(), 0);
        l.running("n2", [report("7", 20)].iter(), 0);
        l.ended("n1", vec![share("7", 1_000, true)], 1_000);
        assert!(l.due(1_000, |_| None).is_empty(), "n2 still runs");
        // Re-sent, and a late running report: nothing changes.
        l.ended("n1", vec![share("7", 1_000, true)], 2_000);
        l.running("n1", [report("7", 999)].iter(), 2_000);
        l.ended("n2", vec![share("7", 2_000, true)], 3_000);
        let records = l.due(3_000, |_| Some(4242));
        assert_eq!(records.len(), 1);
        assert_eq!(records[0].energy_j, 3.0);
        assert_eq!(records[0].uid, 4242, "Slurm's owner, not the agents'");
        assert!(records[0].incomplete_nodes.is_empty());
        assert_eq!(
            records[0].nodes[0].node, "n1",
            "the sender, not the share's word"
        );
        // Re-sent after the record: ignored.
        l.ended("n2", vec![share("7", 2_000, true)], 4_000);
        assert!(l.due(100_000, |_| None).is_empty());
        assert_eq!(l.recent().count(), 1);
    }

    #[test]
    fn the_owner_is_the_believed_report_s_never_the_share_s_word() {
        let mut l = Ledger::default();
        let mut forged = report("7", 10);
        if let Some(u) = forged.usage.as_mut() {
            u.uid = 0;
        }
        l.running("n1", [forged].iter(), 0);
        let mut unknown = report("8", 10);
        unknown.owner_uid = None;
        l.running("n1", [unknown].iter(), 0);
        let mut forged_final = share("7", 1_000, true);
        forged_final.uid = 0;
        l.ended("n1", vec![forged_final, share("8", 1, true)], 1_000);
        let r = l.due(1_000, |_| None);
        assert_eq!(r.len(), 1, "a job of unknown owner is not taken");
        assert_eq!(r[0].uid, 1000);
    }

    #[test]
    fn a_missing_final_share_is_waited_for_then_named() {
        let mut l = Ledger::default();
        l.running("n1", [report("7", 10)].iter(), 0);
        l.running("n2", [report("7", 20)].iter(), 0);
        l.ended("n1", vec![share("7", 1_000, true)], 1_000);
        assert!(l.due(1_000 + FINAL_WAIT_MS - 1, |_| None).is_empty());
        let r = l.due(1_000 + FINAL_WAIT_MS, |_| None);
        assert_eq!(r[0].incomplete_nodes, vec!["n2".to_string()]);
        assert_eq!(r[0].energy_j, 1.02);
    }

    #[test]
    fn a_node_cannot_end_or_invent_a_share_it_was_not_believed_for() {
        let mut l = Ledger::default();
        l.running("n1", [report("7", 10)].iter(), 0);
        // n3 never had job 7 believed: its final share is ignored.
        l.ended("n3", vec![share("7", 9_000_000, true)], 1_000);
        // Nor can it create job 8 from a final share alone.
        l.ended("n3", vec![share("8", 9_000_000, true)], 1_000);
        l.ended("n1", vec![share("7", 1_000, true)], 1_000);
        let r = l.due(1_000, |_| None);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].energy_j, 1.0);
        assert_eq!(r[0].nodes.len(), 1);
    }

    #[test]
    fn a_job_whose_agents_went_silent_is_written_as_incomplete() {
        let mut l = Ledger::default();
        l.running("n1", [report("7", 5_000)].iter(), 0);
        assert!(l.due(STALE_MS - 1, |_| None).is_empty());
        let r = l.due(STALE_MS, |_| None);
        assert_eq!(r[0].incomplete_nodes, vec!["n1".to_string()]);
    }

    #[test]
    fn the_site_s_admin_comment_is_kept_and_ours_replaced() {
        assert_eq!(
            merge_admin_comment("", "powerflex;tier=a"),
            "powerflex;tier=a"
        );
        assert_eq!(
            merge_admin_comment("project=X", "powerflex;tier=a"),
            "project=X | powerflex;tier=a"
        );
        assert_eq!(
            merge_admin_comment("project=X | powerflex;tier=a;cap=500W", "powerflex;tier=b"),
            "project=X | powerflex;tier=b"
        );
        assert_eq!(
            merge_admin_comment("powerflex;tier=a;cap=500W", "powerflex;tier=b"),
            "powerflex;tier=b"
        );
    }
}
