//! The fault matrix (docs/fault-matrix.md), the rows that need the whole stack on a local
//! Slurm cluster with SIMULATED GPUs. Each row injects one fault while jobs run under a
//! budget that caps them, and checks what must hold: the draw never over the budget, no
//! GPU left capped without a live job, no job killed by powerflex, no node drained.
//!
//! The rows whose subject is logic (the controller gone past the lease, a wall-clock
//! jump on one node, a controller restarted mid-event) run on the site harness's fake
//! clock: `harness/tests/faults.rs`.

use std::path::PathBuf;
use std::time::Duration;

use powerflex::needs::{can_run, Need};
use powerflex::site_config::SiteBuilder;
use powerflex::slurm::pid_alive;
use powerflex::stack::{Stack, StackOptions, DEFAULT_CAP_W};
use powerflex::wait_until;
use powerflex_core::config::{RawGpuModel, RawSiteConfig};
use powerflex_daemon::os::{kill, Signal};
use powerflex_proto::status::{CtldStatus, NodeStatus, SiteJobStatus};

/// A budget that caps two 4-GPU jobs well below their ~2.5 kW each.
const BUDGET_W: f64 = 3000.0;
const PROFILE: &str = "qwen3-30b-a3b-moe-ft-8g";

/// The stack's one GPU model section, to edit.
fn h200(site: &mut RawSiteConfig) -> &mut RawGpuModel {
    site.gpu_models
        .get_mut("H200")
        .expect("the stack's site config has [gpu_models.H200]")
}

/// Sets the budget and waits until the jobs' caps bring the draw within it.
fn capped(stack: &Stack) {
    let set = powerflex::run(
        &stack.ctl,
        &[
            "budget",
            "set",
            &format!("{BUDGET_W}W"),
            "--socket",
            &stack.socket.to_string_lossy(),
        ],
    );
    assert_eq!(set.code, Some(0), "{}", set.stderr);
    wait_until(
        "the controller's caps within the budget",
        Duration::from_secs(30),
        || allocated(stack).then_some(()),
    );
}

/// Every job runs at the cap the controller allocated it (not the fail-safe cap a job
/// waits at until then, nor the default) and the draw is within the budget.
fn allocated(stack: &Stack) -> bool {
    allocated_within(stack, BUDGET_W)
}

/// [`allocated`] for a budget other than [`BUDGET_W`].
fn allocated_within(stack: &Stack, budget_w: f64) -> bool {
    let Some(jobs) = stack.ctl_json::<Vec<SiteJobStatus>>(&["jobs"]) else {
        return false;
    };
    let granted: Vec<f64> = jobs.iter().filter_map(|j| j.cap_w).collect();
    let caps = stack.caps_w();
    !granted.is_empty()
        && granted.len() == jobs.len()
        && caps
            .iter()
            .all(|c| *c < DEFAULT_CAP_W && granted.contains(c))
        && stack.draw_w() <= budget_w * 1.01
}

/// Submits the rows' training job (flex3, no calibration walk, 2 nodes x 4 GPUs) and
/// waits until it runs.
fn start_job(stack: &Stack) -> u32 {
    let job = stack.submit("flex3,calibrate=off", 2, 4, PROFILE);
    wait_until("the job runs", Duration::from_secs(30), || {
        stack.running(job).then_some(())
    });
    job
}

#[test]
fn slurmd_restarted_mid_job_keeps_the_caps_the_job_and_the_epilog() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let mut stack = Stack::start("f-slurmd", StackOptions::default());
    let job = start_job(&stack);
    capped(&stack);
    let caps = stack.caps_w();
    stack.cluster.restart_slurmd("n1");
    stack.assert_draw_within(BUDGET_W, Duration::from_secs(4), "after slurmd restarted");
    assert_eq!(stack.caps_w(), caps, "caps untouched by the slurmd restart");
    assert!(stack.running(job), "the job survives its slurmd's restart");
    assert!(stack.capped_without_a_job().is_empty());
    // The job's end still reaches the agent through the new slurmd (job epilog).
    stack.ends_clean(&[job], Duration::from_secs(30));
}

