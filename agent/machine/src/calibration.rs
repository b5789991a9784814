//! Calibration of one job's power–throughput curve, and its refinement in operation: a
//! pure state machine the control loop drives with the time, the job's progress and its
//! GPUs' power.
//!
//! 1. **Warm-up**: wait for progress reports, then for steady state — the job's rate over
//!    the last five windows (1 s, or three of the job's report intervals when it reports
//!    less often) varies by less than `steady_cv`. (Without reports for `no_signal_s` the
//!    job is planned on the telemetry prior until its first report comes, which starts
//!    the warm-up.) What it still waits for is kept in
//!    [`Calibration::waiting`], for status and the agent's log.
//! 2. **Walk**: the calibration design of `powerflex_core::calibration_design` — the
//!    same one `powerflexctl evaluate` scores — decides which caps of the site's grid to
//!    visit, how many windows of `hold_s` to read at each and when to stop: at the depth
//!    the site's `expected_cut_pct` can push a job to, when its token budget (2 % of the
//!    job's first-hour tokens by default) is spent, or before a cap where the measured
//!    or predicted slowdown exceeds the tier's bound plus `allowance`. A new cap gets
//!    `settle_s` before its first window. The rate in a window comes from the job's own
//!    reports ([`ProgressLog::rate`]); power is the mean of the job's summed GPU power.
//! 3. **Result**: every window is a reading; the curve is the offline estimator
//!    (`estimate_from_windows`: monotone, no forced concavity, a standard error per
//!    point), its PFI (Eq. 1), how long the walk took and the tokens it cost the job
//!    (uncapped rate minus the window's rate, over the window and its settle time),
//!    also as a fraction of first-hour tokens. A curve the GPUs' clocks contradict
//!    ([`implausible`]) is not believed.
//! 4. **Learning in operation**: after the walk, every steady stretch at one cap (after
//!    `settle_s`, with reports) is cut into windows that join the curve, so each event's
//!    hold refines the points the allocator decides on. While an event holds a job below
//!    its uncapped cap, a **probe** may hold it one step lower for one window (never
//!    above its grant, so never costing the budget; within its tier bound on the curve;
//!    priced against the same token budget), so the curve's slope below the grant is
//!    learned too: re-reading only the caps a job is given teaches the allocator nothing
//!    new about where to move it.

use std::collections::{BTreeMap, VecDeque};

use powerflex_core::calibration_design::{DesignParams, DesignWalk, FIRST_HOUR_S};
use powerflex_core::curve::{estimate_from_windows, CapCurve, OperatingPoint};
use powerflex_core::Watts;

/// Knobs of the walk (from the site config's `[agent]` section).
#[derive(Debug, Clone, PartialEq)]
pub struct CalibrationSettings {
    /// Per-GPU caps the design may visit, descending, the first being the uncapped
    /// setting: the site's `calibration_caps_w` when set, else every cap step of the GPU.
    pub grid: Vec<Watts>,
    /// Time a job gets to feel a new cap before it is measured, s.
    pub settle_s: f64,
    /// One measurement window, s.
    pub hold_s: f64,
    /// Most token cost of the walk, a fraction of the job's first-hour tokens.
    pub budget_fraction: f64,
    /// The deepest site-wide cut the site expects (`facility.expected_cut_pct`), fraction.
    pub expected_cut: f64,
    /// Least time between the first report and the first level.
    pub warmup_s: f64,
    /// Coefficient of variation of 1 s rates below which the job is steady.
    pub steady_cv: f64,
    /// Extra slowdown tolerated during the walk beyond the tier bound.
    pub allowance: f64,
    /// Without a report for this long after registration: use the telemetry prior.
    pub no_signal_s: f64,
    /// Least time from a walk's end to walking the job again, s
    /// (`agent.calibration_rewalk_after_s`).
    pub rewalk_after_s: f64,
}

/// The job's cumulative progress as reported, with the agent's receive times.
///
/// Several processes of one job may report to one node's agent (every rank of a job,
/// a step and its successor, or a rank whose address was inherited from another step):
/// each reporter's count is its own cumulative counter, and interleaving two of them in
/// one series made the count go backwards at every switch. Each reporter is followed on
/// its own; the log holds the sum of their progress since each was first heard, so it
/// only goes forward whoever reports.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProgressLog {
    reports: VecDeque<Entry>,
    /// Per reporter (the sending process).
    sources: BTreeMap<u32, Reporter>,
    /// Times a reporter's count went backwards (it restarted its counter).
    pub restarts: u64,
}

/// One report as the log keeps it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Entry {
    /// Receive time, s.
    t: f64,
    /// Progress of every reporter since it was first heard.
    total: f64,
    /// The reporter, and its own progress since it was first heard.
    source: u32,
    own: f64,
}

/// A reporter as the log follows it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Reporter {
    /// Its last count as sent.
    last: f64,
    /// When it was last heard, s.
    heard: f64,
    /// Its progress since it was first heard (restarts count on from there).
    own: f64,
}

/// What a report did to the log (for the agent's logs and status).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Recorded {
    /// The log's first report.
    First,
    /// A known reporter went forward (or stayed).
    Forward,
    /// A reporter not heard before while another was: its progress counts from here.
    NewReporter { reporters: usize },
    /// A known reporter's count went backwards (its counter restarted): its progress
    /// counts again from this report; the log keeps everything before.
    Restarted { from: f64, to: f64 },
}

/// What status says of a job in [`Phase::NoSignal`].
pub const NO_SIGNAL_WAITING: &str =
    "no progress report yet: planned on the telemetry prior until the job's first report starts the calibration";

/// Reporters not heard for this long are forgotten (a step that ended), s.
const SOURCE_FORGET_S: f64 = 600.0;
/// Most reporters followed per job on one node (the progress socket admits 16 per uid).
const MAX_SOURCES: usize = 64;

/// Relative noise assumed for points restored from a previous run (their own noise was
/// not saved): the paper's repeat-run noise of ~0.5 %, doubled for the agent's short holds.
const RESTORED_NOISE: f64 = 0.01;

/// How much more a job's reported throughput may fall, as a fraction of uncapped, than its
/// GPUs' SM clock fell at the same cap: a cap slows the SM clock and leaves memory alone,
/// so no job slows by more than its clock (memory-bound jobs slow by less). The margin is
/// for measurement noise and clock averaging.
const CLOCK_SLOWDOWN_MARGIN: f64 = 0.05;

/// Why the levels cannot be a true curve, if they cannot: at some cap the reported
/// throughput fell further below the top level's than the SM clock did (beyond the margin
/// and three standard errors of the two rates).
pub fn implausible(levels: &[Level]) -> Option<String> {
    let top = levels.first()?;
    let top_clock = top.sm_clock_mhz.filter(|c| *c > 0.0)?;
    if top.throughput <= 0.0 {
        return None;
    }
    for level in &levels[1..] {
        let Some(clock) = level.sm_clock_mhz.filter(|c| *c > 0.0) else {
            continue;
        };
        let speed = level.throughput / top.throughput;
        let clock_ratio = clock / top_clock;
        let noise = 3.0 * (level.relative_noise.powi(2) + top.relative_noise.powi(2)).sqrt();
        if speed < clock_ratio - CLOCK_SLOWDOWN_MARGIN - noise {
            return Some(format!(
                "reported progress at {:.0} W fell to {:.0} % of the top level's while the SM clock stayed at {:.0} %",
                level.cap.0,
                100.0 * speed,
                100.0 * clock_ratio
            ));
        }
    }
    None
}

/// Least time between the end of a walk and a repeated one, s: the site default of
/// `agent.calibration_rewalk_after_s`.
pub const DEFAULT_REWALK_AFTER_S: f64 = 600.0;
/// Most repeated walks per job.
pub const MAX_REWALKS: u32 = 3;

/// Windows whose rates must agree for warm-up to end, and the report gaps the window
/// length is taken from.
const STEADY_WINDOWS: usize = 5;
const STEADY_GAPS: usize = 20;

/// Reports kept per job: enough for any window the walk looks at.
const MAX_REPORTS: usize = 20_000;

/// Least share of a window's time a rate must rest on once its pauses are cut out.
const MIN_KEPT_SHARE: f64 = 0.5;

/// Reports closer together than this arrived together, s: no training step is this short,
/// so such a gap is never the job's pace.
const SAME_ARRIVAL_S: f64 = 0.002;

/// Least length of a pause, in the job's report gaps: anything shorter is a late report
/// (its time and counts both kept), not the job standing still.
const PAUSE_GAPS: f64 = 4.0;

/// A window with this many alike slow, long stretches (within a factor of two of their
/// median length) keeps them: they are the job's rhythm (a long step every few
/// reports), part of its rate at the cap.
const RHYTHM_STRETCHES: usize = 3;

/// Runs of points further than this many robust standard deviations from the first line
/// fitted to a window's reports, with points on the line on both sides, are left out of
/// the second (see [`ProgressLog::rate`]).
const TRIM_MADS: f64 = 3.0;
/// The median absolute deviation of normal noise times this is its standard deviation.
const MAD_TO_SIGMA: f64 = 1.4826;
/// No point within this of the line is left out, s: timestamps are whole milliseconds, so
/// a window of perfectly paced reports has a robust spread of zero.
const TRIM_FLOOR_S: f64 = 0.001;
/// Fewer points than this are fitted once: a refit on a handful says nothing.
const TRIM_MIN_POINTS: usize = 8;
/// Most share of a window's points left out as excursions.
const TRIM_MAX_SHARE: f64 = 0.2;

/// A line of time on count: `t = intercept + seconds_per_count · c`.
#[derive(Debug, Clone, Copy)]
struct TimeOnCount {
    intercept: f64,
    seconds_per_count: f64,
    /// Standard error of the slope.
    slope_se: f64,
}

/// Least-squares time on count over `points` (count, time); `None` when the counts do
/// not spread or time does not rise with them.
fn fit_time_on_count(points: &[(f64, f64)]) -> Option<TimeOnCount> {
    let n = points.len() as f64;
    if points.len() < 3 {
        return None;
    }
    let mean_c = points.iter().map(|p| p.0).sum::<f64>() / n;
    let mean_t = points.iter().map(|p| p.1).sum::<f64>() / n;
    let scc: f64 = points.iter().map(|p| (p.0 - mean_c).powi(2)).sum();
    let sct: f64 = points.iter().map(|p| (p.0 - mean_c) * (p.1 - mean_t)).sum();
    if scc <= 0.0 || sct <= 0.0 {
        return None;
    }
    let seconds_per_count = sct / scc;
    let residual: f64 = points
        .iter()
        .map(|p| (p.1 - mean_t - seconds_per_count * (p.0 - mean_c)).powi(2))
        .sum();
    Some(TimeOnCount {
        intercept: mean_t - seconds_per_count * mean_c,
        seconds_per_count,
        slope_se: (residual / (n - 2.0) / scc).sqrt(),
    })
}

