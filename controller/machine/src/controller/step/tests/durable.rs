//! Effects after durability, and Slurm's record of jobs held by powerflex that the state
//! in force does not hold.

use super::*;

fn durable(version: u64) -> Input {
    Input::Durable { version }
}

fn not_durable(version: u64, error: &str) -> Input {
    Input::NotDurable {
        version,
        error: error.into(),
    }
}

/// Two nodes at 500 W a GPU under a 4 kW budget, every state so far durable.
fn two_at_500_w_saved() -> Controller {
    let mut core = fresh();
    two_jobs_at_500_w(&mut core, "flex3");
    let out = core.step(UnixMs(T0 + 1), vec![]);
    assert!(out.persist.is_none(), "{out:?}");
    // The budget set at T0 was held for version 1; made durable here.
    core.step(UnixMs(T0 + 2), vec![durable(1)]);
    core
}

#[test]
fn a_cut_reaches_no_agent_and_is_not_acknowledged_before_it_is_durable() {
    let mut core = two_at_500_w_saved();
    let out = core.step(UnixMs(T0 + 1_000), vec![budget_set(2000.0, None)]);
    let saved = out.persist.clone().expect("the change is saved");
    assert_eq!(saved.budget_w, Some(Watts(2000.0)));
    assert!(
        out.replies.is_empty(),
        "acknowledged before durable: {out:?}"
    );
    assert_eq!(out.wait_replies.len(), 1);
    assert!(
        out.leases.is_empty(),
        "a lease went out before durable: {out:?}"
    );
    let (index, ticket) = out.wait_replies[0];
    assert_eq!(index, 0);

    // Time passes and ticks come while the save is on its way: still nothing.
    let out2 = core.step(UnixMs(T0 + 11_000), vec![Input::Tick]);
    assert!(
        out2.leases.is_empty() && out2.late_replies.is_empty(),
        "{out2:?}"
    );

    let done = core.step(UnixMs(T0 + 11_500), vec![durable(out.persist_version)]);
    assert_eq!(done.late_replies.len(), 1, "{done:?}");
    assert_eq!(done.late_replies[0].0, ticket);
    assert!(done.late_replies[0].1.is_ok());
    let total: f64 = done
        .leases
        .values()
        .flat_map(|l| l.caps.values())
        .map(|cap_w| cap_w * 4.0)
        .sum();
    assert!(
        !done.leases.is_empty() && total <= 2000.0 + 1e-6,
        "the cut's leases go out once durable: {done:?}"
    );
}

#[test]
fn a_failed_save_refuses_the_change_keeps_the_durable_state_and_refuses_changes_until_saved() {
    let mut core = two_at_500_w_saved();
    let before = core.state().clone();
    let out = core.step(UnixMs(T0 + 1_000), vec![budget_set(2000.0, None)]);
    let (_, ticket) = out.wait_replies[0];
    let failed = core.step(
        UnixMs(T0 + 1_100),
        vec![not_durable(out.persist_version, "disk full")],
    );
    assert_eq!(failed.late_replies.len(), 1, "{failed:?}");
    let (t, r) = &failed.late_replies[0];
    assert_eq!(*t, ticket);
    assert_eq!(r.refusal(), Some(Refusal::NotDurable), "{r:?}");
    assert!(
        r.error_message().is_some_and(|m| m.contains("disk full")),
        "{r:?}"
    );
    assert!(
        failed.leases.is_empty(),
        "the refused cut's leases are dropped"
    );
    assert_eq!(
        core.state().budget_w,
        before.budget_w,
        "the durable budget in force"
    );
    // The state in force is saved again, so a retry never writes the refused change.
    let again = failed
        .persist
        .clone()
        .expect("the durable state saved again");
    assert_eq!(again.budget_w, before.budget_w);

    // Changes are refused with the cause while saves fail; reads are answered.
    let refused = core.step(UnixMs(T0 + 1_200), vec![budget_set(3000.0, None)]);
    let r = reply(&refused);
    assert_eq!(r.refusal(), Some(Refusal::NotDurable), "{r:?}");
    assert!(r.error_message().is_some_and(|m| m.contains("disk full")));
    let read = core.step(UnixMs(T0 + 1_300), vec![admin(AdminOp::Status, 0)]);
    assert!(reply(&read).is_ok());

    // The allocation goes on from the durable state: the 4 kW budget's caps.
    let tick = core.step(
        UnixMs(T0 + 11_000),
        vec![
            at_cap("n1", "101", "flex3", 500.0),
            at_cap("n2", "102", "flex3", 500.0),
            Input::Tick,
        ],
    );
    let total: f64 = tick
        .leases
        .values()
        .flat_map(|l| l.caps.values())
        .map(|cap_w| cap_w * 4.0)
        .sum();
    assert!(total > 2000.0 && total <= 4000.0 + 1e-6, "{tick:?}");

    // Each period tries a save again; one that succeeds lets changes in again.
    assert!(
        tick.persist
            .as_ref()
            .is_some_and(|s| s.budget_w == before.budget_w),
        "a save is tried again each period: {tick:?}"
    );
    core.step(UnixMs(T0 + 11_100), vec![durable(again_version(&tick))]);
    let out = core.step(UnixMs(T0 + 11_200), vec![budget_set(3000.0, None)]);
    assert!(
        out.replies.is_empty() && out.wait_replies.len() == 1,
        "{out:?}"
    );
}

fn again_version(out: &Output) -> u64 {
    assert!(out.persist.is_some());
    out.persist_version
}

