//! Per-job energy on a real Slurm cluster, from the GPUs' counters. Two users'
//! jobs share a node (each charged only its own GPUs), one of them spans two nodes
//! (charged the sum), an agent restarts mid-job (nothing lost), and the records the
//! controller writes match the simulated GPUs' counters over the time each job held
//! each GPU. The owner reads their own record, not another user's. The first node's agent
//! is down when both jobs end: at its next start it sends their final shares from its
//! state file, and drops them once the controller acknowledges the records. Each batch
//! job's own output ends with the powerflex line of its node's final share, unless the
//! site turned the line off (`end_line=off` in plugstack.conf) or the node's agent was
//! down when the job ended (the job is never held for it).

use std::time::Duration;

use powerflex::needs::{can_run, Need};
use powerflex::stack::{Stack, StackOptions};
use powerflex::users::TestUser;
use powerflex::{run, wait_until};
use powerflex_proto::status::SiteJobStatus;
use powerflex_proto::usage::{human_energy, EnergySource, JobEnergyRecord, NodeUsage};

/// The part of the agent's state file this test reads.
#[derive(serde::Deserialize)]
struct SavedFinals {
    #[serde(default)]
    unacked_finals: Vec<serde::de::IgnoredAny>,
}

#[test]
fn job_records_equal_the_gpus_counters_over_each_hold_and_reach_their_owner_only() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let alice = TestUser::ensure("pf-alice").expect("user");
    let bob = TestUser::ensure("pf-bob").expect("user");
    let mut stack = Stack::start(
        "accounting",
        StackOptions {
            budget_w: 100_000.0,
            sample_interval_ms: 100,
            ..StackOptions::default()
        },
    );
    let (base, ctl) = (stack.base.clone(), stack.ctl.clone());
    let socket = stack.socket.to_str().expect("utf-8").to_string();
    let names: Vec<String> = stack.cluster.node_names().to_vec();
    let cluster = &stack.cluster;
    // Each user's job output goes to a directory of their own, as in a home directory.
    let out_dir = |user: &TestUser| {
        let dir = base.join("out").join(&user.name);
        std::fs::create_dir_all(&dir).expect("output dir");
        std::os::unix::fs::chown(&dir, Some(user.uid), Some(user.gid)).expect("chown");
        dir
    };
    let (alice_out, bob_out) = (out_dir(&alice), out_dir(&bob));
    let train = format!(
        "srun env POWERFLEX_SIM_DIR={}/sim/%n bash -c 'POWERFLEX_SIM_DIR=${{POWERFLEX_SIM_DIR/\\%n/$SLURMD_NODENAME}} {} --profile synthetic-memory-bound --duration 600 --time-scale 20 > /dev/null'",
        base.display(),
        stack.simjob.display()
    );
    // Alice's job on both nodes, two GPUs each; Bob's on the first node's other two.
    let a = alice
        .sbatch(
            cluster,
            &[
                "-N2",
                "--gres=gpu:2",
                "--power-flex=flex3,calibrate=off",
                &format!("--output={}/%j.out", alice_out.display()),
                "--wrap",
                &train,
            ],
        )
        .expect("sbatch a");
    let b = bob
        .sbatch(
            cluster,
            &[
                "-N1",
                "-w",
                &names[0],
                "--gres=gpu:2",
                "--power-flex=flex2,calibrate=off",
                "--wrap",
                &train,
            ],
        )
        .expect("sbatch b");
    let (a_id, b_id) = (a.to_string(), b.to_string());
    let both_running = || {
        let out = run(&ctl, &["jobs", "--format", "json", "--socket", &socket]);
        let jobs: Vec<SiteJobStatus> = serde_json::from_str(&out.stdout).ok()?;
        let gpus = |id: &str| jobs.iter().find(|j| j.job == id).map(|j| j.gpus);
        (gpus(&a_id) == Some(4) && gpus(&b_id) == Some(2)).then_some(())
    };
    wait_until(
        "both jobs at the controller",
        Duration::from_secs(60),
        both_running,
    );
    // A budget that caps them, so the records have capped time to show.
    assert_eq!(
        run(&ctl, &["budget", "set", "2.4kW", "--socket", &socket]).code,
        Some(0)
    );
    std::thread::sleep(Duration::from_secs(4));
    // The second node's agent restarts mid-job (SIGTERM, as systemctl restart does).
    stack.stop_agent(1);
    stack.start_agent(1);
    let cluster = &stack.cluster;
    std::thread::sleep(Duration::from_secs(2));
    wait_until(
        "both jobs at the controller again",
        Duration::from_secs(60),
        both_running,
    );
    // While it runs, Slurm shows its energy so far in its AdminComment (Slurm refuses
    // updates to a finished job: the exact figure is the record's).
    let comment = wait_until(
        "the energy in AdminComment",
        Duration::from_secs(30),
        || {
            let info = cluster.job_info(a);
            info.split_whitespace()
                .find(|w| {
                    w.starts_with("AdminComment=powerflex;") && w.contains("energy_kwh_so_far=")
                })
                .map(str::to_string)
        },
    );
    assert!(comment.contains("tier=flex3"), "{comment}");
    // Two short jobs of Bob's on the second node's free GPUs, which end by themselves:
    // the first with the line on; the second started after the site turned it off. Each
    // new slurmstepd reads plugstack.conf, so the switch applies from the next job on.
    let short = |gpus_busy_s: u32| {
        let work = train.replace(
            "--duration 600",
            &format!("--duration {}", gpus_busy_s * 20),
        );
        bob.sbatch(
            cluster,
            &[
                "-N1",
                "-w",
                &names[1],
                "--gres=gpu:1",
                "--power-flex=flex2,calibrate=off",
                &format!("--output={}/%j.out", bob_out.display()),
                "--wrap",
                &work,
            ],
        )
        .expect("sbatch short")
    };
    let c = short(4);
    wait_until(
        "the short job's batch step at its agent",
        Duration::from_secs(30),
        || {
            let status = stack.agent_status(1)?;
            status
                .jobs
                .iter()
                .any(|j| j.job == c.to_string())
                .then_some(())
        },
    );
    let plugstack = cluster.dir().join("plugstack.conf");
    let on = std::fs::read_to_string(&plugstack).expect("plugstack.conf");
    let off = format!("{} end_line=off\n", on.trim_end());
    let staged = cluster.dir().join("plugstack.conf.new");
    std::fs::write(&staged, off).expect("write");
    std::fs::rename(&staged, &plugstack).expect("rename: the switch in one step");
    let d = short(4);
    std::thread::sleep(Duration::from_secs(1));
    // The first node's agent is down when both jobs end there: their ends never reach it.
    stack.stop_agent(0);
    let cluster = &stack.cluster;
    cluster.run("scancel", &[&a_id, &b_id]);
    for job in [a, b] {
        assert!(matches!(
            cluster.wait_job_done(job, Duration::from_secs(60)).as_str(),
            "CANCELLED" | "COMPLETED"
        ));
    }
    // At its next start it makes their final shares from its state file and the
    // counters read then.
    stack.start_agent(0);
    let cluster = &stack.cluster;
    for job in [c, d] {
        assert_eq!(
            cluster.wait_job_done(job, Duration::from_secs(60)),
            "COMPLETED"
        );
    }
    let (c_id, d_id) = (c.to_string(), d.to_string());
    let log = base.join("ctld").join("job-energy.jsonl");
    let records: Vec<JobEnergyRecord> = wait_until(
        "the four jobs' energy records",
        Duration::from_secs(90),
        || {
            let text = std::fs::read_to_string(&log).ok()?;
            let records: Vec<JobEnergyRecord> = text
                .lines()
                .filter_map(|l| serde_json::from_str(l).ok())
                .collect();
            [&a_id, &b_id, &c_id, &d_id]
                .iter()
                .all(|id| records.iter().any(|r| &&r.job_id == id))
                .then_some(records)
        },
    );
    // A run's latest revision is its record.
    let record = |id: &str| {
        records
            .iter()
            .filter(|r| r.job_id == id)
            .max_by_key(|r| r.revision)
            .unwrap_or_else(|| panic!("no record of job {id}: {records:?}"))
    };
    let (ra, rb) = (record(&a_id), record(&b_id));
    assert_eq!((ra.uid, rb.uid), (alice.uid, bob.uid), "Slurm's owners");
    assert!(ra.simulated && rb.simulated, "labelled simulated");
    assert!(
        ra.run_start_unix_ms.is_some() && rb.run_start_unix_ms.is_some(),
        "each record names its run (Slurm's start)"
    );
    assert!(ra.incomplete_nodes.is_empty() && rb.incomplete_nodes.is_empty());
    assert_eq!(ra.nodes.len(), 2, "alice's job on both nodes");
    assert_eq!(rb.nodes.len(), 1);
    assert!(ra.capped_pct > 0.0, "the budget capped alice's job: {ra:?}");
    // Each job is charged its own GPUs: job A GPUs 0 and 1 of each node, job B 2 and 3 of
    // the first; the counter readings are the simulated counters at the readings' times.
    let mut worst_mj = 0.0f64;
    let mut check = |share: &NodeUsage, indices: &[u32]| {
        let sim = &stack.sims[names.iter().position(|n| n == &share.node).expect("node")];
        let mut held: Vec<u32> = share.gpus.iter().map(|g| g.index).collect();
        held.sort_unstable();
        assert_eq!(
            held, indices,
            "{} on {}: its own GPUs only",
            share.job_id, share.node
        );
        let mut sum = 0;
        for g in &share.gpus {
            assert_eq!(g.uuid, sim.gpu(g.index).expect("gpu").uuid);
            assert_eq!(g.source, EnergySource::Counter);
            let (from, to) = (
                g.counter_from_mj.expect("counter"),
                g.counter_to_mj.expect("counter"),
            );
            assert_eq!(g.energy_mj, to - from, "the counter's advance, exactly");
            assert!(g.to_unix_ms - g.from_unix_ms >= 5_000, "{g:?}");
            for (at, read) in [(g.from_unix_ms, from), (g.to_unix_ms, to)] {
                let truth = sim
                    .energy_at_unix_ms(g.index, at)
                    .expect("energy log")
                    .expect("logged");
                worst_mj = worst_mj.max((truth - read as f64).abs());
                // The agent stamps a reading with its own clock, a few ms from the
                // simulator's: at 700 W a millisecond is 700 mJ.
                assert!(
                    (truth - read as f64).abs() <= 700.0 * 25.0,
                    "GPU {} of job {} on {}: read {read} mJ at {at}, the counter was {truth:.0}",
                    g.index,
                    share.job_id,
                    share.node
                );
            }
            sum += g.energy_mj;
        }
        assert_eq!(share.energy_mj, sum);
        assert!(share.ended);
    };
    for share in &ra.nodes {
        check(share, &[0, 1]);
    }
    check(&rb.nodes[0], &[2, 3]);
    eprintln!(
        "largest gap between a reading and the simulated counter at its time: {worst_mj:.0} mJ"
    );
    let total: u64 = ra.nodes.iter().map(|n| n.energy_mj).sum();
    assert_eq!(
        ra.energy_j,
        total as f64 / 1000.0,
        "the job's energy is its nodes' sum"
    );
    // The restarted node lost nothing: its share spans the restart, from the hold's start.
    let restarted = ra
        .nodes
        .iter()
        .find(|n| n.node == names[1])
        .expect("second node");
    let first = ra
        .nodes
        .iter()
        .find(|n| n.node == names[0])
        .expect("first node");
    assert!(
        restarted.from_unix_ms.abs_diff(first.from_unix_ms) < 3_000,
        "the share on the restarted node starts with the job, not at the restart: {} vs {}",
        restarted.from_unix_ms,
        first.from_unix_ms
    );
    // The owner reads her record; not Bob's.
    let ctl_as = |user: &TestUser, args: &[&str]| {
        user.command(cluster, ctl.to_str().expect("utf-8"))
            .args(args)
            .args(["--socket", &socket])
            .output()
            .expect("powerflexctl")
    };
    let mine = ctl_as(&alice, &["report", "--job", &a_id]);
    let text = String::from_utf8_lossy(&mine.stdout);
    assert!(
        mine.status.success(),
        "{}",
        String::from_utf8_lossy(&mine.stderr)
    );
    assert!(
        text.contains(&format!("powerflex: job {a_id} used")),
        "{text}"
    );
    let theirs = ctl_as(&alice, &["report", "--job", &b_id]);
    assert!(!theirs.status.success(), "alice read bob's job");
    let listed = ctl_as(&alice, &["accounting", "--format", "json"]);
    let listed: Vec<JobEnergyRecord> = serde_json::from_slice(&listed.stdout).expect("json");
    assert_eq!(
        listed.iter().map(|r| r.job_id.as_str()).collect::<Vec<_>>(),
        [a_id.as_str()]
    );
    // Her energy plot draws her own tier only; root's draws both. She writes it where
    // she may (the stack's directory is root's).
    let hers = std::env::temp_dir().join(format!("pf-accounting-plot-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&hers);
    std::fs::create_dir(&hers).expect("her directory");
    std::os::unix::fs::chown(&hers, Some(alice.uid), Some(alice.gid)).expect("chown");
    let her_svg = hers.join("energy.svg");
    let plot = ctl_as(
        &alice,
        &["accounting", "--plot", her_svg.to_str().expect("utf-8")],
    );
    assert!(
        plot.status.success(),
        "{}",
        String::from_utf8_lossy(&plot.stderr)
    );
    assert!(
        String::from_utf8_lossy(&plot.stdout).contains("1 jobs in 1 tiers"),
        "{}",
        String::from_utf8_lossy(&plot.stdout)
    );
    let svg = std::fs::read_to_string(&her_svg).expect("her plot");
    // (A tier's label may wrap at its comma into tspans: the name is one text run.)
    assert!(svg.contains(">flex3,calibrate=off<"), "{svg}");
    assert!(
        !svg.contains("flex2"),
        "alice's plot shows bob's tier: {svg}"
    );
    let all_svg = base.join("all-energy.svg");
    let plot = run(
        &ctl,
        &[
            "accounting",
            "--plot",
            all_svg.to_str().expect("utf-8"),
            "--socket",
            &socket,
        ],
    );
    assert_eq!(plot.code, Some(0), "{}", plot.stderr);
    let svg = std::fs::read_to_string(&all_svg).expect("root's plot");
    for tier in ["flex3,calibrate=off", "flex2,calibrate=off"] {
        assert!(svg.contains(&format!(">{tier}<")), "{tier}: {svg}");
    }
    assert!(svg.contains("SIMULATED") && svg.contains("ESTIMATE"));
    // A user's range with no records is an error that says so, not an empty picture.
    let none = ctl_as(
        &alice,
        &[
            "accounting",
            "--tier",
            "flex0",
            "--plot",
            hers.join("none.svg").to_str().expect("utf-8"),
        ],
    );
    assert_eq!(none.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&none.stderr).contains("no job energy records in that range"),
        "{}",
        String::from_utf8_lossy(&none.stderr)
    );
    assert!(
        !hers.join("none.svg").exists(),
        "nothing written for nothing"
    );
    let _ = std::fs::remove_dir_all(&hers);
    // Root sees all four, in the CSV too.
    let csv = run(
        &ctl,
        &["accounting", "--format", "csv", "--socket", &socket],
    );
    assert_eq!(csv.stdout.lines().count(), 5, "{}", csv.stdout);
    // The line at the end of each job's own output: the final share of the batch step's
    // node, exactly as the controller recorded it, written with the owner's credentials.
    let last_line = |dir: &std::path::Path, id: &str| {
        let path = dir.join(format!("{id}.out"));
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let meta = std::fs::metadata(&path).expect("metadata");
        (
            text.lines().last().unwrap_or_default().to_string(),
            text,
            meta,
        )
    };
    let rc = record(&c_id);
    assert_eq!(rc.nodes.len(), 1);
    let (line, text, meta) = last_line(&bob_out, &c_id);
    assert_eq!(line, rc.nodes[0].end_line(1), "job output:\n{text}");
    assert!(
        line.starts_with(&format!(
            "powerflex: job {c_id} used {} on 1 GPU (counter), capped ",
            human_energy(rc.energy_j)
        )) && line.ends_with("[SIMULATED GPUs]"),
        "{line}"
    );
    use std::os::unix::fs::MetadataExt;
    assert_eq!(
        meta.uid(),
        bob.uid,
        "Slurm made the file as bob; it stays bob's"
    );
    eprintln!("end of job {c_id}'s output: {line}");
    // Alice's job ended while its batch node's agent was down: no line, and the job
    // was never held for it (it ended as Slurm says above).
    let (_, text, _) = last_line(&alice_out, &a_id);
    assert!(
        !text.lines().any(|l| l.starts_with("powerflex:")),
        "the agent was down at the end, yet:\n{text}"
    );
    // Switched off: the job was managed and recorded, and its output has no line.
    assert_eq!(record(&d_id).nodes.len(), 1, "job {d_id} was accounted");
    let (_, text, _) = last_line(&bob_out, &d_id);
    assert!(
        !text.lines().any(|l| l.starts_with("powerflex:")),
        "end_line=off, yet:\n{text}"
    );
    // Each node logged its shares too.
    let node_log = base.join("state").join(&names[0]).join("usage.jsonl");
    let text = std::fs::read_to_string(&node_log).expect("node usage log");
    assert_eq!(text.lines().count(), 2, "{text}");
    // The controller acknowledged both final shares: the agent keeps none.
    let state = base.join("state").join(&names[0]).join("agent-state.json");
    wait_until(
        "the first node's final shares acknowledged",
        Duration::from_secs(30),
        || {
            let text = std::fs::read_to_string(&state).ok()?;
            let saved: SavedFinals = serde_json::from_str(&text).ok()?;
            saved.unacked_finals.is_empty().then_some(())
        },
    );
    stack.cluster.assert_no_node_drained();
}

