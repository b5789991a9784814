//! Allocations: steady caps, history, annotations, rollouts, ramps and preemptions.

use super::*;

#[test]
fn a_job_is_annotated_only_when_its_text_changes() {
    let mut core = fresh();
    let out = core.step_saved(
        UnixMs(T0),
        vec![hello("n1"), report("n1", vec![job("101", None)])],
    );
    assert_eq!(out.annotations.len(), 1);
    let (id, text) = &out.annotations[0];
    assert_eq!(id, "101");
    assert!(
        text.starts_with("powerflex;tier=flex2;pfi=-;cap="),
        "{text}"
    );
    assert!(!text.contains(' '), "scontrol splits on spaces: {text}");
    let out = core.step_saved(UnixMs(T0 + 10_000), vec![Input::Tick]);
    assert!(
        out.metrics.is_some() && out.annotations.is_empty(),
        "{out:?}"
    );
    let out = core.step_saved(
        UnixMs(T0 + 20_000),
        vec![report("n1", vec![job("101", Some(1.5))]), Input::Tick],
    );
    assert_eq!(out.annotations.len(), 1);
    assert!(out.annotations[0].1.contains("pfi=1.50"), "{out:?}");
}

/// Under a constant budget and steady jobs, caps settle. Four jobs whose throughput falls almost
/// alike with the cap (a flat optimum: which one gives the watts barely matters) report curves that
/// move by 1 % noise every period, as learned windows move an agent's estimate. The fresh decision
/// (what `whatif` shows) swings caps; the caps sent change at most once per job per minute.
#[test]
fn caps_settle_under_a_steady_budget_while_the_fresh_decision_swings() {
    // Leases at once: these reports confirm no lease, and the subject is the decision.
    let at_once = CtldSettings {
        lease_rollout: LeaseRollout::AtOnce,
        ..options()
    };
    let mut core = Controller::new(at_once, Loaded::default(), UnixMs(T0));
    let mut rng = powerflex_core::rng::SplitMix64::new(7);
    // (node, job, the share of its speed it loses from 700 W down to 0 W).
    let placement = [
        ("n1", "101", 0.50),
        ("n1", "102", 0.52),
        ("n2", "103", 0.48),
        ("n2", "104", 0.51),
    ];
    let mut caps: BTreeMap<String, f64> = BTreeMap::new();
    let reports = |caps: &BTreeMap<String, f64>, rng: &mut powerflex_core::rng::SplitMix64| {
        let mut by_node: BTreeMap<&str, Vec<JobReport>> = BTreeMap::new();
        for (node, id, loss) in placement {
            let cap = caps.get(id).copied().unwrap_or(700.0);
            let mut j = job(id, None);
            j.tier = "flex3".into();
            j.cap_w = Some(cap);
            j.power_cap_w = Some(cap);
            j.power_w = Some(4.0 * cap);
            // What it runs at now: its curve at the cap in force.
            j.throughput = Some(1000.0 * (1.0 - loss * (1.0 - cap / 700.0)));
            for p in &mut j.points {
                p.throughput =
                    1000.0 * (1.0 - loss * (1.0 - p.cap_w.0 / 700.0)) * (1.0 + 0.01 * rng.normal());
            }
            // Its standard errors, as the agent states them: the noise they carry.
            j.curve = j
                .points
                .iter()
                .rev()
                .map(|p| CurvePoint {
                    cap_w: p.cap_w.0,
                    power_w: p.power_w.0,
                    throughput: p.throughput,
                    power_sigma_w: 0.01 * p.power_w.0,
                    throughput_sigma: 0.01 * p.throughput,
                    windows: 40,
                })
                .collect();
            by_node.entry(node).or_default().push(j);
        }
        by_node
            .into_iter()
            .map(|(node, jobs)| {
                let power_w = jobs.iter().filter_map(|j| j.power_w).sum();
                Input::Report {
                    ended: Vec::new(),
                    observe_only: false,
                    node: node.into(),
                    power_w,
                    jobs,
                }
            })
            .collect::<Vec<_>>()
    };
    let mut first = vec![hello("n1"), hello("n2")];
    first.extend(reports(&caps, &mut rng));
    first.push(budget_set(8000.0, None));
    core.step_saved(UnixMs(T0), first);
    let period_ms = options().period.as_millis() as u64;
    let periods = 60u64;
    let (mut sent_changes, mut fresh_changes) = (0usize, 0usize);
    let mut last_fresh: Option<BTreeMap<String, f64>> = None;
    let mut last_sent: Option<BTreeMap<String, f64>> = None;
    for i in 1..=periods {
        let now = T0 + i * period_ms;
        let mut inputs = reports(&caps, &mut rng);
        inputs.push(Input::Tick);
        core.step_saved(UnixMs(now), inputs);
        let sent: BTreeMap<String, f64> = core
            .last
            .as_ref()
            .and_then(|d| d.allocation.as_ref())
            .expect("an allocation")
            .jobs
            .iter()
            .map(|j| (j.id.clone(), j.cap_w.0))
            .collect();
        let out = core.step_saved(
            UnixMs(now + 1),
            vec![admin(
                AdminOp::WhatIf {
                    policy: Some(Policy::Optimal),
                    budget_w: None,
                    ignore_tiers: false,
                },
                0,
            )],
        );
        let fresh: BTreeMap<String, f64> = reply(&out)
            .what_if()
            .and_then(|d| d.allocation.as_ref())
            .expect("a decision")
            .jobs
            .iter()
            .map(|j| (j.id.clone(), j.cap_w.0))
            .collect();
        let changed = |a: &BTreeMap<String, f64>, b: &BTreeMap<String, f64>| {
            a.iter().filter(|(k, v)| b.get(*k) != Some(v)).count()
        };
        // The first two periods take the cut; count from then on.
        if i > 2 {
            if let Some(prev) = &last_sent {
                sent_changes += changed(&sent, prev);
            }
            if let Some(prev) = &last_fresh {
                fresh_changes += changed(&fresh, prev);
            }
        }
        let planned: f64 = sent.values().map(|c| 4.0 * c).sum();
        assert!(planned <= 8000.0 + 1e-6, "period {i}: {sent:?}");
        caps = sent.clone();
        last_sent = Some(sent);
        last_fresh = Some(fresh);
    }
    let minutes = (periods - 2) as f64 * period_ms as f64 / 60_000.0;
    let per_job_minute = |n: usize| n as f64 / placement.len() as f64 / minutes;
    assert!(
        per_job_minute(sent_changes) <= 1.0,
        "{sent_changes} cap changes sent in {minutes:.1} min"
    );
    assert!(
        fresh_changes > 3 * sent_changes.max(1),
        "the noise alone swings the fresh decision ({fresh_changes} changes) far more than the caps sent ({sent_changes})"
    );
}