/// Slurm restarted in place while a job runs, as a package upgrade restarts
/// it (every daemon stopped, then started from its saved state). While `squeue` cannot
/// answer, the controller keeps its last placement and says so, the caps stay and the
/// draw stays within the budget at every 50 ms sample; after, the placement is read
/// again, the job is still managed, and its end still reaches the agents. (The same
/// Slurm binaries start again: no other Slurm version is installed here.)
#[test]
fn slurm_restarted_in_place_keeps_the_caps_the_job_and_the_placement() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let mut stack = Stack::start("f-slurmup", StackOptions::default());
    let job = start_job(&stack);
    capped(&stack);
    stack.cluster.stop_daemons();
    let stale = wait_until(
        "the controller saying its placement is stale",
        Duration::from_secs(30),
        || {
            let status: CtldStatus = stack.ctl_json(&["status"])?;
            let slurm = status.slurm?;
            slurm.error.is_some().then_some(slurm)
        },
    );
    assert!(stale.jobs >= 1, "the last placement kept: {stale:?}");
    stack.assert_draw_within(BUDGET_W, Duration::from_secs(6), "with Slurm down");
    assert!(
        stack.capped_without_a_job().is_empty(),
        "no GPU capped without a job"
    );
    assert!(
        stack.caps_w().iter().all(|&c| c < DEFAULT_CAP_W),
        "the job's GPUs stay capped: {:?}",
        stack.caps_w()
    );
    stack.cluster.start_daemons();
    wait_until(
        "the job running after the restart",
        Duration::from_secs(60),
        || stack.running(job).then_some(()),
    );
    wait_until("the placement read again", Duration::from_secs(60), || {
        let status: CtldStatus = stack.ctl_json(&["status"])?;
        let slurm = status.slurm?;
        (slurm.error.is_none() && slurm.jobs >= 1).then_some(())
    });
    wait_until(
        "the job managed at the controller's caps",
        Duration::from_secs(30),
        || allocated(&stack).then_some(()),
    );
    stack.assert_draw_within(BUDGET_W, Duration::from_secs(3), "after Slurm restarted");
    stack.ends_clean(&[job], Duration::from_secs(30));
}

/// A copy of the installed `slurmstepd` that one test's cluster runs (`slurmd -d`), so
/// that replacing it, as a package upgrade replaces the installed one, touches no other
/// test's cluster (the suite runs test binaries side by side). Removed when dropped.
struct StepdCopy {
    dir: PathBuf,
    /// The copy, named `slurmstepd` as Slurm's own and RPM installs name it (Debian's
    /// file is `slurmstepd-wlm`, behind an alternatives link of that name).
    exe: PathBuf,
    /// The installed binary it was copied from.
    source: PathBuf,
}

impl StepdCopy {
    fn new(name: &str) -> StepdCopy {
        let source = std::fs::canonicalize("/usr/sbin/slurmstepd")
            .unwrap_or_else(|e| panic!("no installed slurmstepd at /usr/sbin/slurmstepd: {e}"));
        let dir = std::env::temp_dir().join(format!("pf-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let exe = dir.join("slurmstepd");
        std::fs::copy(&source, &exe).unwrap_or_else(|e| panic!("{}: {e}", exe.display()));
        StepdCopy { dir, exe, source }
    }

    /// Replaces the copy the way dpkg and rpm install a new binary: a new file written
    /// beside it, then renamed over it. Processes running the old one run on, and the
    /// kernel shows their `exe` link as `PATH (deleted)`.
    fn upgrade(&self) {
        let new = self.dir.join("upgrade.tmp");
        std::fs::copy(&self.source, &new).unwrap_or_else(|e| panic!("{}: {e}", new.display()));
        std::fs::rename(&new, &self.exe).unwrap_or_else(|e| panic!("{}: {e}", self.exe.display()));
    }

    /// The processes whose `exe` link reads `target`, by PID.
    fn running(target: &str) -> Vec<u32> {
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        entries
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                std::fs::read_link(format!("/proc/{pid}/exe"))
                    .is_ok_and(|link| link.as_os_str() == target)
            })
            .collect::<std::collections::BTreeSet<u32>>()
            .into_iter()
            .collect()
    }
}

