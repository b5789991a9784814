//! Per-job accounting on one node, pure: the agent feeds it each GPU reading of the job's
//! GPUs and one observation per control period, and it keeps what the job's record
//! needs (see [`powerflex_proto::usage::NodeUsage`]).
//!
//! Energy is the GPUs' own counters: the job is charged each counter's advance from the
//! first reading of its hold to the last. A counter that goes backwards (a driver reload
//! resets it) closes one segment and opens another; a GPU whose reading has no counter
//! is charged power × time for that span, and its share says so. Time-based shares
//! (capped, in events, throttled) count only spans between consecutive observations at
//! most [`max_observation_gap_ms`] apart (a few of the agent's sample periods), so an
//! agent restart charges its gap to the energy (the counter ran on) but to no share.
//!
//! A hold ends when the GPU leaves the job (its claim refused, another job given the
//! GPU) as well as at the job's end: [`JobUsage::release_gpu`] closes the span, and a
//! later hold of the same GPU opens a new one from its own first reading, so what the
//! counter advanced while another job held the GPU is never charged to this one.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use powerflex_core::curve::CapCurve;
use powerflex_core::promise::{BoundJudgement, WindowRate};
use powerflex_core::Watts;
use powerflex_proto::usage::ThroughputUnit;
use powerflex_proto::usage::{CapTime, EnergySource, GpuEnergy, NodeUsage, MAX_CAP_TIMES};

/// The shortest gap between two observations that still counts toward the time shares,
/// ms: at fast sample periods, a busy tick or two (slow NVML reads, a burst of
/// registrations) must not drop time from the shares.
pub const MIN_OBSERVATION_GAP_MS: u64 = 5_000;

/// How many sample periods apart two observations may be and still count: a missed tick
/// or two counts, an agent restart (tens of periods, and [`JobUsage::resumed`] starts
/// afresh anyway) does not.
pub const OBSERVATION_GAP_PERIODS: u64 = 3;

/// Longest span between two observations that still counts toward the time shares, ms,
/// for an agent that samples every `sample_interval_ms`: [`OBSERVATION_GAP_PERIODS`]
/// periods, at least [`MIN_OBSERVATION_GAP_MS`]. A site sampling every 10 s keeps its
/// 10 s spans (a fixed 5 s gap would drop every one of them).
pub fn max_observation_gap_ms(sample_interval_ms: u64) -> u64 {
    sample_interval_ms
        .saturating_mul(OBSERVATION_GAP_PERIODS)
        .max(MIN_OBSERVATION_GAP_MS)
}

/// One counter reading.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CounterReading {
    pub at_unix_ms: u64,
    pub energy_mj: u64,
}

/// One GPU's hold by the job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuHold {
    pub index: u32,
    pub from_unix_ms: u64,
    pub to_unix_ms: u64,
    /// The open counter segment: its first and latest reading.
    pub segment: Option<(CounterReading, CounterReading)>,
    /// Energy of closed segments (before a counter reset), mJ.
    pub closed_mj: u64,
    /// Energy from power × time where the counter was missing, mJ.
    pub integrated_mj: f64,
    /// The last reading's time and power, for integrating the next span.
    pub last_power: Option<(u64, f64)>,
    pub counted: bool,
    /// The GPU left the job (a refused claim, another job given it): its span is closed,
    /// and a later hold starts a new one at its own first reading. Absent in state files
    /// from older agents (then not released).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub released: bool,
}

impl GpuHold {
    fn energy_mj(&self) -> u64 {
        let open = self.segment.map_or(0, |(first, last)| {
            last.energy_mj.saturating_sub(first.energy_mj)
        });
        self.closed_mj
            .saturating_add(open)
            .saturating_add(self.integrated_mj.round() as u64)
    }

    fn source(&self) -> EnergySource {
        match (self.counted, self.integrated_mj > 0.0) {
            (true, false) => EnergySource::Counter,
            (false, true) => EnergySource::Integrated,
            (true, true) => EnergySource::Mixed,
            // Nothing charged yet: the counter is what will be used.
            (false, false) => EnergySource::Counter,
        }
    }
}