#[test]
fn history_keeps_one_sample_per_allocation() {
    let board = HistoryBoard::new();
    let mut core = fresh();
    step_published(
        &mut core,
        &board,
        T0,
        vec![
            hello("n1"),
            report("n1", vec![job("101", None)]),
            hello("n2"),
            report("n2", vec![job("102", None)]),
        ],
    );
    for i in 1..=3 {
        step_published(&mut core, &board, T0 + i * 5_000, vec![Input::Tick]);
    }
    // A step that allocates nothing adds no sample.
    let out = step_published(
        &mut core,
        &board,
        T0 + 15_001,
        vec![report("n1", vec![job("101", None)])],
    );
    assert!(out.history.is_none() && out.metrics.is_none());
    assert_eq!(allocations(&core), 4);
    let answered = board.answer(None, None, 0);
    let history = answered.history().expect("history");
    assert_eq!(
        history.iter().map(|s| s.t_ms).collect::<Vec<_>>(),
        [T0, T0 + 5_000, T0 + 10_000, T0 + 15_000]
    );
    assert!(history
        .iter()
        .all(|s| s.caps.keys().eq(["101", "102"]) && s.budget_w == 10_000.0 && !s.simulated));
    // The step answers no history itself: it keeps none.
    let out = core.step_saved(
        UnixMs(T0 + 15_002),
        vec![admin(
            AdminOp::History {
                since_ms: None,
                max_samples: None,
            },
            0,
        )],
    );
    assert!(!reply(&out).is_ok() && reply(&out).history().is_none());
}

