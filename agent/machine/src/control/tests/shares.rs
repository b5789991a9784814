//! Each job's energy share on this node.

use super::*;

#[test]
fn a_job_is_charged_its_own_gpus_counters_over_its_hold_and_its_end_is_final() {
    let mut a = agent(None);
    a.register(
        1001.0,
        "7",
        "0",
        1000,
        "n1",
        &["0".into(), "1".into()],
        "flex2",
    )
    .expect("7");
    a.register(1001.0, "8", "0", 2000, "n1", &["2".into()], "none")
        .expect("8");
    // The readings at registration start each hold.
    for g in 0..3 {
        a.sampled(
            1001.0,
            g,
            reading(700.0, 650.0, 10_000 * u64::from(g + 1), false),
        );
    }
    a.tick(1001.0);
    a.event_in_force = true;
    for (t, e) in [(1002.0, 500_000u64), (1003.0, 1_000_000)] {
        for g in 0..3 {
            a.sampled(
                t,
                g,
                reading(500.0, 480.0, 10_000 * u64::from(g + 1) + e, true),
            );
        }
        a.tick(t);
    }
    let running = a.snapshot(1003.0);
    let seven = running.jobs.iter().find(|j| j.job == "7").expect("7");
    let share = seven.usage.as_ref().expect("usage");
    // GPUs 0 and 1 each advanced 1,000,000 mJ over the hold; GPU 2 is job 8's.
    assert_eq!(share.energy_mj, 2_000_000);
    assert_eq!(share.gpus.len(), 2);
    assert_eq!(
        (share.from_unix_ms, share.to_unix_ms),
        (1_001_000, 1_003_000)
    );
    assert!(!share.ended);
    assert_eq!(
        share.peak_power_w, 1300.0,
        "two GPUs at 650 W before the cut"
    );
    // Capped, in an event and throttled from the 2 s observation to the 3 s one.
    assert_eq!(
        (share.capped_s, share.event_s, share.power_throttled_s),
        (1.0, 1.0, 1.0)
    );
    assert!(a.end_job("7", 1003.5));
    // Job 7's GPUs read after its end are no longer its.
    a.sampled(1004.0, 0, reading(700.0, 100.0, 9_999_999, false));
    let ended = a.unacked_finals();
    assert_eq!(ended.len(), 1);
    assert!(ended[0].ended && ended[0].energy_mj == 2_000_000 && ended[0].uid == 1000);
    assert_eq!(a.take_records().len(), 1);
    assert!(a.take_records().is_empty(), "a record is logged once");
    // Kept, and re-sent, until the controller acknowledges it: an hour on, still.
    a.tick(3_604.0);
    assert_eq!(a.unacked_finals(), ended);
    assert_eq!(a.acked(&[FinalRef::of(&ended[0])]), 1);
    assert!(
        a.unacked_finals().is_empty(),
        "acknowledged: no longer sent"
    );
    assert_eq!(
        a.acked(&[FinalRef::of(&ended[0])]),
        0,
        "a repeat ack is harmless"
    );
    // Job 8 (none) is accounted too.
    let eight = a.snapshot(1004.0);
    let eight = eight.jobs.iter().find(|j| j.job == "8").expect("8");
    assert_eq!(eight.usage.as_ref().expect("usage").energy_mj, 1_000_000);
}

/// The line at the end of a batch job's output is made from the share its batch
/// step's end returns, which must be the final share the controller gets.
#[test]
fn the_batch_step_s_end_makes_the_job_s_final_share_and_keeps_its_caps_to_its_end() {
    let mut a = agent(None);
    let gpus = ["0".to_string(), "1".to_string()];
    a.register(1001.0, "7", "batch", 1000, "n1", &gpus, "flex2")
        .expect("batch");
    a.register(1001.5, "7", "0", 1000, "n1", &gpus, "flex2")
        .expect("step 0");
    for (t, e) in [(1001.0, 0u64), (1002.0, 400_000), (1003.0, 900_000)] {
        for g in 0..2 {
            a.sampled(t, g, reading(700.0, 450.0, 5_000 + e, false));
        }
        a.tick(t);
    }
    // An srun step's end leaves the job (and its hold) in place.
    assert_eq!(a.end_step("7", "0", 1003.0), Ok(None));
    assert!(a.jobs.contains_key("7"));
    let share = a
        .end_step("7", "batch", 1003.2)
        .expect("known")
        .expect("the batch step's end ends the job");
    assert!(share.ended);
    assert_eq!(share.energy_mj, 1_800_000);
    assert_eq!(share.uid, 1000);
    // The job keeps its GPUs, at their caps, while Slurm stops what is left of it.
    assert!(a.jobs.contains_key("7"), "held until the job's end");
    assert_eq!(a.gpus[0].job.as_deref(), Some("7"));
    assert_eq!(
        a.unacked_finals(),
        vec![share.clone()],
        "what the controller gets"
    );
    // A second batch end, and the job's end that follows, make no second share.
    a.sampled(1003.3, 0, reading(700.0, 450.0, 5_000 + 950_000, false));
    assert_eq!(a.end_step("7", "batch", 1003.3), Ok(Some(share.clone())));
    assert!(a.end_job("7", 1003.4), "the job's end releases its GPUs");
    assert_eq!(a.gpus[0].job, None);
    assert_eq!(a.unacked_finals(), vec![share.clone()], "one final share");
    assert_eq!(a.take_records(), vec![share]);
    // A cancelled job: the extern step's end came first; the batch step's end still
    // gets the final share.
    a.register(1004.0, "9", "batch", 1000, "n1", &gpus, "flex2")
        .expect("9");
    assert!(a.end_job("9", 1005.0));
    let late = a
        .end_step("9", "batch", 1005.1)
        .expect("ended here")
        .expect("share");
    assert!(late.ended && late.job_id == "9");
    assert!(
        a.end_step("9", "0", 1005.1).is_err(),
        "no job 9 for other steps"
    );
    assert!(a.end_step("8", "batch", 1005.1).is_err(), "never here");
}