/// The points of a window without its excursions: runs of points further than
/// TRIM_MADS robust deviations (at least TRIM_FLOOR_S) from `first` that have points on
/// the line on both sides, or that open the window late. `None` when nothing is left out, when the window holds fewer
/// than TRIM_MIN_POINTS points, or when more than TRIM_MAX_SHARE of them are off the line.
fn trim_excursions(points: &[(f64, f64)], first: &TimeOnCount) -> Option<Vec<(f64, f64)>> {
    if points.len() < TRIM_MIN_POINTS {
        return None;
    }
    let residuals: Vec<f64> = points
        .iter()
        .map(|p| p.1 - first.intercept - first.seconds_per_count * p.0)
        .collect();
    let centre = median_of(&residuals);
    let deviations: Vec<f64> = residuals.iter().map(|r| (r - centre).abs()).collect();
    let limit = (TRIM_MADS * MAD_TO_SIGMA * median_of(&deviations)).max(TRIM_FLOOR_S);
    let mut off: Vec<bool> = deviations.iter().map(|d| *d > limit).collect();
    // A run at the window's start that is late (above the line) is a stall before the
    // window whose catch-up fell inside it: the demo's job 2 once read its first window
    // at a new cap 0.6 % fast that way. Early points at the start are a slow step just
    // after them, and every later point carries its time: kept. A run at the end is
    // kept too: late points there may be a slow step or a stall, and nothing shows
    // that they come back to the line.
    let lead = off.iter().take_while(|o| **o).count();
    if !residuals[..lead].iter().all(|r| *r > centre) {
        off[..lead].fill(false);
    }
    for flag in off.iter_mut().rev().take_while(|o| **o) {
        *flag = false;
    }
    let dropped = off.iter().filter(|o| **o).count();
    if dropped == 0 || dropped as f64 > TRIM_MAX_SHARE * points.len() as f64 {
        return None;
    }
    Some(
        points
            .iter()
            .zip(&off)
            .filter(|(_, o)| !**o)
            .map(|(p, _)| *p)
            .collect(),
    )
}

/// Median of a non-empty slice (0 for an empty one).
fn median_of(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]),
    }
}

impl ProgressLog {
    /// Records a cumulative count (tokens, or steps for jobs that count only steps) at `t`
    /// from the job's only reporter.
    pub fn record(&mut self, t: f64, count: f64) -> Recorded {
        self.record_from(t, 0, count)
    }

    /// Records a cumulative count from reporter `source` (the sending process) at `t`.
    /// A reporter's first report and a count that went backwards (its counter restarted)
    /// only set where its progress counts from; the log never goes backwards and is
    /// never cleared, so a second reporter cannot keep the job from ever looking steady.
    pub fn record_from(&mut self, t: f64, source: u32, count: f64) -> Recorded {
        let total = self.reports.back().map(|r| r.total);
        let known = self.sources.get(&source).copied();
        let outcome = match (total, known) {
            (None, _) => Recorded::First,
            (Some(_), Some(r)) if count >= r.last => Recorded::Forward,
            (Some(_), Some(r)) => {
                self.restarts += 1;
                Recorded::Restarted {
                    from: r.last,
                    to: count,
                }
            }
            (Some(_), None) => Recorded::NewReporter {
                reporters: self.sources.len() + 1,
            },
        };
        let gained = match (outcome, known) {
            (Recorded::Forward, Some(r)) => count - r.last,
            _ => 0.0,
        };
        let next = match total {
            Some(total) => total + gained,
            None => count,
        };
        let own = known.map_or(0.0, |r| r.own) + gained;
        self.sources.insert(
            source,
            Reporter {
                last: count,
                heard: t,
                own,
            },
        );
        if self.sources.len() > MAX_SOURCES {
            self.sources.retain(|_, r| t - r.heard < SOURCE_FORGET_S);
            while self.sources.len() > MAX_SOURCES {
                let oldest = self
                    .sources
                    .iter()
                    .min_by(|a, b| a.1.heard.total_cmp(&b.1.heard))
                    .map(|(k, _)| *k);
                match oldest {
                    Some(k) => self.sources.remove(&k),
                    None => break,
                };
            }
        }
        self.reports.push_back(Entry {
            t,
            total: next,
            source,
            own,
        });
        if self.reports.len() > MAX_REPORTS {
            self.reports.pop_front();
        }
        outcome
    }

    /// Reporters heard within the last `within_s` before `now`.
    pub fn reporters(&self, now: f64, within_s: f64) -> usize {
        self.sources
            .values()
            .filter(|r| now - r.heard <= within_s)
            .count()
    }

    pub fn is_empty(&self) -> bool {
        self.reports.is_empty()
    }

    /// Median time between the last `n` + 1 reports (gaps of zero left out), s.
    pub fn median_gap(&self, n: usize) -> Option<f64> {
        let skip = self.reports.len().saturating_sub(n + 1);
        let recent: Vec<f64> = self.reports.iter().skip(skip).map(|r| r.t).collect();
        let mut gaps: Vec<f64> = recent
            .windows(2)
            .map(|w| w[1] - w[0])
            .filter(|g| *g > 0.0)
            .collect();
        if gaps.is_empty() {
            return None;
        }
        gaps.sort_by(f64::total_cmp);
        Some(gaps[gaps.len() / 2])
    }

    pub fn first_time(&self) -> Option<f64> {
        self.reports.front().map(|r| r.t)
    }

    /// The newest report's receive time and the log's total then.
    pub fn last(&self) -> Option<(f64, f64)> {
        self.reports.back().map(|r| (r.t, r.total))
    }

    /// Robust rate over `[from, to]` (see the module docs) and its relative standard error.
    ///
    /// The rate is pooled (counts over time), so a report that arrives late only moves
    /// time from one interval to the next and biases nothing. Two things are taken out:
    /// - reports that arrive in a burst (the agent was descheduled and read a queue of
    ///   them at once) are folded into the interval before them, where their counts were
    ///   earned;
    /// - pauses: stretches of intervals slower than half the median rate (evaluations,
    ///   checkpoints) lasting at least four report gaps, when the window holds fewer
    ///   than three of them (more are the job's rhythm: a long optimizer step after
    ///   micro-steps). Dropping only the slow side of ordinary jitter would bias the
    ///   rate upward, so a lone slow interval shorter than that (a late report, its
    ///   next interval fast) is kept.
    ///
    /// With several reporters in the window (every rank of a job reporting, a few
    /// milliseconds apart), each one's own series is measured on its own pace and the
    /// rates are summed: pooled, two ranks 5 ms apart made every 45 ms gap look like a
    /// pause at a 5 ms pace, and the window gave no rate. When a reporter's series gives
    /// none (too few of its reports in the window), the pooled series is measured.
    pub fn rate(&self, from: f64, to: f64) -> Option<(f64, f64)> {
        let inside: Vec<&Entry> = self
            .reports
            .iter()
            .filter(|r| r.t >= from && r.t <= to)
            .collect();
        // Most windows hear one reporter: group by reporter only when there are more.
        if inside.iter().any(|r| r.source != inside[0].source) {
            let mut by_source: BTreeMap<u32, Vec<(f64, f64)>> = BTreeMap::new();
            for r in &inside {
                by_source.entry(r.source).or_default().push((r.t, r.own));
            }
            if let Some(summed) = summed_rate(&by_source) {
                return Some(summed);
            }
        }
        let pooled: Vec<(f64, f64)> = inside.iter().map(|r| (r.t, r.total)).collect();
        series_rate(&pooled)
    }

    /// Rates over consecutive `window_s` windows ending at `now` (oldest first).
    pub fn window_rates(&self, now: f64, window_s: f64, count: usize) -> Vec<f64> {
        (0..count)
            .rev()
            .filter_map(|k| {
                let end = now - k as f64 * window_s;
                self.rate(end - window_s, end).map(|r| r.0)
            })
            .collect()
    }
}

/// The job's rate over a window from several reporters' own series (receive time, own
/// progress): each reporter measured on its own pace. A reporter that covers the whole
/// window (its first and last reports within two of its own gaps of the window's ends)
/// counts at its rate; one that covers part of it (a step handing over to the next, a
/// rank joining or leaving) counts its rate over the share it covered; one whose series
/// gives no rate (fewer than three separate arrivals) counts its progress over the
/// window. `None` when no reporter gives a rate. The error is taken as fully correlated
/// between reporters: the ranks of one job share their step times.
fn summed_rate(by_source: &BTreeMap<u32, Vec<(f64, f64)>>) -> Option<(f64, f64)> {
    let first = by_source
        .values()
        .filter_map(|s| s.first())
        .map(|p| p.0)
        .fold(f64::INFINITY, f64::min);
    let last = by_source
        .values()
        .filter_map(|s| s.last())
        .map(|p| p.0)
        .fold(f64::NEG_INFINITY, f64::max);
    let span = last - first;
    if span.is_nan() || span <= 0.0 {
        return None;
    }
    let (mut sum, mut error, mut measured) = (0.0, 0.0, false);
    for series in by_source.values() {
        let (Some(a), Some(b)) = (series.first(), series.last()) else {
            continue;
        };
        let arrivals = 1 + series
            .windows(2)
            .filter(|w| w[1].0 - w[0].0 >= SAME_ARRIVAL_S)
            .count();
        let rate = if arrivals >= 3 {
            series_rate(series)
        } else {
            None
        };
        match rate {
            Some((rate, noise)) => {
                let own_span = b.0 - a.0;
                let gap = own_span / (series.len() - 1) as f64;
                let whole = a.0 - first <= 2.0 * gap && last - b.0 <= 2.0 * gap;
                let share = if whole { 1.0 } else { own_span / span };
                sum += rate * share;
                error += rate * share * noise;
                measured = true;
            }
            None => sum += (b.1 - a.1) / span,
        }
    }
    (measured && sum > 0.0).then(|| (sum, error / sum))
}