impl Drop for StepdCopy {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The shortest grace the agent allows before it ends a job whose step daemons it no
/// longer sees, so that a job wrongly seen as gone is ended within the test's window.
fn short_job_end_grace(site: SiteBuilder) -> SiteBuilder {
    site.edit(|raw| raw.agent.job_end_grace_s = Some(JOB_END_GRACE_S))
}

const JOB_END_GRACE_S: f64 = 5.0;

/// Slurm's package upgraded in place under a running job: its `slurmstepd` binary
/// replaced on disk (here the cluster's own copy, renamed over as dpkg does), so the
/// job's step daemons run a deleted file and `/proc/PID/exe` reads `... (deleted)`. The
/// agents still see the job's step daemons: past the grace after which a job whose step
/// daemons are gone is ended, every GPU stays capped at every 50 ms sample, the job is
/// still managed and the draw within the budget; its end still restores the GPUs.
#[test]
fn slurmstepd_replaced_under_a_running_job_keeps_it_managed_and_capped() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let stepd = StepdCopy::new("stepd-up");
    let stack = Stack::start(
        "f-stepdup",
        StackOptions {
            slurmstepd: Some(stepd.exe.clone()),
            site: Some(short_job_end_grace),
            ..StackOptions::default()
        },
    );
    let job = start_job(&stack);
    capped(&stack);
    let exe = stepd.exe.display().to_string();
    let daemons = StepdCopy::running(&exe);
    assert!(
        !daemons.is_empty(),
        "the job's step daemons run the cluster's copy {exe}"
    );
    stepd.upgrade();
    let deleted = format!("{exe} (deleted)");
    let replaced = StepdCopy::running(&deleted);
    assert_eq!(
        replaced, daemons,
        "every step daemon now runs a deleted binary ({deleted})"
    );
    // Two job scans of the agents (every 2 s) past the grace.
    let window = Duration::from_secs_f64(JOB_END_GRACE_S + 5.0);
    let start = std::time::Instant::now();
    let (mut samples, mut highest_w, mut highest_cap_w) = (0u32, 0.0f64, 0.0f64);
    while start.elapsed() < window {
        let caps = stack.caps_w();
        assert!(
            caps.iter().all(|&c| c < DEFAULT_CAP_W),
            "a GPU of the running job back at its default {DEFAULT_CAP_W} W {:.2} s after \
             the upgrade: {caps:?}",
            start.elapsed().as_secs_f64()
        );
        highest_cap_w = caps.iter().copied().fold(highest_cap_w, f64::max);
        highest_w = highest_w.max(stack.draw_w());
        samples += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    println!(
        "after the upgrade: {samples} samples over {:.1} s, highest cap {highest_cap_w} W, \
         highest draw {highest_w:.0} W of {BUDGET_W} W",
        window.as_secs_f64()
    );
    assert!(
        highest_w <= BUDGET_W * 1.01,
        "draw {highest_w:.0} W over the {BUDGET_W} W budget"
    );
    assert!(stack.running(job), "the job runs on");
    assert_eq!(
        StepdCopy::running(&deleted),
        daemons,
        "the step daemons run on"
    );
    for i in 0..2 {
        let status = stack.agent_status(i).expect("the agent answers");
        assert!(
            status.jobs.iter().any(|j| j.job == job.to_string()),
            "agent {i} still manages job {job}: {:?}",
            status.jobs
        );
    }
    assert!(stack.capped_without_a_job().is_empty());
    stack.ends_clean(&[job], Duration::from_secs(30));
}

#[test]
fn a_killed_job_process_gets_its_gpus_back_and_the_other_job_runs_on() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let stack = Stack::start("f-jobkill", StackOptions::default());
    let victim = stack.submit("flex3,calibrate=off", 1, 4, PROFILE);
    let other = stack.submit("flex3,calibrate=off", 1, 4, PROFILE);
    wait_until("both jobs run", Duration::from_secs(30), || {
        (stack.running(victim) && stack.running(other)).then_some(())
    });
    capped(&stack);
    // kill -9 the victim's training process (found through the GPUs it holds).
    let pid = wait_until(
        "the victim's process on a GPU",
        Duration::from_secs(10),
        || {
            stack.sims.iter().find_map(|sim| {
                (0..stack.gpus_per_node).find_map(|g| {
                    let gpu = sim.gpu(g).ok()?;
                    let w = gpu.running()?;
                    (w.job_id == victim.to_string()).then_some(w.pid)
                })
            })
        },
    );
    assert!(pid_alive(pid));
    kill(pid, Signal::KILL).expect("SIGKILL to the job's process");
    let state = stack.cluster.wait_job_done(victim, Duration::from_secs(60));
    assert_ne!(state, "RUNNING");
    wait_until(
        "the killed job's GPUs back at their default",
        Duration::from_secs(30),
        || stack.capped_without_a_job().is_empty().then_some(()),
    );
    stack.assert_draw_within(BUDGET_W, Duration::from_secs(3), "after the job died");
    assert!(stack.running(other), "powerflex kills no job");
    stack.ends_clean(&[other], Duration::from_secs(30));
}

