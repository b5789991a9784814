//! The controller's lease: its epoch checked (fencing), its caps installed for at most
//! the site's lease TTL, and what it asks of the walks (end before an announced event,
//! walk again where measurements left the curve).

use std::collections::BTreeMap;

use powerflex_core::Watts;

use super::{Action, Agent, Lease, LeaseMessage, LeaseRefused};

impl Agent {
    /// Applies a lease from the controller (authenticated and bounded by the link): the
    /// event flag, the walks to repeat, the walks to end before an announced event, the
    /// caps and the jobs that may be probed. Returns what writes the caps now; the edge
    /// writes them and reads the written GPUs back.
    pub(super) fn apply_lease(&mut self, now: f64, lease: LeaseMessage) -> Vec<Action> {
        self.accepted_epoch = self.accepted_epoch.max(lease.epoch);
        self.event_in_force = lease.event_in_force;
        for (job_id, due) in self.recalibrate(now, &lease.recalibrate) {
            tracing::info!(
                job_id = %job_id,
                walk_in_s = due - now,
                "measurements left the job's curve: its old windows set aside, walking it again"
            );
        }
        if let Some(in_s) = lease.next_event_in_s {
            // Walks end before an announced event (pre-positioning).
            self.event_ahead(now, in_s);
        }
        self.set_lease(now, lease.caps, lease.ttl_s, lease.start_cap);
        self.learn = lease.learn.into_iter().collect();
        self.leases_applied += 1;
        self.tick(now)
    }

    /// Whether a lease of `epoch` may be applied: not when a controller of a higher
    /// epoch has steered this node (fencing). Equal epochs pass: the same controller's
    /// next lease, or the single controller's (epoch 0).
    pub(super) fn check_epoch(&self, epoch: u64) -> Result<(), LeaseRefused> {
        if epoch < self.accepted_epoch {
            Err(LeaseRefused::StaleEpoch {
                lease_epoch: epoch,
                accepted_epoch: self.accepted_epoch,
            })
        } else {
            Ok(())
        }
    }

    /// Installs a lease from the controller, valid for `ttl_s` (never longer than the
    /// site's lease TTL, whatever the message says). `start_cap` is the per-GPU cap for a
    /// managed job the lease does not name. A lease already expired (`ttl_s <= 0`, e.g.
    /// the previous run's after a restart) grants nothing, but its caps still bound the
    /// fail-safe: it never raises a job above its last grant.
    pub(super) fn set_lease(
        &mut self,
        now: f64,
        caps: BTreeMap<String, Watts>,
        ttl_s: f64,
        start_cap: Option<Watts>,
    ) {
        self.install_lease(now, caps, ttl_s, start_cap, true);
    }

    pub(super) fn install_lease(
        &mut self,
        now: f64,
        caps: BTreeMap<String, Watts>,
        ttl_s: f64,
        start_cap: Option<Watts>,
        current: bool,
    ) {
        let ttl = if ttl_s.is_finite() && ttl_s > 0.0 {
            ttl_s.min(self.settings.lease_ttl_s)
        } else {
            0.0
        };
        let valid = |w: &Watts| w.0.is_finite() && w.0 >= 0.0;
        if current && ttl > 0.0 {
            // A GPU taken back from another power manager stays at the limit it was
            // counted at until leases decided since it came back.
            for slot in &mut self.gpus {
                slot.take_back_ceiling = match slot.take_back_ceiling {
                    Some((c, left)) if left > 1 => Some((c, left - 1)),
                    _ => None,
                };
            }
            // A current lease decides the caps from now on: the limits read back at
            // start no longer bound them.
            self.awaiting_current_lease = false;
            for slot in &mut self.gpus {
                slot.start_ceiling = None;
            }
        }
        self.lease = Some(Lease {
            caps: caps.into_iter().filter(|(_, w)| valid(w)).collect(),
            expires_at: now + ttl,
            start_cap: start_cap.filter(valid),
        });
    }

    /// The controller announces a grid event starting `in_s` seconds from now: every
    /// job's calibration walk ends before it (see [`Calibration::finish_by`]).
    pub(super) fn event_ahead(&mut self, now: f64, in_s: f64) {
        if !(in_s.is_finite() && in_s >= 0.0) {
            return;
        }
        for job in self.jobs.values_mut() {
            job.calibration.finish_by(now, now + in_s);
        }
    }

    /// An announced event's plan needs these jobs at these per-GPU caps: each job's walk
    /// reaches down to its cap (never below its GPUs' lowest), see
    /// [`Calibration::reach_down_to`]. Returns whether any job was named.
    pub(super) fn pre_position(&mut self, now: f64, caps: &BTreeMap<String, Watts>) -> bool {
        let mut named = false;
        for (id, cap) in caps {
            let Some(job) = self.jobs.get(id) else {
                continue;
            };
            let Some(&first) = job.gpus.first() else {
                continue;
            };
            let lowest = self.gpus[first as usize].identity.min_cap;
            if let Some(job) = self.jobs.get_mut(id) {
                job.calibration
                    .reach_down_to(now, Watts(cap.0.max(lowest.0)));
                named = true;
            }
        }
        named
    }

    /// The controller found these jobs' measurements outside their curves (a new phase, a
    /// drift): each sets its old windows aside at once and is walked again as soon as the
    /// rate limit allows (see [`Calibration::rewalk`]). Never refused: a repeat while a
    /// walk is due changes nothing. Returns the jobs asked now, with when their walk is
    /// due.
    ///
    /// A walk started while the budget holds the job below its GPUs' maximum reads its
    /// levels against the grant's rate, not the uncapped one: it goes below the grant only
    /// as far as the chord under the curve shows the tier's bound held against uncapped
    /// (see `loss_below_ceiling` in the walk), so it need not wait for a grant at the
    /// maximum that a long cut may never give.
    pub(super) fn recalibrate(&mut self, now: f64, jobs: &[String]) -> Vec<(String, f64)> {
        let mut asked = Vec::new();
        for id in jobs {
            let Some(job) = self.jobs.get_mut(id) else {
                continue;
            };
            if let Some(due) = job.calibration.rewalk(now) {
                // A previous run's curve is the old phase's too.
                job.restored_points.clear();
                job.restored_pfi = None;
                asked.push((id.clone(), due));
            }
        }
        asked
    }
}
