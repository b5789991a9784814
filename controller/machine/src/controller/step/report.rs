//! An agent's report: what the node runs and draws, the caps it confirms, and the final
//! energy shares of its ended jobs.

use std::collections::{BTreeMap, BTreeSet};

use tracing::{debug, info, warn};

use powerflex_proto::report::JobReport;
use powerflex_proto::usage::NodeUsage;

use crate::placement::RefusedBecause;

use super::{Controller, Output};

/// How much a job's draw must rise between two reports of a node, under a cap that did
/// not rise and had held long enough for the draw to show it, to count as a new load: a
/// fraction of the earlier draw (the drift band; NVML's noise is about 1 %), and at
/// least [`DRAW_ROSE_MIN_W`] per GPU.
const DRAW_ROSE_FRACTION: f64 = 0.10;
const DRAW_ROSE_MIN_W: f64 = 10.0;
/// How long the cap must have held for a rising draw to be the job's and not the cap's, s
/// (the site's rule for a settled draw).
const DRAW_ROSE_CAP_HELD_S: f64 = 1.0;

/// Whether a job's draw rose from `old` to `new` (two reports of one node) under a cap
/// that did not rise: the job's load grew, not its cap.
fn draw_rose(old: &JobReport, new: &JobReport) -> bool {
    let (Some(from), Some(to)) = (old.power_w, new.power_w) else {
        return false;
    };
    let cap = |r: &JobReport| r.power_cap_w.or(r.cap_w);
    let cap_not_raised = match (cap(old), cap(new)) {
        (Some(a), Some(b)) => b <= a + 0.5,
        _ => false,
    };
    let settled = new
        .power_cap_steady_s
        .is_some_and(|s| s >= DRAW_ROSE_CAP_HELD_S);
    let gpus = f64::from(new.gpus.max(1));
    cap_not_raised
        && settled
        && to > from * (1.0 + DRAW_ROSE_FRACTION)
        && to - from > DRAW_ROSE_MIN_W * gpus
}