/// What one observation (a control period) saw of the job.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Observation {
    pub at_unix_ms: u64,
    /// The job's summed draw on this node, when every GPU of it was read.
    pub power_w: Option<f64>,
    /// The per-GPU limit the job's GPUs read back, when they agree.
    pub cap_w: Option<f64>,
    /// A GPU of the job is limited below its default.
    pub capped: bool,
    /// The controller says a grid event is in force.
    pub in_event: bool,
    /// A GPU of the job reports its clocks held back by power; none when unknown.
    pub power_throttled: Option<bool>,
}

/// A job's accounting on this node.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JobUsage {
    /// By GPU UUID.
    pub gpus: BTreeMap<String, GpuHold>,
    pub last_observed_unix_ms: Option<u64>,
    pub peak_power_w: f64,
    pub observed_s: f64,
    pub capped_s: f64,
    pub event_s: f64,
    pub power_throttled_s: f64,
    pub throttle_known_s: f64,
    /// Seconds at each per-GPU cap, by the cap in whole watts.
    pub cap_seconds: BTreeMap<u32, f64>,
    /// What the last observation saw: the span to the next one is charged to it.
    pub last_state: Option<SpanState>,
    /// Work the job's processes reported here before this agent's run (a restarted
    /// agent's progress log starts empty), and in all so far.
    pub work_before_run: f64,
    pub work_seen: f64,
    /// The job's final share here is made (its batch script ended): the job's end, which
    /// follows once Slurm has stopped its steps, makes none again. Absent in older files.
    #[serde(default)]
    pub closed: bool,
    /// The job's bound judged on its measurement windows here, each against the same
    /// phase's uncapped rate ([`powerflex_core::promise`]). Absent in older files (then
    /// judged from the next window on).
    #[serde(default)]
    pub bound: BoundJudgement,
}

/// The state an observation leaves in force until the next.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SpanState {
    /// The per-GPU cap, whole watts.
    pub cap_w: Option<u32>,
    pub capped: bool,
    pub in_event: bool,
    pub power_throttled: Option<bool>,
}

impl JobUsage {
    /// A reading of GPU `uuid` (index `index`) while the job holds it.
    pub fn gpu_reading(
        &mut self,
        uuid: &str,
        index: u32,
        at_unix_ms: u64,
        energy_mj: Option<u64>,
        power: Watts,
    ) {
        let hold = self.gpus.entry(uuid.to_string()).or_insert(GpuHold {
            index,
            from_unix_ms: at_unix_ms,
            to_unix_ms: at_unix_ms,
            segment: None,
            closed_mj: 0,
            integrated_mj: 0.0,
            last_power: None,
            counted: false,
            released: false,
        });
        if at_unix_ms < hold.to_unix_ms {
            // A reading older than the last (a clock step back): nothing to charge.
            return;
        }
        if hold.released {
            // Held again after a release: a new span from this reading. The segment and
            // the last power were closed at the release, so neither the counter's advance
            // nor the power × time between the release and now is charged here.
            hold.released = false;
            hold.index = index;
        }
        match energy_mj {
            Some(e) => {
                hold.counted = true;
                hold.segment = match hold.segment {
                    None => Some((
                        CounterReading {
                            at_unix_ms,
                            energy_mj: e,
                        },
                        CounterReading {
                            at_unix_ms,
                            energy_mj: e,
                        },
                    )),
                    Some((first, last)) if e >= last.energy_mj => Some((
                        first,
                        CounterReading {
                            at_unix_ms,
                            energy_mj: e,
                        },
                    )),
                    // The counter went backwards: it was reset (driver reload). What it
                    // counted before stays charged; a new segment starts here.
                    Some((first, last)) => {
                        hold.closed_mj = hold
                            .closed_mj
                            .saturating_add(last.energy_mj.saturating_sub(first.energy_mj));
                        let now = CounterReading {
                            at_unix_ms,
                            energy_mj: e,
                        };
                        Some((now, now))
                    }
                };
            }
            None => {
                // No counter in this reading: close the open segment and charge the span
                // since the last reading at the mean of its two powers.
                if let Some((first, last)) = hold.segment.take() {
                    hold.closed_mj = hold
                        .closed_mj
                        .saturating_add(last.energy_mj.saturating_sub(first.energy_mj));
                }
                if let Some((t, p)) = hold.last_power {
                    let dt_s = at_unix_ms.saturating_sub(t) as f64 / 1000.0;
                    if power.0.is_finite() && p.is_finite() {
                        hold.integrated_mj += 1000.0 * dt_s * (p + power.0.max(0.0)) / 2.0;
                    }
                }
            }
        }
        hold.to_unix_ms = at_unix_ms;
        hold.last_power = power
            .0
            .is_finite()
            .then_some((at_unix_ms, power.0.max(0.0)));
    }