/// The rate of one series of (receive time, cumulative count) and its relative standard
/// error (see [`ProgressLog::rate`]).
fn series_rate(inside: &[(f64, f64)]) -> Option<(f64, f64)> {
    if inside.len() < 3 {
        return None;
    }
    let gaps: Vec<f64> = inside
        .windows(2)
        .map(|w| w[1].0 - w[0].0)
        .filter(|dt| *dt > 0.0)
        .collect();
    if gaps.is_empty() {
        return None;
    }
    // The job's pace, from the gaps long enough to be one: reports closer together
    // than SAME_ARRIVAL_S are one arrival (the ranks of one step, or a backlog read
    // at once), and letting their gaps set the median would make every real gap
    // look like a pause. A job that only ever reports that fast keeps its own gaps.
    let mut paced: Vec<f64> = gaps
        .iter()
        .copied()
        .filter(|dt| *dt >= SAME_ARRIVAL_S)
        .collect();
    if paced.is_empty() {
        paced = gaps;
    }
    paced.sort_by(f64::total_cmp);
    let pace_s = paced[paced.len() / 2];
    let burst_s = 0.25 * pace_s;
    let mut intervals: Vec<(f64, f64)> = Vec::with_capacity(inside.len());
    let mut anchor = inside[0];
    for &report in &inside[1..] {
        let dt = report.0 - anchor.0;
        if dt > burst_s {
            intervals.push((dt, report.1 - anchor.1));
            anchor = report;
        } else if let Some(last) = intervals.last_mut() {
            // A burst: its counts belong to the interval that ended at the anchor.
            last.1 += report.1 - anchor.1;
            anchor.1 = report.1;
        } else {
            // A burst opening the window (a backlog read at once): when its counts were
            // earned is not known, so the first interval starts after it.
            anchor = report;
        }
    }
    if intervals.is_empty() {
        return None;
    }
    let mut rates: Vec<f64> = intervals.iter().map(|(dt, dc)| dc / dt).collect();
    rates.sort_by(f64::total_cmp);
    let median = rates[rates.len() / 2];
    // A pause is slow and long: at least PAUSE_GAPS report gaps. A report the agent
    // read 60 ms late at a 50 ms pace makes its interval read slow and the next one
    // fast; cutting out only the slow one booked the late report's time nowhere and
    // its counts in the fast interval, a rate a few per cent high (the demo's job 4
    // once read 1.2 % high at its lowest cap, its PFI 14 % off).
    // Consecutive slow intervals count together (a job whose reporter runs on a
    // timer reports zero progress every gap of its pause).
    let slow: Vec<bool> = intervals
        .iter()
        .map(|(dt, dc)| dc / dt < 0.5 * median)
        .collect();
    let mut long_stretches = Vec::new();
    let mut i = 0;
    while i < intervals.len() {
        if !slow[i] {
            i += 1;
            continue;
        }
        let start = i;
        while i < intervals.len() && slow[i] {
            i += 1;
        }
        let length: f64 = intervals[start..i].iter().map(|(dt, _)| dt).sum();
        if length >= PAUSE_GAPS * pace_s {
            long_stretches.push(start..i);
        }
    }
    // Pauses are rare (an evaluation, a checkpoint); a long step that comes back
    // again and again is the job's rhythm (gradient accumulation: seven 30 ms
    // micro-steps and a 190 ms optimizer step, each reported), and cutting it out
    // read such a job 66 % fast.
    // It is rhythm when at least RHYTHM_STRETCHES of the stretches are alike (within a
    // factor of two of their median length); a stretch much longer than those (a
    // checkpoint among the optimizer steps) is still a pause. Otherwise every long
    // stretch is a pause: a checkpoint and two loader hiccups are not a rhythm.
    let lengths: Vec<f64> = long_stretches
        .iter()
        .map(|r| intervals[r.clone()].iter().map(|(dt, _)| dt).sum())
        .collect();
    let typical = median_of(&lengths);
    let alike = lengths
        .iter()
        .filter(|l| **l <= 2.0 * typical && **l >= 0.5 * typical)
        .count();
    let rhythm = alike >= RHYTHM_STRETCHES;
    let mut in_pause = vec![false; intervals.len()];
    for (stretch, length) in long_stretches.into_iter().zip(&lengths) {
        if !rhythm || *length > 3.0 * typical {
            in_pause[stretch].fill(true);
        }
    }
    let kept: Vec<&(f64, f64)> = intervals
        .iter()
        .zip(&in_pause)
        .filter(|(_, &paused)| !paused)
        .map(|(interval, _)| interval)
        .collect();
    let time: f64 = kept.iter().map(|(dt, _)| dt).sum();
    let count: f64 = kept.iter().map(|(_, dc)| dc).sum();
    if time <= 0.0 || count <= 0.0 {
        return None;
    }
    // Most of the window looked like pause: either the job mostly stood still, or
    // its reports reached the agent in clumps (a reader held up, then reading a
    // backlog at once), whose tight gaps pass for the job's pace and whose waits for
    // pauses. Neither gives a rate to believe; the walk holds on for a better window.
    let span = inside[inside.len() - 1].0 - inside[0].0;
    if time < MIN_KEPT_SHARE * span {
        return None;
    }
    // The kept intervals laid end to end (pauses cut out) give points of (count,
    // time). Counts are exact and arrival times carry the jitter, so time is
    // regressed on count: every report's timing contributes, where the pooled
    // count / time would rest on the first and last report alone. With fewer than
    // three intervals the pooled rate is all there is.
    if kept.len() < 3 {
        return Some((count / time, 1.0 / (kept.len() as f64).sqrt()));
    }
    let mut points = Vec::with_capacity(kept.len() + 1);
    let (mut c, mut t) = (0.0, 0.0);
    points.push((c, t));
    for (dt, dc) in &kept {
        c += dc;
        t += dt;
        points.push((c, t));
    }
    let Some(first) = fit_time_on_count(&points) else {
        return Some((count / time, 1.0));
    };
    // A report the job wrote late (its process descheduled while the GPU worked
    // on) sits above the line, and a run of them can tilt it: the demo's simulated
    // jobs' own step logs read ±0.06 % from one 5 s window to the next, and a PFI
    // at a cap that costs 1 % of throughput moves by six times that. Such a run
    // comes back to the line (the job catches up), so runs of points more than
    // TRIM_MADS robust deviations off the first fit, with points on the line on
    // both sides, are left out and the line fitted again (the same step logs then
    // read ±0.025 %). A run touching either end of the window is kept: it may be a
    // slow step whose time every later point carries, and dropping it would read
    // the window fast. A window with few points, or whose off-line points are more
    // than TRIM_MAX_SHARE of them (two kinds of step, not a line and a few late
    // reports), keeps the first fit.
    let Some(kept_points) = trim_excursions(&points, &first) else {
        return Some((
            1.0 / first.seconds_per_count,
            first.slope_se / first.seconds_per_count,
        ));
    };
    let fit = fit_time_on_count(&kept_points).unwrap_or(first);
    // The error stated is never below the first fit's: the kept points were chosen
    // for lying near a line, so their own scatter understates the window's.
    let slope_se = fit.slope_se.max(first.slope_se);
    Some((
        1.0 / fit.seconds_per_count,
        slope_se / fit.seconds_per_count,
    ))
}

/// Where the walk is.
#[derive(Debug, Clone, PartialEq)]
pub enum Phase {
    /// Waiting for reports and steady state.
    Warmup,
    /// The design holds the job at `cap` since `since` (agent seconds); the window under
    /// way started at `window_from` (after the settle time, for a new cap).
    Walking {
        cap: Watts,
        since: f64,
        window_from: f64,
    },
    /// Finished: the curve is measured (and refined by learning in operation).
    Done,
    /// No progress report came within `no_signal_s` of registration: the job is planned
    /// on the telemetry prior meanwhile, and its first report starts the warm-up. Not an
    /// end: a real job may load its model and data for many minutes before its first
    /// step, and a loaded node may start a job's process late; either used to leave the
    /// job on the prior for good.
    NoSignal,
    /// Not calibrated, and why (calibrate=off, flex0, too few levels, a curve the clocks
    /// contradict).
    Skipped(String),
}

/// One measurement window: a steady stretch of `hold_s` at one cap.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    pub cap: Watts,
    /// Mean of the job's summed GPU power over the window.
    pub power: Watts,
    pub throughput: f64,
    /// Standard error of the window's rate, relative (from its reports' spread).
    pub relative_noise: f64,
    /// Mean SM clock over the window, MHz, where the GPUs gave it.
    pub sm_clock_mhz: Option<f64>,
    /// Read by learning in operation (not by the calibration walk).
    pub learned: bool,
}

/// The windows at one cap, pooled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Level {
    pub cap: Watts,
    pub power: Watts,
    pub throughput: f64,
    pub relative_noise: f64,
    /// Mean SM clock over the level's windows, MHz, where the GPUs gave it.
    pub sm_clock_mhz: Option<f64>,
    /// Windows behind it.
    pub windows: usize,
}

/// Most windows kept per cap: the newest, so a long job's curve follows the job and its
/// memory stays bounded.
pub const MAX_WINDOWS_PER_CAP: usize = 48;

/// Windows at the grant between two probes, and windows a probe cap needs before it is
/// known well enough to stop probing it.
pub const PROBE_AFTER_WINDOWS: usize = 2;
pub const PROBE_WINDOWS: usize = 4;

/// A steady stretch at one cap being cut into windows (learning in operation).
#[derive(Debug, Clone, PartialEq)]
struct Stretch {
    cap: Watts,
    window_from: f64,
    power_sum: f64,
    power_samples: u32,
    clock_sum: f64,
    clock_samples: u32,
    /// Windows this stretch has produced.
    windows: usize,
}

/// A probe under way: the job held at `cap`, one step below its grant, since `since`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Probe {
    cap: Watts,
    granted: Watts,
    since: f64,
}

/// The calibration of one job.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    pub settings: CalibrationSettings,
    /// The tier's bound (fraction); `None` = no bound.
    pub bound: Option<f64>,
    pub phase: Phase,
    /// Every window read, walk and operation, at most [`MAX_WINDOWS_PER_CAP`] per cap.
    pub windows: Vec<Window>,
    pub registered_at: f64,
    pub started_at: Option<f64>,
    pub finished_at: Option<f64>,
    /// Tokens (or steps) the walks cost the job against running uncapped (every walk),
    /// and probes since.
    pub cost: f64,
    /// Uncapped throughput the cost is priced against (the walk's top windows).
    pub top_throughput: f64,
    /// The curve of the walk before the one under way, reported until the new one ends.
    pub previous: Vec<Window>,
    /// Walks started again because the job's measurements left its curve.
    pub rewalks: u32,
    /// Why the job's reported curve was not believed, when it was not (flagged to the
    /// admin in status and reports).
    pub implausible: Option<String>,
    design: Option<DesignWalk>,
    power_sum: f64,
    power_samples: u32,
    clock_sum: f64,
    clock_samples: u32,
    /// Token cost already booked up to this time (the walk books per window).
    booked_to: f64,
    stretch: Option<Stretch>,
    probe: Option<Probe>,
    /// Tokens the probes cost (part of `cost`).
    pub probe_cost: f64,
    /// In warm-up: what it waits for (status shows it; the agent logs it now and then).
    pub waiting: Option<String>,
    /// When the next announced grid event starts (agent seconds): a walk is compressed
    /// to end before it ([`Calibration::finish_by`]).
    deadline: Option<f64>,
}

impl Calibration {
    /// A calibration for a job registered at `now`. `enabled = false` (calibrate=off)
    /// and a bound of 0 (flex0: never capped, so a walk could only hurt) skip the walk.
    pub fn new(
        settings: CalibrationSettings,
        bound: Option<f64>,
        enabled: bool,
        now: f64,
    ) -> Calibration {
        let phase = if !enabled {
            Phase::Skipped("calibrate=off".into())
        } else if bound == Some(0.0) {
            Phase::Skipped("flex0 jobs are never capped".into())
        } else if settings.grid.len() < 2 {
            Phase::Skipped("the calibration grid has fewer than two caps".into())
        } else {
            Phase::Warmup
        };
        Calibration {
            settings,
            bound,
            phase,
            windows: Vec::new(),
            registered_at: now,
            started_at: None,
            finished_at: None,
            cost: 0.0,
            top_throughput: 0.0,
            previous: Vec::new(),
            rewalks: 0,
            implausible: None,
            design: None,
            power_sum: 0.0,
            power_samples: 0,
            clock_sum: 0.0,
            clock_samples: 0,
            booked_to: now,
            stretch: None,
            probe: None,
            probe_cost: 0.0,
            waiting: None,
            deadline: None,
        }
    }

    /// The design's knobs for this job: the site's, with the job's tier bound (plus the
    /// calibration allowance) as the most loss the walk may read or predict.
    pub fn design_params(&self) -> DesignParams {
        DesignParams {
            window_s: self.settings.hold_s,
            settle_s: self.settings.settle_s,
            budget_fraction: self.settings.budget_fraction,
            expected_cut: self.settings.expected_cut,
            max_loss: self
                .bound
                .map(|b| (b + self.settings.allowance).clamp(0.0, 1.0)),
            ..DesignParams::default()
        }
    }

    /// The cap the walk (or a probe) wants on the job's GPUs now, if any.
    pub fn cap(&self) -> Option<Watts> {
        match self.phase {
            Phase::Walking { cap, .. } => Some(cap),
            Phase::Done => self.probe.map(|p| p.cap),
            _ => None,
        }
    }

    pub fn is_active(&self) -> bool {
        matches!(self.phase, Phase::Warmup | Phase::Walking { .. })
    }

    /// Whether a probe holds the job below its grant now.
    pub fn probing(&self) -> bool {
        self.probe.is_some()
    }