/// Leases sent to every node at once would let one node raise its caps before another
/// had lowered its own, and the site would overshoot at every reallocation: decreases
/// go first.
#[test]
fn a_reallocation_lowers_first_and_raises_once_the_lowering_is_confirmed() {
    let mut core = fresh();
    two_jobs_at_500_w(&mut core, "flex3");
    // Both jobs settle at their caps and confirm them.
    let t = T0 + 1000;
    let out = core.step_saved(UnixMs(t), vec![Input::Tick]);
    let (c1, c2) = (
        cap(&out, "n1", "101").expect("n1"),
        cap(&out, "n2", "102").expect("n2"),
    );
    let out = core.step_saved(
        UnixMs(t + 100),
        vec![
            at_cap("n1", "101", "flex3", c1),
            at_cap("n2", "102", "flex3", c2),
        ],
    );
    assert!(
        out.leases.is_empty(),
        "nothing held, nothing released: {out:?}"
    );
    // Job 102 becomes unmovable (flex0): 101 must give it its watts.
    let out = core.step_saved(
        UnixMs(t + 200),
        vec![at_cap("n2", "102", "flex0", c2), Input::Tick],
    );
    let lowered = cap(&out, "n1", "101").expect("n1 lowered at once");
    assert!(lowered < c1, "{out:?}");
    assert_eq!(
        cap(&out, "n2", "102"),
        Some(c2),
        "n2's rise is held: {out:?}"
    );
    // n1 still reports its old cap: nothing moves.
    let out = core.step_saved(UnixMs(t + 300), vec![at_cap("n1", "101", "flex3", c1)]);
    assert!(out.leases.is_empty(), "{out:?}");
    // n1 confirms: n2's increase goes out.
    let out = core.step_saved(UnixMs(t + 400), vec![at_cap("n1", "101", "flex3", lowered)]);
    let raised = cap(&out, "n2", "102").expect("released");
    assert!(raised > c2, "{out:?}");
    assert!(lowered * 4.0 + raised * 4.0 <= 4000.0 + 1e-6);
}