#[test]
fn a_truncated_agent_state_file_is_set_aside_and_the_running_job_taken_back() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let mut stack = Stack::start("f-state", StackOptions::default());
    let job = start_job(&stack);
    capped(&stack);
    stack.kill_agent(0);
    let state = stack.agent_state_file(0);
    let text = std::fs::read(&state).expect("the agent's state file");
    std::fs::write(&state, &text[..text.len() / 2]).expect("truncate");
    stack.start_agent(0);
    // The agent starts, says so, keeps the corrupt file for a post-mortem, and takes the
    // running job back from its processes: the caps and the budget hold throughout.
    assert!(
        state.with_extension("json.corrupt").exists(),
        "the corrupt file is set aside"
    );
    stack.assert_draw_within(
        BUDGET_W,
        Duration::from_secs(6),
        "after the agent restarted",
    );
    wait_until(
        "the job managed on n1 again",
        Duration::from_secs(20),
        || {
            let jobs: Vec<SiteJobStatus> = stack.ctl_json(&["jobs"])?;
            let j = jobs.into_iter().find(|j| j.job == job.to_string())?;
            (j.nodes.len() == 2).then_some(())
        },
    );
    assert!(stack.running(job));
    assert!(stack.capped_without_a_job().is_empty());
    stack.ends_clean(&[job], Duration::from_secs(30));
}

/// A restarted agent must not read a job's recorded tier from `scontrol show job -o`:
/// its `key=value` pairs split on spaces, so a job *named*
/// `x AdminComment=powerflex;tier=…` would choose the tier it is taken back under after a
/// lost state file. The tier comes from `squeue --json`'s own `admin_comment` field.
#[test]
fn a_forged_job_name_does_not_choose_the_tier_a_lost_state_file_takes_the_job_back_under() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let mut stack = Stack::start("f-forge", StackOptions::default());
    let wrap = format!(
        "srun bash -c 'POWERFLEX_SIM_DIR={}/sim/$SLURMD_NODENAME exec {} --profile {PROFILE} --duration 20000 --time-scale 20 > /dev/null'",
        stack.base.display(),
        stack.simjob.display()
    );
    let job = stack
        .cluster
        .sbatch(
            &[
                "-N1",
                "--nodelist=n1",
                "--gres=gpu:4",
                "--power-flex=flex1,calibrate=off",
                "-J",
                "x AdminComment=powerflex;tier=flex3,preempt=requeue;cap=200W",
                "--wrap",
                &wrap,
            ],
            None,
        )
        .expect("sbatch");
    // The controller's own annotation, in Slurm's record.
    wait_until(
        "the controller's AdminComment on the job",
        Duration::from_secs(60),
        || {
            let info = stack.cluster.job_info(job);
            info.contains("AdminComment=powerflex;tier=flex1,calibrate=off;")
                .then_some(())
        },
    );
    stack.kill_agent(0);
    let state = stack.agent_state_file(0);
    let text = std::fs::read(&state).expect("the agent's state file");
    std::fs::write(&state, &text[..text.len() / 2]).expect("truncate");
    stack.start_agent(0);
    let tier = wait_until("the job taken back on n1", Duration::from_secs(30), || {
        let jobs: Vec<SiteJobStatus> = stack.ctl_json(&["jobs"])?;
        jobs.into_iter()
            .find(|j| j.job == job.to_string() && j.nodes == ["n1"])
            .map(|j| j.tier)
    });
    assert_eq!(
        tier, "flex1,calibrate=off",
        "Slurm's AdminComment, not the one forged in the job's name"
    );
    assert!(stack.logs("agent-n1").contains("managing it again"));
    stack.cluster.run("scancel", &[&job.to_string()]);
    stack.ends_clean(&[], Duration::from_secs(60));
}

