//! Slurm's placement: which of a node's words to believe, and a new read of it.

use tracing::{info, warn};

use powerflex_core::config::JobPlacement;
use powerflex_proto::report::validate_gpus;

use crate::error::MachineError;
use crate::placement::{bound_gpu_power, Placement, RefusedBecause};
use crate::preempt::Action;
use powerflex_core::slurm_record::SlurmJobState;

use super::Controller;

impl Controller {
    /// The placement the node's words are checked against: Slurm's, or none at all
    /// (`job_placement = "reports"`: every node believed). A shared handle, so the caller
    /// may hold it while it changes the sessions.
    pub(super) fn checked_placement(&self) -> Option<Option<std::sync::Arc<Placement>>> {
        match self.options.job_placement {
            JobPlacement::Slurm => Some(self.placement.clone()),
            JobPlacement::Reports => None,
        }
    }

    /// Recomputes what is believed of `node` from what it last said and the placement:
    /// whether its set of jobs changed, and the jobs refused.
    pub(super) fn believe(&mut self, node: &str) -> (bool, Vec<(String, RefusedBecause)>) {
        let checked = self.checked_placement();
        // Before Slurm's first answer, a node's GPUs are bounded by what it announced
        // before (the state file), and nothing is saved: its word alone is not kept.
        let known_gpus = self.state.nodes.get(node).map(Vec::len);
        let Some(s) = self.sessions.get_mut(node) else {
            return (false, Vec::new());
        };
        let unverified = matches!(checked, Some(None));
        let mut refused = Vec::new();
        let (jobs, gpus, refused_gpus) = match checked {
            None => (s.reported.clone(), s.announced.clone(), 0),
            Some(placement) => {
                let b = Placement::believe(placement.as_deref(), node, &s.reported, &s.announced);
                refused = b.refused;
                let (gpus, refused) = match (unverified, known_gpus) {
                    (true, Some(known)) => (
                        b.gpus.into_iter().take(known).collect::<Vec<_>>(),
                        s.announced.len().saturating_sub(known),
                    ),
                    _ => (b.gpus, b.gpus_refused),
                };
                (b.jobs, gpus, refused)
            }
        };
        let (gpus, clamped) = bound_gpu_power(&gpus, self.options.max_gpu_power_w);
        if clamped && s.view.gpus != gpus {
            warn!(
                node,
                max_gpu_power_w = self.options.max_gpu_power_w,
                "a node announced GPUs above the site's largest GPU model; counted at that model's limit"
            );
        }
        if refused_gpus > 0 && s.refused_gpus as usize != refused_gpus {
            let why = if unverified {
                "a node announced more GPUs than it had before, while Slurm's placement is not read yet; the rest are not counted"
            } else {
                "a node announced more GPUs than Slurm configures for it; the rest are not counted"
            };
            warn!(
                node,
                announced = s.announced.len(),
                believed = gpus.len(),
                "{why}"
            );
        }
        s.refused_gpus = refused_gpus as u32;
        let changed = s
            .view
            .jobs
            .iter()
            .map(|j| &j.job_id)
            .ne(jobs.iter().map(|j| &j.job_id));
        s.view.jobs = jobs;
        s.view.gpus = gpus.clone();
        // Only a list the committed state's own check accepts is kept: one it refuses
        // would make the whole state unloadable at the next start or takeover (every
        // event and budget with it). The node is still paid for (the allocation counts
        // a node whose GPUs fail that check as silent, at the most it may draw).
        if !unverified && self.state.nodes.get(node) != Some(&gpus) && validate_gpus(&gpus).is_ok()
        {
            self.state.nodes.insert(node.to_string(), gpus);
            self.dirty = true;
        }
        (changed, refused)
    }

    /// A new read of Slurm's placement: every node believed again against it.
    pub(super) fn placement_read(&mut self, read: Result<Placement, MachineError>) {
        match read {
            Ok(placement) => {
                if self.placement_error.take().is_some() {
                    info!(jobs = placement.jobs.len(), "Slurm's placement read again");
                }
                // Where each run is placed is remembered for its final shares, which
                // may come after Slurm has forgotten the job.
                self.ledger.placement(&placement.jobs);
                self.orphans = self.orphans_in(&placement);
                self.placement = Some(std::sync::Arc::new(placement));
                let nodes: Vec<String> = self.sessions.keys().cloned().collect();
                for node in nodes {
                    self.allocate_now |= self.believe(&node).0;
                }
            }
            Err(e) => {
                let e = e.to_string();
                if self.placement_error.as_deref() != Some(e.as_str()) {
                    warn!(error = %e, "cannot read Slurm's placement; the last one read stays in force");
                }
                self.placement_error = Some(e);
            }
        }
    }

    /// Jobs Slurm shows suspended, or requeued and held, by powerflex (its
    /// `AdminComment` says so) that the state in force does not hold: a deposed or paused
    /// leader's command that ran after the state this controller steers from was
    /// committed, or a command decided on a state never saved. Each is resumed or
    /// released once by this controller (a takeover builds a new one): held by nobody,
    /// it would stay stopped for ever.
    fn orphans_in(&mut self, placement: &Placement) -> Vec<Action> {
        self.reconciled
            .retain(|job| placement.jobs.contains_key(job));
        let mut out = Vec::new();
        for (id, job) in &placement.jobs {
            if self.state.preempted.contains_key(id) || self.reconciled.contains(id) {
                continue;
            }
            let ours = |how: &str| held_by_powerflex(job, how);
            let action = match job.state {
                SlurmJobState::Suspended if ours(";suspended:") => {
                    Action::Resume { job: id.clone() }
                }
                SlurmJobState::Pending if ours(";requeued:") => Action::Release { job: id.clone() },
                _ => continue,
            };
            warn!(job_id = %id, action = action.scontrol_args()[0], "Slurm shows a job held by powerflex that the state in force does not hold; giving it back");
            self.reconciled.insert(id.clone());
            out.push(action);
        }
        out
    }
}

/// Whether Slurm's record of `job` says powerflex holds it `how` (`";suspended:"` or
/// `";requeued:"` in its `AdminComment`, which only Slurm's admins and powerflex set).
pub(super) fn held_by_powerflex(job: &powerflex_core::slurm_record::SlurmJob, how: &str) -> bool {
    job.admin_comment
        .split(" | ")
        .any(|part| part.starts_with("powerflex;") && part.contains(how))
}