/// Caps lowered only when a ramp's step takes effect leave the meter above each new
/// step until the agents have applied them: each allocation is made for the lowest
/// step before the next one's caps are confirmed, and the rise after the event is
/// held to the ramp-rate limit.
#[test]
fn ramps_are_met_ahead_going_down_and_held_to_the_rate_going_up() {
    let mut core = Controller::new(
        CtldSettings {
            max_ramp_w_per_s: Some(50.0),
            ..options()
        },
        Loaded::default(),
        UnixMs(T0),
    );
    let sum = |out: &Output| -> f64 {
        out.leases
            .values()
            .flat_map(|l| l.caps.values())
            .map(|c| c * 4.0)
            .sum()
    };
    core.step_saved(
        UnixMs(T0),
        vec![
            budget_set(5600.0, None),
            admin(
                AdminOp::EventAdd {
                    cut: Cut::Reduce { fraction: 0.3 },
                    start_ms: T0 + 20_000,
                    duration_ms: 60_000,
                    ramp_ms: 10_000,
                    domain: None,
                },
                0,
            ),
            hello("n1"),
            at_cap("n1", "101", "flex3", 700.0),
            hello("n2"),
            at_cap("n2", "102", "flex3", 700.0),
        ],
    );
    // 5 s in, a 10 s period and 10 s to confirm: the allocation looks to 25 s, half
    // way down the ramp (5 steps of 168 W), while the budget in force is untouched.
    let out = core.step_saved(UnixMs(T0 + 5_000), vec![Input::Tick]);
    let status = core.status(UnixMs(T0 + 5_000));
    assert_eq!(status.budget_w, 5600.0);
    assert_eq!(status.allocated_budget_w, Some(4760.0));
    assert!(sum(&out) <= 4760.0 + 1e-6, "{out:?}");
    assert_eq!(out.history.as_ref().map(|h| h.budget_w), Some(5600.0));
    // Through the event, every allocation is at or below every step it serves.
    let mut t = T0 + 5_000;
    while t < T0 + 80_000 {
        t += 10_000;
        core.step_saved(UnixMs(t), vec![Input::Tick]);
        let allocated = core
            .status(UnixMs(t))
            .allocated_budget_w
            .expect("allocated");
        for at in (t..t + 20_000).step_by(100) {
            assert!(allocated <= core.status(UnixMs(at)).budget_w, "{t} {at}");
        }
    }
    // The full cut (3920 W) was allocated last at 65 s; from there 50 W/s, slower
    // than the event's own ramp back: 4420 W at 75 s, 4920 W at 85 s, after the end.
    let at_end = core
        .status(UnixMs(t))
        .allocated_budget_w
        .expect("allocated");
    assert_eq!((t - T0, at_end), (85_000, 4920.0));
    assert_eq!(core.status(UnixMs(t)).budget_w, 5600.0);
    core.step_saved(UnixMs(t + 10_000), vec![Input::Tick]);
    assert_eq!(
        core.status(UnixMs(t + 10_000)).allocated_budget_w,
        Some(5420.0)
    );
    core.step_saved(UnixMs(t + 20_000), vec![Input::Tick]);
    assert_eq!(
        core.status(UnixMs(t + 20_000)).allocated_budget_w,
        Some(5600.0)
    );
}

/// Observe mode enforces nothing: the same deep cut holds no job out of a
/// node whose agent writes no limit.
#[test]
fn a_cut_deeper_than_caps_holds_out_no_job_of_an_observe_only_node() {
    let mut core = fresh();
    let observing = |input: Input| match input {
        Input::Report {
            node,
            jobs,
            power_w,
            ended,
            ..
        } => Input::Report {
            node,
            jobs,
            power_w,
            ended,
            observe_only: true,
        },
        other => other,
    };
    core.step_saved(UnixMs(T0), flex0_beside_a_suspendable_job(observing));
    let out = core.step_saved(UnixMs(T0 + 500), vec![cut_below_the_caps_announced()]);
    assert!(out.preempt.is_empty(), "{:?}", out.preempt);
    assert!(core.status(UnixMs(T0 + 500)).preempted.is_empty());
}

