//! Attacks on a node, tried on the local Slurm cluster as ordinary users would
//! (`src/users.rs`): nothing a user writes — environment variables, progress lines,
//! connections — decides identity, GPUs or power, and a wedged agent hangs no launch.
//! docs/security.md's table names each check here.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use powerflex::needs::{can_run, Need};
use powerflex::stack::{Stack, StackOptions};
use powerflex::users::TestUser;
use powerflex::wait_until;
use powerflex_daemon::os::{kill, Signal};
use powerflex_proto::status::{AgentStatus, PfiSource, SiteJobStatus};

const PYTHON: &str = "/usr/bin/python3";

/// Sends one progress report for `JOB` to `SOCKET` (or `$POWERFLEX_PROGRESS` when
/// empty) and writes what happened to `OUT`: `reply=accepted` (the agent answers only
/// refusals) or the agent's error line. Then sleeps `HOLD` seconds, as a job would run.
const REPORTER: &str = r#"
import os, socket, sys, time
path = sys.argv[1] or os.environ.get("POWERFLEX_PROGRESS", "")
job, out, hold = sys.argv[2], sys.argv[3], float(sys.argv[4])
try:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(3)
    s.connect(path)
    s.sendall(('{"v":1,"job_id":"%s","tokens":1000,"steps":1}\n' % job).encode())
    time.sleep(1.5)
    s.setblocking(False)
    try:
        said = s.recv(4096).decode().strip()
    except BlockingIOError:
        said = ""
except Exception as e:
    said = "error: %s" % e
with open(out + ".tmp", "w") as f:
    f.write("progress=%s\nreply=%s\n" % (path, said or "accepted"))
os.rename(out + ".tmp", out)
time.sleep(hold)
"#;

/// Holds `N` idle connections to each socket given, then sleeps.
const HOLDER: &str = r#"
import socket, sys, time
held = []
for path in sys.argv[2:]:
    for _ in range(int(sys.argv[1])):
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        held.append(s)
print("held", flush=True)
time.sleep(120)
"#;

/// Queues connections to a socket whose owner does not accept until the kernel takes no
/// more (its listen backlog is full), prints `queued N`, then holds them.
const BACKLOG_FILLER: &str = r#"
import socket, sys, time
held = []
for _ in range(4096):
    s = socket.socket(socket.AF_UNIX)
    s.setblocking(False)
    try:
        s.connect(sys.argv[1])
    except (BlockingIOError, OSError):
        s.close()
        break
    held.append(s)
print("queued %d" % len(held), flush=True)
time.sleep(120)
"#;

/// A directory every test user may write to (sticky, like /tmp).
fn shared_dir() -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("pf-attacks-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
    std::fs::write(dir.join("reporter.py"), REPORTER).expect("reporter");
    dir
}

/// The reporter's verdict in `out`, once written.
fn verdict(out: &Path, timeout: Duration) -> String {
    wait_until(&format!("{} written", out.display()), timeout, || {
        std::fs::read_to_string(out).ok()
    })
}

fn status(stack: &Stack) -> AgentStatus {
    stack.agent_status(0).expect("agent status")
}

/// Ends processes this test started, by their Child handles, when dropped.
struct Started(Vec<Child>);

impl Drop for Started {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn users_cannot_claim_gpus_progress_or_slots_with_words() {
    if !can_run(&[
        Need::Root,
        Need::Slurm,
        Need::Program("runuser"),
        Need::Program("useradd"),
        Need::File(PYTHON),
    ]) {
        return;
    }
    let alice = TestUser::ensure("pf-alice").expect("user");
    let bob = TestUser::ensure("pf-bob").expect("user");
    let mut stack = Stack::start(
        "attacks",
        StackOptions {
            nodes: 1,
            gpus_per_node: 4,
            budget_w: 100_000.0,
            lease_ttl_s: 3600,
            ..StackOptions::default()
        },
    );
    let dir = shared_dir();
    let reporter = dir.join("reporter.py");
    let reporter = reporter.to_str().expect("utf-8");
    let mut started = Started(Vec::new());