    /// GPU `uuid` left the job (its claim refused, or another job given it): the open
    /// span is closed with what it charged so far. A later reading while the job holds
    /// the GPU again opens a new span (see [`JobUsage::gpu_reading`]).
    pub fn release_gpu(&mut self, uuid: &str) {
        let Some(hold) = self.gpus.get_mut(uuid) else {
            return;
        };
        if let Some((first, last)) = hold.segment.take() {
            hold.closed_mj = hold
                .closed_mj
                .saturating_add(last.energy_mj.saturating_sub(first.energy_mj));
        }
        hold.last_power = None;
        hold.released = true;
    }

    /// One control period's view of the job. The span from the previous observation to
    /// this one is charged to the previous one's state (the cap and flags in force over
    /// it), when at most `max_gap_ms` long (see [`max_observation_gap_ms`]).
    pub fn observe(&mut self, o: Observation, max_gap_ms: u64) {
        if let Some(p) = o.power_w.filter(|p| p.is_finite()) {
            self.peak_power_w = self.peak_power_w.max(p);
        }
        if let (Some(last), Some(state)) = (self.last_observed_unix_ms, self.last_state) {
            let gap = o.at_unix_ms.saturating_sub(last);
            if o.at_unix_ms > last && gap <= max_gap_ms {
                let dt = gap as f64 / 1000.0;
                self.observed_s += dt;
                if state.capped {
                    self.capped_s += dt;
                }
                if state.in_event {
                    self.event_s += dt;
                }
                if let Some(throttled) = state.power_throttled {
                    self.throttle_known_s += dt;
                    if throttled {
                        self.power_throttled_s += dt;
                    }
                }
                if let Some(cap) = state.cap_w {
                    *self.cap_seconds.entry(cap).or_insert(0.0) += dt;
                    self.bound_cap_times();
                }
            }
        }
        if self.last_observed_unix_ms.is_none_or(|l| o.at_unix_ms >= l) {
            self.last_observed_unix_ms = Some(o.at_unix_ms);
            self.last_state = Some(SpanState {
                cap_w: o
                    .cap_w
                    .filter(|c| c.is_finite() && *c > 0.0)
                    .map(|c| c.round() as u32),
                capped: o.capped,
                in_event: o.in_event,
                power_throttled: o.power_throttled,
            });
        }
    }

    /// Keeps at most [`MAX_CAP_TIMES`] caps: the two closest merge into the longer-held.
    fn bound_cap_times(&mut self) {
        while self.cap_seconds.len() > MAX_CAP_TIMES {
            let caps: Vec<(u32, f64)> = self.cap_seconds.iter().map(|(c, s)| (*c, *s)).collect();
            let Some(pair) = caps
                .windows(2)
                .min_by_key(|w| w[1].0 - w[0].0)
                .map(|w| (w[0], w[1]))
            else {
                return;
            };
            let ((a, sa), (b, sb)) = pair;
            let (keep, drop) = if sa >= sb { (a, b) } else { (b, a) };
            let moved = self.cap_seconds.remove(&drop).unwrap_or(0.0);
            *self.cap_seconds.entry(keep).or_insert(0.0) += moved;
        }
    }

