//! A job's progress as its processes report it: each reporter followed on its own, and
//! the rate over a window fitted to the arrivals (pauses, late reports and clumps left
//! out of it).

use std::collections::{BTreeMap, VecDeque};

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

/// Reporters not heard for this long are forgotten (a step that ended), s.
const SOURCE_FORGET_S: f64 = 600.0;
/// Most reporters followed per job on one node (the progress socket admits 16 per uid).
const MAX_SOURCES: usize = 64;

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
    // window whose catch-up fell inside it: left in, it reads a first window at a new
    // cap fast (0.6 % in a demo job). Early points at the start are a slow step just
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
    // fast; cutting out only the slow one would book the late report's time nowhere
    // and its counts in the fast interval, a rate a few per cent high (1.2 % at a
    // demo job's lowest cap, its PFI 14 % off).
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

#[cfg(test)]
mod tests;
