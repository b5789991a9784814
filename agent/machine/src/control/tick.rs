//! One control period ([`AgentInput::Tick`](super::AgentInput::Tick)): every job's
//! calibration advances on what its GPUs read, the accounting observes every job, the
//! node budget is split (standalone mode), and the caps are reconciled with the GPUs.

use powerflex_core::Watts;

use super::{Action, Agent, Job, WARMUP_LOG_AFTER_S, WARMUP_LOG_EVERY_S};
use crate::calibration::{Phase, StepAnswer};

/// What a job's GPUs read and what it is granted, gathered before its calibration
/// advances (the calibration is then borrowed mutably with the job).
struct JobReadings {
    /// The job's summed GPU power, when every GPU of it was read.
    power: Option<Watts>,
    /// The mean memory utilisation of its GPUs that were read, fraction.
    memory_util: Option<f64>,
    /// The job's mean SM clock now, MHz, when every GPU of it says.
    sm_clock: Option<f64>,
    /// Its grant, when that is below the level its walk holds.
    held_below: Option<Watts>,
    /// The cap the job's GPUs read back, and since when it has held on all of them.
    held: Option<(Watts, f64)>,
    granted: Option<Watts>,
    /// The lowest cap a probe may hold it at (its first GPU's minimum).
    probe_floor: Option<Watts>,
    /// The controller's last lease lets this agent probe the job.
    may_probe: bool,
}

impl Agent {
    /// One control period: advance calibrations, allocate, and return the cap writes
    /// needed to reach the desired caps.
    pub(super) fn tick(&mut self, now: f64) -> Vec<Action> {
        let mut changed = false;
        let ids: Vec<String> = self.jobs.keys().cloned().collect();
        for id in &ids {
            changed |= self.advance_calibration(now, id);
        }
        self.observe_usage(now);
        if let Some(budget) = self.settings.node_budget {
            self.allocate_node_budget(budget);
        }
        let mut actions = self.cap_writes(now);
        // Final shares the controller never acknowledged go after a day (the state
        // file then drops them too).
        changed |= self.expire_unacked(now) > 0;
        changed |= std::mem::take(&mut self.owned_changed);
        if changed {
            actions.push(Action::Persist);
        }
        actions
    }

    /// Advances job `id`'s calibration on what its GPUs read now; returns whether its
    /// phase changed (the state is then to be saved).
    fn advance_calibration(&mut self, now: f64, id: &str) -> bool {
        let Some(readings) = self.jobs.get(id).map(|j| self.readings_of(now, j)) else {
            return false;
        };
        let step = self.settings.cap_step;
        let prior = (self.settings.prior_intercept, self.settings.prior_slope);
        let Some(job) = self.jobs.get_mut(id) else {
            return false;
        };
        // Before anything below can end the walk (a grant held below its level does), so
        // every end is seen and logged.
        let before = job.calibration.phase.clone();
        job.feed_calibration(now, &readings, step);
        let changed = job.calibration.phase != before;
        if changed {
            job.phase_changed(now, &before);
        }
        job.log_long_warmup(now);
        job.take_telemetry_prior(readings.memory_util, prior);
        changed
    }

    /// What `job`'s GPUs read now and what it is granted (see [`JobReadings`]).
    fn readings_of(&self, now: f64, job: &Job) -> JobReadings {
        let memory_util = {
            let utils: Vec<f64> = job
                .gpus
                .iter()
                .filter_map(|&g| {
                    self.gpus[g as usize]
                        .last
                        .map(|s| f64::from(s.memory_util_pct) / 100.0)
                })
                .collect();
            (!utils.is_empty()).then(|| utils.iter().sum::<f64>() / utils.len() as f64)
        };
        let clocks: Option<Vec<f64>> = job
            .gpus
            .iter()
            .map(|&g| {
                self.gpus[g as usize]
                    .last
                    .map(|s| f64::from(s.sm_clock_mhz))
                    .filter(|&c| c > 0.0)
            })
            .collect();
        let sm_clock = clocks
            .filter(|c| !c.is_empty())
            .map(|c| c.iter().sum::<f64>() / c.len() as f64);
        let granted = self.granted_cap(now, job);
        let held_below = match (job.calibration.cap(), granted) {
            (Some(level), Some(granted)) if granted.0 < level.0 - 0.5 => Some(granted),
            _ => None,
        };
        let held = self.job_sampled_cap(job).and_then(|cap| {
            let since = job
                .gpus
                .iter()
                .map(|&g| self.gpus[g as usize].cap_since)
                .try_fold(f64::NEG_INFINITY, |late, s| s.map(|s| late.max(s)))?;
            Some((cap, since))
        });
        let probe_floor = job
            .gpus
            .first()
            .and_then(|&g| self.gpus.get(g as usize))
            .map(|first| first.identity.min_cap);
        JobReadings {
            power: self.job_power(job),
            memory_util,
            sm_clock,
            held_below,
            held,
            granted,
            probe_floor,
            may_probe: self.controller_mode() && self.learn.contains(&job.id),
        }
    }
}