    /// The work reported in this agent's run so far is `in_this_run`.
    pub fn work_reported(&mut self, in_this_run: f64) {
        if in_this_run.is_finite() && in_this_run >= 0.0 {
            self.work_seen = self.work_before_run + in_this_run;
        }
    }

    /// Taken over by a restarted agent: the work counted so far is the base of this run.
    pub fn resumed(&mut self) {
        self.work_before_run = self.work_seen;
        self.last_observed_unix_ms = None;
        self.last_state = None;
        for hold in self.gpus.values_mut() {
            hold.last_power = None;
        }
    }

    /// A measurement window of the job here, judged against `bound_pct` (none: a tier
    /// without a bound, nothing to judge).
    pub fn window_judged(&mut self, window: WindowRate, bound_pct: Option<f64>) {
        if let Some(bound) = bound_pct {
            self.bound.judge(window, bound);
        }
    }

    /// Energy charged so far, mJ.
    pub fn energy_mj(&self) -> u64 {
        self.gpus
            .values()
            .fold(0u64, |sum, h| sum.saturating_add(h.energy_mj()))
    }

    /// The share as the job's record carries it. `curve` is the job's measured curve
    /// (none before one is measured); `bound_pct` its tier's bound.
    #[allow(clippy::too_many_arguments)]
    pub fn share(
        &self,
        job_id: &str,
        node: &str,
        uid: u32,
        tier: &str,
        curve: Option<&CapCurve>,
        bound_pct: Option<f64>,
        pfi: Option<f64>,
        work: Option<(f64, ThroughputUnit)>,
        ended: bool,
        simulated: bool,
    ) -> NodeUsage {
        let gpus: Vec<GpuEnergy> = self
            .gpus
            .iter()
            .map(|(uuid, h)| GpuEnergy {
                uuid: uuid.clone(),
                index: h.index,
                from_unix_ms: h.from_unix_ms,
                to_unix_ms: h.to_unix_ms,
                counter_from_mj: h.segment.map(|(f, _)| f.energy_mj),
                counter_to_mj: h.segment.map(|(_, l)| l.energy_mj),
                energy_mj: h.energy_mj(),
                source: h.source(),
            })
            .collect();
        let energy_source = gpus
            .iter()
            .map(|g| g.source)
            .reduce(EnergySource::combine)
            .unwrap_or(EnergySource::Counter);
        let effect = curve.and_then(|c| self.effect(c));
        NodeUsage {
            job_id: job_id.to_string(),
            node: node.to_string(),
            uid,
            tier: tier.to_string(),
            energy_mj: gpus
                .iter()
                .fold(0u64, |sum, g| sum.saturating_add(g.energy_mj)),
            energy_source,
            from_unix_ms: gpus.iter().map(|g| g.from_unix_ms).min().unwrap_or(0),
            to_unix_ms: gpus.iter().map(|g| g.to_unix_ms).max().unwrap_or(0),
            gpus,
            peak_power_w: self.peak_power_w,
            observed_s: self.observed_s,
            capped_s: self.capped_s,
            event_s: self.event_s,
            power_throttled_s: self.power_throttled_s,
            throttle_known_s: self.throttle_known_s,
            caps: self
                .cap_seconds
                .iter()
                .rev()
                .map(|(c, s)| CapTime {
                    cap_w: f64::from(*c),
                    seconds: *s,
                })
                .collect(),
            slowdown_pct: effect.map(|e| e.slowdown_pct),
            bound_pct,
            bound_held: bound_pct.and_then(|_| self.bound.held()),
            bound_judgement: bound_pct
                .is_some()
                .then_some(self.bound)
                .filter(|j| j.held().is_some()),
            saved_estimate_j: effect.map(|e| e.saved_j),
            work: work.map(|w| w.0),
            work_unit: work.map(|w| w.1),
            pfi,
            ended,
            simulated,
        }
    }

