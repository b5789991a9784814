//! What the GPUs read and what NVML lists on them: samples (and limits changed behind
//! the agent's back), cap writes' outcomes, a job's power, and the processes that tell
//! a claimed GPU from a used one.

use std::collections::{BTreeMap, BTreeSet};

use powerflex_core::config::UnregisteredGpuUse;
use powerflex_core::{UnixMs, Watts};

use super::{Agent, CapMismatch, ForeignGpuUse, GpuProcesses, Job};
use crate::gpu::{ErrorClass, GpuError, GpuSample};

impl Agent {
    /// Records a GPU reading (or its failure). The limit read back is what the GPU
    /// enforces from now on, whatever the agent last wrote: when they differ, something
    /// else changed it, and the next tick writes the agent's cap again. That mismatch is
    /// returned (to log) and counted (metrics, status, the controller's report).
    pub(super) fn sampled(
        &mut self,
        now: f64,
        gpu: u32,
        result: Result<GpuSample, GpuError>,
    ) -> Option<CapMismatch> {
        let at_ms = UnixMs::from_secs_f64(now).ms();
        let slot = self.gpus.get_mut(gpu as usize)?;
        match result {
            Ok(s) => {
                let same_cap = slot.last.is_some_and(|l| (l.cap.0 - s.cap.0).abs() <= 0.5);
                if !same_cap {
                    slot.cap_since = Some(now);
                }
                slot.last = Some(s);
                if let Some(job) = slot.job.as_ref().and_then(|j| self.jobs.get_mut(j)) {
                    job.usage.gpu_reading(
                        &slot.identity.uuid,
                        slot.identity.index,
                        at_ms,
                        s.energy_mj,
                        s.power,
                    );
                }
                if self.awaiting_current_lease && slot.start_ceiling.is_none() {
                    slot.start_ceiling = Some(s.cap);
                }
                let mismatch = slot.mismatch(gpu, s.cap);
                // After a fault, or a change behind the agent's back, the limit on the
                // GPU is what it reads, not what was last written.
                slot.applied = Some(s.cap);
                slot.degraded = None;
                if let Some(m) = &mismatch {
                    self.cap_mismatches += 1;
                    self.note_lowered(now, m);
                }
                mismatch
            }
            Err(e) => {
                slot.last = None;
                slot.cap_since = None;
                if e.class != ErrorClass::Transient {
                    slot.degraded = Some(e.message);
                }
                None
            }
        }
    }

    /// A cap write succeeded; `found` is the limit read just before it (`None` when it
    /// could not be read). A limit other than the last one written or read was changed
    /// behind the agent's back since its last sample: counted and returned like a
    /// sampled one (a new grant written first would otherwise hide it).
    pub(super) fn cap_written(
        &mut self,
        now: f64,
        gpu: u32,
        cap: Watts,
        found: Option<Watts>,
    ) -> Option<CapMismatch> {
        let slot = self.gpus.get_mut(gpu as usize)?;
        let mismatch = found.and_then(|found| slot.mismatch(gpu, found));
        slot.applied = Some(cap);
        if let Some(m) = &mismatch {
            self.cap_mismatches += 1;
            self.note_lowered(now, m);
        }
        mismatch
    }

    /// A limit found changed behind the agent's back: lowered below what the agent wrote
    /// [`OWNER_OVERRIDES`](super::OWNER_OVERRIDES) times within
    /// [`OWNER_WINDOW_S`](super::OWNER_WINDOW_S), the GPU is taken as held by another
    /// power manager, and the agent stops writing it. A raised limit is only written back.
    fn note_lowered(&mut self, now: f64, m: &CapMismatch) {
        let Some(slot) = self.gpus.get_mut(m.gpu as usize) else {
            return;
        };
        if m.found.0 >= m.expected.0 {
            return;
        }
        slot.lowered_at
            .retain(|&t| now - t <= super::OWNER_WINDOW_S);
        slot.lowered_at.insert(0, now);
        slot.lowered_at.truncate(super::OWNER_OVERRIDES);
        if slot.owned_elsewhere.is_none() && slot.lowered_at.len() >= super::OWNER_OVERRIDES {
            slot.owned_elsewhere = Some(super::OwnedElsewhere {
                since: now,
                counted: m.found,
            });
            self.gpus_owned_elsewhere += 1;
            self.owned_changed = true;
            tracing::warn!(
                gpu = m.gpu,
                enforced_w = m.found.0,
                written_w = m.expected.0,
                times = super::OWNER_OVERRIDES,
                within_s = super::OWNER_WINDOW_S,
                "another power manager keeps this GPU's limit below powerflex's: powerflex stops writing it and counts it at its enforced limit until that limit rises to powerflex's cap"
            );
        }
    }

    /// A cap write failed: a permanent or lost-device failure degrades that GPU only.
    pub(super) fn cap_failed(&mut self, e: &GpuError) {
        if let Some(slot) = self.gpus.get_mut(e.index as usize) {
            if e.class != ErrorClass::Transient {
                slot.degraded = Some(e.message.clone());
            }
        }
    }

    /// The limit the job's GPUs read back in the samples that gave [`Self::job_power`], when
    /// they all agree.
    pub(super) fn job_sampled_cap(&self, job: &Job) -> Option<Watts> {
        let mut caps = job
            .gpus
            .iter()
            .map(|&g| self.gpus[g as usize].last.map(|s| s.cap));
        let first = caps.next()??;
        caps.all(|c| c.is_some_and(|c| (c.0 - first.0).abs() <= 0.5))
            .then_some(first)
    }

