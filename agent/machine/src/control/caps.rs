//! Which cap each GPU gets: a job's grant (the controller's lease while it lasts, then
//! the fail-safe, which never raises a cap), the limits read back at start that bound
//! every cap until a current lease (fail-static through a restart), the writes that
//! reconcile the GPUs with all that, and what a stop leaves on them (what is in force).

use powerflex_core::config::UnregisteredGpuUse;
use powerflex_core::workload::chord_safe_cap_w;
use powerflex_core::Watts;

use super::{Action, Agent, Job};
use crate::gpu::GpuIdentity;

impl Agent {
    /// The per-GPU cap the job should run at now (before calibration lowers it).
    pub(super) fn granted_cap(&self, now: f64, job: &Job) -> Option<Watts> {
        if !job.managed() {
            return None;
        }
        if self.controller_mode() {
            let failsafe = self.settings.failsafe_cap;
            // A job the controller has not granted a cap yet (it started since the last
            // lease) runs at the lease's start cap, never above the fail-safe: the budget
            // was split without it, and uncapped it could carry the site over.
            // When the lease runs out, every job falls to the fail-safe cap, or stays at
            // its last grant when that is lower: the fail-safe never raises a cap (a cut
            // below it must hold while the controller is away).
            //
            //
            // While the controller is there, a job it has not named yet must not break its
            // tier either: it has no curve the budget was checked against, so it runs no
            // lower than the cap the physics shows safe for its bound
            // ([`Agent::tier_safe_cap`]); the next allocation pays for it. Once the lease
            // has run out (or before the first one) the fail-safe is the site's word on
            // power while the controller is away, and it stands.
            let safe = self.tier_safe_cap(job);
            let at_least_safe = |cap: Watts| safe.map_or(cap, |s| Watts(cap.0.max(s.0)));
            return Some(match &self.lease {
                Some(lease) => {
                    let unnamed = lease.start_cap.map_or(failsafe, |s| s.min(failsafe));
                    match lease.caps.get(&job.id).copied() {
                        Some(cap) if now < lease.expires_at => cap,
                        Some(cap) => cap.min(failsafe),
                        None if now < lease.expires_at => at_least_safe(unnamed),
                        None => unnamed,
                    }
                }
                None => failsafe,
            });
        }
        job.granted
    }

    /// The lowest per-GPU cap at which `job` certainly holds its tier's bound whatever its
    /// curve ([`chord_safe_cap_w`] over its GPUs' range); `None` for a job with no bound.
    /// flex0 (a bound of 0) gets its GPUs' maximum.
    pub(super) fn tier_safe_cap(&self, job: &Job) -> Option<Watts> {
        let bound = job.calibration.bound?;
        let identity = &self.gpus.get(*job.gpus.first()? as usize)?.identity;
        Some(Watts(chord_safe_cap_w(
            bound,
            identity.min_cap.0,
            identity.max_cap.0,
        )))
    }

    /// Whether the controller's lease has run out (controller mode only).
    pub(super) fn failsafe_active(&self, now: f64) -> bool {
        self.controller_mode()
            && match &self.lease {
                Some(lease) => now >= lease.expires_at,
                None => now - self.started_at >= self.settings.lease_ttl_s,
            }
    }

    /// Cap writes for a stop (fail-static): none. Every GPU keeps the limit in force, the
    /// GPUs of running managed jobs, those held at the fail-safe for unregistered use and
    /// idle ones alike, so a `systemctl restart` or an upgrade during a cut never
    /// over-draws the site (as a BMC keeps its last limit through an outage); only a
    /// job's end gives its GPUs their defaults back. The next agent takes them over from
    /// the state file and the limits it reads back (`start_ceiling`), and releases a GPU
    /// of no managed job once the lease would have run out. With `release_jobs`
    /// (decommissioning: `powerflexd --release-on-exit`), every GPU goes back to its
    /// default.
    pub(super) fn stop_actions(&self, release_jobs: bool) -> Vec<Action> {
        if !self.settings.enforce || !release_jobs {
            return Vec::new();
        }
        self.gpus
            .iter()
            .filter(|g| g.degraded.is_none())
            .map(|g| Action::SetCap {
                gpu: g.identity.index,
                cap: clamp(g.saved_default, &g.identity),
            })
            .collect()
    }
}

/// `cap` within what the GPU accepts.
fn clamp(cap: Watts, identity: &GpuIdentity) -> Watts {
    Watts(cap.0.clamp(identity.min_cap.0, identity.max_cap.0))
}