/// A cut below every floor at the GPUs' minimum: the flex3 job that allows
/// it is suspended ahead of the start (flex0 never), saved, annotated, exported, and
/// resumed when the event is over.
#[test]
fn a_cut_deeper_than_caps_suspends_ahead_and_resumes_after() {
    let mut core = fresh();
    core.step_saved(UnixMs(T0), flex0_beside_a_suspendable_job(|job| job));
    // Announced 4.5 s ahead: the allocation the change triggers already suspends.
    let out = core.step_saved(UnixMs(T0 + 500), vec![cut_below_the_caps_announced()]);
    assert_eq!(
        out.preempt,
        [Action::Suspend { job: "102".into() }],
        "{out:?}"
    );
    assert_eq!(
        core.status(UnixMs(T0 + 500)).budget_w,
        5600.0,
        "not started yet"
    );
    assert_eq!(cap(&out, "n1", "101"), Some(700.0), "flex0 untouched");
    assert_eq!(
        cap(&out, "n2", "102"),
        Some(200.0),
        "held at its lowest cap"
    );
    let saved = out.persist.expect("saved");
    assert!(saved.preempted.contains_key("102"));
    assert!(out
        .annotations
        .iter()
        .any(|(job, text)| job == "102" && text.contains("suspended:grid-cut")));
    // The metrics show it held (the edge renders this as
    // `powerflex_job_preempted{job="102",how="suspend"} 1`).
    assert!(out.metrics.as_ref().is_some_and(|m| m
        .preempted
        .get("102")
        .is_some_and(|p| p.how == powerflex_core::flex::Preempt::Suspend)));
    let status = core.status(UnixMs(T0 + 500));
    assert_eq!(status.preempted.len(), 1);
    // Suspended: the job draws idle power at its lowest cap; nothing more to do.
    let mut idle = job("102", None);
    idle.tier = "flex3,preempt=suspend".into();
    idle.cap_w = Some(200.0);
    idle.power_cap_w = Some(200.0);
    idle.power_w = Some(300.0);
    let out = core.step_saved(
        UnixMs(T0 + 10_000),
        vec![
            Input::Report {
                ended: Vec::new(),
                observe_only: false,
                node: "n2".into(),
                power_w: 300.0,
                jobs: vec![idle.clone()],
            },
            Input::Tick,
        ],
    );
    assert!(out.preempt.is_empty(), "{out:?}");
    // Over at 35 s: resumed.
    let out = core.step_saved(
        UnixMs(T0 + 36_000),
        vec![
            at_cap("n1", "101", "flex0", 700.0),
            Input::Report {
                ended: Vec::new(),
                observe_only: false,
                node: "n2".into(),
                power_w: 300.0,
                jobs: vec![idle],
            },
            Input::Tick,
        ],
    );
    assert_eq!(out.preempt, [Action::Resume { job: "102".into() }]);
    assert!(core.state().preempted.is_empty());
}

#[test]
fn a_node_that_does_not_confirm_is_counted_at_its_most() {
    let mut core = fresh();
    core.step_saved(
        UnixMs(T0),
        vec![
            budget_set(6000.0, None),
            hello("n1"),
            at_cap("n1", "101", "flex3", 600.0),
            hello("n2"),
            at_cap("n2", "102", "flex3", 600.0),
        ],
    );
    let out = core.step_saved(UnixMs(T0 + 100), vec![budget_set(3000.0, None)]);
    assert!(cap(&out, "n1", "101").is_some_and(|c| c < 600.0));
    // n2 confirms; n1 keeps reporting 600 W past the confirmation time.
    let c2 = cap(&out, "n2", "102").expect("n2");
    core.step_saved(UnixMs(T0 + 200), vec![at_cap("n2", "102", "flex3", c2)]);
    let late = T0 + 100 + 10_000 + 1;
    let out = core.step_saved(
        UnixMs(late),
        vec![at_cap("n1", "101", "flex3", 600.0), Input::Tick],
    );
    // n1 is counted as silent, at its GPUs' defaults: no lease for it, and n2 is cut
    // to what is left.
    assert!(!out.leases.contains_key("n1"), "{out:?}");
    assert!(core
        .last
        .as_ref()
        .is_some_and(|d| d.reserved_w >= 8.0 * 700.0));
}

#[test]
fn at_once_sends_every_lease_immediately() {
    let mut core = Controller::new(
        CtldSettings {
            lease_rollout: LeaseRollout::AtOnce,
            ..options()
        },
        Loaded::default(),
        UnixMs(T0),
    );
    two_jobs_at_500_w(&mut core, "flex0");
    let out = core.step_saved(UnixMs(T0 + 100), vec![Input::Tick]);
    assert_eq!(
        cap(&out, "n2", "102"),
        Some(700.0),
        "raised without waiting: {out:?}"
    );
}

