//! Per-job energy records, pure: the nodes' shares of each job run (running totals in
//! their reports, final ones after the run's end there) are summed into one
//! [`JobEnergyRecord`] per run once every node that sent a share has sent its final one,
//! or [`FINAL_WAIT_MS`] after the first final share (then naming the nodes still
//! missing). The I/O edge appends the records to the accounting log, then acknowledges
//! the final shares in them to their nodes ([`Ledger::take_acks`]): an agent keeps a
//! final share on disk and re-sends it until then, so none is lost to a dropped
//! connection, a full report or a restart on either side.
//!
//! **Runs.** Slurm reuses a requeued job's id, so a share belongs to a *run*: the job id
//! and Slurm's start time of the run (`squeue`'s `start_time`), which every node of the
//! run shares, which Slurm records (no node's word), and which changes at each requeue
//! (the restart count would tell runs apart too, but reaches the node only through the
//! job's own environment, and is absent from the extern step). A share's run is the
//! latest run Slurm placed on the sending node that started no later than the share's
//! hold ([`RUN_START_SKEW_MS`] of clock skew allowed): a node registers a job after Slurm
//! starts it, and a requeued run starts after the previous one's end. Without Slurm's
//! record (`job_placement = "reports"`) every share of a job id is one run until its
//! record is written, and the next shares (of another hold) make the next record.
//!
//! **Trust.** Only shares about runs Slurm placed on the sending node are taken: a
//! running share arrives inside a believed job report, a final one is taken when a
//! placement read by the controller (now or earlier: the ledger remembers where each
//! run was placed) put its run on the sender, whether or not a running share came
//! first. The owner is Slurm's. A rogue node cannot charge another node's job, nor
//! invent one.
//!
//! **Late final shares.** A final share that arrives after its run's record (its agent
//! was down when the job ended, and sent it at its next start) makes the record again,
//! with the next `revision`; the latest revision of a run is its record.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use powerflex_core::slurm_record::{SlurmJobState, SlurmJobs};
use powerflex_proto::admin::RecordCursor;
use powerflex_proto::report::JobReport;
use powerflex_proto::usage::FinalRef;
use powerflex_proto::usage::{JobEnergyRecord, NodeUsage};

/// Longest wait for the other nodes' final shares after a run's first, ms.
pub const FINAL_WAIT_MS: u64 = 60_000;
/// A run none of whose nodes has reported it for this long, without a final share
/// (its agents gone), is written from its last running shares, ms.
pub const STALE_MS: u64 = 600_000;
/// Records kept in memory for `powerflexctl accounting` and `report --job` (the log
/// on disk keeps all).
pub const RECENT_RECORDS: usize = 10_000;
/// How much earlier than Slurm's start of a run a node's hold may seem to start (the
/// two clocks differ; Slurm's start is whole seconds), ms.
pub const RUN_START_SKEW_MS: u64 = 5_000;
/// Runs remembered per job, and jobs whose placement is remembered.
const RUNS_PER_JOB: usize = 8;
const JOBS_PLACED_REMEMBERED: usize = 20_000;
/// Runs recorded, and node shares in records, remembered (a repeat is acknowledged, a
/// late final share amends its record).
const FINISHED_RUNS_REMEMBERED: usize = 20_000;
/// The newest records [`Ledger::load`] keeps of a log read back: older ones would leave
/// its bounded memories at once.
pub const LOADED_RECORDS: usize = if RECENT_RECORDS > FINISHED_RUNS_REMEMBERED {
    RECENT_RECORDS
} else {
    FINISHED_RUNS_REMEMBERED
};
const RECORDED_SHARES_REMEMBERED: usize = 200_000;

/// A job run: its id and Slurm's start of the run, ms (none without Slurm's record).
pub type RunKey = (String, Option<u64>);

#[derive(Debug, Clone, Default, PartialEq)]
struct Pending {
    /// Node → its latest share.
    shares: BTreeMap<String, NodeUsage>,
    first_final_ms: Option<u64>,
    last_update_ms: u64,
}

/// One run of a job as Slurm placed it.
#[derive(Debug, Clone, PartialEq)]
struct Run {
    start_ms: u64,
    nodes: BTreeSet<String>,
    uid: u32,
    /// Slurm's account for the job (none when Slurm names none).
    account: Option<String>,
}

/// Why a final share was not taken (for the caller's log).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinalRefused {
    pub job_id: String,
    pub reason: &'static str,
}

