//! Jobs come and go: a step's registration (checked against the GPUs Slurm gave it),
//! step and job ends, and jobs whose end never arrived, ended once their step daemons
//! are gone from the host.

use std::collections::BTreeSet;

use powerflex_core::flex::{parse_power_flex, Calibrate, FlexRequest};
use powerflex_core::gpus::{parse_gpu_list, GpuRef};
use powerflex_proto::usage::NodeUsage;

use super::{Agent, Job, Registered, ADOPTED_STEP, BATCH_STEP_NAME};
use crate::calibration::{Calibration, ProgressLog};
use crate::usage::JobUsage;
use crate::JobKey;
use crate::MachineError;

impl Agent {
    /// The slot of the GPU a registration names, by index or UUID.
    pub(super) fn slot_of(&self, gpu: &GpuRef) -> Option<usize> {
        self.gpus.iter().position(|g| match gpu {
            GpuRef::Index(i) => g.identity.index == *i,
            GpuRef::Uuid(u) => &g.identity.uuid == u,
        })
    }

    /// Registers a job step. Every step of a job registers; the first creates the job.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn register(
        &mut self,
        now: f64,
        job_id: &str,
        step_id: &str,
        uid: u32,
        node: &str,
        gpus: &[String],
        flex: &str,
    ) -> Result<Registered, MachineError> {
        let (request, indices) = self.checked_registration(now, job_id, node, gpus, flex)?;
        let managed = request.service.is_managed();
        let settings = self.settings.calibration.clone();
        let bound = request.service.max_slowdown().map(|b| b.0);
        let calibrate = request.calibrate == Calibrate::Auto;
        // A job taken back after a lost state file runs under the site's most flexible
        // tier (`persist::adoption_tier`); its next step's registration, from slurmstepd,
        // carries the tier it was submitted with, and that one holds from then on.
        // A job registered so far only by unmanaged steps (the plugin registers them as
        // `none`: a batch step under a site default of `none`) takes the first managed
        // step's request, as it did when unmanaged steps did not register: an `srun
        // --power-flex=flex2` step in such a job is managed. A `none` step in a managed
        // job leaves the job managed; its GPUs are the job's.
        if let Some(job) = self.jobs.get_mut(job_id) {
            let only_adopted = job.steps.len() == 1 && job.steps.contains(ADOPTED_STEP);
            let first_managed = !job.request.service.is_managed() && managed;
            if (only_adopted || first_managed) && job.request != request {
                job.request = request.clone();
                job.calibration =
                    Calibration::new(settings.clone(), bound, calibrate && managed, now);
            }
        }
        let job = self.jobs.entry(job_id.to_string()).or_insert_with(|| Job {
            id: job_id.to_string(),
            uid,
            request: request.clone(),
            gpus: Vec::new(),
            steps: BTreeSet::new(),
            log: ProgressLog::default(),
            calibration: Calibration::new(settings, bound, calibrate && managed, now),
            granted: None,
            registered_at: now,
            prior: None,
            restored_pfi: None,
            restored_points: Vec::new(),
            counts_tokens: None,
            seen_alive_at: None,
            cluster: None,
            warmup_logged_at: None,
            usage: JobUsage::default(),
        });
        let new_step = job.steps.insert(step_id.to_string());
        if new_step && job.request.service.is_managed() {
            // A new step may be a new phase: the curve is in question until a window
            // after it answers, and the controller hears of it at once.
            let asked = !job.calibration.curve_in_question();
            job.calibration.question_curve(now);
            if asked && job.calibration.curve_in_question() {
                self.curve_questions += 1;
            }
        }
        // The step runs under the job's request, which may not be the one it asked for
        // (a `none` step in a managed job): it is told that one.
        let (tier, job_managed) = (job.request.to_string(), job.request.service.is_managed());
        for i in indices {
            if !job.gpus.contains(&i) {
                job.gpus.push(i);
            }
        }
        let job_gpus = job.gpus.clone();
        self.hand_gpus_to(job_id, &job_gpus);
        self.finish_jobs_without_gpus(Some(job_id), now);
        Ok(Registered {
            tier,
            progress: job_managed.then(|| self.settings.progress_address.clone()),
        })
    }

    /// The request and the GPU slots a registration names, or why it is refused.
    /// Everything is checked before anything is recorded, so a refused step changes
    /// nothing.
    fn checked_registration(
        &self,
        now: f64,
        job_id: &str,
        node: &str,
        gpus: &[String],
        flex: &str,
    ) -> Result<(FlexRequest, Vec<u32>), MachineError> {
        if node != self.settings.node {
            return Err(MachineError::WrongNode {
                serves: self.settings.node.clone(),
                asked: node.to_string(),
            });
        }
        let request = if flex.trim().is_empty() {
            FlexRequest {
                service: self.settings.default_service.clone(),
                calibrate: Calibrate::Auto,
                preempt: None,
            }
        } else {
            parse_power_flex(flex, &self.settings.tiers)?
        };
        let refs = parse_gpu_list(&gpus.join(","))?;
        let mut indices = Vec::new();
        for r in &refs {
            match self.slot_of(r) {
                Some(i) => indices.push(i as u32),
                None => {
                    return Err(MachineError::NoSuchGpu {
                        gpu: r.clone(),
                        node: self.settings.node.clone(),
                    })
                }
            }
        }
        // Slurm gives a GPU to one job at a time: a step naming a GPU of a job that is
        // still running names GPUs Slurm did not give it.
        for &g in &indices {
            let slot = &self.gpus[g as usize];
            let running_owner = slot
                .job
                .as_ref()
                .filter(|o| o.as_str() != job_id)
                .and_then(|o| self.jobs.get(o))
                .filter(|o| {
                    o.seen_alive_at
                        .is_some_and(|t| now - t < self.settings.job_end_grace_s)
                });
            if let Some(owner) = running_owner {
                return Err(MachineError::GpuOfRunningJob {
                    gpu: slot.identity.index,
                    owner: owner.id.clone(),
                });
            }
        }
        Ok((request, indices))
    }

    /// `job_id` holds `gpus` from now on; another job that held one of them loses it.
    fn hand_gpus_to(&mut self, job_id: &str, gpus: &[u32]) {
        for &g in gpus {
            let slot = &mut self.gpus[g as usize];
            if let Some(other) = slot.job.as_ref().filter(|o| o.as_str() != job_id) {
                // Slurm gives a GPU to one job at a time: the other job's end was missed.
                // Its hold of the GPU ends here, so the counter's advance from now is
                // this job's only.
                let other = other.clone();
                let uuid = slot.identity.uuid.clone();
                if let Some(o) = self.jobs.get_mut(&other) {
                    o.gpus.retain(|x| *x != g);
                    o.usage.release_gpu(&uuid);
                }
            }
            self.gpus[g as usize].job = Some(job_id.to_string());
        }
    }

    /// A step ended. The job keeps its GPUs (other steps) until it ends. When the step is
    /// the batch script, Slurm completes the job (slurmstepd's `batch_finish` reports the
    /// script's end and slurmctld then stops the job's steps on every node): the job's
    /// final share here is made now and returned — the figures of the line at the end of
    /// the job's output, equal to the share the controller records. Its GPUs keep their
    /// caps until the job's end (the extern step's, or its step daemons gone): a step still
    /// running while Slurm stops it (a trapped SIGTERM, up to `KillWait`) draws no more
    /// than its cap.
    pub(super) fn end_step(
        &mut self,
        job_id: &str,
        step_id: &str,
        now: f64,
    ) -> Result<Option<NodeUsage>, MachineError> {
        // The share stays among the unacknowledged ones until the controller has its
        // record: a cancel's race (extern step first) is a second or so, well inside.
        let ended_here = |agent: &Agent| {
            agent
                .unacked
                .iter()
                .rev()
                .find(|u| u.share.job_id == job_id)
                .map(|u| u.share.clone())
        };
        let Some(job) = self.jobs.get_mut(job_id) else {
            // A cancelled job's steps end together: the extern step's end (or the scan
            // of step daemons) may have ended the job a moment before its batch step's
            // end arrives. Its final share is the same either way.
            if step_id == BATCH_STEP_NAME {
                if let Some(share) = ended_here(self) {
                    return Ok(Some(share));
                }
            }
            return Err(MachineError::NoSuchJob(job_id.to_string()));
        };
        job.steps.remove(step_id);
        if step_id != BATCH_STEP_NAME {
            return Ok(None);
        }
        self.close_share(job_id, now);
        Ok(ended_here(self))
    }

    /// Makes the job's final share here (once), keeping the job and its caps.
    pub(super) fn close_share(&mut self, job_id: &str, now: f64) {
        let Some(job) = self.jobs.get(job_id).filter(|j| !j.usage.closed) else {
            return;
        };
        let share = self.share(job, true);
        if let Some(job) = self.jobs.get_mut(job_id) {
            job.usage.closed = true;
        }
        self.keep_final(now, share);
    }

    /// The job ended: its GPUs return to their defaults on the next tick. Ending an
    /// unknown job is not an error (every epilog calls it, calibrated or not).
    pub(super) fn end_job(&mut self, job_id: &str, now: f64) -> bool {
        self.finish_job(job_id, now)
    }

    /// Ends `job_id` here: its GPUs are freed and its final share kept for the
    /// controller and the node's usage log.
    pub(super) fn finish_job(&mut self, job_id: &str, now: f64) -> bool {
        self.close_share(job_id, now);
        if self.jobs.remove(job_id).is_none() {
            return false;
        }
        for slot in &mut self.gpus {
            if slot.job.as_deref() == Some(job_id) {
                slot.job = None;
            }
        }
        true
    }

    /// Drops jobs left without GPUs (another job took them all), ending each.
    pub(super) fn finish_jobs_without_gpus(&mut self, keep: Option<&str>, now: f64) {
        let empty: Vec<String> = self
            .jobs
            .values()
            .filter(|j| j.gpus.is_empty() && Some(j.id.as_str()) != keep)
            .map(|j| j.id.clone())
            .collect();
        for id in empty {
            self.finish_job(&id, now);
        }
    }

    /// The cluster of the step daemon that registered `job_id` (see [`Job::cluster`]),
    /// seen at `now`: a registration from a live step daemon is a sighting of the job, so
    /// a job that ends before the next scan of the host's processes is still ended by it.
    pub(super) fn set_job_cluster(&mut self, job_id: &str, cluster: Option<String>, now: f64) {
        if let Some(job) = self.jobs.get_mut(job_id) {
            job.cluster = Some(cluster);
            job.seen_alive_at = Some(now);
        }
    }

    /// The jobs with step daemons on this host now (from the agent's `/proc` reader). A job seen
    /// alive before whose daemons have all been gone for `job_end_grace_s` has ended
    /// without its epilog reaching the agent (a busy agent, a failed connect, an empty
    /// `SLURMD_NODENAME`): it is ended here, and its GPUs go back to their defaults at the
    /// next tick. A job never seen alive (registered from elsewhere, or before the first
    /// scan) is left to its epilog. Returns the jobs ended.
    pub(super) fn jobs_alive(&mut self, now: f64, alive: &BTreeSet<JobKey>) -> Vec<String> {
        let grace = self.settings.job_end_grace_s;
        let mut gone = Vec::new();
        for job in self.jobs.values_mut() {
            let Some(cluster) = &job.cluster else {
                continue;
            };
            if alive.contains(&(job.id.clone(), cluster.clone())) {
                job.seen_alive_at = Some(now);
            } else if job.seen_alive_at.is_some_and(|t| now - t >= grace) {
                gone.push(job.id.clone());
            }
        }
        for id in &gone {
            self.end_job(id, now);
        }
        gone
    }

    /// Whether another job of a known cluster holds one of `gpus` here: only then can a
    /// registration find a job whose end was lost ([`Agent::hand_over_from_ended_jobs`]).
    pub(super) fn gpus_held_by_others(&self, job_id: &str, gpus: &[String]) -> bool {
        let Ok(refs) = parse_gpu_list(&gpus.join(",")) else {
            return false;
        };
        refs.iter().any(|r| {
            self.slot_of(r)
                .and_then(|i| self.gpus[i].job.as_ref())
                .filter(|holder| holder.as_str() != job_id)
                .and_then(|holder| self.jobs.get(holder))
                .is_some_and(|j| j.cluster.is_some())
        })
    }

    /// Before a step of `job_id`, registered by a live root `slurmstepd`, claims `gpus`:
    /// a job that holds one of them but has no step daemon left on the host (`alive`,
    /// read just now) has ended, its end lost (no `PrologFlags=Contain`, a missed
    /// epilog). Slurm gave its GPUs to the new job, so it is ended now rather than after
    /// `job_end_grace_s`, and the new job is not refused as "belongs to running job A"
    /// (then run unmanaged, and uncapped once A was ended). A holder of unknown cluster
    /// (registered by something other than a step daemon) is left alone. Returns the jobs
    /// ended.
    pub(super) fn hand_over_from_ended_jobs(
        &mut self,
        now: f64,
        job_id: &str,
        gpus: &[String],
        alive: &BTreeSet<JobKey>,
    ) -> Vec<String> {
        let Ok(refs) = parse_gpu_list(&gpus.join(",")) else {
            return Vec::new();
        };
        let mut ended = Vec::new();
        for r in &refs {
            let Some(slot) = self.slot_of(r).map(|i| &self.gpus[i]) else {
                continue;
            };
            let Some(holder) = slot.job.as_ref().filter(|h| h.as_str() != job_id) else {
                continue;
            };
            let Some(cluster) = self.jobs.get(holder).and_then(|j| j.cluster.clone()) else {
                continue;
            };
            if !alive.contains(&(holder.clone(), cluster)) && !ended.contains(holder) {
                ended.push(holder.clone());
            }
        }
        for id in &ended {
            self.end_job(id, now);
        }
        ended
    }
}