    /// What the caps held did to the job, on its measured curve: its average slowdown
    /// and the energy saved (both estimates; the bound is judged on windows instead).
    fn effect(&self, curve: &CapCurve) -> Option<Effect> {
        let top = curve.uncapped();
        if !top.throughput.is_finite() || top.throughput <= 0.0 {
            return None;
        }
        let (mut held_s, mut slow_s, mut capped_j, mut uncapped_j) = (0.0, 0.0, 0.0, 0.0);
        for (&cap, &seconds) in &self.cap_seconds {
            let at = curve.at(Watts(f64::from(cap)));
            let relative = (at.throughput / top.throughput).clamp(0.0, 1.0);
            held_s += seconds;
            slow_s += seconds * (1.0 - relative);
            capped_j += seconds * at.power_w.0;
            // The same work uncapped takes `relative` of the time at the uncapped draw.
            uncapped_j += seconds * relative * top.power_w.0;
        }
        (held_s > 0.0).then(|| Effect {
            slowdown_pct: 100.0 * slow_s / held_s,
            saved_j: uncapped_j - capped_j,
        })
    }
}

#[derive(Debug, Clone, Copy)]
struct Effect {
    slowdown_pct: f64,
    saved_j: f64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use powerflex_core::point::OperatingPoint;

    /// The gap of an agent sampling every second.
    const GAP_1S: u64 = 5_000;

    fn obs(at: u64, cap: f64, capped: bool) -> Observation {
        Observation {
            at_unix_ms: at,
            power_w: Some(2.0 * cap),
            cap_w: Some(cap),
            capped,
            in_event: capped,
            power_throttled: Some(capped),
        }
    }

    #[test]
    fn energy_is_the_counters_advance_over_the_hold_across_a_reset() {
        let mut u = JobUsage::default();
        u.gpu_reading("A", 0, 1_000, Some(5_000), Watts(500.0));
        u.gpu_reading("A", 0, 2_000, Some(505_000), Watts(500.0));
        u.gpu_reading("B", 1, 1_000, Some(90), Watts(300.0));
        u.gpu_reading("B", 1, 2_000, Some(300_090), Watts(300.0));
        // A's counter reset (driver reload): what it counted stays charged.
        u.gpu_reading("A", 0, 3_000, Some(1_000), Watts(500.0));
        u.gpu_reading("A", 0, 4_000, Some(501_000), Watts(500.0));
        // A reading from the past charges nothing.
        u.gpu_reading("A", 0, 3_500, Some(9_999_999), Watts(500.0));
        assert_eq!(u.energy_mj(), 500_000 + 500_000 + 300_000);
        let s = u.share(
            "7",
            "n1",
            1000,
            "flex2",
            None,
            Some(25.0),
            None,
            None,
            true,
            true,
        );
        assert_eq!(s.energy_mj, 1_300_000);
        assert_eq!(s.energy_source, EnergySource::Counter);
        assert_eq!((s.from_unix_ms, s.to_unix_ms), (1_000, 4_000));
        assert_eq!(s.gpus[0].counter_from_mj, Some(1_000));
        assert_eq!(s.bound_held, None, "no curve, no verdict");
    }

    #[test]
    fn a_gpu_without_the_counter_is_charged_power_times_time_and_says_so() {
        let mut u = JobUsage::default();
        u.gpu_reading("A", 0, 0, None, Watts(400.0));
        u.gpu_reading("A", 0, 1_000, None, Watts(600.0));
        u.gpu_reading("A", 0, 3_000, None, Watts(600.0));
        assert_eq!(u.energy_mj(), 500_000 + 1_200_000);
        let s = u.share("7", "n1", 1, "flex1", None, None, None, None, false, false);
        assert_eq!(s.energy_source, EnergySource::Integrated);
        u.gpu_reading("B", 1, 0, Some(0), Watts(1.0));
        let s = u.share("7", "n1", 1, "flex1", None, None, None, None, false, false);
        assert_eq!(s.energy_source, EnergySource::Mixed);
    }