/// The shares of running jobs and the records of ended ones.
#[derive(Debug, Clone, PartialEq)]
pub struct Ledger {
    /// Runs come from Slurm's placement (`job_placement = "slurm"`).
    slurm: bool,
    pending: BTreeMap<RunKey, Pending>,
    /// Where Slurm placed each job's recent runs.
    placed: BTreeMap<String, Vec<Run>>,
    placed_order: VecDeque<String>,
    finished_runs: BTreeSet<RunKey>,
    finished_runs_order: VecDeque<RunKey>,
    /// Each node share in a record: its run, and whether it was final there.
    recorded: BTreeMap<(String, FinalRef), (RunKey, bool)>,
    recorded_order: VecDeque<(String, FinalRef)>,
    recent: VecDeque<JobEnergyRecord>,
    /// Records made outside [`Ledger::due`] (amended by a late final share).
    amended: Vec<JobEnergyRecord>,
    /// Final shares to acknowledge once this step's records are written, by node.
    acks: BTreeMap<String, BTreeSet<FinalRef>>,
}

impl Default for Ledger {
    fn default() -> Ledger {
        Ledger::new(true)
    }
}

impl Ledger {
    /// A ledger whose runs come from Slurm's placement (`slurm`), or from the shares
    /// alone (`job_placement = "reports"`).
    pub fn new(slurm: bool) -> Ledger {
        Ledger {
            slurm,
            pending: BTreeMap::new(),
            placed: BTreeMap::new(),
            placed_order: VecDeque::new(),
            finished_runs: BTreeSet::new(),
            finished_runs_order: VecDeque::new(),
            recorded: BTreeMap::new(),
            recorded_order: VecDeque::new(),
            recent: VecDeque::new(),
            amended: Vec::new(),
            acks: BTreeMap::new(),
        }
    }

    /// A read of Slurm's jobs: where each run that started is placed, remembered for
    /// the final shares that come after Slurm has forgotten the job.
    pub fn placement(&mut self, jobs: &SlurmJobs) {
        for (id, job) in jobs {
            if job.nodes.is_empty() || job.state == SlurmJobState::Pending {
                continue;
            }
            // Without a start time (an older Slurm) the job's runs cannot be told
            // apart: one run, from 0.
            let start_ms = job.start_unix_s.map_or(0, |s| s.saturating_mul(1000));
            let account = Some(job.account.clone()).filter(|a| !a.is_empty());
            if !self.placed.contains_key(id) {
                self.placed_order.push_back(id.clone());
                while self.placed_order.len() > JOBS_PLACED_REMEMBERED {
                    if let Some(old) = self.placed_order.pop_front() {
                        self.placed.remove(&old);
                    }
                }
            }
            let runs = self.placed.entry(id.clone()).or_default();
            match runs.iter_mut().find(|r| r.start_ms == start_ms) {
                Some(run) => {
                    // Read every few seconds for every job: clone only names not held.
                    for node in &job.nodes {
                        if !run.nodes.contains(node) {
                            run.nodes.insert(node.clone());
                        }
                    }
                    run.uid = job.uid;
                    run.account = account;
                }
                None => {
                    runs.push(Run {
                        start_ms,
                        nodes: job.nodes.clone(),
                        uid: job.uid,
                        account,
                    });
                    runs.sort_by_key(|r| r.start_ms);
                    if runs.len() > RUNS_PER_JOB {
                        runs.remove(0);
                    }
                }
            }
        }
    }

    /// The run of `job_id` that a share from `node` whose hold started at `from_ms`
    /// belongs to: the latest Slurm placed on the node that started by then. None when
    /// Slurm placed no such run there (as far as this controller read).
    fn run_of(&self, job_id: &str, node: &str, from_ms: u64) -> Option<RunKey> {
        if !self.slurm {
            return Some((job_id.to_string(), None));
        }
        self.placed
            .get(job_id)?
            .iter()
            .filter(|r| {
                r.nodes.contains(node) && r.start_ms <= from_ms.saturating_add(RUN_START_SKEW_MS)
            })
            .map(|r| r.start_ms)
            .max()
            .map(|start| (job_id.to_string(), Some(start)))
    }

