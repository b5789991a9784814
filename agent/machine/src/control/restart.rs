//! Across a restart: the state saved for the next agent, and the previous run's jobs and
//! lease taken back from it (a job that ended while the agent was down gets its final
//! share).

use std::collections::{BTreeMap, BTreeSet};

use powerflex_core::curve::CapCurve;
use powerflex_core::flex::parse_power_flex;
use powerflex_core::point::OperatingPoint;
use powerflex_core::{UnixMs, Watts};
use powerflex_proto::usage::NodeUsage;

use super::Agent;
use crate::saved::{PersistedJob, PersistedLease, PersistedState};
use crate::usage::JobUsage;
use crate::JobKey;

impl Agent {
    /// What the agent keeps across a restart (see [`crate::saved`]): its GPUs' saved
    /// defaults, its jobs with their curves and accounting, the lease with its expiry on
    /// the wall clock, and the final shares not yet acknowledged.
    pub(super) fn saved_state(&self) -> PersistedState {
        PersistedState {
            node: self.settings.node.clone(),
            saved_defaults: self
                .gpus
                .iter()
                .map(|g| (g.identity.uuid.clone(), g.saved_default))
                .collect(),
            owned_elsewhere: self
                .gpus
                .iter()
                .filter_map(|g| Some((g.identity.uuid.clone(), g.owned_elsewhere?.counted)))
                .collect(),
            jobs: self
                .jobs
                .values()
                .map(|j| PersistedJob {
                    job_id: j.id.clone(),
                    uid: j.uid,
                    flex: j.request.to_string(),
                    gpus: j
                        .gpus
                        .iter()
                        .map(|&g| self.gpus[g as usize].identity.uuid.clone())
                        .collect(),
                    steps: j.steps.iter().cloned().collect(),
                    pfi: j.calibration.pfi().or(j.restored_pfi),
                    points: j.curve_points(),
                    from_stepd: j.cluster.is_some(),
                    cluster: j.cluster.clone().flatten(),
                    usage: Some(j.usage.clone()),
                })
                .collect(),
            lease: self.lease.as_ref().map(|l| PersistedLease {
                caps: l.caps.clone(),
                expires_unix_s: l.expires_at,
                start_cap_w: l.start_cap.map(|w| w.0),
            }),
            unacked_finals: self.unacked.clone(),
            controller_epoch: self.accepted_epoch,
        }
    }

    /// After a restart: the previous run's jobs that still run (`live`: the jobs whose
    /// step daemons the host shows, by id and cluster) are managed again with their
    /// curves and accounting (no second walk); a job that ended while the agent was down
    /// gets its final share from its saved hold and the counters read at
    /// `first_read_at` (a GPU in `busy` now runs another job's processes and is not
    /// charged to it), and its GPUs go back to their defaults at the first tick.
    pub(super) fn restore_saved_jobs(
        &mut self,
        now: f64,
        first_read_at: f64,
        jobs: Vec<PersistedJob>,
        live: &BTreeSet<JobKey>,
        busy: &BTreeSet<String>,
    ) {
        for job in jobs {
            // A job registered by a step daemon is told apart from other clusters' jobs
            // of the same id by that daemon's cluster; an older file's job by its id.
            let running = live.iter().any(|(id, cluster)| {
                id == &job.job_id && (!job.from_stepd || cluster == &job.cluster)
            });
            if !running {
                tracing::info!(job_id = %job.job_id, "job from the previous run has ended; its GPUs return to default");
                if let Some(usage) = job.usage.clone() {
                    let share = self.ended_while_down(
                        first_read_at,
                        &job.job_id,
                        job.uid,
                        &job.flex,
                        &job.points,
                        job.pfi,
                        usage,
                        busy,
                    );
                    tracing::info!(job_id = %job.job_id, energy_j = share.energy_mj as f64 / 1000.0, "final share of a job that ended while the agent was down");
                }
                continue;
            }
            let steps = if job.steps.is_empty() {
                vec!["0".to_string()]
            } else {
                job.steps.clone()
            };
            let node = self.settings.node.clone();
            for step in steps {
                if let Err(e) = self.register(
                    now,
                    &job.job_id,
                    &step,
                    job.uid,
                    &node,
                    &job.gpus,
                    &job.flex,
                ) {
                    tracing::warn!(job_id = %job.job_id, error = %e, "cannot restore job");
                }
            }
            if let Some(j) = self.jobs.get_mut(&job.job_id) {
                j.restored_pfi = job.pfi;
                j.restored_points = job.points.clone();
                if job.from_stepd {
                    j.cluster = Some(job.cluster.clone());
                }
                // The curve survives the restart: no second walk, no point of one
                // replacing it.
                j.calibration.restore(&job.points);
                // So does its accounting: the counters ran on, and the next readings
                // charge the restart's gap to the job.
                if let Some(mut usage) = job.usage.clone() {
                    usage.resumed();
                    j.usage = usage;
                }
                tracing::info!(job_id = %job.job_id, "job from the previous run is still running; managing it again");
            }
        }
    }

    /// A job of the previous run (from the state file) that ended while the agent was
    /// down: its final share from its persisted hold and a fresh reading of each of its
    /// GPUs' counters (the readings at start, taken at agent time `read_at`). A GPU that
    /// now runs another job's processes (`busy`, by UUID) is not read again: the job is
    /// charged up to its last persisted reading there, never another job's energy.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn ended_while_down(
        &mut self,
        read_at: f64,
        job_id: &str,
        uid: u32,
        flex: &str,
        points: &[OperatingPoint],
        pfi: Option<f64>,
        mut usage: JobUsage,
        busy: &BTreeSet<String>,
    ) -> NodeUsage {
        usage.resumed();
        let at_ms = UnixMs::from_secs_f64(read_at).ms();
        let holds: Vec<(String, bool)> = usage
            .gpus
            .iter()
            .map(|(uuid, h)| (uuid.clone(), h.released))
            .collect();
        for (uuid, released) in holds {
            if released || busy.contains(&uuid) {
                continue;
            }
            let Some(slot) = self.gpus.iter().find(|g| g.identity.uuid == uuid) else {
                continue;
            };
            if let Some(sample) = slot.last {
                usage.gpu_reading(
                    &uuid,
                    slot.identity.index,
                    at_ms,
                    sample.energy_mj,
                    sample.power,
                );
            }
        }
        let request = if flex.trim().is_empty() {
            None
        } else {
            parse_power_flex(flex, &self.settings.tiers).ok()
        };
        let curve = CapCurve::from_points(points).ok();
        let simulated = usage.gpus.keys().any(|u| {
            self.gpus
                .iter()
                .any(|g| &g.identity.uuid == u && g.identity.simulated)
        });
        let share = usage.share(
            job_id,
            &self.settings.node,
            uid,
            flex,
            curve.as_ref(),
            request
                .as_ref()
                .and_then(|r| r.service.max_slowdown())
                .map(|b| 100.0 * b.0),
            pfi,
            None,
            true,
            simulated,
        );
        self.keep_final(read_at, share.clone());
        share
    }

    /// The previous run's lease, from the state file: its caps bound the fail-safe and,
    /// while unexpired, grant what they granted, but it is not a current lease: the
    /// limits read back at start still bound every cap until the controller speaks.
    pub(super) fn restore_saved_lease(
        &mut self,
        now: f64,
        caps: BTreeMap<String, Watts>,
        ttl_s: f64,
        start_cap: Option<Watts>,
    ) {
        self.install_lease(now, caps, ttl_s, start_cap, false);
    }
}