    /// Advances the walk. `job_power` is the job's summed GPU power now, when known.
    /// Returns the window this tick read, if it read one.
    pub fn tick(
        &mut self,
        now: f64,
        log: &ProgressLog,
        job_power: Option<Watts>,
    ) -> Option<Window> {
        match self.phase.clone() {
            Phase::Warmup => {
                let Some(first) = log.first_time() else {
                    if now - self.registered_at >= self.settings.no_signal_s {
                        self.phase = Phase::NoSignal;
                        self.waiting = Some(NO_SIGNAL_WAITING.into());
                    } else {
                        self.waiting = Some("no progress report yet".into());
                    }
                    return None;
                };
                if now - first < self.settings.warmup_s {
                    self.waiting = Some(format!(
                        "warming up: {:.0} s of reports, {:.0} s needed",
                        now - first,
                        self.settings.warmup_s
                    ));
                    return None;
                }
                // Windows long enough for three reports of the job's own cadence: a job
                // whose steps take longer than a third of a second never had three
                // reports in a 1 s window, and waited here forever.
                let window_s = log
                    .median_gap(STEADY_GAPS)
                    .map_or(1.0, |gap| (3.0 * gap).max(1.0));
                let rates = log.window_rates(now, window_s, STEADY_WINDOWS);
                if rates.len() < STEADY_WINDOWS {
                    self.waiting = Some(format!(
                        "waiting for steady progress: a rate in {} of the last {STEADY_WINDOWS} windows of {window_s:.1} s (each needs three reports)",
                        rates.len()
                    ));
                    return None;
                }
                let mean = rates.iter().sum::<f64>() / rates.len() as f64;
                let sd = (rates.iter().map(|r| (r - mean).powi(2)).sum::<f64>()
                    / rates.len() as f64)
                    .sqrt();
                if mean > 0.0 && sd / mean < self.settings.steady_cv {
                    self.waiting = None;
                    self.started_at = Some(now);
                    self.start_design(now, None);
                } else {
                    self.waiting = Some(format!(
                        "waiting for steady progress: the rate varies {:.1} % over the last {STEADY_WINDOWS} windows of {window_s:.1} s (steady below {:.1} %)",
                        if mean > 0.0 { 100.0 * sd / mean } else { f64::INFINITY },
                        100.0 * self.settings.steady_cv
                    ));
                }
                None
            }
            Phase::Walking {
                cap,
                since,
                window_from,
            } => {
                if now >= window_from {
                    if let Some(p) = job_power {
                        self.power_sum += p.0;
                        self.power_samples += 1;
                    }
                }
                if now < window_from + self.settings.hold_s {
                    return None;
                }
                let Some((rate, noise)) = log.rate(window_from, now) else {
                    // No reports in the window: the job paused; hold longer.
                    if now - since > 10.0 * (self.settings.settle_s + self.settings.hold_s) {
                        self.finish(now);
                    }
                    return None;
                };
                let power = if self.power_samples > 0 {
                    Watts(self.power_sum / f64::from(self.power_samples))
                } else {
                    Watts(0.0)
                };
                let sm_clock_mhz = (self.clock_samples > 0)
                    .then(|| self.clock_sum / f64::from(self.clock_samples));
                let Some(design) = self.design.as_mut() else {
                    self.finish(now);
                    return None;
                };
                design.record(OperatingPoint {
                    cap_w: cap,
                    power_w: power,
                    throughput: rate,
                });
                self.top_throughput = design.top_throughput();
                // Tokens lost against uncapped since the last booking (the settle
                // time of a new cap included).
                if self.top_throughput > 0.0 {
                    self.cost +=
                        (self.top_throughput - rate).max(0.0) * (now - self.booked_to.max(since));
                }
                self.booked_to = now;
                let window = Window {
                    cap,
                    power,
                    throughput: rate,
                    relative_noise: noise,
                    sm_clock_mhz,
                    learned: false,
                };
                self.push_window(window);
                self.follow_design(now);
                Some(window)
            }
            Phase::NoSignal => {
                if log.first_time().is_some() {
                    self.phase = Phase::Warmup;
                    self.waiting = Some("warming up: the first progress report came".into());
                }
                None
            }
            Phase::Done | Phase::Skipped(_) => None,
        }
    }

    /// Whether the job is planned on the telemetry prior: it has not reported progress
    /// yet, or its walk's curve was not believed ([`implausible`]).
    pub fn on_telemetry_prior(&self) -> bool {
        match self.phase {
            Phase::NoSignal => true,
            Phase::Skipped(_) => self.implausible.is_some(),
            _ => false,
        }
    }

    /// Starts a design over the site's grid (only caps at or below `ceiling`, when the
    /// budget holds the job there).
    fn start_design(&mut self, now: f64, ceiling: Option<Watts>) {
        let grid: Vec<Watts> = self
            .settings
            .grid
            .iter()
            .copied()
            .filter(|c| ceiling.is_none_or(|top| c.0 <= top.0 + 0.5))
            .collect();
        self.design = DesignWalk::new(&grid, &self.design_params()).ok();
        if let (Some(design), Some(deadline)) =
            (self.design.as_mut(), self.deadline.filter(|d| *d > now))
        {
            design.finish_within(deadline - now - self.settings.hold_s);
        }
        self.booked_to = now;
        self.follow_design(now);
    }

    /// An announced grid event starts at `deadline` (agent seconds): the walk under way,
    /// or the one still to start, is compressed to end a window before it, so that the
    /// job's curve is measured before the cut (issue 16, pre-positioning; see
    /// `DesignWalk::finish_within`). When the compressed design moves on from the level
    /// held, the window under way is dropped, so no reading is labelled with a cap other
    /// than the one it was taken at.
    pub fn finish_by(&mut self, now: f64, deadline: f64) {
        self.deadline = Some(deadline);
        let Some(design) = self.design.as_mut() else {
            return;
        };
        design.finish_within(deadline - now - self.settings.hold_s);
        if let Phase::Walking { cap, .. } = self.phase {
            if design.current().is_none_or(|c| (c.0 - cap.0).abs() >= 0.5) {
                self.follow_design(now);
            }
        }
    }

    /// Holds the cap the design wants next, or ends the walk.
    fn follow_design(&mut self, now: f64) {
        let next = self.design.as_ref().and_then(DesignWalk::current);
        match (next, &self.phase) {
            (None, _) => self.finish(now),
            (Some(cap), Phase::Walking { cap: held, .. }) if (cap.0 - held.0).abs() < 0.5 => {
                let since = match self.phase {
                    Phase::Walking { since, .. } => since,
                    _ => now,
                };
                self.phase = Phase::Walking {
                    cap,
                    since,
                    window_from: now,
                };
                self.reset_window();
            }
            (Some(cap), _) => {
                self.phase = Phase::Walking {
                    cap,
                    since: now,
                    window_from: now + self.settings.settle_s,
                };
                self.reset_window();
            }
        }
    }

    fn reset_window(&mut self) {
        self.power_sum = 0.0;
        self.power_samples = 0;
        self.clock_sum = 0.0;
        self.clock_samples = 0;
    }

    /// Adds a window, dropping the oldest at its cap beyond [`MAX_WINDOWS_PER_CAP`].
    fn push_window(&mut self, window: Window) {
        self.windows.push(window);
        let same = |w: &Window| (w.cap.0 - window.cap.0).abs() < 0.5;
        if self.windows.iter().filter(|w| same(w)).count() > MAX_WINDOWS_PER_CAP {
            if let Some(i) = self.windows.iter().position(same) {
                self.windows.remove(i);
            }
        }
    }

    /// The budget holds the job's GPUs at `granted`, below the cap the walk holds: that
    /// cap cannot be measured now. The design goes on below the grant (a job capped from
    /// the start is walked from its granted cap down, instead of waiting forever for a
    /// level the budget does not allow); the window under way is dropped, so no reading
    /// is labelled with a cap other than the one it was taken at. Under the top windows,
    /// the design starts again from the grant. With the grant below every cap left, the
    /// walk ends with what it has measured.
    pub fn held_below_level(&mut self, now: f64, granted: Watts) {
        let Phase::Walking { cap, .. } = self.phase else {
            return;
        };
        if granted.0 >= cap.0 - 0.5 {
            return;
        }
        let in_top = self
            .design
            .as_ref()
            .is_some_and(|d| d.top_throughput() <= 0.0);
        self.phase = Phase::Warmup;
        if in_top {
            self.start_design(now, Some(granted));
        } else if let Some(design) = self.design.as_mut() {
            design.hold_at_most(granted);
            self.follow_design(now);
        } else {
            self.finish(now);
        }
    }

    /// The controller found the job's measurements outside its curve's band: walk it
    /// again, when the last walk finished at least `settings.rewalk_after_s` ago and fewer
    /// than [`MAX_REWALKS`] walks were repeated (each costs the job tokens). The finished
    /// curve stays in use until the new walk ends; the windows behind it are dropped
    /// then, since the job has changed. Returns whether a walk started.
    pub fn rewalk(&mut self, now: f64) -> bool {
        let rested = self
            .finished_at
            .is_none_or(|t| now - t >= self.settings.rewalk_after_s);
        if self.phase != Phase::Done || !rested || self.rewalks >= MAX_REWALKS {
            return false;
        }
        self.previous = std::mem::take(&mut self.windows);
        self.rewalks += 1;
        self.registered_at = now;
        self.started_at = None;
        self.finished_at = None;
        self.design = None;
        self.stretch = None;
        self.probe = None;
        self.phase = Phase::Warmup;
        true
    }

    /// The windows to plan on: this walk's once done, else the previous walk's while a
    /// repeated walk is under way, else what this walk has measured so far.
    fn best_windows(&self) -> &[Window] {
        if self.phase != Phase::Done && !self.previous.is_empty() {
            &self.previous
        } else {
            &self.windows
        }
    }

    /// The points to plan on, one per cap (see `best_windows`), highest cap first.
    pub fn best_levels(&self) -> Vec<Level> {
        pool(self.best_windows())
    }

    /// The levels of this walk (and what operation has added), highest cap first.
    pub fn levels(&self) -> Vec<Level> {
        pool(&self.windows)
    }

    /// Takes the curve measured by a previous run of the agent (points of per-GPU cap W,
    /// job power W, throughput): a restarted agent does not walk the job again, and the
    /// curve is not replaced by a new walk's first point. Fewer than two valid points
    /// change nothing. Each point counts as one window (their windows were not saved).
    pub fn restore(&mut self, points: &[[f64; 3]]) {
        let windows: Vec<Window> = points
            .iter()
            .filter(|p| p.iter().all(|x| x.is_finite() && *x > 0.0))
            .map(|p| Window {
                cap: Watts(p[0]),
                power: Watts(p[1]),
                throughput: p[2],
                relative_noise: RESTORED_NOISE,
                sm_clock_mhz: None,
                learned: false,
            })
            .collect();
        if windows.len() >= 2 {
            self.top_throughput = windows
                .iter()
                .max_by(|a, b| a.cap.0.total_cmp(&b.cap.0))
                .map_or(0.0, |w| w.throughput);
            self.windows = windows;
            self.phase = Phase::Done;
        }
    }

    /// The job's mean SM clock at `now`, MHz: kept over each window, to check the job's
    /// reported slowdown against what the cap did to its GPUs.
    pub fn observe_clock(&mut self, now: f64, sm_clock_mhz: f64) {
        if !(sm_clock_mhz.is_finite() && sm_clock_mhz > 0.0) {
            return;
        }
        if let Phase::Walking { window_from, .. } = self.phase {
            if now >= window_from {
                self.clock_sum += sm_clock_mhz;
                self.clock_samples += 1;
            }
        }
        if let Some(s) = self.stretch.as_mut() {
            if now >= s.window_from {
                s.clock_sum += sm_clock_mhz;
                s.clock_samples += 1;
            }
        }
    }