    /// The run Slurm placed for `key`, if this controller read it.
    fn placed_run(&self, key: &RunKey) -> Option<&Run> {
        let start = key.1?;
        self.placed
            .get(&key.0)?
            .iter()
            .find(|r| r.start_ms == start)
    }

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
            if share.job_id != report.job_id || share.validate().is_err() {
                continue;
            }
            // A share already in a record (a report built before the end, delivered
            // after) changes nothing.
            if self
                .recorded
                .contains_key(&(node.to_string(), FinalRef::of(share)))
            {
                continue;
            }
            let Some(key) = self.run_of(&share.job_id, node, share.from_unix_ms) else {
                continue;
            };
            if self.finished_runs.contains(&key) {
                continue;
            }
            // The owner is the believed report's (Slurm's uid, set by the placement
            // check), never the share's own word; a job of unknown owner is not taken.
            let Some(owner) = report.owner_uid else {
                continue;
            };
            let pending = self.pending.entry(key).or_default();
            // A final share already taken from this node is not replaced by a running
            // one (a report built before the end, delivered after).
            if pending.shares.get(node).is_some_and(|s| s.ended) {
                continue;
            }
            let mut share = share.clone();
            share.node = node.to_string();
            share.uid = owner;
            share.ended = false;
            pending.shares.insert(node.to_string(), share);
            pending.last_update_ms = now_ms;
        }
    }

    /// A node's final shares (re-sent until acknowledged: repeats are acknowledged and
    /// otherwise ignored). `owner` gives Slurm's uid of a job when its placement lists
    /// it. Returns the shares refused, and why.
    pub fn ended(
        &mut self,
        node: &str,
        shares: Vec<NodeUsage>,
        now_ms: u64,
        owner: impl Fn(&str) -> Option<u32>,
    ) -> Vec<FinalRefused> {
        let mut refused = Vec::new();
        for mut share in shares {
            if !share.ended || share.validate().is_err() {
                refused.push(FinalRefused {
                    job_id: share.job_id.clone(),
                    reason: "not a valid final share",
                });
                continue;
            }
            let reference = FinalRef::of(&share);
            let id = (node.to_string(), reference.clone());
            match self.recorded.get(&id).cloned() {
                // In a record already: its acknowledgement was lost.
                Some((_, true)) => {
                    self.ack(node, reference);
                    continue;
                }
                // The record was written without it (the node was late): amend it.
                Some((key, false)) => {
                    self.amend(&key, node, share, now_ms);
                    continue;
                }
                None => {}
            }
            let Some(key) = self.run_of(&share.job_id, node, share.from_unix_ms) else {
                refused.push(FinalRefused {
                    job_id: share.job_id.clone(),
                    reason: "Slurm placed no run of this job on the node",
                });
                continue;
            };
            if !self.pending.contains_key(&key) && self.finished_runs.contains(&key) {
                // A node of the run that never reported it before its record.
                self.amend(&key, node, share, now_ms);
                continue;
            }
            let slurm_uid = owner(&share.job_id)
                .filter(|_| self.slurm)
                .or_else(|| self.placed_run(&key).map(|r| r.uid));
            let pending = self.pending.entry(key).or_default();
            let before = pending.shares.get(node);
            if before.is_some_and(|s| s.ended) {
                continue;
            }
            // The owner is Slurm's, else (no Slurm record: every node trusted) the
            // believed running share's, else the share's own.
            let uid = match (slurm_uid, before) {
                (Some(uid), _) => uid,
                (None, Some(b)) => b.uid,
                (None, None) if !self.slurm => share.uid,
                (None, None) => {
                    refused.push(FinalRefused {
                        job_id: share.job_id.clone(),
                        reason: "the job's owner is unknown",
                    });
                    continue;
                }
            };
            if let Some(b) = before {
                share.tier = b.tier.clone();
            }
            share.node = node.to_string();
            share.uid = uid;
            pending.shares.insert(node.to_string(), share);
            pending.first_final_ms.get_or_insert(now_ms);
            pending.last_update_ms = now_ms;
        }
        // A run created by a refused share's owner lookup is left empty: drop it.
        self.pending.retain(|_, p| !p.shares.is_empty());
        refused
    }

    /// Makes the record of `key` again with `node`'s final share, as the next revision.
    fn amend(&mut self, key: &RunKey, node: &str, mut share: NodeUsage, now_ms: u64) {
        let reference = FinalRef::of(&share);
        let at = self.recent.iter().rposition(|r| {
            r.job_id == key.0
                && r.run_start_unix_ms == key.1
                && (key.1.is_some()
                    || r.nodes
                        .iter()
                        .any(|s| s.node == node && s.from_unix_ms == reference.from_unix_ms))
        });
        let Some(at) = at else {
            // Too old to be kept: the log has the record; nothing to amend here.
            self.ack(node, reference);
            return;
        };
        let Some(old) = self.recent.remove(at) else {
            return;
        };
        share.node = node.to_string();
        share.uid = old.uid;
        if let Some(before) = old.nodes.iter().find(|s| s.node == node) {
            share.tier = before.tier.clone();
        } else {
            share.tier = old.tier.clone();
        }
        let mut shares: Vec<NodeUsage> = old
            .nodes
            .iter()
            .filter(|s| s.node != node)
            .cloned()
            .collect();
        shares.push(share);
        shares.sort_by(|a, b| a.node.cmp(&b.node));
        let incomplete: Vec<String> = old
            .incomplete_nodes
            .iter()
            .filter(|n| n.as_str() != node)
            .cloned()
            .collect();
        let Some(mut record) = JobEnergyRecord::from_shares(shares, incomplete, now_ms) else {
            self.recent.insert(at, old);
            return;
        };
        record.uid = old.uid;
        record.account.clone_from(&old.account);
        record.run_start_unix_ms = old.run_start_unix_ms;
        record.revision = old.revision.saturating_add(1);
        self.remember_record(key, &record);
        self.recent.push_back(record.clone());
        self.amended.push(record);
    }

    fn ack(&mut self, node: &str, reference: FinalRef) {
        self.acks
            .entry(node.to_string())
            .or_default()
            .insert(reference);
    }

    /// The records due at `now_ms`, each once (and any made again by a late final
    /// share). `owner` gives Slurm's uid of a job when known (it then replaces the
    /// agents' word).
    pub fn due(
        &mut self,
        now_ms: u64,
        owner: impl Fn(&str) -> Option<u32>,
    ) -> Vec<JobEnergyRecord> {
        let ready: Vec<RunKey> = self
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
            .map(|(key, _)| key.clone())
            .collect();
        let mut out = std::mem::take(&mut self.amended);
        for key in ready {
            let Some(pending) = self.pending.remove(&key) else {
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
                if let Some(uid) = owner(&key.0).or_else(|| self.placed_run(&key).map(|r| r.uid)) {
                    record.uid = uid;
                }
                // Slurm's account, remembered with the run past Slurm's forgetting of it.
                record.account = self.placed_run(&key).and_then(|r| r.account.clone());
                record.run_start_unix_ms = key.1;
                self.remember_record(&key, &record);
                self.recent.push_back(record.clone());
                out.push(record);
            }
        }
        while self.recent.len() > RECENT_RECORDS {
            self.recent.pop_front();
        }
        out
    }

    /// Notes a record written: its run is finished, its node shares known, and its
    /// final shares acknowledged (once the caller has written it).
    fn remember_record(&mut self, key: &RunKey, record: &JobEnergyRecord) {
        if key.1.is_some() && self.finished_runs.insert(key.clone()) {
            self.finished_runs_order.push_back(key.clone());
            while self.finished_runs_order.len() > FINISHED_RUNS_REMEMBERED {
                if let Some(old) = self.finished_runs_order.pop_front() {
                    self.finished_runs.remove(&old);
                }
            }
        }
        for share in &record.nodes {
            let id = (share.node.clone(), FinalRef::of(share));
            if self
                .recorded
                .insert(id.clone(), (key.clone(), share.ended))
                .is_none()
            {
                self.recorded_order.push_back(id);
            }
            if share.ended {
                self.ack(&share.node.clone(), FinalRef::of(share));
            }
        }
        while self.recorded_order.len() > RECORDED_SHARES_REMEMBERED {
            if let Some(old) = self.recorded_order.pop_front() {
                self.recorded.remove(&old);
            }
        }
    }

    /// The final shares to acknowledge, by node: call after this step's records (from
    /// [`Ledger::due`]) are written, never before.
    pub fn take_acks(&mut self) -> BTreeMap<String, Vec<FinalRef>> {
        std::mem::take(&mut self.acks)
            .into_iter()
            .map(|(node, refs)| (node, refs.into_iter().collect()))
            .collect()
    }

    /// Records written by this controller since it started (and loaded back from the
    /// log at start), oldest first; a run's latest revision only.
    pub fn recent(&self) -> impl DoubleEndedIterator<Item = &JobEnergyRecord> {
        self.recent.iter()
    }

    /// Records read back from the log at start: known, never written again (a later
    /// revision of a run replaces the earlier).
    pub fn load(&mut self, records: Vec<JobEnergyRecord>) {
        // Linear in the log: only the newest records can stay in the bounded memories
        // below, and only a later revision looks back for the one it replaces (within
        // the recent window, itself bounded as it fills).
        let skip = records.len().saturating_sub(LOADED_RECORDS);
        for r in records.into_iter().skip(skip) {
            let key = (r.job_id.clone(), r.run_start_unix_ms);
            let replaces = r.revision > 1;
            if let Some(at) = replaces
                .then(|| {
                    self.recent.iter().rposition(|old| {
                        old.job_id == r.job_id
                            && old.run_start_unix_ms == r.run_start_unix_ms
                            && old.revision < r.revision
                            && (r.run_start_unix_ms.is_some()
                                || old.nodes.iter().any(|s| {
                                    r.nodes.iter().any(|n| {
                                        n.node == s.node && n.from_unix_ms == s.from_unix_ms
                                    })
                                }))
                    })
                })
                .flatten()
            {
                self.recent.remove(at);
            }
            self.remember_record(&key, &r);
            self.recent.push_back(r);
            while self.recent.len() > RECENT_RECORDS {
                self.recent.pop_front();
            }
        }
        // Loaded records were acknowledged when written (or are re-sent and then
        // acknowledged as repeats).
        self.acks.clear();
        while self.recent.len() > RECENT_RECORDS {
            self.recent.pop_front();
        }
    }

    /// Running shares by job, for status.
    pub fn running_share(&self, job_id: &str) -> Vec<&NodeUsage> {
        self.pending
            .iter()
            .filter(|((id, _), _)| id == job_id)
            .flat_map(|(_, p)| p.shares.values())
            .collect()
    }
}