#[test]
fn a_suspension_runs_only_once_the_held_set_is_durable() {
    let mut core = fresh();
    core.step(UnixMs(T0), flex0_beside_a_suspendable_job(|job| job));
    core.step(UnixMs(T0 + 1), vec![durable(1)]);
    let cut = cut_below_the_caps_announced();
    let out = core.step(UnixMs(T0 + 500), vec![cut]);
    let saved = out.persist.clone().expect("saved");
    assert!(saved.preempted.contains_key("102"));
    assert!(out.preempt.is_empty(), "suspended before durable: {out:?}");
    assert!(out.annotations.is_empty(), "{out:?}");
    let done = core.step(UnixMs(T0 + 600), vec![durable(out.persist_version)]);
    assert_eq!(done.preempt, [Action::Suspend { job: "102".into() }]);
    assert_eq!(
        cap(&done, "n2", "102"),
        Some(200.0),
        "held at its lowest cap"
    );
    assert_eq!(done.late_replies.len(), 1);
}

#[test]
fn a_leader_that_steps_down_before_its_state_is_durable_carries_out_nothing() {
    let mut core = two_at_500_w_saved();
    core.step(
        UnixMs(T0 + 3),
        vec![leadership(LeadershipRole::Active, 4, None)],
    );
    let out = core.step(UnixMs(T0 + 1_000), vec![budget_set(2000.0, None)]);
    assert!(out.leases.is_empty() && out.replies.is_empty());
    let down = core.step(
        UnixMs(T0 + 2_000),
        vec![leadership(LeadershipRole::SteppedDown, 4, None)],
    );
    assert_eq!(down.late_replies.len(), 1, "{down:?}");
    assert_eq!(down.late_replies[0].1.refusal(), Some(Refusal::NotActive));
    // Its save confirmed late: nothing held is carried out by a controller that stopped.
    let late = core.step(UnixMs(T0 + 3_000), vec![durable(out.persist_version)]);
    assert!(
        late.leases.is_empty() && late.preempt.is_empty() && late.late_replies.is_empty(),
        "{late:?}"
    );
}

/// Slurm's placement with one job per (id, node, state, `AdminComment`).
fn slurm_with(
    jobs: &[(
        &str,
        &str,
        powerflex_core::slurm_record::SlurmJobState,
        &str,
    )],
) -> Input {
    use powerflex_core::slurm_record::SlurmJob;
    Input::Placement(Box::new(Ok(Placement {
        jobs: jobs
            .iter()
            .map(|(id, node, state, comment)| {
                (
                    id.to_string(),
                    SlurmJob {
                        nodes: [node.to_string()].into(),
                        uid: 1000,
                        state: *state,
                        admin_comment: comment.to_string(),
                        account: "physics".to_string(),
                        start_unix_s: Some(T0 / 1000 - 60),
                    },
                )
            })
            .collect(),
        node_gpus: [("n1".to_string(), 8), ("n2".to_string(), 8)].into(),
        read_at_ms: T0,
    })))
}

#[test]
fn a_new_leader_gives_back_jobs_slurm_shows_held_by_powerflex_that_it_does_not_hold() {
    use powerflex_core::slurm_record::SlurmJobState::{OnItsNodes, Pending, Suspended};
    let mut o = options();
    o.job_placement = JobPlacement::Slurm;
    let held = CtldState {
        preempted: [(
            "201".to_string(),
            crate::preempt::Preempted {
                how: powerflex_core::flex::Preempt::Suspend,
                since_ms: T0,
            },
        )]
        .into(),
        ..CtldState::default()
    };
    let mut core = Controller::new(
        o,
        Loaded {
            state: held,
            lost: false,
        },
        UnixMs(T0),
    );
    let ours_suspended = "project=X | powerflex;tier=flex3;suspended:grid-cut-deeper-than-every-cap-floor;back-when-the-cut-ends";
    let ours_requeued =
        "powerflex;tier=flex3;requeued:grid-cut-deeper-than-every-cap-floor;back-when-the-cut-ends";
    let read = slurm_with(&[
        // Suspended by a deposed leader after the committed state: given back.
        ("200", "n1", Suspended, ours_suspended),
        // Held by the state in force: kept until its cut ends.
        ("201", "n1", Suspended, ours_suspended),
        // Suspended by an admin, not by powerflex: left alone.
        ("202", "n2", Suspended, "project=X"),
        ("203", "n2", Pending, ours_requeued),
        (
            "204",
            "n2",
            OnItsNodes,
            "powerflex;tier=flex3;pfi=-;cap=500W",
        ),
    ]);
    // A standby reads Slurm too, and gives nothing back.
    core.step(
        UnixMs(T0),
        vec![leadership(LeadershipRole::Standby, 3, Some("b"))],
    );
    let out = core.step(UnixMs(T0 + 1), vec![read.clone()]);
    assert!(out.preempt.is_empty(), "{out:?}");
    core.step(
        UnixMs(T0 + 2),
        vec![leadership(LeadershipRole::Active, 4, None)],
    );
    let out = core.step(UnixMs(T0 + 3), vec![read.clone()]);
    assert_eq!(
        out.preempt,
        [
            Action::Resume { job: "200".into() },
            Action::Release { job: "203".into() }
        ],
        "{out:?}"
    );
    // Once each: Slurm may show them held for a read or two more.
    let out = core.step(UnixMs(T0 + 4), vec![read]);
    assert!(out.preempt.is_empty(), "{out:?}");
}