impl Controller {
    pub(super) fn report(&mut self, node: &str, jobs: Vec<JobReport>, power_w: f64, now_ms: u64) {
        // A report before a hello is dropped: the link only forwards reports from a
        // connection that said hello as this node.
        let Some(s) = self.sessions.get_mut(node) else {
            return;
        };
        let previous = s.view.jobs.clone();
        let previously_reported: BTreeSet<String> =
            s.reported.iter().map(|r| r.job_id.clone()).collect();
        s.reported = jobs;
        // What Slurm does not bear out is refused here, counted and logged, and never
        // reaches the allocation, the annotations, the preemptions or the status. Only a
        // change in the set of jobs needs a new allocation before the next tick.
        let (changed, refused) = self.believe(node);
        if !refused.is_empty() {
            // A job Slurm has not listed yet may just have started: read again now, once
            // per job newly reported (a node repeating a job Slurm does not know cannot
            // make the controller read Slurm every second).
            self.refresh_placement |= refused.iter().any(|(id, why)| {
                *why != RefusedBecause::NotOnThisNode && !previously_reported.contains(id)
            });
            if let Some(s) = self.sessions.get_mut(node) {
                let first = s.refused_reports == 0;
                // Before Slurm's first answer nobody is believed: no node's fault.
                s.refused_reports += refused
                    .iter()
                    .filter(|(_, why)| *why != RefusedBecause::NoPlacementYet)
                    .count() as u64;
                // Logged when a job first appears refused, not at every report.
                for (job_id, why) in &refused {
                    if *why != RefusedBecause::NoPlacementYet
                        && (first || !previously_reported.contains(job_id))
                    {
                        warn!(
                            node,
                            job_id,
                            why = why.label(),
                            "a node reported a job Slurm does not place on it; refused"
                        );
                    }
                }
            }
        }
        if let Some(s) = self.sessions.get(node) {
            self.ledger.running(node, s.view.jobs.iter(), now_ms);
        }
        let Some(s) = self.sessions.get_mut(node) else {
            return;
        };
        let jobs = &s.view.jobs;
        // The caps in force on the node, as its agent read them back: they confirm the
        // decreases a rollout waits for.
        let in_force: BTreeMap<String, f64> = jobs
            .iter()
            .filter_map(|j| {
                j.cap_w
                    .filter(|c| c.is_finite())
                    .map(|c| (j.job_id.clone(), c))
            })
            .collect();
        // A job whose draw rose under a cap that did not rise (a new phase, a new step
        // after an idle gap) makes every increase held for confirmation stale: it was
        // decided when that job drew less, and released now it would raise caps on
        // watts the job has just taken back. Budget first: drop them and allocate at
        // once on what the node says now.
        let rose = jobs.iter().find_map(|new| {
            let old = previous.iter().find(|o| o.job_id == new.job_id)?;
            draw_rose(old, new).then(|| (new.job_id.clone(), old.power_w, new.power_w))
        });
        // A job whose new step put its curve in question is planned at once on what
        // physics guarantees (see the decision's specs), not at the next period: its new
        // phase may be running past its bound at its old phase's cap meanwhile.
        let questioned: Vec<String> = jobs
            .iter()
            .filter(|new| {
                new.curve_in_question
                    && !previous
                        .iter()
                        .any(|o| o.job_id == new.job_id && o.curve_in_question)
            })
            .map(|j| j.job_id.clone())
            .collect();
        s.view.power_w = power_w;
        s.last_seen_ms = now_ms;
        s.reported_since_hello = true;
        self.rollout.confirm(node, &in_force);
        if let Some((job_id, from_w, to_w)) = rose {
            info!(
                node,
                job_id,
                from_w,
                to_w,
                "a job's draw rose under an unchanged cap; held increases dropped, allocating now"
            );
            self.rollout.drop_held();
            self.allocate_now = true;
        }
        if !questioned.is_empty() {
            info!(
                node,
                jobs = ?questioned,
                "a new step put a job's curve in question; allocating now"
            );
            self.allocate_now = true;
        }
        // An agent reports right after its hello; the first report after a restart
        // completes what the controller knows of the node.
        let first = self.awaiting.remove(node);
        self.allocate_now |= changed || first;
    }

    /// A node's final shares: checked as a whole (a malformed list is refused, logged
    /// and counted against the node), then each taken where Slurm placed its run on the
    /// node (see [`accounting`]).
    pub(super) fn final_shares(&mut self, node: &str, ended: Vec<NodeUsage>, now_ms: u64) {
        if ended.is_empty() {
            return;
        }
        if let Err(e) = powerflex_proto::report::validate_final_shares(&ended) {
            warn!(node, error = %e, "a node's final shares refused");
            if let Some(s) = self.sessions.get_mut(node) {
                s.refused_reports += 1;
            }
            return;
        }
        let placement = self.placement.clone();
        let refused = self.ledger.ended(node, ended, now_ms, |job| {
            placement
                .as_ref()
                .and_then(|p| p.jobs.get(job))
                .filter(|j| j.nodes.contains(node))
                .map(|j| j.uid)
        });
        for r in refused {
            // The agent re-sends it until acknowledged, or for a day: debug, not warn.
            debug!(node, job_id = %r.job_id, why = r.reason, "a node's final share refused");
        }
    }

    /// The energy records due now. (Not annotated: Slurm refuses `AdminComment` updates
    /// to a finished job; the running annotation carries the energy so far.)
    pub(super) fn write_records(&mut self, now_ms: u64, out: &mut Output) {
        let placement = self.placement.clone();
        let records = self.ledger.due(now_ms, |job| {
            placement
                .as_ref()
                .and_then(|p| p.jobs.get(job))
                .map(|j| j.uid)
        });
        for record in &records {
            self.energy_totals.add(record);
        }
        for record in &records {
            info!(
                job_id = %record.job_id,
                energy_j = record.energy_j,
                nodes = record.nodes.len(),
                incomplete = record.incomplete_nodes.len(),
                "job energy record"
            );
        }
        out.job_records = records;
        out.final_acks = self.ledger.take_acks();
    }
}