impl Job {
    /// Hands the job's calibration this period's readings: a grant held below the walk's
    /// level, learning in operation, probes, the SM clock, then the walk itself (each
    /// window it reads is logged).
    fn feed_calibration(&mut self, now: f64, r: &JobReadings, step: Watts) {
        if let Some(granted) = r.held_below {
            self.calibration.held_below_level(now, granted);
        } else if let Some(granted) = r.granted {
            self.calibration.held_above_level(now, granted);
        }
        match self
            .calibration
            .observe_operation(now, &self.log, r.power, r.held)
        {
            Some(StepAnswer::SameCurve) => {
                tracing::info!(job_id = %self.id, "the job's new step runs on its curve");
            }
            Some(StepAnswer::LeftCurve {
                cap,
                throughput_ratio,
                power_ratio,
            }) => {
                // A previous run's curve is the old phase's too.
                self.restored_points.clear();
                self.restored_pfi = None;
                tracing::info!(
                    job_id = %self.id,
                    cap_w = cap.0,
                    throughput_ratio,
                    power_ratio,
                    "the job's new step left its curve (a new phase): its old windows set aside, walking it again"
                );
            }
            Some(StepAnswer::Unanswered { open_s }) => {
                tracing::info!(
                    job_id = %self.id,
                    open_s,
                    "no steady window since the job's new step: its curve is no longer in question; the controller's drift check judges it"
                );
            }
            None => {}
        }
        self.calibration.check_probe(now, r.granted);
        if let (true, Some(granted), Some(floor)) = (r.may_probe, r.granted, r.probe_floor) {
            self.calibration.consider_probe(now, granted, step, floor);
        }
        if let Some(mhz) = r.sm_clock {
            self.calibration.observe_clock(now, mhz);
        }
        // Each window the walk reads is logged: a curve that came out wrong (a rate far
        // off, a flat top) can then be traced to the window that made it.
        let walked = self.calibration.tick(now, &self.log, r.power);
        // Every window read this period (walk and operation) judges the bound, in the
        // accounting, which is saved with the job and outlives the windows.
        let bound_pct = self.request.service.max_slowdown().map(|b| 100.0 * b.0);
        for window in self.calibration.take_judged() {
            self.usage.window_judged(window, bound_pct);
        }
        if let Some(window) = walked {
            tracing::info!(
                job_id = %self.id,
                cap_w = window.cap.0,
                power_w = window.power.0,
                throughput = window.throughput,
                relative_noise = window.relative_noise,
                "calibration window read"
            );
        }
    }

    /// The calibration left phase `before`: logged, and a job that reports at last is
    /// taken off the telemetry prior.
    fn phase_changed(&mut self, now: f64, before: &Phase) {
        match &self.calibration.phase {
            Phase::Done => tracing::info!(
                job_id = %self.id,
                levels = self.calibration.levels().len(),
                pfi = self.calibration.pfi(),
                "calibration walk done"
            ),
            Phase::Skipped(why) => tracing::info!(
                job_id = %self.id,
                why = why.as_str(),
                "calibration walk skipped"
            ),
            Phase::NoSignal => tracing::info!(
                job_id = %self.id,
                waited_s = now - self.calibration.registered_at,
                "no progress report yet: planned on the telemetry prior until the job reports"
            ),
            Phase::Warmup if *before == Phase::NoSignal => {
                // Planned as every job that reports is until its walk ends (the site's
                // prior), not on a telemetry reading frozen now.
                self.prior = None;
                tracing::info!(
                    job_id = %self.id,
                    waited_s = now - self.calibration.registered_at,
                    "the job's first progress report came: calibrating it"
                )
            }
            Phase::Walking { .. } | Phase::Warmup => {}
        }
    }

    /// A warm-up that lasts says why, now and then, so a job that never leaves it
    /// leaves the reason in the log. Counted from the first report when it came late
    /// (after NoSignal), so a job that just began reporting is not logged as long in
    /// warm-up.
    fn log_long_warmup(&mut self, now: f64) {
        let warming_since = self
            .log
            .first_time()
            .map_or(self.calibration.registered_at, |t| {
                t.max(self.calibration.registered_at)
            });
        if self.calibration.phase == Phase::Warmup
            && now - warming_since >= WARMUP_LOG_AFTER_S
            && self
                .warmup_logged_at
                .is_none_or(|t| now - t >= WARMUP_LOG_EVERY_S)
        {
            self.warmup_logged_at = Some(now);
            tracing::info!(
                job_id = %self.id,
                waited_s = now - warming_since,
                reporters = self.log.reporters(now, 10.0),
                counter_restarts = self.log.restarts,
                why = self.calibration.waiting.as_deref().unwrap_or("-"),
                "calibration still warming up"
            );
        }
    }

    /// No progress signal: the paper's telemetry predictor as a prior, PFI ≈ intercept +
    /// slope · DRAM copy product. NVML has no DRAM-active counter, so its memory
    /// utilisation (the memory-copy share) stands in for both factors of the product.
    fn take_telemetry_prior(&mut self, memory_util: Option<f64>, (intercept, slope): (f64, f64)) {
        if self.calibration.on_telemetry_prior() {
            if let Some(u) = memory_util {
                let dcp = u * u;
                self.prior = Some((dcp, intercept + slope * dcp));
            }
        }
    }
}