/// The demo's overshoot after a phase change, the rollout's part: an increase held
/// for a decrease's confirmation went out when the decrease was confirmed, although
/// the raised job's draw had risen since the allocation that decided it. Budget
/// first: a job whose draw rose is never raised on the reports from before the rise,
/// and a confirmation never sends an older lease over a newer allocation's.
#[test]
fn an_increase_held_for_a_confirmation_is_dropped_when_the_raised_jobs_draw_rises() {
    let budget = 3600.0;
    let mut core = fresh();
    // Job 102 runs light (at most 300 W per GPU) on a prior: a curve in doubt, so it
    // gets its equal-split cap, and both start capped under 3.6 kW.
    core.step_saved(
        UnixMs(T0),
        vec![
            budget_set(budget, None),
            hello("n1"),
            at_cap("n1", "101", "flex3", 500.0),
            hello("n2"),
            on_prior("n2", "102", "flex3", 500.0, 300.0),
        ],
    );
    let mut t = T0 + 1000;
    let out = core.step_saved(UnixMs(t), vec![Input::Tick]);
    let c1 = cap(&out, "n1", "101").expect("n1");
    let c2 = cap(&out, "n2", "102").expect("n2");
    assert!(c2 < 700.0, "102 must start capped: {out:?}");
    core.step_saved(
        UnixMs(t + 100),
        vec![
            at_cap("n1", "101", "flex3", c1),
            on_prior("n2", "102", "flex3", c2, 300.0_f64.min(c2)),
        ],
    );
    // 102 becomes unmovable (flex0): 101 is lowered at once, 102's rise held.
    t += 1000;
    let out = core.step_saved(
        UnixMs(t),
        vec![
            on_prior("n2", "102", "flex0", c2, 300.0_f64.min(c2)),
            Input::Tick,
        ],
    );
    let lowered = cap(&out, "n1", "101").expect("n1 lowered");
    assert!(lowered < c1, "{out:?}");
    assert_eq!(cap(&out, "n2", "102"), Some(c2), "held: {out:?}");
    // Before n1 confirms, 102's load comes: it draws its cap under the cap it had.
    let out = core.step_saved(
        UnixMs(t + 300),
        vec![on_prior("n2", "102", "flex0", c2, c2)],
    );
    assert!(
        out.metrics.is_some(),
        "a rise under an unchanged cap is allocated at once: {out:?}"
    );
    let relowered = cap(&out, "n1", "101").expect("n1 lowered again");
    // n1 confirms the first decrease. The increase decided while 102 was light must
    // not go out: at 700 W it draws 2.8 kW, and 101 is not yet down to make room.
    let out = core.step_saved(UnixMs(t + 400), vec![at_cap("n1", "101", "flex3", lowered)]);
    if let Some(c) = cap(&out, "n2", "102") {
        assert!(
            lowered * 4.0 + c * 4.0 <= budget + 1e-6,
            "102 raised to {c} W with 101 still at {lowered} W: {out:?}"
        );
    }
    // Once 101 confirms the second decrease, 102 gets its full cap, within the budget.
    let out = core.step_saved(
        UnixMs(t + 500),
        vec![at_cap("n1", "101", "flex3", relowered)],
    );
    let raised = cap(&out, "n2", "102").expect("released");
    assert_eq!(raised, 700.0, "flex0: {out:?}");
    assert!(relowered * 4.0 + raised * 4.0 <= budget + 1e-6, "{out:?}");
}

/// An allocation and a confirmation in one batch: the leases of the allocation go
/// out, not the increase the confirmation would have released from the one before.
#[test]
fn a_confirmation_in_the_same_batch_as_an_allocation_does_not_send_the_older_lease() {
    let mut core = fresh();
    two_jobs_at_500_w(&mut core, "flex3");
    let t = T0 + 1000;
    let out = core.step_saved(UnixMs(t), vec![Input::Tick]);
    let (c1, c2) = (
        cap(&out, "n1", "101").expect("n1"),
        cap(&out, "n2", "102").expect("n2"),
    );
    core.step_saved(
        UnixMs(t + 100),
        vec![
            at_cap("n1", "101", "flex3", c1),
            at_cap("n2", "102", "flex3", c2),
        ],
    );
    let out = core.step_saved(
        UnixMs(t + 200),
        vec![at_cap("n2", "102", "flex0", c2), Input::Tick],
    );
    let lowered = cap(&out, "n1", "101").expect("n1 lowered");
    // n1 confirms in the same batch as a cut to 3 kW.
    let out = core.step_saved(
        UnixMs(t + 300),
        vec![
            at_cap("n1", "101", "flex3", lowered),
            budget_set(3000.0, None),
        ],
    );
    let n1 = cap(&out, "n1", "101").unwrap_or(lowered);
    let n2 = cap(&out, "n2", "102").unwrap_or(c2);
    assert!(
        n1 * 4.0 + n2 * 4.0 <= 3000.0 + 1e-6,
        "{n1} W and {n2} W sent under a 3 kW budget: {out:?}"
    );
}

