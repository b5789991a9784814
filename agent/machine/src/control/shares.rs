//! The accounting: each job's share of this node's energy, its observations every
//! period, and the final shares kept until the controller acknowledges them.

use powerflex_core::curve::CapCurve;
use powerflex_core::UnixMs;
use powerflex_proto::usage::ThroughputUnit;
use powerflex_proto::usage::{FinalRef, NodeUsage};

use super::{Agent, GpuSlot, Job, UnackedFinal, MAX_ENDED_KEPT, UNACKED_FINAL_MAX_AGE_MS};
use crate::gpu::GpuSample;
use crate::usage::Observation;

impl Agent {
    /// The job's share on this node now (`ended`: final).
    pub(super) fn share(&self, job: &Job, ended: bool) -> NodeUsage {
        self.share_on(job, job.calibration.best_curve(), ended)
    }

    /// [`Agent::share`] on the job's best curve, already estimated.
    pub(super) fn share_on(&self, job: &Job, best: Option<CapCurve>, ended: bool) -> NodeUsage {
        let curve = best.or_else(|| CapCurve::from_points(&job.restored_points).ok());
        let work = job.counts_tokens.map(|tokens| {
            (
                job.usage.work_seen,
                if tokens {
                    ThroughputUnit::Tokens
                } else {
                    ThroughputUnit::Steps
                },
            )
        });
        let simulated = job
            .gpus
            .iter()
            .any(|&g| self.gpus[g as usize].identity.simulated)
            || job.usage.gpus.keys().any(|u| {
                self.gpus
                    .iter()
                    .any(|g| &g.identity.uuid == u && g.identity.simulated)
            });
        job.usage.share(
            &job.id,
            &self.settings.node,
            job.uid,
            &job.request.to_string(),
            curve.as_ref(),
            job.request.service.max_slowdown().map(|b| 100.0 * b.0),
            job.calibration.pfi().or(job.restored_pfi),
            work,
            ended,
            simulated,
        )
    }

    /// Keeps `share` (final) for the controller until it acknowledges it, and for the
    /// node's usage log.
    pub(super) fn keep_final(&mut self, now: f64, share: NodeUsage) {
        let reference = FinalRef::of(&share);
        self.unacked.retain(|u| FinalRef::of(&u.share) != reference);
        while self.unacked.len() >= MAX_ENDED_KEPT {
            let dropped = self.unacked.remove(0);
            tracing::warn!(
                job_id = %dropped.share.job_id,
                kept = MAX_ENDED_KEPT,
                "too many final shares unacknowledged by the controller; the oldest is dropped (the usage log has it)"
            );
        }
        self.unacked.push(UnackedFinal {
            ended_unix_ms: UnixMs::from_secs_f64(now).ms(),
            share: share.clone(),
        });
        self.pending_records.push(share);
    }

    /// The controller acknowledged these final shares (their records are written): they
    /// are no longer re-sent. Returns how many were dropped (then the state is to be
    /// saved).
    pub(super) fn acked(&mut self, finals: &[FinalRef]) -> usize {
        let before = self.unacked.len();
        self.unacked
            .retain(|u| !finals.contains(&FinalRef::of(&u.share)));
        before - self.unacked.len()
    }

    /// Drops the unacknowledged final shares older than [`UNACKED_FINAL_MAX_AGE_MS`] at
    /// `now`; returns how many.
    pub(super) fn expire_unacked(&mut self, now: f64) -> usize {
        let now_ms = UnixMs::from_secs_f64(now).ms();
        let before = self.unacked.len();
        self.unacked.retain(|u| {
            let keep = now_ms.saturating_sub(u.ended_unix_ms) < UNACKED_FINAL_MAX_AGE_MS;
            if !keep {
                tracing::warn!(
                    job_id = %u.share.job_id,
                    max_age_h = UNACKED_FINAL_MAX_AGE_MS / 3_600_000,
                    "a final share was never acknowledged by the controller; dropped (the usage log has it)"
                );
            }
            keep
        });
        before - self.unacked.len()
    }

    /// The final shares of jobs ended since the last call, to append to the node's
    /// usage log.
    pub(super) fn take_records(&mut self) -> Vec<NodeUsage> {
        std::mem::take(&mut self.pending_records)
    }

    /// The final shares the controller has not acknowledged, oldest first.
    pub(super) fn unacked_finals(&self) -> Vec<NodeUsage> {
        self.unacked.iter().map(|u| u.share.clone()).collect()
    }

    /// One observation of every job for its accounting (see [`crate::usage`]).
    pub(super) fn observe_usage(&mut self, now: f64) {
        let at_unix_ms = UnixMs::from_secs_f64(now).ms();
        let max_gap_ms = crate::usage::max_observation_gap_ms(self.sample_interval_ms);
        let ids: Vec<String> = self.jobs.keys().cloned().collect();
        for id in ids {
            let Some(job) = self.jobs.get(&id) else {
                continue;
            };
            let samples: Vec<(&GpuSlot, Option<GpuSample>)> = job
                .gpus
                .iter()
                .map(|&g| (&self.gpus[g as usize], self.gpus[g as usize].last))
                .collect();
            let capped = samples
                .iter()
                .any(|(slot, s)| s.is_some_and(|s| s.cap.0 < slot.saved_default.0 - 0.5));
            let power_throttled = samples
                .iter()
                .map(|(_, s)| s.and_then(|s| s.power_throttled))
                .collect::<Option<Vec<bool>>>()
                .filter(|v| !v.is_empty())
                .map(|v| v.iter().any(|t| *t));
            let observation = Observation {
                at_unix_ms,
                power_w: self.job_power(job).map(|w| w.0),
                cap_w: self.job_sampled_cap(job).map(|w| w.0),
                capped,
                in_event: self.event_in_force,
                power_throttled,
            };
            let work = job.log.last().map_or(0.0, |(_, w)| w);
            if let Some(job) = self.jobs.get_mut(&id) {
                job.usage.observe(observation, max_gap_ms);
                job.usage.work_reported(work);
            }
        }
    }
}