    pub(super) fn job_power(&self, job: &Job) -> Option<Watts> {
        let mut total = 0.0;
        for &g in &job.gpus {
            total += self.gpus[g as usize].last?.power.0;
        }
        Some(Watts(total))
    }

    /// The processes NVML lists on each GPU now, with the job each belongs to (from
    /// the agent's `/proc` reader; `None` for a process in no job). A GPU missing from `listed`
    /// (NVML could not list it) shows none rather than an old list.
    ///
    /// A GPU no registered job holds, with processes on it, is in unregistered use (a job
    /// whose registration failed, a process outside Slurm, a job's process on a GPU it
    /// did not register): with `agent.unregistered_gpu_use = "failsafe"` the next tick
    /// holds it at the fail-safe cap until NVML lists none. A GPU NVML could not list
    /// counts as unused: a listing that keeps failing (a driver that stopped supporting
    /// it) must not strand the cap.
    pub(super) fn nvml_processes_seen(
        &mut self,
        now: f64,
        listed: &BTreeMap<u32, Vec<(u32, Option<String>)>>,
    ) {
        let failsafe = self.settings.failsafe_cap;
        let capping = self.settings.unregistered_gpu_use == UnregisteredGpuUse::Failsafe;
        for (gpu, slot) in self.gpus.iter_mut().enumerate() {
            let processes = listed.get(&(gpu as u32)).cloned().unwrap_or_default();
            slot.nvml_processes = processes.clone();
            let unregistered = slot.job.is_none() && !processes.is_empty();
            match (slot.unregistered_since, unregistered) {
                (None, true) => {
                    slot.unregistered_since = Some(now);
                    tracing::warn!(
                        gpu,
                        pids = ?processes.iter().map(|p| p.0).collect::<Vec<_>>(),
                        jobs = ?processes.iter().filter_map(|p| p.1.clone()).collect::<Vec<_>>(),
                        cap_w = if capping { failsafe.0 } else { slot.saved_default.0 },
                        "processes use a GPU no registered job holds"
                    );
                }
                (Some(since), false) => {
                    slot.unregistered_since = None;
                    tracing::info!(
                        gpu,
                        lasted_s = now - since,
                        "the GPU's unregistered use ended"
                    );
                }
                _ => {}
            }
        }
    }

    /// Other jobs' processes that already ran on GPUs a step was just registered with
    /// ([`ForeignGpuUse`], held by the step's job now): the same foreign use the process
    /// scans find, noted at once so that it is counted, shown and logged from the
    /// registration, once, not only from the next scan. Returns the onsets, to log.
    pub(super) fn note_foreign_use_at_registration(
        &mut self,
        seen: Vec<ForeignGpuUse>,
    ) -> Vec<ForeignGpuUse> {
        let mut onsets = Vec::new();
        for r in seen {
            let Some(slot) = self.gpus.get_mut(r.gpu as usize) else {
                continue;
            };
            if slot.job.as_deref() != Some(r.holder.as_str()) {
                continue;
            }
            let used_by: BTreeSet<String> = r.used_by.iter().cloned().collect();
            let onset = slot.foreign_jobs.is_empty() && !used_by.is_empty();
            slot.foreign_jobs = used_by;
            if onset {
                onsets.push(r);
            }
        }
        self.gpu_foreign_use += onsets.len() as u64;
        onsets
    }

    /// What NVML says uses each GPU, as jobs (from the agent's `/proc` reader: the job each
    /// running process belongs to; processes in no job are left out). A GPU Slurm gave to a
    /// job stays that job's, capped as the job is, whatever else runs on it: processes of
    /// other jobs on it (a stray process, a debugger, a shared node) are foreign use,
    /// counted at each onset, logged and shown in status, and never hand the GPU back to
    /// its default (which would lift the holder's cap in the middle of a cut). GPUs NVML
    /// could not list keep what was last seen. Returns the onsets, to log.
    pub(super) fn check_gpu_use(&mut self, now: f64, listed: &GpuProcesses) -> Vec<ForeignGpuUse> {
        let none = BTreeSet::new();
        let mut onsets = Vec::new();
        for (gpu, slot) in self.gpus.iter_mut().enumerate() {
            let gpu = gpu as u32;
            // A GPU NVML listed with no job's process on it has none in `jobs`.
            let users = match listed.processes.contains_key(&gpu) {
                true => Some(listed.jobs.get(&gpu).unwrap_or(&none)),
                false => listed.jobs.get(&gpu),
            };
            let foreign: BTreeSet<String> = match (&slot.job, users) {
                (Some(holder), Some(users)) => {
                    // The holder's cluster, where known, tells its processes from those of
                    // a same-numbered job of another cluster.
                    let cluster = self.jobs.get(holder).and_then(|j| j.cluster.clone());
                    users
                        .iter()
                        .filter(|(job, c)| {
                            job != holder || cluster.as_ref().is_some_and(|hc| hc != c)
                        })
                        .map(|(job, _)| job.clone())
                        .collect()
                }
                (Some(_), None) => continue,
                (None, _) => BTreeSet::new(),
            };
            if foreign == slot.foreign_jobs {
                continue;
            }
            let was_foreign = !slot.foreign_jobs.is_empty();
            slot.foreign_jobs = foreign;
            match (was_foreign, slot.foreign_jobs.is_empty()) {
                (false, false) => onsets.push(ForeignGpuUse {
                    gpu,
                    holder: slot.job.clone().unwrap_or_default(),
                    used_by: slot.foreign_jobs.iter().cloned().collect(),
                }),
                (true, true) => tracing::info!(gpu, at_s = now, "the GPU's foreign use ended"),
                _ => {}
            }
        }
        self.gpu_foreign_use += onsets.len() as u64;
        onsets
    }
}