    fn finish(&mut self, now: f64) {
        self.finished_at = Some(now);
        self.design = None;
        let levels = self.levels();
        self.phase = if levels.len() < 2 {
            Phase::Skipped("too few levels measured".into())
        } else if let Some(why) = implausible(&levels) {
            // The job's own reports say it slowed more than its GPUs did: its curve is
            // words, not a measurement. Plan on the telemetry prior, and say why.
            self.implausible = Some(why.clone());
            Phase::Skipped(format!("{why}; planned on the telemetry prior"))
        } else {
            Phase::Done
        };
    }

    /// Learning in operation: once the walk is done, every steady stretch at one cap is
    /// cut into windows of `hold_s` that join the job's curve. `held` is the cap the
    /// job's GPUs read back and since when it has held (agent seconds); the first
    /// `settle_s` of a stretch are not read. A window needs the job's reports (three or
    /// more) and its power; one without them is skipped, not guessed.
    pub fn observe_operation(
        &mut self,
        now: f64,
        log: &ProgressLog,
        job_power: Option<Watts>,
        held: Option<(Watts, f64)>,
    ) {
        if self.phase != Phase::Done {
            self.stretch = None;
            return;
        }
        let Some((cap, held_since)) = held else {
            self.stretch = None;
            return;
        };
        let fresh = self
            .stretch
            .as_ref()
            .is_none_or(|s| (s.cap.0 - cap.0).abs() > 0.5);
        if fresh {
            self.stretch = Some(Stretch {
                cap,
                window_from: held_since + self.settings.settle_s,
                power_sum: 0.0,
                power_samples: 0,
                clock_sum: 0.0,
                clock_samples: 0,
                windows: 0,
            });
        }
        let hold_s = self.settings.hold_s;
        let Some(s) = self.stretch.as_mut() else {
            return;
        };
        if now < s.window_from {
            return;
        }
        if let Some(p) = job_power {
            s.power_sum += p.0;
            s.power_samples += 1;
        }
        if now < s.window_from + hold_s {
            return;
        }
        let window = log
            .rate(s.window_from, now)
            .filter(|_| s.power_samples > 0)
            .map(|(rate, noise)| Window {
                cap,
                power: Watts(s.power_sum / f64::from(s.power_samples)),
                throughput: rate,
                relative_noise: noise,
                sm_clock_mhz: (s.clock_samples > 0)
                    .then(|| s.clock_sum / f64::from(s.clock_samples)),
                learned: true,
            });
        s.window_from = now;
        s.power_sum = 0.0;
        s.power_samples = 0;
        s.clock_sum = 0.0;
        s.clock_samples = 0;
        if let Some(w) = window {
            s.windows += 1;
            self.push_window(w);
            if self.probe.is_some_and(|p| (p.cap.0 - cap.0).abs() < 0.5) {
                self.end_probe(now);
            }
        }
    }

    /// Decides whether to probe now, while the budget holds the job at `granted` below
    /// its uncapped cap (an event's hold): one window `step` below the grant, to learn
    /// the slope of the curve where the allocator decides. Only when the walk is done,
    /// the job has held the grant for [`PROBE_AFTER_WINDOWS`] windows, the probe cap is
    /// at or above `min_cap`, the curve predicts the job within its tier bound there,
    /// that cap has fewer than [`PROBE_WINDOWS`] windows, and the probes so far cost less
    /// than the design's token budget over the job's life (a fraction of its tokens so
    /// far). Lowering a cap below the grant never costs the budget anything.
    pub fn consider_probe(&mut self, now: f64, granted: Watts, step: Watts, min_cap: Watts) {
        if self.phase != Phase::Done || self.probe.is_some() || step.0 <= 0.0 {
            return;
        }
        let Some(curve) = self.curve() else {
            return;
        };
        let top = curve.uncapped();
        if granted.0 >= top.cap_w.0 - 0.5 || top.throughput <= 0.0 {
            return;
        }
        let settled = self
            .stretch
            .as_ref()
            .is_some_and(|s| (s.cap.0 - granted.0).abs() < 0.5 && s.windows >= PROBE_AFTER_WINDOWS);
        let cap = Watts(granted.0 - step.0);
        if !settled || cap.0 < min_cap.0 - 0.5 {
            return;
        }
        let loss = 1.0 - curve.at(cap).throughput / top.throughput;
        if self.bound.is_some_and(|b| loss > b) {
            return;
        }
        let known = self
            .windows
            .iter()
            .filter(|w| (w.cap.0 - cap.0).abs() < 0.5)
            .count();
        let age_s = now - self.started_at.unwrap_or(self.registered_at);
        let allowance = self.settings.budget_fraction * age_s * self.top_throughput;
        if known >= PROBE_WINDOWS || self.probe_cost >= allowance {
            return;
        }
        self.probe = Some(Probe {
            cap,
            granted,
            since: now,
        });
        tracing::debug!(
            cap_w = cap.0,
            granted_w = granted.0,
            "probing one step below the grant"
        );
    }

    /// Ends the probe: its cost is booked at the curve's loss between the grant and the
    /// probe cap over the time held there.
    fn end_probe(&mut self, now: f64) {
        let Some(probe) = self.probe.take() else {
            return;
        };
        if let Some(curve) = self.curve() {
            let lost = (curve.at(probe.granted).throughput - curve.at(probe.cap).throughput)
                .max(0.0)
                * (now - probe.since);
            self.probe_cost += lost;
            self.cost += lost;
        }
    }

    /// A probe whose cap was not held, or that found no window (the job paused, the
    /// grant moved), ends after three windows' time; a grant that moved ends it at once.
    pub fn check_probe(&mut self, now: f64, granted: Option<Watts>) {
        let Some(probe) = self.probe else {
            return;
        };
        let moved = granted.is_none_or(|g| (g.0 - probe.granted.0).abs() > 0.5);
        let stale = now - probe.since > 3.0 * (self.settings.settle_s + self.settings.hold_s);
        if moved || stale {
            self.end_probe(now);
        }
    }

    /// The measured points (per-GPU cap, summed power, throughput): the curve's knots.
    pub fn points(&self) -> Vec<OperatingPoint> {
        self.levels()
            .iter()
            .map(|l| OperatingPoint {
                cap_w: l.cap,
                power_w: l.power,
                throughput: l.throughput,
            })
            .collect()
    }

    /// PFI of the measured points (Eq. 1), once done.
    pub fn pfi(&self) -> Option<f64> {
        (self.phase == Phase::Done)
            .then(|| self.curve().and_then(|c| c.pfi()))
            .flatten()
    }

    /// The estimated curve with per-point uncertainty, once done: the estimator
    /// `powerflexctl evaluate` uses ([`estimate_from_windows`]) over every window.
    pub fn curve(&self) -> Option<CapCurve> {
        if self.phase != Phase::Done {
            return None;
        }
        curve_of(&self.windows)
    }

    /// The curve to plan on and report: this walk's once done, else the previous one's
    /// while a repeated walk is under way.
    pub fn best_curve(&self) -> Option<CapCurve> {
        if self.phase == Phase::Done {
            self.curve()
        } else {
            curve_of(&self.previous)
        }
    }

    /// Seconds from the start of the walk to its end.
    pub fn duration_s(&self) -> Option<f64> {
        Some(self.finished_at? - self.started_at?)
    }

    /// The cost as a fraction of the job's first-hour tokens (uncapped throughput ×
    /// 3600 s), once the uncapped throughput is known.
    pub fn cost_fraction(&self) -> Option<f64> {
        (self.top_throughput > 0.0).then(|| self.cost / (FIRST_HOUR_S * self.top_throughput))
    }
}

/// The curve of `windows` by [`estimate_from_windows`], the windows' own spread as the
/// prior noise of one window (at least 0.2 %).
fn curve_of(windows: &[Window]) -> Option<CapCurve> {
    if windows.is_empty() {
        return None;
    }
    let prior =
        (windows.iter().map(|w| w.relative_noise).sum::<f64>() / windows.len() as f64).max(0.002);
    let readings: Vec<OperatingPoint> = windows
        .iter()
        .map(|w| OperatingPoint {
            cap_w: w.cap,
            power_w: w.power,
            throughput: w.throughput,
        })
        .collect();
    let curve = estimate_from_windows(&readings, prior).ok()?;
    (curve.knots().len() >= 2).then_some(curve)
}