#[test]
fn nvml_errors_on_one_gpu_leave_the_others_managed_and_the_budget_held() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    use powerflex_sim::state::Fault;
    let stack = Stack::start("f-nvml", StackOptions::default());
    let job = start_job(&stack);
    capped(&stack);
    let n1 = &stack.sims[0];
    for (i, kind) in ["gpu-lost", "no-permission", "timeout"].iter().enumerate() {
        n1.set_fault(1, Fault::from_name(kind)).expect("inject");
        // A lower budget must still reach the GPUs that answer.
        let budget = BUDGET_W - 200.0 * (i as f64 + 1.0);
        let set = powerflex::run(
            &stack.ctl,
            &[
                "budget",
                "set",
                &format!("{budget}W"),
                "--socket",
                &stack.socket.to_string_lossy(),
            ],
        );
        assert_eq!(set.code, Some(0), "{}", set.stderr);
        wait_until(
            &format!("the draw within {budget} W with {kind} on n1 GPU 1"),
            Duration::from_secs(20),
            || (stack.draw_w() <= budget * 1.01).then_some(()),
        );
        stack.assert_draw_within(budget, Duration::from_secs(2), kind);
        let nodes: Vec<NodeStatus> = stack.ctl_json(&["nodes"]).expect("controller answers");
        let n1_live = nodes.iter().find(|n| n.node == "n1").map(|n| n.live);
        assert_eq!(n1_live, Some(true), "the agent carries on with {kind}");
        n1.set_fault(1, None).expect("clear");
    }
    assert!(stack.running(job), "powerflex kills no job");
    stack.ends_clean(&[job], Duration::from_secs(30));
}

#[test]
fn an_invalid_site_config_reload_is_refused_and_the_config_in_force_stays() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let stack = Stack::start(
        "f-reload",
        StackOptions {
            budget_w: BUDGET_W,
            ..StackOptions::default()
        },
    );
    let job = stack.submit("flex3,calibrate=off", 2, 4, PROFILE);
    wait_until(
        "the job capped within the config's budget",
        Duration::from_secs(30),
        || (stack.running(job) && allocated(&stack)).then_some(()),
    );
    // A valid edit takes effect on SIGHUP.
    stack.edit_site(|site| site.facility.gpu_budget_w = 2500.0);
    stack.reload_ctld();
    wait_until(
        "the reloaded budget in force",
        Duration::from_secs(10),
        || (stack.budget_w()? == 2500.0).then_some(()),
    );
    wait_until(
        "the caps for the reloaded budget",
        Duration::from_secs(20),
        || allocated_within(&stack, 2500.0).then_some(()),
    );
    // An invalid one is refused, reported, and changes nothing.
    stack.edit_site(|site| site.facility.gpu_budget_w = -5.0);
    stack.reload_ctld();
    let status = wait_until("the refusal reported", Duration::from_secs(10), || {
        let s: CtldStatus = stack.ctl_json(&["status"])?;
        s.config_error.is_some().then_some(s)
    });
    assert!(
        status
            .config_error
            .as_deref()
            .is_some_and(|e| e.contains("gpu_budget_w")),
        "{status:?}"
    );
    assert_eq!(status.budget_w, 2500.0, "the config in force stays");
    let table = powerflex::run(
        &stack.ctl,
        &["status", "--socket", &stack.socket.to_string_lossy()],
    );
    assert!(
        table.stdout.contains("SITE CONFIG RELOAD REFUSED"),
        "{}",
        table.stdout
    );
    stack.assert_draw_within(2500.0, Duration::from_secs(3), "after the refused reload");
    assert!(stack.running(job), "powerflex kills no job");
    // Fixed: accepted, the report cleared.
    stack.edit_site(|site| site.facility.gpu_budget_w = 2600.0);
    stack.reload_ctld();
    wait_until("the fixed config in force", Duration::from_secs(10), || {
        let s: CtldStatus = stack.ctl_json(&["status"])?;
        (s.budget_w == 2600.0 && s.config_error.is_none()).then_some(())
    });
    stack.ends_clean(&[job], Duration::from_secs(30));
}