/// What `accounting` asks for: records that ended in `(since_ms, until_ms]`, of one
/// owner, tier or job, after a cursor.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RecordQuery {
    pub since_ms: Option<u64>,
    pub until_ms: Option<u64>,
    pub uid: Option<u32>,
    pub tier: Option<String>,
    pub job: Option<String>,
    pub after: Option<RecordCursor>,
    /// Slurm's account the jobs were charged to.
    pub account: Option<String>,
}

/// One page of `records` for `query`: in [`RecordCursor`] order, after `query.after`,
/// at most `limit`. Paging by the last record's cursor visits every record once, however
/// many end in the same millisecond.
pub fn records_page<'a>(
    records: impl Iterator<Item = &'a JobEnergyRecord>,
    query: &RecordQuery,
    limit: usize,
) -> Vec<JobEnergyRecord> {
    let mut matching: Vec<(RecordCursor, &JobEnergyRecord)> = records
        .filter(|r| query.since_ms.is_none_or(|t| r.to_unix_ms > t))
        .filter(|r| query.until_ms.is_none_or(|t| r.to_unix_ms <= t))
        .filter(|r| query.uid.is_none_or(|u| r.uid == u))
        .filter(|r| query.tier.as_ref().is_none_or(|t| &r.tier == t))
        .filter(|r| query.job.as_ref().is_none_or(|j| &r.job_id == j))
        .filter(|r| query.account.is_none() || r.account == query.account)
        .map(|r| (RecordCursor::of(r), r))
        .filter(|(c, _)| query.after.as_ref().is_none_or(|a| c > a))
        .collect();
    matching.sort_by(|a, b| a.0.cmp(&b.0));
    matching
        .into_iter()
        .take(limit)
        .map(|(_, r)| r.clone())
        .collect()
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
    use powerflex_core::slurm_record::SlurmJob;
    use powerflex_proto::usage::EnergySource;

    const RUN1_S: u64 = 1_000;
    const RUN1_MS: u64 = RUN1_S * 1000;

    fn share_at(job: &str, from_ms: u64, energy_mj: u64, ended: bool) -> NodeUsage {
        NodeUsage {
            job_id: job.into(),
            node: "whatever-the-agent-says".into(),
            uid: 1000,
            tier: "flex2".into(),
            gpus: vec![],
            energy_mj,
            energy_source: EnergySource::Counter,
            from_unix_ms: from_ms,
            to_unix_ms: from_ms + 10_000,
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
            bound_judgement: None,
            saved_estimate_j: None,
            work: None,
            work_unit: None,
            pfi: None,
            ended,
            simulated: false,
        }
    }

    /// A share of run 1 (its hold started 2 s after Slurm's start).
    fn share(job: &str, energy_mj: u64, ended: bool) -> NodeUsage {
        share_at(job, RUN1_MS + 2_000, energy_mj, ended)
    }

    fn report_of(share: NodeUsage) -> JobReport {
        JobReport {
            job_id: share.job_id.clone(),
            tier: "flex2".into(),
            owner_uid: Some(1000),
            usage: Some(share),
            ..JobReport::default()
        }
    }

    fn report(job: &str, energy_mj: u64) -> JobReport {
        report_of(share(job, energy_mj, false))
    }

    /// Slurm's placement: each job's nodes and the start of its current run, s.
    fn placed(jobs: &[(&str, &[&str], u64)]) -> SlurmJobs {
        jobs.iter()
            .map(|(id, nodes, start_s)| {
                (
                    id.to_string(),
                    SlurmJob {
                        nodes: nodes.iter().map(|n| n.to_string()).collect(),
                        uid: 1000,
                        state: SlurmJobState::OnItsNodes,
                        admin_comment: String::new(),
                        account: String::new(),
                        start_unix_s: Some(*start_s),
                    },
                )
            })
            .collect()
    }

    fn ledger(jobs: &[(&str, &[&str], u64)]) -> Ledger {
        let mut l = Ledger::new(true);
        l.placement(&placed(jobs));
        l
    }

    fn acks(l: &mut Ledger, node: &str) -> Vec<FinalRef> {
        l.take_acks().remove(node).unwrap_or_default()
    }

    #[test]
    fn a_two_node_job_is_written_once_both_final_shares_are_in_then_acknowledged() {
        let mut l = ledger(&[("7", &["n1", "n2"], RUN1_S)]);
        l.running("n1", [report("7", 10)].iter(), 0);
        l.running("n2", [report("7", 20)].iter(), 0);
        l.ended("n1", vec![share("7", 1_000, true)], 1_000, |_| None);
        assert!(l.due(1_000, |_| None).is_empty(), "n2 still runs");
        assert!(
            l.take_acks().is_empty(),
            "nothing acknowledged before its record"
        );
        // Re-sent, and a late running report: nothing changes.
        l.ended("n1", vec![share("7", 1_000, true)], 2_000, |_| None);
        l.running("n1", [report("7", 999)].iter(), 2_000);
        l.ended("n2", vec![share("7", 2_000, true)], 3_000, |_| None);
        let records = l.due(3_000, |_| Some(4242));
        assert_eq!(records.len(), 1);
        assert_eq!(records[0].energy_j, 3.0);
        assert_eq!(records[0].uid, 4242, "Slurm's owner, not the agents'");
        assert_eq!(records[0].run_start_unix_ms, Some(RUN1_MS));
        assert!(records[0].incomplete_nodes.is_empty());
        assert_eq!(
            records[0].nodes[0].node, "n1",
            "the sender, not the share's word"
        );
        let all = l.take_acks();
        let reference = FinalRef::of(&share("7", 0, true));
        assert_eq!(all.get("n1"), Some(&vec![reference.clone()]));
        assert_eq!(all.get("n2"), Some(&vec![reference.clone()]));
        // Re-sent after the record (its acknowledgement lost): acknowledged again,
        // written never again.
        l.ended("n2", vec![share("7", 2_000, true)], 4_000, |_| None);
        assert!(l.due(100_000, |_| None).is_empty());
        assert_eq!(acks(&mut l, "n2"), vec![reference]);
        assert_eq!(l.recent().count(), 1);
    }

    #[test]
    fn the_owner_is_slurm_s_never_the_share_s_word() {
        let mut l = ledger(&[("7", &["n1"], RUN1_S), ("8", &["n1"], RUN1_S)]);
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
        l.ended("n1", vec![forged_final], 1_000, |_| None);
        let r = l.due(1_000, |_| None);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].uid, 1000, "the placement's uid");
    }

    #[test]
    fn a_missing_final_share_is_waited_for_then_named() {
        let mut l = ledger(&[("7", &["n1", "n2"], RUN1_S)]);
        l.running("n1", [report("7", 10)].iter(), 0);
        l.running("n2", [report("7", 20)].iter(), 0);
        l.ended("n1", vec![share("7", 1_000, true)], 1_000, |_| None);
        assert!(l.due(1_000 + FINAL_WAIT_MS - 1, |_| None).is_empty());
        let r = l.due(1_000 + FINAL_WAIT_MS, |_| None);
        assert_eq!(r[0].incomplete_nodes, vec!["n2".to_string()]);
        assert_eq!(r[0].energy_j, 1.02);
    }

    /// A final share counts without a running share from the same node before it, and
    /// one arriving after the record amends it rather than being lost.
    #[test]
    fn a_final_share_without_a_running_one_is_taken_and_a_late_one_amends_the_record() {
        let mut l = ledger(&[("7", &["n1", "n2"], RUN1_S)]);
        // A short job: n1's agent never reported it running.
        l.ended("n1", vec![share("7", 1_000, true)], 1_000, |_| Some(1000));
        let r = l.due(1_000, |_| None);
        assert_eq!(r.len(), 1, "n1's share alone: every share it has is final");
        assert_eq!((r[0].energy_j, r[0].revision), (1.0, 1));
        assert_eq!(acks(&mut l, "n1").len(), 1);
        // n2's agent was down when the job ended; at its next start it sends its share.
        l.ended("n2", vec![share("7", 2_000, true)], 900_000, |_| None);
        let r = l.due(900_000, |_| None);
        assert_eq!(r.len(), 1, "the record again, complete");
        assert_eq!(
            (r[0].energy_j, r[0].revision, r[0].nodes.len()),
            (3.0, 2, 2)
        );
        assert_eq!(acks(&mut l, "n2").len(), 1);
        assert_eq!(l.recent().count(), 1, "the latest revision answers");
        // A node written as incomplete sends its final share late: amended too.
        let mut l = ledger(&[("8", &["n1", "n2"], RUN1_S)]);
        l.running("n1", [report("8", 10)].iter(), 0);
        l.running("n2", [report("8", 20)].iter(), 0);
        l.ended("n1", vec![share("8", 1_000, true)], 1_000, |_| None);
        let r = l.due(1_000 + FINAL_WAIT_MS, |_| None);
        assert_eq!(r[0].incomplete_nodes, vec!["n2".to_string()]);
        l.ended("n2", vec![share("8", 5_000, true)], 2_000_000, |_| None);
        let r = l.due(2_000_000, |_| None);
        assert_eq!((r[0].energy_j, r[0].revision), (6.0, 2));
        assert!(r[0].incomplete_nodes.is_empty());
        // Loaded back at a restart, the later revision replaces the earlier.
        let mut again = Ledger::new(true);
        let all: Vec<JobEnergyRecord> = l.recent().cloned().collect();
        let first = JobEnergyRecord {
            revision: 1,
            ..all[0].clone()
        };
        again.load(vec![first, all[0].clone()]);
        assert_eq!(again.recent().count(), 1);
        assert_eq!(again.recent().next().map(|r| r.revision), Some(2));
        assert!(again.take_acks().is_empty());
    }

    #[test]
    fn a_node_cannot_end_or_invent_a_share_slurm_did_not_place_on_it() {
        let mut l = ledger(&[("7", &["n1"], RUN1_S)]);
        l.running("n1", [report("7", 10)].iter(), 0);
        // n3 was never placed on job 7: its final share is refused.
        let refused = l.ended("n3", vec![share("7", 9_000_000, true)], 1_000, |_| Some(1));
        assert_eq!(refused.len(), 1);
        // Nor can it create job 8, which Slurm never listed.
        let refused = l.ended("n3", vec![share("8", 9_000_000, true)], 1_000, |_| Some(1));
        assert_eq!(
            refused[0].reason,
            "Slurm placed no run of this job on the node"
        );
        // A share from before the run started (another run's, or forged) is refused.
        let early = share_at("7", RUN1_MS - RUN_START_SKEW_MS - 1, 5, true);
        assert_eq!(l.ended("n1", vec![early], 1_000, |_| None).len(), 1);
        l.ended("n1", vec![share("7", 1_000, true)], 1_000, |_| None);
        let r = l.due(1_000, |_| None);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].energy_j, 1.0);
        assert_eq!(r[0].nodes.len(), 1);
        assert!(
            !l.take_acks().contains_key("n3"),
            "nothing acknowledged to n3"
        );
        // Placed earlier, gone from Slurm's list now: still known to have run on n1.
        let mut l = ledger(&[("9", &["n1"], RUN1_S)]);
        l.placement(&placed(&[]));
        l.ended("n1", vec![share("9", 7_000, true)], 1_000, |_| None);
        assert_eq!(l.due(1_000, |_| None).len(), 1);
    }

    /// A requeued job (same id) gets a record for each run, not only its first.
    #[test]
    fn each_run_of_a_requeued_job_gets_its_own_record() {
        const RUN2_S: u64 = RUN1_S + 300;
        let mut l = ledger(&[("7", &["n1"], RUN1_S)]);
        l.running("n1", [report("7", 10)].iter(), 0);
        l.ended("n1", vec![share("7", 1_000, true)], 100_000, |_| None);
        let first = l.due(100_000, |_| None);
        assert_eq!(first[0].run_start_unix_ms, Some(RUN1_MS));
        // Requeued: pending, then running again on n1 and n2.
        let mut pending = placed(&[("7", &[], RUN2_S)]);
        if let Some(j) = pending.get_mut("7") {
            j.state = SlurmJobState::Pending;
        }
        l.placement(&pending);
        l.placement(&placed(&[("7", &["n1", "n2"], RUN2_S)]));
        let run2 = |energy_mj, ended| share_at("7", RUN2_S * 1000 + 1_500, energy_mj, ended);
        l.running("n1", [report_of(run2(5, false))].iter(), 400_000);
        l.running("n2", [report_of(run2(6, false))].iter(), 400_000);
        // Run 1's final share re-sent meanwhile: acknowledged, nothing new.
        l.ended("n1", vec![share("7", 1_000, true)], 400_000, |_| None);
        assert!(l.due(400_000, |_| None).is_empty());
        l.ended("n1", vec![run2(4_000, true)], 500_000, |_| None);
        l.ended("n2", vec![run2(6_000, true)], 500_000, |_| None);
        let second = l.due(500_000, |_| None);
        assert_eq!(second.len(), 1, "run 2 has its own record");
        assert_eq!(second[0].run_start_unix_ms, Some(RUN2_S * 1000));
        assert_eq!((second[0].energy_j, second[0].nodes.len()), (10.0, 2));
        assert_eq!(l.recent().count(), 2);
        // Without Slurm's record, the next hold after a record is the next run too.
        let mut r = Ledger::new(false);
        r.running("n1", [report("7", 10)].iter(), 0);
        r.ended("n1", vec![share("7", 1_000, true)], 1_000, |_| None);
        assert_eq!(r.due(1_000, |_| None).len(), 1);
        r.ended("n1", vec![share("7", 1_000, true)], 2_000, |_| None);
        assert!(r.due(2_000, |_| None).is_empty(), "a repeat");
        r.running("n1", [report_of(run2(5, false))].iter(), 3_000);
        r.ended("n1", vec![run2(2_000, true)], 4_000, |_| None);
        let again = r.due(4_000, |_| None);
        assert_eq!((again.len(), again[0].energy_j), (1, 2.0));
    }

    /// Paging skips no record, even among records ending in the same ms (a cursor by
    /// `to_unix_ms` alone would).
    #[test]
    fn paging_by_cursor_visits_every_record_once_however_many_share_an_end() {
        let records: Vec<JobEnergyRecord> = (0..1_234u64)
            .map(|i| {
                let mut r = JobEnergyRecord::from_shares(
                    vec![share_at(&(5_000 - i).to_string(), 0, 1, true)],
                    vec![],
                    i,
                )
                .expect("record");
                // Three distinct ends only.
                r.to_unix_ms = 10_000 + i % 3;
                r
            })
            .collect();
        let mut query = RecordQuery::default();
        let mut seen = Vec::new();
        loop {
            let page = records_page(records.iter(), &query, 500);
            let Some(last) = page.last() else { break };
            query.after = Some(RecordCursor::of(last));
            seen.extend(page.iter().map(|r| r.job_id.clone()));
        }
        assert_eq!(seen.len(), records.len());
        let unique: BTreeSet<&String> = seen.iter().collect();
        assert_eq!(unique.len(), records.len(), "none twice");
        // The window still applies: (since, until].
        let query = RecordQuery {
            since_ms: Some(10_000),
            until_ms: Some(10_001),
            ..RecordQuery::default()
        };
        assert!(records_page(records.iter(), &query, 10_000)
            .iter()
            .all(|r| r.to_unix_ms == 10_001));
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