fn observe_only(site: powerflex::site_config::SiteBuilder) -> powerflex::site_config::SiteBuilder {
    site.edit(|raw| raw.agent.enforce = Some(false))
}

/// Observe mode (`agent.enforce = false`): the controller decides caps under a budget
/// that binds, the agents take its leases and say what they would write, and no
/// simulated GPU's limit ever leaves its default; the job is still accounted.
#[test]
fn observe_mode_writes_no_limit_while_the_controller_shows_what_it_would_do() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let stack = Stack::start(
        "observe",
        StackOptions {
            nodes: 1,
            budget_w: 1_500.0,
            sample_interval_ms: 100,
            site: Some(observe_only),
            ..StackOptions::default()
        },
    );
    let job = stack.submit("flex3,calibrate=off", 1, 4, "synthetic-memory-bound");
    let id = job.to_string();
    // The controller caps the job well below its GPUs' 700 W to fit 1.5 kW.
    let granted = wait_until(
        "the controller's cap for the job",
        Duration::from_secs(60),
        || {
            let jobs: Vec<SiteJobStatus> = stack.ctl_json(&["jobs"])?;
            jobs.into_iter()
                .find(|j| j.job == id)
                .and_then(|j| j.cap_w)
                .filter(|c| *c < 500.0)
        },
    );
    let would = wait_until(
        "the agent's cap it would write",
        Duration::from_secs(30),
        || {
            let status = stack.agent_status(0)?;
            (!status.enforce).then_some(())?;
            let caps: Vec<f64> = status.gpus.iter().filter_map(|g| g.would_cap_w).collect();
            (caps.len() == 4 && caps.iter().all(|c| (c - granted).abs() < 1.0)).then_some(caps)
        },
    );
    // Every 50 ms for 3 s: every limit is still the default.
    for _ in 0..60 {
        for g in 0..4 {
            let limit = stack.sims[0].gpu(g).expect("gpu").power_limit_mw;
            assert_eq!(
                limit, 700_000,
                "GPU {g} written in observe mode (would be {would:?})"
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let status = stack.agent_status(0).expect("status");
    let usage = status
        .jobs
        .iter()
        .find(|j| j.job == id)
        .and_then(|j| j.usage.clone())
        .expect("accounted");
    assert!(usage.energy_mj > 0 && usage.capped_s == 0.0, "{usage:?}");
    stack.cluster.run("scancel", &[&id]);
    stack.cluster.wait_job_done(job, Duration::from_secs(60));
    for g in 0..4 {
        assert_eq!(stack.sims[0].gpu(g).expect("gpu").power_limit_mw, 700_000);
    }
}
