//! The progress log's tests: reporters, restarts, and rates over windows with pauses,
//! late reports, clumps and several ranks.

use super::*;

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
