//! Progress reports and the warm-up they end.

use super::*;

/// Only the job's owner or root may report its progress, and only from a step of
/// the job's own Slurm cluster (the test clusters share one host and repeat job
/// ids); every refusal is counted, and nothing refused reaches the job's log.
#[test]
fn progress_is_taken_only_from_the_jobs_owner_or_root_of_its_cluster() {
    let mut a = agent(Some(Watts(2800.0)));
    a.register(0.0, "1", "0", 1000, "n1", &["0".into()], "flex1")
        .expect("job 1");
    a.set_job_cluster("1", Some("/etc/slurm-a/slurm.conf".into()), 0.0);
    let report = |tokens| ProgressReport {
        v: 1,
        job_id: "1".into(),
        tokens,
        steps: tokens / 1000,
    };
    let sender = |uid, cluster: Option<&str>| ReportSender {
        uid,
        pid: 4000 + uid,
        step_job: "1".into(),
        cluster: cluster.map(str::to_string),
    };
    let ours = Some("/etc/slurm-a/slurm.conf");
    assert_eq!(
        a.report_progress(1.0, &sender(1000, ours), &report(1000)),
        Ok(())
    );
    assert_eq!(
        a.report_progress(1.1, &sender(0, ours), &report(2000)),
        Ok(())
    );
    let refused = [
        a.report_progress(1.2, &sender(1001, ours), &report(9_000_000)),
        a.report_progress(
            1.3,
            &sender(1000, Some("/etc/slurm-b/slurm.conf")),
            &report(9_000_000),
        ),
        a.report_progress(1.4, &sender(1000, None), &report(9_000_000)),
        a.report_progress(
            1.5,
            &sender(1000, ours),
            &ProgressReport {
                job_id: "2".into(),
                ..report(9_000_000)
            },
        ),
    ];
    let reasons: Vec<String> = refused
        .into_iter()
        .map(|r| r.expect_err("refused").to_string())
        .collect();
    assert!(
        reasons[0].contains("uid 1001 may not report for job 1"),
        "{reasons:?}"
    );
    assert!(reasons[1].contains("another Slurm cluster"), "{reasons:?}");
    assert!(reasons[2].contains("the default config"), "{reasons:?}");
    assert!(reasons[3].contains("no job 2"), "{reasons:?}");
    a.progress_refused();
    assert_eq!(a.progress_rejected, 5);
    assert_eq!(
        a.jobs["1"].log.last().map(|(_, count)| count),
        Some(1000.0),
        "only the two accepted reports counted: owner's 1000, then root's own counter from its first report"
    );
}

/// A job silent past `no_signal_s` is planned on the telemetry prior; its first
/// report starts its calibration and drops that prior, so it is planned as every
/// reporting job is until its walk ends, not on a reading frozen at that moment.
#[test]
fn a_late_first_report_ends_the_telemetry_prior() {
    let mut a = agent(None);
    a.register(0.0, "4", "0", 1000, "n1", &["0".into()], "flex2")
        .expect("registered");
    a.tick(1.0);
    assert!(
        a.jobs["4"].prior.is_none(),
        "within no_signal_s: no prior yet"
    );
    a.tick(11.0);
    assert_eq!(a.jobs["4"].calibration.phase, Phase::NoSignal);
    assert!(
        a.jobs["4"].prior.is_some(),
        "planned on the telemetry prior"
    );
    a.progress(12.0, "4", 77, 1000, 1).expect("report");
    a.tick(12.0);
    assert_eq!(a.jobs["4"].calibration.phase, Phase::Warmup);
    assert!(a.jobs["4"].prior.is_none());
}

/// The demo's job 3 stayed in warm-up on n2 for its whole 240 s wait: a second rank's
/// reports, one step behind the first, reached the same agent, and every switch
/// between the two made the count go backwards, which cleared the log, so it never
/// held the five steady seconds warm-up waits for.
#[test]
fn two_ranks_reporting_to_one_agent_do_not_keep_the_job_in_warm_up() {
    for lag_steps in [1, 3, 0] {
        let (phase, waiting, a) = two_reporters(lag_steps, 60.0);
        let cal = &a.jobs["3"].calibration;
        assert!(
            cal.started_at.is_some_and(|t| t < 10.0),
            "lag {lag_steps}: the walk never started; {phase:?}: {waiting:?}"
        );
        assert_eq!(a.jobs["3"].log.reporters(60.0, 10.0), 2);
        assert_eq!(a.jobs["3"].log.restarts, 0, "no counter went backwards");
    }
}

/// A warm-up that has not ended says why, in status.
#[test]
fn a_job_in_warm_up_says_what_it_waits_for() {
    let mut a = agent(None);
    a.register(0.0, "9", "0", 0, "n1", &["0".into()], "flex3")
        .expect("registered");
    a.tick(1.0);
    let note = |a: &Agent| {
        a.snapshot(0.0)
            .jobs
            .iter()
            .find(|j| j.job == "9")
            .and_then(|j| j.calibration_note.clone())
            .unwrap_or_default()
    };
    assert_eq!(note(&a), "no progress report yet");
    // Reports every 50 ms whose rate halves and doubles every 1.5 s: never steady.
    let mut count = 0u64;
    for k in 0..200u64 {
        let t = 1.0 + k as f64 * 0.05;
        count += if (k / 30) % 2 == 0 { 100 } else { 50 };
        a.progress(t, "9", 77, count, k).expect("report");
        if k % 10 == 0 {
            a.tick(t);
        }
    }
    assert_eq!(a.jobs["9"].calibration.phase, Phase::Warmup);
    let why = note(&a);
    assert!(
        why.starts_with("waiting for steady progress: the rate varies"),
        "{why}"
    );
}