    #[test]
    fn shares_count_observed_time_and_skip_gaps() {
        let mut u = JobUsage::default();
        u.observe(obs(0, 700.0, false), GAP_1S);
        u.observe(obs(1_000, 500.0, true), GAP_1S);
        u.observe(obs(3_000, 500.0, true), GAP_1S);
        // An agent restart: 60 s unobserved.
        u.observe(obs(63_000, 700.0, false), GAP_1S);
        u.observe(obs(64_000, 700.0, false), GAP_1S);
        assert_eq!(u.observed_s, 4.0);
        assert_eq!(u.capped_s, 2.0);
        assert_eq!(u.event_s, 2.0);
        assert_eq!(u.power_throttled_s, 2.0);
        assert_eq!(u.peak_power_w, 1400.0);
        assert_eq!(u.cap_seconds.get(&700), Some(&2.0));
        assert_eq!(u.cap_seconds.get(&500), Some(&2.0));
    }

    #[test]
    fn the_gap_follows_the_sample_period_so_a_slow_sampling_site_keeps_its_shares() {
        assert_eq!(max_observation_gap_ms(1_000), GAP_1S);
        assert_eq!(max_observation_gap_ms(50), MIN_OBSERVATION_GAP_MS);
        assert_eq!(max_observation_gap_ms(10_000), 30_000);
        assert_eq!(max_observation_gap_ms(u64::MAX), u64::MAX, "no overflow");
        // A site sampling every 10 s: every span counts.
        let mut u = JobUsage::default();
        for i in 0..=6u64 {
            u.observe(obs(i * 10_000, 500.0, true), max_observation_gap_ms(10_000));
        }
        assert_eq!(u.observed_s, 60.0);
        assert_eq!(u.capped_s, 60.0);
        assert_eq!(u.cap_seconds.get(&500), Some(&60.0));
        // A restart's gap (many periods) still counts in no share.
        u.observe(obs(200_000, 500.0, true), max_observation_gap_ms(10_000));
        assert_eq!(u.observed_s, 60.0);
    }

    #[test]
    fn a_released_gpu_taken_back_opens_a_new_span_and_nothing_is_charged_twice() {
        let mut u = JobUsage::default();
        u.gpu_reading("A", 0, 1_000, Some(10_000), Watts(500.0));
        u.gpu_reading("A", 0, 2_000, Some(510_000), Watts(500.0));
        // The claim is refused: another job's processes use the GPU from here.
        u.release_gpu("A");
        // While the other job holds it, its counter runs on by 7,000,000 mJ; then the
        // GPU comes back to this job.
        u.gpu_reading("A", 0, 20_000, Some(7_510_000), Watts(500.0));
        u.gpu_reading("A", 0, 21_000, Some(8_010_000), Watts(500.0));
        assert_eq!(u.energy_mj(), 500_000 + 500_000, "only its own two spans");
        // The same with power × time: the released gap is not integrated.
        let mut v = JobUsage::default();
        v.gpu_reading("B", 1, 0, None, Watts(400.0));
        v.gpu_reading("B", 1, 1_000, None, Watts(400.0));
        v.release_gpu("B");
        v.gpu_reading("B", 1, 60_000, None, Watts(400.0));
        v.gpu_reading("B", 1, 61_000, None, Watts(400.0));
        assert_eq!(v.energy_mj(), 800_000);
        // A hold from an older state file (no `released`) reads as held.
        let hold: GpuHold = serde_json::from_str(
            r#"{"index":0,"from_unix_ms":1,"to_unix_ms":2,"segment":null,"closed_mj":0,"integrated_mj":0.0,"last_power":null,"counted":false}"#,
        )
        .expect("old hold");
        assert!(!hold.released);
    }