#[test]
fn a_corrupt_controller_state_mid_event_falls_back_on_the_previous_copy() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let mut stack = Stack::start(
        "f-ctldstate",
        StackOptions {
            budget_w: 5000.0,
            ..StackOptions::default()
        },
    );
    let job = start_job(&stack);
    // A grid event down to the test budget, then an admin change after it (so the
    // previous copy holds the event too).
    let socket = stack.socket.to_string_lossy().to_string();
    let add = powerflex::run(
        &stack.ctl,
        &[
            "event",
            "add",
            "--target",
            &format!("{BUDGET_W}W"),
            "--duration",
            "10m",
            "--socket",
            &socket,
        ],
    );
    assert_eq!(add.code, Some(0), "{}", add.stderr);
    let set = powerflex::run(&stack.ctl, &["budget", "set", "5200W", "--socket", &socket]);
    assert_eq!(set.code, Some(0), "{}", set.stderr);
    wait_until("the event's caps", Duration::from_secs(30), || {
        allocated(&stack).then_some(())
    });
    stack.kill_ctld();
    let state = stack.ctld_state_file();
    let text = std::fs::read(&state).expect("controller state");
    std::fs::write(&state, &text[..text.len() / 3]).expect("truncate");
    stack.start_ctld();
    assert!(state.with_extension("json.corrupt").exists(), "set aside");
    let status = wait_until("the event known again", Duration::from_secs(10), || {
        let s: CtldStatus = stack.ctl_json(&["status"])?;
        (s.active_event.as_ref().map(|e| e.id) == Some(1)).then_some(s)
    });
    assert!(status.budget_w <= BUDGET_W + 1e-6, "{status:?}");
    stack.assert_draw_within(
        BUDGET_W,
        Duration::from_secs(4),
        "after the restart on the previous state",
    );
    assert!(stack.running(job), "powerflex kills no job");
    stack.ends_clean(&[job], Duration::from_secs(30));
}

#[test]
fn an_agent_reload_applies_a_valid_failsafe_and_refuses_an_invalid_one() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let mut stack = Stack::start(
        "f-agentcfg",
        StackOptions {
            budget_w: BUDGET_W,
            lease_ttl_s: 5,
            ..StackOptions::default()
        },
    );
    let job = stack.submit("flex3,calibrate=off", 2, 4, PROFILE);
    wait_until(
        "the job capped within the budget",
        Duration::from_secs(30),
        || (stack.running(job) && allocated(&stack)).then_some(()),
    );
    // An invalid edit: refused by both agents, reported, nothing changes.
    stack.edit_site(|site| h200(site).failsafe_cap_w = 9000.0);
    for i in 0..2 {
        stack.reload_agent(i);
    }
    for i in 0..2 {
        let status = wait_until(
            "the refusal in the agent's status",
            Duration::from_secs(10),
            || {
                let s = stack.agent_status(i)?;
                s.config_error.is_some().then_some(s)
            },
        );
        assert!(
            status
                .config_error
                .as_deref()
                .is_some_and(|e| e.contains("failsafe_cap_w")),
            "{status:?}"
        );
    }
    stack.assert_draw_within(BUDGET_W, Duration::from_secs(2), "after the refused reload");
    // A valid edit takes effect: with the controller gone past its lease, the jobs fall
    // to the new fail-safe cap.
    stack.edit_site(|site| h200(site).failsafe_cap_w = 250.0);
    for i in 0..2 {
        stack.reload_agent(i);
    }
    for i in 0..2 {
        wait_until("the reload accepted", Duration::from_secs(10), || {
            stack.agent_status(i)?.config_error.is_none().then_some(())
        });
    }
    stack.kill_ctld();
    wait_until(
        "every GPU at the new fail-safe cap",
        Duration::from_secs(20),
        || stack.caps_w().iter().all(|&c| c == 250.0).then_some(()),
    );
    assert!(stack.running(job), "powerflex kills no job");
    stack.ends_clean(&[job], Duration::from_secs(30));
}