impl Agent {
    /// The cap writes that bring every GPU to its desired cap (see [`Agent::desired_cap`]);
    /// in observe mode none, and each GPU shows what would be written.
    pub(super) fn cap_writes(&mut self, now: f64) -> Vec<Action> {
        let mut actions = Vec::new();
        let failsafe_now = self.failsafe_active(now);
        for gpu in 0..self.gpus.len() {
            let Some(desired) = self.desired_cap(now, gpu, failsafe_now) else {
                continue;
            };
            if !self.settings.enforce {
                // Observe mode: what would be written is shown, never written.
                self.gpus[gpu].would_cap = Some(desired);
                continue;
            }
            // Another power manager holding it lower is not fought; one taken back from
            // it gets no more than it was counted at.
            let Some(desired) = self.writable(now, gpu, desired) else {
                continue;
            };
            if self.gpus[gpu]
                .applied
                .is_none_or(|a| (a.0 - desired.0).abs() > 0.5)
            {
                actions.push(Action::SetCap {
                    gpu: gpu as u32,
                    cap: desired,
                });
            }
        }
        actions
    }

    /// What GPU `gpu` may be written now, `desired` at most: nothing while another power
    /// manager holds its limit below the agent's (see [`super::OWNER_OVERRIDES`]) and no
    /// higher than the limit the node's report counts it at. Once the limit it reads rises
    /// past that (the other manager raised it or let go) or reaches `desired`, the agent
    /// takes it back, and for [`super::TAKE_BACK_LEASES`] leases writes it no higher than
    /// the limit it was counted at ([`super::GpuSlot::take_back_ceiling`]): the controller
    /// gave the difference to other jobs.
    fn writable(&mut self, now: f64, gpu: usize, desired: Watts) -> Option<Watts> {
        let controller_mode = self.controller_mode();
        let slot = &mut self.gpus[gpu];
        if let Some(held) = slot.owned_elsewhere {
            let read = slot.last?.cap;
            if read.0 <= held.counted.0 + 0.5 {
                // Still held at or below what the report counts: a lower limit is counted
                // lower from now on.
                slot.owned_elsewhere = Some(super::OwnedElsewhere {
                    counted: Watts(read.0.min(held.counted.0)),
                    ..held
                });
                if read.0 + 0.5 < desired.0 {
                    return None;
                }
            }
            slot.owned_elsewhere = None;
            slot.lowered_at.clear();
            // In standalone mode the agent's own split counts the GPU in its job again at
            // once.
            slot.take_back_ceiling =
                controller_mode.then_some((held.counted, super::TAKE_BACK_LEASES));
            self.owned_changed = true;
            tracing::info!(
                gpu,
                limit_w = read.0,
                cap_w = desired.0,
                held_elsewhere_s = now - held.since,
                "this GPU's limit rose past the one it was counted at, or to powerflex's cap: the other power manager let go, and powerflex writes it again"
            );
        }
        Some(match self.gpus[gpu].take_back_ceiling {
            Some((ceiling, _)) => Watts(desired.0.min(ceiling.0)),
            None => desired,
        })
    }

    /// The cap GPU `gpu` should have now, clamped to what it accepts; `None` where it is
    /// not to be written (degraded, or never read while the limits read back at start
    /// bound the caps). `failsafe_now`: the controller's lease has run out.
    fn desired_cap(&self, now: f64, gpu: usize, failsafe_now: bool) -> Option<Watts> {
        let slot = &self.gpus[gpu];
        if slot.degraded.is_some() {
            return None;
        }
        let job = slot.job.as_ref().and_then(|j| self.jobs.get(j));
        let desired = match job {
            None if slot.unregistered_since.is_some()
                && self.settings.unregistered_gpu_use == UnregisteredGpuUse::Failsafe =>
            {
                Watts(slot.saved_default.0.min(self.settings.failsafe_cap.0))
            }
            None => slot.saved_default,
            Some(job) if !job.managed() => slot.saved_default,
            Some(job) => {
                let granted = self.granted_cap(now, job).unwrap_or(slot.identity.max_cap);
                match job.calibration.cap() {
                    Some(level) => granted.min(level),
                    None => granted,
                }
            }
        };
        // Until a current lease arrives, no GPU rises above what it read back at start:
        // the previous run's cap holds through a restart, for the jobs this agent
        // manages and for any it could not take back (a lost or stale state file).
        // A GPU of no managed job is released once the lease would have run out
        // anyway (the fail-safe regime, where idle GPUs are at their default); a
        // managed job's GPU only by a current lease.
        let managed = job.is_some_and(|j| j.managed());
        let held = self.awaiting_current_lease && (managed || !failsafe_now);
        let desired = match slot.start_ceiling {
            Some(ceiling) if held => Watts(desired.0.min(ceiling.0)),
            // Its limit was never read (a transient error at start): a managed job's
            // GPU gets no more than the fail-safe (a write that can only lower what
            // the budget counted); any other GPU is not written until it is read.
            None if held && managed => Watts(desired.0.min(self.settings.failsafe_cap.0)),
            None if held => return None,
            _ => desired,
        };
        Some(clamp(desired, &slot.identity))
    }
}