    // 1. Exported GPU variables with no --gres: Slurm gives the job no GPU, and the
    //    variables the user set claim none (batch step and srun step alike).
    let forged_gpus = "0,1,2,3";
    let out = bob
        .command(&stack.cluster, "sbatch")
        .args(["--parsable", "--chdir=/tmp", "--output=/dev/null"])
        .args(["--power-flex=flex0", "--wrap"])
        .arg(format!(
            "export SLURM_STEP_GPUS={forged_gpus} SLURM_JOB_GPUS={forged_gpus} CUDA_VISIBLE_DEVICES={forged_gpus}; srun {PYTHON} {reporter} '' x {}/nogres.out 20",
            dir.display()
        ))
        .env("SLURM_JOB_GPUS", forged_gpus)
        .env("SLURM_STEP_GPUS", forged_gpus)
        .env("CUDA_VISIBLE_DEVICES", forged_gpus)
        .output()
        .expect("sbatch");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let nogres: u32 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("job id");
    let said = verdict(&dir.join("nogres.out"), Duration::from_secs(60));
    assert!(
        said.contains("progress=\n"),
        "no progress address was handed out: {said}"
    );
    let s = status(&stack);
    assert!(
        s.jobs.iter().all(|j| j.job != nogres.to_string()),
        "job {nogres} without --gres registered GPUs: {:?}",
        s.jobs
    );
    assert!(s.gpus.iter().all(|g| g.job.is_none()), "{:?}", s.gpus);

    // 2. Alice's real job: one GPU, flex3; its own process reports and is accepted.
    let real = alice
        .sbatch(
            &stack.cluster,
            &[
                "--gres=gpu:1",
                "--power-flex=flex3",
                "--wrap",
                &format!(
                    "srun {PYTHON} {reporter} '' $SLURM_JOB_ID {}/real.out 600",
                    dir.display()
                ),
            ],
        )
        .expect("sbatch");
    let said = verdict(&dir.join("real.out"), Duration::from_secs(60));
    assert!(
        said.contains("reply=accepted"),
        "the job's own report: {said}"
    );
    let progress = said
        .lines()
        .find_map(|l| l.strip_prefix("progress="))
        .expect("progress address")
        .to_string();
    let real_id = real.to_string();
    let real_gpus = wait_until("alice's job registered", Duration::from_secs(30), || {
        status(&stack)
            .jobs
            .into_iter()
            .find(|j| j.job == real_id)
            .map(|j| j.gpus)
    });
    assert_eq!(real_gpus.len(), 1);

    // 3. A progress report across jobs: from alice's process outside any job with the
    //    job id in its environment, and from alice's other job (no GPUs): both refused.
    let outside = dir.join("outside.out");
    let ran = alice
        .command(&stack.cluster, PYTHON)
        .args([
            reporter,
            &progress,
            &real_id,
            outside.to_str().expect("utf-8"),
            "0",
        ])
        .env("SLURM_JOB_ID", &real_id)
        .status()
        .expect("python");
    assert!(ran.success());
    let said = verdict(&outside, Duration::from_secs(10));
    assert!(said.contains("runs in no Slurm job"), "{said}");
    alice
        .sbatch(
            &stack.cluster,
            &[
                "--power-flex=flex2",
                "--export",
                &format!("ALL,SLURM_JOB_ID={real_id}"),
                "--wrap",
                &format!(
                    "{PYTHON} {reporter} {progress} {real_id} {}/other.out 0",
                    dir.display()
                ),
            ],
        )
        .expect("sbatch");
    let said = verdict(&dir.join("other.out"), Duration::from_secs(60));
    assert!(
        said.contains("runs in job") && !said.contains("accepted"),
        "another job's process: {said}"
    );

    // 4. A forged environment, then an agent restart: bob's `sleep` claiming job 666,
    //    tier flex0 and every GPU is not taken back; alice's job keeps its GPU and tier.
    started.0.push(
        bob.exec_command(&stack.cluster, "env")
            .args([
                "SLURM_JOB_ID=666",
                "POWERFLEX_TIER=flex0",
                "SLURMD_NODENAME=n1",
                &format!("SLURM_STEP_GPUS={forged_gpus}"),
                &format!("SLURM_JOB_GPUS={forged_gpus}"),
                &format!("CUDA_VISIBLE_DEVICES={forged_gpus}"),
                "sleep",
                "300",
            ])
            .stdout(Stdio::null())
            .spawn()
            .expect("forged sleep"),
    );
    stack.kill_agent(0);
    stack.start_agent(0);
    let s = wait_until(
        "the restarted agent's status",
        Duration::from_secs(30),
        || stack.agent_status(0),
    );
    assert!(s.jobs.iter().all(|j| j.job != "666"), "{:?}", s.jobs);
    let kept = s
        .jobs
        .iter()
        .find(|j| j.job == real_id)
        .expect("alice's job kept");
    assert_eq!(
        (kept.gpus.clone(), kept.tier.as_str()),
        (real_gpus.clone(), "flex3")
    );

