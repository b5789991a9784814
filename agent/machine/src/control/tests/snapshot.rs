//! What each user may see of the status.

use super::*;

/// Need-to-know: a local user must not read other users' job ids, uids, tiers and
/// throughput from the agent's status.
#[test]
fn a_user_sees_only_their_own_jobs_and_root_sees_all() {
    let mut a = agent(Some(Watts(2800.0)));
    a.register(0.0, "1", "0", 1000, "n1", &["0".into()], "flex1")
        .expect("job 1");
    a.register(
        0.0,
        "2",
        "0",
        1001,
        "n1",
        &["1".into(), "2".into()],
        "flex2",
    )
    .expect("job 2");
    // NVML lists job 1's process and one in no job on GPU 0, job 2's on GPU 1.
    a.nvml_processes_seen(
        1.0,
        &BTreeMap::from([
            (0, vec![(11, Some("1".to_string())), (99, None)]),
            (1, vec![(12, Some("2".to_string()))]),
        ]),
    );
    let all = a.snapshot(1.0);
    assert_eq!(all.gpus[0].processes.len(), 2, "root sees every process");
    let mine = super::seen_by(&all, 1000);
    assert_eq!(
        mine.gpus[0].processes,
        vec![GpuProcess {
            pid: 11,
            job: Some("1".into())
        }],
        "only the user's own jobs' processes"
    );
    assert!(mine.gpus[1].processes.is_empty());
    assert_eq!(
        mine.jobs.iter().map(|j| j.job.as_str()).collect::<Vec<_>>(),
        ["1"]
    );
    assert_eq!(mine.gpus.len(), 4, "the node's GPUs stay visible");
    assert_eq!(mine.gpus[0].job.as_deref(), Some("1"));
    assert!(
        mine.gpus[1..].iter().all(|g| g.job.is_none()),
        "{:?}",
        mine.gpus
    );
    assert!(super::seen_by(&all, 4242).jobs.is_empty());
    assert_eq!(super::seen_by(&all, 0), all);
    // Ended jobs' final shares are their owners' too.
    assert!(a.end_job("2", 2.0));
    let all = a.snapshot(2.0);
    assert_eq!(all.ended.len(), 1);
    assert!(super::seen_by(&all, 1000).ended.is_empty());
    assert_eq!(super::seen_by(&all, 1001).ended.len(), 1);
}