/// Windows pooled per cap, highest cap first.
fn pool(windows: &[Window]) -> Vec<Level> {
    let mut levels: Vec<Level> = Vec::new();
    let mut caps: Vec<f64> = windows.iter().map(|w| w.cap.0).collect();
    caps.sort_by(|a, b| b.total_cmp(a));
    caps.dedup_by(|a, b| (*a - *b).abs() < 0.5);
    for cap in caps {
        let at: Vec<&Window> = windows
            .iter()
            .filter(|w| (w.cap.0 - cap).abs() < 0.5)
            .collect();
        let n = at.len() as f64;
        let mean = |f: &dyn Fn(&Window) -> f64| at.iter().map(|w| f(w)).sum::<f64>() / n;
        let clocks: Vec<f64> = at.iter().filter_map(|w| w.sm_clock_mhz).collect();
        levels.push(Level {
            cap: Watts(cap),
            power: Watts(mean(&|w| w.power.0)),
            throughput: mean(&|w| w.throughput),
            relative_noise: mean(&|w| w.relative_noise) / n.sqrt(),
            sm_clock_mhz: (!clocks.is_empty())
                .then(|| clocks.iter().sum::<f64>() / clocks.len() as f64),
            windows: at.len(),
        });
    }
    levels
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> CalibrationSettings {
        CalibrationSettings {
            grid: [700.0, 600.0, 500.0, 400.0, 300.0, 200.0]
                .map(Watts)
                .to_vec(),
            settle_s: 2.0,
            hold_s: 5.0,
            warmup_s: 3.0,
            steady_cv: 0.05,
            allowance: 0.05,
            no_signal_s: 30.0,
            rewalk_after_s: DEFAULT_REWALK_AFTER_S,
            budget_fraction: 0.02,
            expected_cut: 0.3,
        }
    }

    /// Relative throughput of a fake job at a cap: loses (1 - cap/700)/2 (PFI 2).
    fn speed(cap: f64) -> f64 {
        1.0 - (1.0 - cap / 700.0) / 2.0
    }

    /// Drives a calibration with a fake clock: the job reports every 0.1 s at the rate
    /// its current cap allows; power follows the cap.
    fn run(bound: Option<f64>) -> Calibration {
        run_with(bound, |_, _, _| {}, |_, _| {})
    }

    /// [`run`] with hooks on each one-second tick: `before` the calibration's tick (given
    /// the tick's slot and the clock) and `after` it (given the clock).
    fn run_with(
        bound: Option<f64>,
        mut before: impl FnMut(f64, f64, &mut Calibration),
        mut after: impl FnMut(f64, &Calibration),
    ) -> Calibration {
        let mut cal = Calibration::new(settings(), bound, true, 0.0);
        let mut log = ProgressLog::default();
        let (mut t, mut count) = (0.0f64, 0.0f64);
        let mut next_tick = 1.0;
        while t < 3000.0 && cal.is_active() {
            let cap = cal.cap().map_or(700.0, |c| c.0);
            t += 0.1;
            count += 1000.0 * speed(cap) * 0.1;
            log.record(t, count);
            if t >= next_tick {
                before(next_tick, t, &mut cal);
                cal.tick(t, &log, Some(Watts(8.0 * cap * 0.985)));
                after(t, &cal);
                next_tick += 1.0;
            }
        }
        cal
    }

    /// Pre-positioning (issue 16): an event announced to start at 60 s (agent clock),
    /// told to the walk in the middle of it, as a lease would; the walk ends before the
    /// event with a curve, where the full design would still be walking.
    #[test]
    fn an_announced_event_ends_the_walk_before_its_start() {
        let full = run(Some(0.50));
        let full_end = full.started_at.expect("started") + full.duration_s().expect("walked");
        let start = 60.0;
        assert!(full_end > start, "the full walk ends at {full_end} s");
        let mut last_walk_s = 0.0;
        let cal = run_with(
            Some(0.50),
            |slot, t, cal| {
                if (slot - 30.0).abs() < 1e-6 {
                    cal.finish_by(t, start);
                }
            },
            |t, cal| {
                if cal.cap().is_some() {
                    last_walk_s = t;
                }
            },
        );
        assert_eq!(cal.phase, Phase::Done);
        assert!(last_walk_s < start, "walked until {last_walk_s} s");
        let levels = cal.levels();
        assert!(levels.len() >= 3, "a curve, not a point: {levels:?}");
        assert!(cal.curve().is_some());
    }

    #[test]
    fn walks_the_grid_and_measures_the_pfi() {
        let cal = run(Some(0.50));
        assert_eq!(cal.phase, Phase::Done);
        assert_eq!(
            cal.levels().len(),
            6,
            "flex3 + 5 % allows the whole grid down to the depth a 30 % cut reaches"
        );
        let pfi = cal.pfi().expect("pfi");
        assert!((pfi - 2.0).abs() < 0.02, "pfi {pfi}");
        assert!(cal.cost > 0.0);
        let fraction = cal.cost_fraction().expect("priced");
        assert!(
            fraction <= 0.02,
            "the walk cost {fraction} of first-hour tokens"
        );
        // Shallow caps are cheap and read more often than deep ones.
        let levels = cal.levels();
        assert!(levels[1].windows > levels[5].windows, "{levels:?}");
        assert!(cal.duration_s().expect("duration") > 6.0 * 7.0 - 1.0);
        assert!(cal.curve().is_some());
    }

    #[test]
    fn a_tight_bound_stops_the_walk_early() {
        // flex1: 10 % + 5 % allowance; slowdown reaches 7.1 % at 600 W... 21 % at 400 W.
        let cal = run(Some(0.10));
        assert_eq!(cal.phase, Phase::Done);
        let levels = cal.levels();
        let deepest = levels.last().expect("levels").cap.0;
        assert!(deepest >= 500.0, "walked down to {deepest} W");
        for l in &levels {
            assert!(1.0 - l.throughput / levels[0].throughput <= 0.15 + 0.01);
        }
    }

    #[test]
    fn skips_when_asked_or_pointless_and_falls_back_without_a_signal() {
        assert!(matches!(
            Calibration::new(settings(), Some(0.25), false, 0.0).phase,
            Phase::Skipped(_)
        ));
        assert!(matches!(
            Calibration::new(settings(), Some(0.0), true, 0.0).phase,
            Phase::Skipped(_)
        ));
        let mut cal = Calibration::new(settings(), Some(0.25), true, 0.0);
        cal.tick(31.0, &ProgressLog::default(), None);
        assert_eq!(cal.phase, Phase::NoSignal);
        assert!(cal.on_telemetry_prior());
        assert!(!cal.is_active(), "no walk holds a job that does not report");
    }

    /// A job that reports only after `no_signal_s` (a model loaded for minutes, a process
    /// started late on a loaded node) is calibrated from its first report on: it used to
    /// stay on the telemetry prior for good.
    #[test]
    fn a_job_whose_first_report_comes_late_is_calibrated_from_it() {
        let mut cal = Calibration::new(settings(), Some(0.5), true, 0.0);
        let mut log = ProgressLog::default();
        cal.tick(31.0, &log, None);
        assert_eq!(cal.phase, Phase::NoSignal);
        let mut t = 200.0;
        log.record(t, 0.0);
        cal.tick(t, &log, Some(Watts(700.0)));
        assert_eq!(cal.phase, Phase::Warmup);
        assert!(!cal.on_telemetry_prior());
        // Steady reports from then on: the walk starts once warm-up has seen them.
        let mut count = 0.0;
        while t < 300.0 && cal.phase == Phase::Warmup {
            t += 0.1;
            count += 100.0;
            log.record(t, count);
            cal.tick(t, &log, Some(Watts(700.0)));
        }
        assert!(
            matches!(cal.phase, Phase::Walking { .. }),
            "{:?} at {t} s ({:?})",
            cal.phase,
            cal.waiting
        );
        assert!(
            t - 200.0 >= cal.settings.warmup_s,
            "warm-up counts from the first report"
        );
    }

    /// A job whose steps take 0.8 s (one report each) had at most two reports in a 1 s
    /// window, so warm-up never found five rates and never ended.
    #[test]
    fn a_job_reporting_slower_than_three_times_a_second_leaves_warm_up() {
        let mut cal = Calibration::new(settings(), Some(0.5), true, 0.0);
        let mut log = ProgressLog::default();
        for k in 1..=100u32 {
            let t = f64::from(k) * 0.8;
            log.record(t, f64::from(k) * 1000.0);
            cal.tick(t, &log, Some(Watts(5600.0)));
            if cal.started_at.is_some() {
                break;
            }
        }
        let started = cal.started_at.expect("warm-up ended");
        assert!(started < 30.0, "after {started} s");
    }

    #[test]
    fn each_reporter_counts_from_its_first_report_and_a_restart_keeps_the_log() {
        let mut log = ProgressLog::default();
        assert_eq!(log.record_from(0.0, 1, 500.0), Recorded::First);
        assert_eq!(
            log.record_from(0.01, 2, 400.0),
            Recorded::NewReporter { reporters: 2 }
        );
        // Two ranks at 1000 a second each, the second 100 behind: the log adds them.
        for k in 1..=50 {
            let t = f64::from(k) * 0.1;
            assert_eq!(
                log.record_from(t, 1, 500.0 + 100.0 * f64::from(k)),
                Recorded::Forward
            );
            assert_eq!(
                log.record_from(t + 0.01, 2, 400.0 + 100.0 * f64::from(k)),
                Recorded::Forward
            );
        }
        let (rate, _) = log.rate(0.0, 5.1).expect("rate");
        assert!((rate - 2000.0).abs() / 2000.0 < 0.02, "{rate}");
        // Rank 2 restarts its counter: the log goes on from where it was.
        let before = log.last().expect("last").1;
        assert_eq!(
            log.record_from(5.2, 2, 10.0),
            Recorded::Restarted {
                from: 5400.0,
                to: 10.0
            }
        );
        assert_eq!(log.last().expect("last").1, before);
        assert_eq!(log.first_time(), Some(0.0), "nothing was cleared");
        assert_eq!(log.restarts, 1);
    }

    #[test]
    fn rate_ignores_pauses() {
        let mut log = ProgressLog::default();
        let mut count = 0.0;
        for i in 1..=100 {
            let t = f64::from(i) * 0.1;
            // A 2 s checkpoint pause in the middle.
            if !(4.0..6.0).contains(&t) {
                count += 100.0;
            }
            log.record(t, count);
        }
        let (rate, _) = log.rate(0.0, 10.0).expect("rate");
        assert!((rate - 1000.0).abs() < 1.0, "{rate}");
    }

    /// Steps every 0.25 s of 100 tokens (400 tokens/s); `late(k)` is how late step k's
    /// report reaches the agent, s.
    fn steady_log(late: impl Fn(u32) -> f64) -> ProgressLog {
        let mut log = ProgressLog::default();
        for k in 1..=40 {
            log.record(f64::from(k) * 0.25 + late(k), f64::from(k) * 100.0);
        }
        log
    }

    #[test]
    fn late_reports_do_not_bias_the_rate() {
        // Every third report 100 ms late (a loaded machine): its interval reads 28 %
        // slow and the next one 67 % fast; the pooled rate is exact.
        let log = steady_log(|k| if k % 3 == 0 { 0.1 } else { 0.0 });
        let (rate, _) = log.rate(0.0, 11.0).expect("rate");
        assert!((rate - 400.0).abs() < 0.5, "{rate}");
    }

    #[test]
    fn jittered_arrivals_are_averaged_not_left_to_the_window_ends() {
        // Steps every 50 ms (a job at time scale 20), each report 0–40 ms late at random,
        // and the window's last report the latest: the first-to-last rate would be 0.8 %
        // low, more than a 600 W level's whole slowdown on a flat curve.
        let mut seed = 12345u64;
        let mut log = ProgressLog::default();
        for k in 0..=100u32 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let late = if k == 100 {
                0.04
            } else {
                (seed >> 11) as f64 / (1u64 << 53) as f64 * 0.04
            };
            log.record(f64::from(k) * 0.05 + late, f64::from(k) * 100.0);
        }
        let (rate, noise) = log.rate(0.0, 6.0).expect("rate");
        assert!((rate - 2000.0).abs() / 2000.0 < 0.0025, "{rate}");
        assert!(noise > 0.0 && noise < 0.005, "{noise}");
    }

    #[test]
    fn reports_read_in_clumps_give_no_rate_rather_than_a_wild_one() {
        // Steps every 50 ms of 100 tokens (2,000 tokens/s), but the agent reads them in
        // clumps: nothing for 0.8 s, then the 16 queued reports 1 ms apart (a reader
        // that waited on a busy loop). The clumps' gaps would pass for the pace (rate
        // 100,000/s) and the waits for pauses.
        let mut log = ProgressLog::default();
        let mut k = 0u32;
        for clump in 0..15u32 {
            for i in 0..16u32 {
                k += 1;
                log.record(
                    f64::from(clump) * 0.8 + f64::from(i) * 0.001,
                    f64::from(k) * 100.0,
                );
            }
        }
        // Each clump is one arrival, folded into the interval it ends: the rate is the
        // job's.
        let (rate, _) = log.rate(0.0, 12.0).expect("a rate from the clumps");
        assert!((rate - 2000.0).abs() / 2000.0 < 0.05, "{rate}");
        // A job that truly pauses for most of the window gives no rate either.
        let mut paused = ProgressLog::default();
        for i in 0..=40u32 {
            let t = if i <= 20 {
                f64::from(i) * 0.1
            } else {
                8.0 + f64::from(i - 20) * 0.1
            };
            paused.record(t, f64::from(i) * 100.0);
        }
        assert_eq!(paused.rate(0.0, 11.0), None);
    }

    #[test]
    fn three_ranks_reporting_each_step_give_the_jobs_rate() {
        // Steps every 100 ms; three ranks each report their own cumulative count of 100
        // tokens a step, 0.5 ms apart (300 tokens/step in all: 3,000 tokens/s).
        let mut log = ProgressLog::default();
        for step in 1..=100u32 {
            for rank in 0..3u32 {
                let t = f64::from(step) * 0.1 + f64::from(rank) * 0.0005;
                log.record_from(t, rank, f64::from(step) * 100.0);
            }
        }
        let (rate, _) = log.rate(2.0, 10.0).expect("rate");
        assert!((rate - 3000.0).abs() / 3000.0 < 0.02, "{rate}");
    }

    #[test]
    fn reports_read_a_little_late_do_not_pass_for_pauses() {
        // Steps every 50 ms of 100 tokens (2,000 tokens/s); every fifth report is read
        // 60 ms late (a descheduled agent on a loaded machine), the next one on time:
        // the late report's interval reads slower than half the pace.
        let mut log = ProgressLog::default();
        for k in 0..=200u32 {
            let late = if k % 5 == 0 && k > 0 { 0.06 } else { 0.0 };
            log.record(f64::from(k) * 0.05 + late, f64::from(k) * 100.0);
        }
        let (rate, _) = log.rate(0.0, 11.0).expect("rate");
        assert!((rate - 2000.0).abs() / 2000.0 < 0.003, "{rate}");
    }

    #[test]
    fn a_run_of_late_reports_does_not_tilt_the_rate() {
        // One 5 s window of 100 steps (2,000 tokens/s), stamped in whole milliseconds.
        // The job's process falls 40 ms behind at step 85 and catches up 4 ms a step:
        // least squares over every report read 0.18 % slow; the trimmed fit leaves the
        // late ones out.
        let mut log = ProgressLog::default();
        for k in 0..=100u32 {
            let behind = if (85..=92).contains(&k) {
                0.040 - 0.004 * f64::from(k - 85)
            } else {
                0.0
            };
            let t = ((f64::from(k) * 0.05 + behind) * 1000.0).round() / 1000.0;
            log.record(t, f64::from(k) * 100.0);
        }
        let (rate, noise) = log.rate(0.0, 5.0).expect("rate");
        assert!((rate - 2000.0).abs() / 2000.0 < 0.0002, "{rate}");
        assert!(noise < 0.001, "{noise}");
        // Two kinds of step (45 and 55 ms, alternating) are not a line and a few late
        // reports: half the points off the line leave nothing out.
        let mut log = ProgressLog::default();
        let mut t = 0.0;
        for k in 0..=100u32 {
            log.record(t, f64::from(k) * 100.0);
            t += if k % 2 == 0 { 0.045 } else { 0.055 };
        }
        let (rate, noise) = log.rate(0.0, 5.1).expect("rate");
        assert!((rate - 2000.0).abs() / 2000.0 < 0.002, "{rate}");
        assert!(noise > 1e-6, "a stated error, not zero: {noise}");
    }

    #[test]
    fn ranks_reporting_a_few_milliseconds_apart_are_each_measured_on_their_own_pace() {
        // Three ranks, a step every 50 ms, 100 tokens each per step; rank 2 reports
        // 3 ms after rank 1 and rank 3 6 ms after. Pooled, the short gaps set the pace
        // and every 44 ms gap was a pause: no rate at all.
        let mut log = ProgressLog::default();
        for k in 0..=100u32 {
            let t = f64::from(k) * 0.05;
            for rank in 0..3u32 {
                log.record_from(t + 0.003 * f64::from(rank), rank + 1, f64::from(k) * 100.0);
            }
        }
        let (rate, noise) = log.rate(0.0, 5.1).expect("a rate");
        assert!((rate - 6000.0).abs() / 6000.0 < 0.001, "{rate}");
        assert!(noise.is_finite() && noise < 0.01, "{noise}");
        // A rank heard once in the window (it just started) adds what it made there:
        // nothing yet.
        let mut log = ProgressLog::default();
        for k in 0..=100u32 {
            log.record_from(f64::from(k) * 0.05, 1, f64::from(k) * 100.0);
        }
        log.record_from(4.9, 3, 0.0);
        let (rate, _) = log.rate(0.0, 5.0).expect("a rate");
        assert!((rate - 2000.0).abs() / 2000.0 < 0.005, "{rate}");
    }

    #[test]
    fn a_step_handing_over_to_the_next_counts_each_over_its_share() {
        // One process reports for the first half of the window, its successor (a new
        // step, a new pid) for the second: the job made 2,000 tokens/s throughout.
        // Summing the two rates read 4,000.
        let mut log = ProgressLog::default();
        for k in 0..=50u32 {
            log.record_from(f64::from(k) * 0.05, 1, f64::from(k) * 100.0);
        }
        for k in 1..=50u32 {
            log.record_from(2.5 + f64::from(k) * 0.05, 2, f64::from(k) * 100.0);
        }
        let (rate, _) = log.rate(0.0, 5.0).expect("a rate");
        assert!((rate - 2000.0).abs() / 2000.0 < 0.03, "{rate}");
    }

    #[test]
    fn a_rank_whose_reports_arrive_in_one_clump_gives_no_pace_of_its_own() {
        // Rank 2's reports reach the agent once per window, 0.2 ms apart (a buffered
        // client): taken as its own series, their gaps set a pace and read 500 k.
        let mut log = ProgressLog::default();
        for k in 0..=100u32 {
            log.record_from(f64::from(k) * 0.05, 1, f64::from(k) * 100.0);
        }
        for k in 0..=100u32 {
            log.record_from(4.0 + f64::from(k) * 0.0002, 2, f64::from(k) * 100.0);
        }
        let (rate, _) = log.rate(0.0, 5.05).expect("a rate");
        // Rank 1's 2,000 plus what rank 2's clump says it made over the window.
        assert!(rate < 5000.0, "{rate}");
        assert!(rate >= 2000.0 * 0.999, "{rate}");
    }

    #[test]
    fn a_long_step_that_recurs_is_the_jobs_rhythm_not_a_pause() {
        // Gradient accumulation, every micro-step reported: seven of 30 ms and an
        // optimizer step of 190 ms, 100 tokens each: 800 tokens every 0.4 s.
        let mut log = ProgressLog::default();
        let mut t = 0.0;
        for k in 0..=120u32 {
            log.record(t, f64::from(k) * 100.0);
            t += if k % 8 == 7 { 0.19 } else { 0.03 };
        }
        let (rate, _) = log.rate(0.0, t).expect("rate");
        assert!((rate - 2000.0).abs() / 2000.0 < 0.01, "{rate}");
        // One such stretch in a window is still a pause (an evaluation), cut out.
        let mut log = ProgressLog::default();
        let mut t = 0.0;
        for k in 0..=100u32 {
            log.record(t, f64::from(k) * 100.0);
            t += if k == 50 { 1.0 } else { 0.05 };
        }
        let (rate, _) = log.rate(0.0, t).expect("rate");
        assert!((rate - 2000.0).abs() / 2000.0 < 0.002, "{rate}");
        // A checkpoint and two loader hiccups are three pauses, not a rhythm: all cut.
        let mut log = ProgressLog::default();
        let mut t = 0.0;
        for k in 0..=100u32 {
            log.record(t, f64::from(k) * 100.0);
            t += match k {
                20 => 1.0,
                50 | 80 => 0.25,
                _ => 0.05,
            };
        }
        let (rate, _) = log.rate(0.0, t).expect("rate");
        assert!((rate - 2000.0).abs() / 2000.0 < 0.002, "{rate}");
    }

    #[test]
    fn a_stall_just_before_the_window_does_not_lend_it_its_catch_up() {
        // The job stalled before the window opened and catches up inside it: its first
        // reports arrive 60 ms late, then 50, 40, ... back on schedule.
        let mut log = ProgressLog::default();
        for k in 0..=100u32 {
            let late = if k < 6 {
                0.06 - 0.01 * f64::from(k)
            } else {
                0.0
            };
            log.record(f64::from(k) * 0.05 + late, f64::from(k) * 100.0);
        }
        let (rate, _) = log.rate(0.0, 5.0).expect("rate");
        assert!((rate - 2000.0).abs() / 2000.0 < 0.0002, "{rate}");
    }

    #[test]
    fn a_slow_step_near_the_end_of_a_window_keeps_its_time() {
        // One step takes 150 ms instead of 50: every later point carries that time. Near
        // either end the later points are few and look like a run off the line; they
        // are not a late run that comes back, and leaving them out would read the
        // window 2 % fast (2,000 tokens/s) where it ran at 1,961.
        for slow in [3u32, 10, 90, 96] {
            let mut log = ProgressLog::default();
            let mut points = Vec::new();
            let mut t = 0.0;
            for k in 0..=100u32 {
                log.record(t, f64::from(k) * 100.0);
                points.push((f64::from(k) * 100.0, t));
                t += if k == slow { 0.15 } else { 0.05 };
            }
            let (rate, _) = log.rate(0.0, 5.2).expect("rate");
            // Nothing left out: the rate is the one fit over every report.
            let every = 1.0 / fit_time_on_count(&points).expect("a fit").seconds_per_count;
            assert!(
                (rate - every).abs() / every < 1e-9,
                "slow step {slow}: {rate} vs {every}"
            );
            assert!(rate < 1995.0, "slow step {slow}: {rate}");
        }
    }

    #[test]
    fn a_burst_of_reports_read_at_once_counts_where_it_was_earned() {
        // The agent is descheduled from 4.1 s to 6.0 s and reads the queued reports of
        // steps 17..=24 at 6.0 s (each 1 µs apart).
        let log = steady_log(|k| {
            if (17..=24).contains(&k) {
                6.0 + f64::from(k) * 1e-6 - f64::from(k) * 0.25
            } else {
                0.0
            }
        });
        let (rate, _) = log.rate(0.0, 11.0).expect("rate");
        assert!((rate - 400.0).abs() / 400.0 < 0.01, "{rate}");
    }

    #[test]
    fn a_job_that_stalls_and_catches_up_is_measured_at_its_rate() {
        // The job itself is descheduled from 3.0 s to 4.6 s, then completes the steps it
        // owes and reports once.
        let mut log = ProgressLog::default();
        for k in 1..=40u32 {
            let t = f64::from(k) * 0.25;
            if (3.0..4.6).contains(&t) {
                continue;
            }
            log.record(t, f64::from(k) * 100.0);
        }
        let (rate, _) = log.rate(0.0, 11.0).expect("rate");
        assert!((rate - 400.0).abs() / 400.0 < 0.01, "{rate}");
    }

    #[test]
    fn a_level_held_below_its_cap_moves_to_the_grant_and_starts_afresh() {
        let mut cal = Calibration::new(settings(), Some(0.5), true, 0.0);
        cal.start_design(10.0, None);
        assert_eq!(cal.cap(), Some(Watts(700.0)));
        cal.held_below_level(25.0, Watts(600.0));
        assert_eq!(
            cal.phase,
            Phase::Walking {
                cap: Watts(600.0),
                since: 25.0,
                window_from: 27.0
            }
        );
    }

    /// Issue 13: a job capped from the start restarted its walk at level 0 for as long as
    /// the cap held, so it was never measured.
    #[test]
    fn a_job_capped_from_the_start_is_walked_from_its_grant_down() {
        let mut cal = Calibration::new(settings(), Some(0.5), true, 0.0);
        let mut log = ProgressLog::default();
        let granted = 450.0;
        let (mut t, mut count) = (0.0f64, 0.0f64);
        let mut next_tick = 1.0;
        while t < 3000.0 && cal.is_active() {
            let cap = cal.cap().map_or(granted, |c| c.0.min(granted));
            t += 0.1;
            count += 1000.0 * speed(cap) * 0.1;
            log.record(t, count);
            if t >= next_tick {
                if cal.cap().is_some_and(|level| granted < level.0 - 0.5) {
                    cal.held_below_level(t, Watts(granted));
                }
                cal.tick(t, &log, Some(Watts(8.0 * cap)));
                next_tick += 1.0;
            }
        }
        assert_eq!(cal.phase, Phase::Done, "{:?}", cal.levels());
        let levels = cal.levels();
        assert_eq!(
            levels[0].cap,
            Watts(400.0),
            "the first level at or below the grant"
        );
        assert!(levels.iter().all(|l| l.cap.0 <= granted));
        assert!(levels.len() >= 2);
    }

    #[test]
    fn a_grant_below_every_level_left_ends_the_walk() {
        let mut cal = Calibration::new(settings(), Some(0.5), true, 0.0);
        cal.start_design(10.0, None);
        cal.held_below_level(11.0, Watts(150.0));
        assert!(!cal.is_active());
        assert!(
            matches!(cal.phase, Phase::Skipped(_)),
            "nothing measured: {:?}",
            cal.phase
        );
    }

    #[test]
    fn a_restored_curve_is_kept_not_walked_again() {
        let mut cal = Calibration::new(settings(), Some(0.5), true, 0.0);
        cal.restore(&[
            [700.0, 5600.0, 1000.0],
            [500.0, 4000.0, 850.0],
            [300.0, 2400.0, 700.0],
        ]);
        assert_eq!(cal.phase, Phase::Done);
        assert!(cal.curve().is_some());
        assert!(cal.pfi().is_some());
        let mut one = Calibration::new(settings(), Some(0.5), true, 0.0);
        one.restore(&[[700.0, 5600.0, 1000.0], [f64::NAN, 1.0, 1.0]]);
        assert_eq!(one.phase, Phase::Warmup, "one valid point is no curve");
    }

    #[test]
    fn a_drifted_job_is_walked_again_at_a_bounded_rate_and_keeps_its_curve_meanwhile() {
        let mut cal = run(Some(0.5));
        assert_eq!(cal.phase, Phase::Done);
        let done_at = cal.finished_at.expect("finished");
        let levels = cal.levels();
        assert!(!cal.rewalk(done_at + 10.0), "too soon after the last walk");
        assert!(cal.rewalk(done_at + DEFAULT_REWALK_AFTER_S));
        assert_eq!(cal.phase, Phase::Warmup);
        assert_eq!(cal.best_levels(), levels, "the old curve while walking");
        assert!(
            !cal.rewalk(done_at + 2.0 * DEFAULT_REWALK_AFTER_S),
            "only a finished walk is repeated"
        );
        cal.rewalks = MAX_REWALKS;
        cal.phase = Phase::Done;
        cal.finished_at = Some(0.0);
        assert!(!cal.rewalk(1e9), "at most MAX_REWALKS repeats");
    }

    /// Issue 14: a job's reported curve decides its floor; a job that reports a steep
    /// drop under caps buys a high floor. Its GPUs' clocks say how much a cap can slow it.
    #[test]
    fn a_reported_slowdown_steeper_than_the_clock_is_not_believed() {
        let level = |cap: f64, throughput: f64, clock: f64| Level {
            cap: Watts(cap),
            power: Watts(cap * 4.0),
            throughput,
            relative_noise: 0.005,
            sm_clock_mhz: Some(clock),
            windows: 1,
        };
        // Honest: throughput falls less than the clock (a memory-bound job).
        let honest = [
            level(700.0, 1000.0, 1980.0),
            level(500.0, 930.0, 1600.0),
            level(300.0, 800.0, 1200.0),
        ];
        assert_eq!(implausible(&honest), None);
        // Compute-bound: throughput falls with the clock, within the margin.
        let compute = [level(700.0, 1000.0, 1980.0), level(500.0, 800.0, 1600.0)];
        assert_eq!(implausible(&compute), None);
        // Words: a 50 % drop while the clock fell 19 %.
        let inflated = [level(700.0, 1000.0, 1980.0), level(500.0, 500.0, 1600.0)];
        let why = implausible(&inflated).expect("implausible");
        assert!(why.contains("500 W"), "{why}");
        // Without clocks nothing can be said.
        let blind = [
            Level {
                sm_clock_mhz: None,
                ..level(700.0, 1000.0, 0.0)
            },
            level(500.0, 500.0, 1600.0),
        ];
        assert_eq!(implausible(&blind), None);
    }

    #[test]
    fn an_implausible_walk_ends_on_the_prior_and_is_flagged() {
        let mut cal = Calibration::new(settings(), Some(0.5), true, 0.0);
        let mut log = ProgressLog::default();
        let (mut t, mut count) = (0.0f64, 0.0f64);
        let mut next_tick = 1.0;
        while t < 3000.0 && cal.is_active() {
            let cap = cal.cap().map_or(700.0, |c| c.0);
            t += 0.1;
            // The job claims to lose 2 % of its speed per 10 W of cap.
            count += 1000.0 * (1.0 - (700.0 - cap) / 500.0).max(0.05) * 0.1;
            log.record(t, count);
            if t >= next_tick {
                // A memory-bound GPU: the clock loses a third of what the cap takes.
                cal.observe_clock(t, 1980.0 * (1.0 - (700.0 - cap) / 700.0 / 3.0));
                cal.tick(t, &log, Some(Watts(4.0 * cap)));
                next_tick += 1.0;
            }
        }
        assert!(
            matches!(&cal.phase, Phase::Skipped(why) if why.contains("telemetry prior")),
            "{:?}",
            cal.phase
        );
        assert!(cal.implausible.is_some());
        assert!(cal.curve().is_none() && cal.pfi().is_none());
    }

    /// Runs a finished calibration on in operation from `t` for `seconds`: the budget
    /// holds the job at `granted` (the lease's cap; the probe may go lower), the job
    /// reports every 0.1 s at its rate with 1 % jitter per report, the GPUs read back the
    /// cap written (after one tick). Returns the time reached.
    fn operate(
        cal: &mut Calibration,
        log: &mut ProgressLog,
        t0: f64,
        seconds: f64,
        granted: f64,
        may_probe: bool,
    ) -> f64 {
        let mut t = t0;
        let mut count = log.last().map_or(0.0, |l| l.1);
        let mut held: Option<(Watts, f64)> = None;
        let mut next_tick = t0 + 1.0;
        let mut k = 0u64;
        while t < t0 + seconds {
            let cap = cal.cap().map_or(granted, |c| c.0.min(granted));
            t += 0.1;
            k += 1;
            let jitter = 1.0 + 0.01 * ((k * 7919 % 13) as f64 / 6.0 - 1.0);
            count += 1000.0 * speed(cap) * 0.1 * jitter;
            log.record(t, count);
            if t >= next_tick {
                next_tick += 1.0;
                // The GPUs read back the cap written at the last tick.
                if held.is_none_or(|(c, _)| (c.0 - cap).abs() > 0.5) {
                    held = Some((Watts(cap), t));
                }
                cal.observe_operation(t, log, Some(Watts(8.0 * cap)), held);
                cal.check_probe(t, Some(Watts(granted)));
                if may_probe {
                    cal.consider_probe(t, Watts(granted), Watts(25.0), Watts(200.0));
                }
                assert!(
                    cal.cap().is_none_or(|c| c.0 <= granted),
                    "a probe never raises a job above its grant"
                );
            }
        }
        t
    }

    #[test]
    fn steady_stretches_after_the_walk_refine_the_curve() {
        let mut cal = Calibration::new(settings(), Some(0.5), true, 0.0);
        let mut log = ProgressLog::default();
        let t = operate_walk(&mut cal, &mut log);
        assert_eq!(cal.phase, Phase::Done);
        let before = cal.curve().expect("curve");
        let windows_at = |cal: &Calibration, cap: f64| {
            cal.windows
                .iter()
                .filter(|w| (w.cap.0 - cap).abs() < 0.5)
                .count()
        };
        let n_before = windows_at(&cal, 500.0);
        let sigma_before = before.sigma_at(Watts(500.0)).expect("sigma").throughput;
        // An event holds the job at 500 W for ten minutes.
        operate(&mut cal, &mut log, t, 600.0, 500.0, false);
        let after = cal.curve().expect("curve");
        let n_after = windows_at(&cal, 500.0);
        let sigma_after = after.sigma_at(Watts(500.0)).expect("sigma").throughput;
        assert!(
            n_after > n_before,
            "windows at 500 W: {n_before} -> {n_after}"
        );
        assert!(
            sigma_after < 0.7 * sigma_before,
            "sigma at 500 W: {sigma_before} -> {sigma_after}"
        );
        assert!(cal.windows.iter().any(|w| w.learned));
        // The point stays where the job runs.
        let truth = 1000.0 * speed(500.0);
        let at = after.at(Watts(500.0)).throughput;
        assert!((at - truth).abs() / truth < 0.01, "{at} vs {truth}");
        // Bounded memory: the newest MAX_WINDOWS_PER_CAP per cap.
        assert_eq!(n_after, MAX_WINDOWS_PER_CAP);
    }

    /// Walks a fresh calibration to its end on a fake clock; returns the time reached.
    fn operate_walk(cal: &mut Calibration, log: &mut ProgressLog) -> f64 {
        let (mut t, mut count) = (0.0f64, 0.0f64);
        let mut next_tick = 1.0;
        while t < 3000.0 && cal.is_active() {
            let cap = cal.cap().map_or(700.0, |c| c.0);
            t += 0.1;
            count += 1000.0 * speed(cap) * 0.1;
            log.record(t, count);
            if t >= next_tick {
                cal.tick(t, log, Some(Watts(8.0 * cap)));
                next_tick += 1.0;
            }
        }
        t
    }

    #[test]
    fn an_events_hold_probes_one_step_below_the_grant_within_budget_and_bound() {
        // A coarse grid: the walk never reads 475 W.
        let mut s = settings();
        s.grid = [700.0, 500.0, 300.0].map(Watts).to_vec();
        let mut cal = Calibration::new(s, Some(0.5), true, 0.0);
        let mut log = ProgressLog::default();
        let t = operate_walk(&mut cal, &mut log);
        assert_eq!(cal.phase, Phase::Done);
        assert!(cal
            .curve()
            .expect("curve")
            .knots()
            .iter()
            .all(|k| k.cap_w.0 != 475.0));
        let t = operate(&mut cal, &mut log, t, 900.0, 500.0, true);
        let probed = cal
            .windows
            .iter()
            .filter(|w| (w.cap.0 - 475.0).abs() < 0.5)
            .count();
        assert!(
            (1..=PROBE_WINDOWS).contains(&probed),
            "windows at the probe cap: {probed}"
        );
        let curve = cal.curve().expect("curve");
        assert!(
            curve.knots().iter().any(|k| k.cap_w.0 == 475.0),
            "a new point"
        );
        let truth = 1000.0 * speed(475.0);
        let at = curve.at(Watts(475.0)).throughput;
        assert!((at - truth).abs() / truth < 0.01, "{at} vs {truth}");
        assert!(cal.probe_cost > 0.0);
        let age = t - cal.started_at.expect("started");
        assert!(
            cal.probe_cost <= 0.02 * age * cal.top_throughput + 1000.0 * 0.05 * 40.0,
            "probes stay within the token budget (one probe's overshoot at most)"
        );
        // Uncapped (no event): no probe.
        let mut idle = Calibration::new(settings(), Some(0.5), true, 0.0);
        let mut log = ProgressLog::default();
        let t = operate_walk(&mut idle, &mut log);
        operate(&mut idle, &mut log, t, 300.0, 700.0, true);
        assert_eq!(idle.probe_cost, 0.0);
        // A probe the tier bound forbids: flex1 at a grant where one step more breaks it.
        let mut tight = Calibration::new(settings(), Some(0.10), true, 0.0);
        let mut log = ProgressLog::default();
        let t = operate_walk(&mut tight, &mut log);
        assert_eq!(tight.phase, Phase::Done, "{:?}", tight.phase);
        // 560 W loses exactly 10 %; 535 W would lose 11.8 %.
        operate(&mut tight, &mut log, t, 300.0, 560.0, true);
        assert!(tight.windows.iter().all(|w| (w.cap.0 - 535.0).abs() > 0.5));
    }
}