/// A job held out before its node switched to observe mode stays held (saved, shown) and is
/// resumed when the cut is over: observe mode spares jobs new holds, never strands a held one.
#[test]
fn a_job_held_before_its_node_switched_to_observe_mode_is_resumed_after_the_cut() {
    let mut core = fresh();
    core.step_saved(UnixMs(T0), flex0_beside_a_suspendable_job(|job| job));
    let out = core.step_saved(UnixMs(T0 + 500), vec![cut_below_the_caps_announced()]);
    assert_eq!(out.preempt, [Action::Suspend { job: "102".into() }]);
    // Mid-cut, n2's agent comes back in observe mode (`agent.enforce = false`), still
    // reporting the suspended job.
    let mut idle = job("102", None);
    idle.tier = "flex3,preempt=suspend".into();
    idle.cap_w = Some(200.0);
    idle.power_cap_w = Some(200.0);
    idle.power_w = Some(300.0);
    let observing = |idle: &JobReport| Input::Report {
        ended: Vec::new(),
        observe_only: true,
        node: "n2".into(),
        power_w: 300.0,
        jobs: vec![idle.clone()],
    };
    let out = core.step_saved(
        UnixMs(T0 + 10_000),
        vec![
            at_cap("n1", "101", "flex0", 700.0),
            observing(&idle),
            Input::Tick,
        ],
    );
    assert!(out.preempt.is_empty(), "{out:?}");
    assert!(
        core.state().preempted.contains_key("102"),
        "still held, so still tracked"
    );
    assert_eq!(core.status(UnixMs(T0 + 10_000)).preempted.len(), 1);
    // Over at 35 s: resumed, though its node still observes.
    let out = core.step_saved(
        UnixMs(T0 + 36_000),
        vec![
            at_cap("n1", "101", "flex0", 700.0),
            observing(&idle),
            Input::Tick,
        ],
    );
    assert_eq!(out.preempt, [Action::Resume { job: "102".into() }]);
    assert!(core.state().preempted.is_empty());
}

/// Slurm's placement: job 101 (flex0) running on n1, job 102 on n2 in `state` with
/// `admin_comment`.
fn placed_with_102(
    state: powerflex_core::slurm_record::SlurmJobState,
    admin_comment: &str,
) -> Input {
    use powerflex_core::slurm_record::{SlurmJob, SlurmJobState};
    let job = |node: &str, state, comment: &str| SlurmJob {
        nodes: [node.to_string()].into(),
        uid: 1001,
        state,
        admin_comment: comment.to_string(),
        account: String::new(),
        start_unix_s: Some(T0 / 1000 - 60),
    };
    Input::Placement(Box::new(Ok(Placement {
        jobs: [
            ("101".to_string(), job("n1", SlurmJobState::OnItsNodes, "")),
            ("102".to_string(), job("n2", state, admin_comment)),
        ]
        .into(),
        node_gpus: [("n1".to_string(), 4), ("n2".to_string(), 4)].into(),
        read_at_ms: T0,
    })))
}