    // 5. 64 idle connections from bob on each socket: alice's next job still registers
    //    and reports.
    let agent_sock = stack.agent_socket(0);
    let mut holder = bob
        .exec_command(&stack.cluster, PYTHON)
        .args(["-c", HOLDER, "64"])
        .arg(&progress)
        .arg(&agent_sock)
        .stdout(Stdio::piped())
        .spawn()
        .expect("holder");
    let mut line = String::new();
    BufReader::new(holder.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("held");
    started.0.push(holder);
    assert_eq!(line.trim(), "held");
    let next = alice
        .sbatch(
            &stack.cluster,
            &[
                "--gres=gpu:1",
                "--power-flex=flex2",
                "--wrap",
                &format!(
                    "srun {PYTHON} {reporter} '' $SLURM_JOB_ID {}/next.out 0",
                    dir.display()
                ),
            ],
        )
        .expect("sbatch");
    let said = verdict(&dir.join("next.out"), Duration::from_secs(60));
    assert!(
        said.contains("reply=accepted") && !said.contains("progress=\n"),
        "job {next} registered and reported despite the flood: {said}"
    );

    // 6. A stopped agent (SIGSTOP), then one whose listen backlog is full too, hangs no
    //    launch: an srun's extra time stays within the plugin's one exchange
    //    (timeout_ms=500) + 50 ms (the issue's bound), plus the two end notices (step and
    //    extern step, 20 ms each at most, never waiting for an answer) and 250 ms for the
    //    spread of one srun's launch time on a shared machine; and no node drains.
    let timed = |what: &str| {
        let t = Instant::now();
        let out = alice
            .command(&stack.cluster, "srun")
            .args(["--gres=gpu:1", "--power-flex=flex2", "true"])
            .output()
            .expect("srun");
        assert!(
            out.status.success(),
            "{what}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        t.elapsed()
    };
    let up = timed("agent up");
    let agent = stack.agent_pid(0).expect("agent pid");
    // The agent this stack started, by its PID.
    kill(agent, Signal::STOP).expect("SIGSTOP");
    let stopped = timed("agent stopped");
    // And with its listen backlog full: bob queues connections until none is taken.
    let mut filler = bob
        .exec_command(&stack.cluster, PYTHON)
        .args(["-c", BACKLOG_FILLER])
        .arg(&agent_sock)
        .stdout(Stdio::piped())
        .spawn()
        .expect("filler");
    let mut queued = String::new();
    BufReader::new(filler.stdout.take().expect("stdout"))
        .read_line(&mut queued)
        .expect("queued");
    started.0.push(filler);
    let full = timed("agent stopped, backlog full");
    kill(agent, Signal::CONT).expect("SIGCONT");
    eprintln!(
        "srun: {up:?} with the agent up, {stopped:?} with it stopped, {full:?} with its backlog full ({})",
        queued.trim()
    );
    assert!(
        queued
            .trim()
            .strip_prefix("queued ")
            .and_then(|n| n.parse::<u32>().ok())
            .is_some_and(|n| n >= 1),
        "{queued}"
    );
    for (what, took) in [("stopped", stopped), ("backlog full", full)] {
        let extra = took.saturating_sub(up);
        assert!(
            extra <= Duration::from_millis(500 + 50 + 2 * 20 + 250),
            "srun took {took:?} with the agent {what}, {up:?} with it up"
        );
    }
    stack.cluster.assert_no_node_drained();
    drop(started);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Submits a simulated training job as `user`: one GPU, `flex`, the simulated job
/// reporting `report_scale` times the tokens it makes, and claiming `flex0` (uncapped)
/// in its own environment, as a user may: the agent must never read it.
fn submit_sim_as(stack: &Stack, user: &TestUser, flex: &str, report_scale: u32) -> u32 {
    let wrap = format!(
        "srun bash -c 'POWERFLEX_TIER=flex0 POWERFLEX_SIM_DIR={}/sim/$SLURMD_NODENAME exec {} --profile {SIM_PROFILE} --duration 20000 --time-scale 20 --report-scale {report_scale} > /dev/null'",
        stack.base.display(),
        stack.simjob.display()
    );
    user.sbatch(
        &stack.cluster,
        &[
            "--gres=gpu:1",
            &format!("--power-flex={flex}"),
            "--wrap",
            &wrap,
        ],
    )
    .expect("sbatch")
}

const SIM_PROFILE: &str = "qwen3-30b-a3b-moe-ft-8g";

/// When every job reports tokens, the objective must not be the raw sum of self-reported
/// tokens/s, or a job claiming 1000× its tokens would take the watts of every other. Two
/// users run the same workload on one GPU each; one reports 1000× its tokens.
/// Under the default (relative-speed) objective the liar gets no more power than the
/// honest job. The simulated jobs run as their users (`sim/` keeps the limits root's).
/// On the way, each user's `powerflexctl jobs` lists only their own job.
#[test]
fn a_job_reporting_1000x_its_tokens_gains_no_watts() {
    if !can_run(&[
        Need::Root,
        Need::Slurm,
        Need::Program("runuser"),
        Need::Program("useradd"),
    ]) {
        return;
    }
    let alice = TestUser::ensure("pf-alice").expect("user");
    let bob = TestUser::ensure("pf-bob").expect("user");
    let stack = Stack::start(
        "attacks-tok",
        StackOptions {
            nodes: 1,
            gpus_per_node: 2,
            budget_w: 100_000.0,
            lease_ttl_s: 30,
            ..StackOptions::default()
        },
    );
    let honest = submit_sim_as(&stack, &alice, "flex3", 1).to_string();
    let liar = submit_sim_as(&stack, &bob, "flex3", 1000).to_string();
    let view = |id: &str| {
        stack
            .ctl_json::<Vec<SiteJobStatus>>(&["jobs"])?
            .into_iter()
            .find(|j| j.job == id)
    };
    for id in [&honest, &liar] {
        wait_until(
            &format!("job {id} calibrated"),
            Duration::from_secs(180),
            || {
                let j = view(id)?;
                (j.pfi_source == Some(PfiSource::Measured) && j.throughput.is_some()).then_some(())
            },
        );
    }
    // Need-to-know at the controller: each user's `powerflexctl` lists their own job
    // only (the owner comes from slurmstepd's registration, through the link); root
    // lists both.
    let jobs_as = |user: &TestUser| -> Vec<String> {
        let out = user
            .command(&stack.cluster, &stack.ctl.to_string_lossy())
            .args(["jobs", "--format", "json", "--socket"])
            .arg(&stack.socket)
            .output()
            .expect("powerflexctl as a user");
        assert!(
            out.status.success(),
            "powerflexctl jobs as {}: {}",
            user.name,
            String::from_utf8_lossy(&out.stderr)
        );
        let rows: Vec<SiteJobStatus> = serde_json::from_slice(&out.stdout).expect("json");
        for r in &rows {
            assert_eq!(r.owner_uid, Some(user.uid), "{r:?}");
        }
        rows.into_iter().map(|r| r.job).collect()
    };
    assert_eq!(
        jobs_as(&alice),
        std::slice::from_ref(&honest),
        "alice sees her job only"
    );
    assert_eq!(
        jobs_as(&bob),
        std::slice::from_ref(&liar),
        "bob sees his job only"
    );
    let all: Vec<String> = stack
        .ctl_json::<Vec<SiteJobStatus>>(&["jobs"])
        .expect("jobs as root")
        .into_iter()
        .map(|j| j.job)
        .collect();
    assert!(
        all.contains(&honest) && all.contains(&liar),
        "root sees both: {all:?}"
    );
    let (h, l) = (view(&honest).expect("honest"), view(&liar).expect("liar"));
    let ratio = l.throughput.unwrap_or(0.0) / h.throughput.unwrap_or(1.0);
    assert!(ratio > 100.0, "the liar's reports are inflated: {ratio}");
    // A budget that cuts both: about 450 W per GPU for two ~650 W jobs.
    let set = powerflex::run(
        &stack.ctl,
        &[
            "budget",
            "set",
            "900W",
            "--socket",
            &stack.socket.to_string_lossy(),
        ],
    );
    assert_eq!(set.code, Some(0), "{}", set.stderr);
    let (h_cap, l_cap) = wait_until(
        "both jobs capped under the budget",
        Duration::from_secs(60),
        || {
            let (h, l) = (view(&honest)?.cap_w?, view(&liar)?.cap_w?);
            (h < 700.0 && l < 700.0 && h + l <= 900.0 + 1.0).then_some((h, l))
        },
    );
    eprintln!("caps: honest {h_cap} W, liar {l_cap} W");
    // Same workload, same tier: the same watts but for the allocation breaking the tie
    // one way or the other (seen: 400/500 W and 490/410 W, both ways round). A raw-tokens
    // objective gives the liar 600 W and pushes the honest job to its 300 W floor (seen
    // with `facility.objective = "tokens"`): the bound lies between the two.
    assert!(
        l_cap <= h_cap + 100.0,
        "the job reporting 1000x its tokens got {l_cap} W, the honest one {h_cap} W"
    );
    stack.cluster.assert_no_node_drained();
}

/// On a start the agent must not adopt a process just because its environment holds
/// `SLURM_JOB_ID`, `POWERFLEX_TIER` and a GPU list, or a forged `sleep` would become a job
/// and take the real job's GPUs. Here the worst case: the state file is lost, so the agent
/// must take jobs back from what runs on its GPUs, and `pf-bob` runs a simulated job
/// *on a GPU*, outside Slurm, with every variable forged (`flex0`: uncapped). The real
/// job is taken back from its processes, under the tier Slurm records for it.
#[test]
fn a_forged_job_on_a_gpu_is_not_taken_back_after_a_lost_state_file() {
    if !can_run(&[
        Need::Root,
        Need::Slurm,
        Need::Program("runuser"),
        Need::Program("useradd"),
    ]) {
        return;
    }
    let alice = TestUser::ensure("pf-alice").expect("user");
    let bob = TestUser::ensure("pf-bob").expect("user");
    let mut stack = Stack::start(
        "attacks-adopt",
        StackOptions {
            nodes: 1,
            gpus_per_node: 2,
            budget_w: 100_000.0,
            lease_ttl_s: 3600,
            site: Some(|site| {
                site.edit(|raw| raw.agent.unregistered_gpu_use = Some("failsafe".into()))
            }),
            ..StackOptions::default()
        },
    );
    let real = submit_sim_as(&stack, &alice, "flex1", 1).to_string();
    let real_gpus = wait_until("alice's job registered", Duration::from_secs(60), || {
        let j = status(&stack).jobs.into_iter().find(|j| j.job == real)?;
        let on_gpu = stack.sims[0]
            .gpu(j.gpus[0])
            .ok()?
            .workload
            .is_some_and(|w| w.job_id == real);
        on_gpu.then_some(j.gpus)
    });
    let free = 1 - real_gpus[0];
    let sim_dir = stack.sims[0].dir().display().to_string();
    let forged = Started(vec![bob
        .exec_command(&stack.cluster, "env")
        .args([
            "SLURM_JOB_ID=666",
            "POWERFLEX_TIER=flex0",
            "SLURMD_NODENAME=n1",
            &format!("SLURM_STEP_GPUS={free}"),
            &format!("SLURM_JOB_GPUS={free}"),
            &format!("POWERFLEX_SIM_DIR={sim_dir}"),
        ])
        .arg(&stack.simjob)
        .args([
            "--profile",
            SIM_PROFILE,
            "--duration",
            "20000",
            "--time-scale",
            "20",
        ])
        .stdout(Stdio::null())
        .spawn()
        .expect("forged job")]);
    wait_until(
        "bob's process on the free GPU",
        Duration::from_secs(20),
        || {
            stack.sims[0]
                .gpu(free)
                .ok()?
                .workload
                .filter(|w| w.job_id == "666")
                .map(|_| ())
        },
    );
    // Slurm's own record of the job's tier: the controller's AdminComment.
    wait_until(
        "the job's tier in its AdminComment",
        Duration::from_secs(30),
        || {
            stack
                .cluster
                .job_info(real.parse().ok()?)
                .contains("AdminComment=powerflex;tier=flex1;")
                .then_some(())
        },
    );
    stack.kill_agent(0);
    std::fs::remove_file(stack.agent_state_file(0)).expect("lose the state file");
    stack.start_agent(0);
    let s = wait_until(
        "the restarted agent's status",
        Duration::from_secs(30),
        || stack.agent_status(0),
    );
    assert!(s.jobs.iter().all(|j| j.job != "666"), "{:?}", s.jobs);
    assert!(s.gpus[free as usize].job.is_none(), "{:?}", s.gpus);
    let kept = s
        .jobs
        .iter()
        .find(|j| j.job == real)
        .expect("alice's job taken back from its processes");
    assert_eq!(kept.gpus, real_gpus, "the real job keeps its GPU");
    assert_eq!(
        kept.tier, "flex1",
        "the tier Slurm records (AdminComment), not any variable"
    );
    // Bob's process uses a GPU no registered job holds, so this site's
    // `agent.unregistered_gpu_use = "failsafe"` holds that GPU below its default.
    wait_until(
        "the forged job's GPU held at the fail-safe",
        Duration::from_secs(20),
        || {
            let s = stack.agent_status(0)?;
            let gpu = &s.gpus[free as usize];
            let limit_w = f64::from(stack.sims[0].gpu(free).ok()?.power_limit_mw) / 1000.0;
            (gpu.unregistered_use && limit_w < gpu.default_w).then_some(())
        },
    );
    drop(forged);
    stack.cluster.assert_no_node_drained();
}
