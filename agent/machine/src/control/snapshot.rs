//! The status snapshot (also the metrics' source), and the part of it a user may see.

use powerflex_proto::status::{AgentMode, CalibrationState, PfiSource};
use powerflex_proto::usage::ThroughputUnit;

use super::{Agent, GpuProcess, GpuSlot, GpuView, Job, JobView, Snapshot};
use crate::calibration::Phase;

impl Agent {
    /// The status snapshot (also the metrics' source).
    pub(super) fn snapshot(&self, now: f64) -> Snapshot {
        Snapshot {
            node: self.settings.node.clone(),
            mode: if self.controller_mode() {
                AgentMode::Controller
            } else {
                AgentMode::Standalone
            },
            failsafe: self.failsafe_active(now),
            degraded: self.gpus.iter().any(|g| g.degraded.is_some()),
            progress_rejected: self.progress_rejected,
            config_error: self.config_error.clone(),
            cap_mismatches: self.cap_mismatches,
            leases_applied: self.leases_applied,
            curve_questions: self.curve_questions,
            controller_epoch: self.accepted_epoch,
            leases_refused_epoch: self.leases_refused_epoch,
            gpu_claims_refused: 0,
            gpu_foreign_use: self.gpu_foreign_use,
            gpus_owned_elsewhere: self.gpus_owned_elsewhere,
            enforce: self.settings.enforce,
            ended: self.unacked_finals(),
            gpus: self.gpus.iter().map(gpu_view).collect(),
            jobs: self.jobs.values().map(|j| self.job_view(now, j)).collect(),
        }
    }

    /// A job as status shows it.
    fn job_view(&self, now: f64, j: &Job) -> JobView {
        let cal = &j.calibration;
        // Estimated once: the curve shown, its points and the accounting's
        // all read it.
        let best = cal.best_curve();
        let curve = j.curve_of(best.as_ref());
        let (state, reason) = match &cal.phase {
            Phase::Warmup => (CalibrationState::Warmup, cal.waiting.clone()),
            Phase::Walking { .. } => (CalibrationState::Walking, None),
            Phase::Done => (CalibrationState::Done, None),
            Phase::Skipped(why) => (CalibrationState::Skipped, Some(why.clone())),
            // Not walked until it reports; status shows it as skipped, with
            // the reason saying a report starts it.
            Phase::NoSignal => (CalibrationState::Skipped, cal.waiting.clone()),
        };
        let rate = match j.log.last() {
            Some((t, _)) if now - t < 30.0 => j.log.rate(now - 10.0, now).map(|r| r.0),
            _ => None,
        };
        JobView {
            job: j.id.clone(),
            uid: j.uid,
            tier: j.request.to_string(),
            gpus: j
                .gpus
                .iter()
                .map(|&g| self.gpus[g as usize].identity.index)
                .collect(),
            steps: j.steps.iter().cloned().collect(),
            cap_w: j
                .gpus
                .first()
                .and_then(|&g| self.gpus[g as usize].applied.map(|w| w.0)),
            granted_w: self.granted_cap(now, j).map(|w| w.0),
            calibration: state,
            calibration_note: reason,
            calibration_level_w: cal.cap().map(|w| w.0),
            calibration_s: cal.duration_s(),
            calibration_cost: cal.cost,
            calibration_cost_pct: cal.cost_fraction().map(|f| 100.0 * f),
            points: j.points_of(&curve),
            curve,
            learned_windows: cal.windows.iter().filter(|w| w.learned).count() as u32,
            pfi: cal.pfi().or(j.restored_pfi),
            pfi_source: if cal.pfi().is_some() || j.restored_pfi.is_some() {
                Some(PfiSource::Measured)
            } else if j.prior.is_some() {
                Some(PfiSource::Prior)
            } else {
                None
            },
            prior_pfi: j.prior.map(|p| p.1),
            throughput: rate,
            throughput_unit: j.counts_tokens.map(|tokens| {
                if tokens {
                    ThroughputUnit::Tokens
                } else {
                    ThroughputUnit::Steps
                }
            }),
            power_w: self.job_power(j).map(|w| w.0),
            power_cap_w: self.job_sampled_cap(j).map(|w| w.0),
            // A probe holds the job below its grant: its draw and speed
            // there are not a drift from its curve at the grant.
            calibrating: cal.remeasuring() || cal.probing(),
            curve_in_question: cal.curve_in_question(),
            curve_implausible: cal.implausible.clone(),
            power_cap_steady_s: j
                .gpus
                .iter()
                .map(|&g| self.gpus[g as usize].cap_since.map(|t| now - t))
                .try_fold(f64::INFINITY, |low, s| s.map(|s| low.min(s)))
                .filter(|s| s.is_finite()),
            usage: Some(self.share_on(j, best, false)),
        }
    }
}

/// A GPU as status shows it.
fn gpu_view(g: &GpuSlot) -> GpuView {
    GpuView {
        index: g.identity.index,
        uuid: g.identity.uuid.clone(),
        name: g.identity.name.clone(),
        default_w: g.saved_default.0,
        cap_w: g.applied.map(|w| w.0),
        power_w: g.last.map(|s| s.power.0),
        energy_j: g
            .last
            .and_then(|s| s.energy_mj)
            .map(|mj| mj as f64 / 1000.0),
        job: g.job.clone(),
        degraded: g.degraded.clone(),
        would_cap_w: g.would_cap.map(|w| w.0),
        min_w: Some(g.identity.min_cap.0),
        max_w: Some(g.identity.max_cap.0),
        power_throttled: g.last.and_then(|s| s.power_throttled),
        processes: g
            .nvml_processes
            .iter()
            .map(|(pid, job)| GpuProcess {
                pid: *pid,
                job: job.clone(),
            })
            .collect(),
        unregistered_use: g.unregistered_since.is_some(),
        foreign_use: !g.foreign_jobs.is_empty(),
        foreign_jobs: g.foreign_jobs.iter().cloned().collect(),
        owned_elsewhere: g.owned_elsewhere.is_some(),
    }
}

/// The status `uid` may see (need-to-know): root sees everything; anyone else sees
/// the node's GPUs and counters, and of the jobs only their own (another user's job
/// ids, tiers and throughput are not theirs to know; the GPU rows keep the power a
/// GPU draws but not whose job runs on it, nor the processes NVML lists on it outside
/// their own jobs).
pub fn seen_by(status: &Snapshot, uid: u32) -> Snapshot {
    let mut seen = status.clone();
    if uid == 0 {
        return seen;
    }
    seen.jobs.retain(|j| j.uid == uid);
    seen.ended.retain(|u| u.uid == uid);
    let theirs = |id: &String| seen.jobs.iter().any(|j| &j.job == id);
    for gpu in &mut seen.gpus {
        if gpu.job.as_ref().is_some_and(|id| !theirs(id)) {
            gpu.job = None;
        }
        // Another user's process ids on a GPU tell what they run; processes in no job
        // are not this user's to know either.
        gpu.processes
            .retain(|p| p.job.as_ref().is_some_and(&theirs));
        gpu.foreign_jobs.retain(&theirs);
    }
    seen
}