/// A job an admin suspended (Slurm's record says so; powerflex did not) is leased at its
/// lowest cap and counted at its idle draw; one Slurm's record shows suspended by
/// powerflex (a resume this controller sent, not yet read back) is allocated as any job.
#[test]
fn a_job_an_admin_suspended_is_leased_at_its_lowest_cap_and_one_powerflex_resumed_is_not() {
    use powerflex_core::slurm_record::SlurmJobState;
    let run = |comment: &str| {
        let mut o = options();
        o.job_placement = JobPlacement::Slurm;
        let mut core = Controller::new(o, Loaded::default(), UnixMs(T0));
        // Job 102's GPUs idle at 75 W each under its 700 W cap.
        let Input::Report { node, mut jobs, .. } = at_cap("n2", "102", "flex3", 700.0) else {
            unreachable!("at_cap is a report")
        };
        jobs[0].power_w = Some(300.0);
        core.step_saved(
            UnixMs(T0),
            vec![
                budget_set(5600.0, None),
                placed_with_102(SlurmJobState::Suspended, comment),
                hello("n1"),
                at_cap("n1", "101", "flex0", 700.0),
                hello("n2"),
                Input::Report {
                    ended: Vec::new(),
                    observe_only: false,
                    node,
                    power_w: 300.0,
                    jobs,
                },
            ],
        )
    };
    let admin = run("");
    assert_eq!(cap(&admin, "n2", "102"), Some(200.0));
    let ours = run("powerflex;tier=flex3;suspended:grid-cut-deeper-than-every-cap-floor");
    assert!(
        cap(&ours, "n2", "102").is_some_and(|c| c > 200.0),
        "{:?}",
        cap(&ours, "n2", "102")
    );
}

/// A node says a new step put its job's curve in question: the controller allocates at
/// once, not at its next period, and the job is raised to the chord's floor for its tier
/// (570 W for flex2 on 700 W GPUs) once the other job's decrease is confirmed, within
/// the budget throughout.
#[test]
fn a_curve_put_in_question_is_allocated_at_once_on_the_chord() {
    let budget = 4000.0;
    let on_curve = |cap: f64| 1000.0 * (1.0 - (1.0 - cap / 700.0) / 2.0);
    let at = |node: &str, id: &str, tier: &str, cap_w: f64, in_question: bool| {
        let mut report = at_cap(node, id, tier, cap_w);
        if let Input::Report { jobs, .. } = &mut report {
            jobs[0].throughput = Some(on_curve(cap_w));
            jobs[0].power_cap_w = Some(cap_w);
            jobs[0].curve_in_question = in_question;
        }
        report
    };
    let mut core = fresh();
    core.step_saved(
        UnixMs(T0),
        vec![
            budget_set(budget, None),
            hello("n1"),
            at("n1", "101", "flex3", 500.0, false),
            hello("n2"),
            at("n2", "102", "flex2", 500.0, false),
        ],
    );
    let t = T0 + 1000;
    let out = core.step_saved(UnixMs(t), vec![Input::Tick]);
    let (c1, c2) = (
        cap(&out, "n1", "101").expect("n1"),
        cap(&out, "n2", "102").expect("n2"),
    );
    assert!(c2 < 570.0, "on its curve, below the chord's floor: {out:?}");
    core.step_saved(
        UnixMs(t + 100),
        vec![
            at("n1", "101", "flex3", c1, false),
            at("n2", "102", "flex2", c2, false),
        ],
    );
    // A new step of 102: the report comes between two periods.
    let out = core.step_saved(UnixMs(t + 300), vec![at("n2", "102", "flex2", c2, true)]);
    assert!(out.metrics.is_some(), "allocated at once: {out:?}");
    let lowered = cap(&out, "n1", "101").expect("101 lowered first");
    assert!(lowered < c1, "{out:?}");
    let out = core.step_saved(
        UnixMs(t + 400),
        vec![at("n1", "101", "flex3", lowered, false)],
    );
    let raised = cap(&out, "n2", "102").expect("102 raised once 101 confirmed");
    assert_eq!(raised, 570.0, "{out:?}");
    assert!(4.0 * (lowered + raised) <= budget + 1e-6, "{out:?}");
}