    fn curve() -> CapCurve {
        // 8 GPUs: uncapped 700 W/GPU, 5600 W job, throughput 100; at 500 W 4000 W and 95.
        CapCurve::from_points(&[
            OperatingPoint {
                cap_w: Watts(300.0),
                power_w: Watts(2400.0),
                throughput: 60.0,
            },
            OperatingPoint {
                cap_w: Watts(500.0),
                power_w: Watts(4000.0),
                throughput: 95.0,
            },
            OperatingPoint {
                cap_w: Watts(700.0),
                power_w: Watts(5600.0),
                throughput: 100.0,
            },
        ])
        .expect("curve")
    }

    #[test]
    fn slowdown_and_saving_come_from_the_curve_the_bound_from_the_windows() {
        let mut u = JobUsage::default();
        // 10 s at 700 W, then 10 s at 500 W, observed every second.
        for i in 0..=20u64 {
            let cap = if i < 10 { 700.0 } else { 500.0 };
            u.observe(obs(i * 1_000, cap, cap < 700.0), GAP_1S);
        }
        let s = u.share(
            "7",
            "n1",
            1,
            "flex1",
            Some(&curve()),
            Some(10.0),
            Some(2.0),
            Some((1e6, ThroughputUnit::Tokens)),
            true,
            false,
        );
        // 10 s at 700 W (0 % slower) and 10 s at 500 W (5 % slower).
        assert!((s.slowdown_pct.expect("slowdown") - 2.5).abs() < 1e-9);
        assert_eq!(s.bound_held, None, "no window judged yet: no verdict");
        assert_eq!(s.bound_judgement, None);
        // At 500 W: 10 s × 4000 W = 40 kJ; uncapped the same work takes 9.5 s × 5600 W.
        let saved = s.saved_estimate_j.expect("saved");
        assert!((saved - (9.5 * 5600.0 - 40_000.0)).abs() < 1e-6, "{saved}");
        assert_eq!(s.caps[0].cap_w, 700.0, "highest cap first");
        // A window at 95 of an uncapped 100 holds a 10 % bound; one at 60 is 30 points
        // past it, whatever the curve says of the cap it ran at.
        let window = |rate: f64| WindowRate {
            seconds: 10.0,
            rate,
            uncapped_rate: 100.0,
            relative_noise: 0.005,
            slack_pct: 0.0,
        };
        u.window_judged(window(95.0), Some(10.0));
        u.window_judged(window(60.0), None);
        assert_eq!(
            u.bound.judged_s, 10.0,
            "a tier without a bound judges nothing"
        );
        // The share as the agent sends it, under the 10 % bound.
        let bounded_share = |u: &JobUsage| {
            u.share(
                "7",
                "n1",
                1,
                "flex1",
                Some(&curve()),
                Some(10.0),
                None,
                None,
                true,
                false,
            )
        };
        u.window_judged(window(95.0), Some(10.0));
        let s = bounded_share(&u);
        assert_eq!(s.bound_held, Some(true));
        u.window_judged(window(60.0), Some(10.0));
        let s = bounded_share(&u);
        assert_eq!(s.bound_held, Some(false));
        let j = s.bound_judgement.expect("judged");
        assert_eq!((j.judged_s, j.past_s), (30.0, 10.0));
        assert!((j.depth_pct.expect("depth") - 30.0).abs() < 1e-9);
        // A share without a bound carries no verdict.
        let unbounded = u.share("7", "n1", 1, "flex1", None, None, None, None, true, false);
        assert_eq!(
            (unbounded.bound_held, unbounded.bound_judgement),
            (None, None)
        );
    }

    #[test]
    fn cap_times_stay_bounded_and_keep_their_total() {
        let mut u = JobUsage::default();
        for i in 0..200u64 {
            u.observe(obs(i * 1_000, 200.0 + i as f64, true), GAP_1S);
        }
        assert!(u.cap_seconds.len() <= MAX_CAP_TIMES);
        let total: f64 = u.cap_seconds.values().sum();
        assert!((total - 199.0).abs() < 1e-9, "{total}");
    }
}
