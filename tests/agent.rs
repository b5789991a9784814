//! `powerflexd` as a real process on simulated GPUs: real sockets, the real NVML code
//! path (nvml-wrapper loading the simulated library), real simulated training jobs.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use powerflex_daemon::os::{kill, Signal};
use powerflex_proto::status::{AgentJobStatus, AgentStatus, CalibrationState};
use powerflex_proto::{ControlOp, ControlReply, ControlRequest};
use powerflex_sim::state::{Fault, Node};

use powerflex::needs::{can_run, Need};
use powerflex::site_config::SiteBuilder;
use powerflex::{binary, profile_dir, repo_root, wait_until};

/// Builds what the tests run besides the agent: the simulated NVML library, the
/// simulated job, the socket client.
fn build() {
    powerflex::cargo_build(&[
        "-p",
        "powerflex-sim-nvml",
        "-p",
        "powerflex-sim",
        "-p",
        "powerflex-agent",
        "--bins",
        "--lib",
        "--examples",
    ]);
}

fn free_port() -> u16 {
    powerflex::free_loopback_port()
}

/// One agent on one simulated node, in its own directory.
struct Fixture {
    dir: PathBuf,
    node: Node,
    config: PathBuf,
    agent: Option<Child>,
    /// Stand-in step daemons this fixture started, and the job process under each.
    jobs: Vec<(Child, u32)>,
    metrics_port: u16,
    /// Start the agent with `--release-on-exit`.
    release_on_exit: bool,
    /// Start the agent in its own mount namespace with its state directory on a tmpfs of
    /// this many KiB (a small `/var` the test can fill through `/proc/PID/root`).
    small_state_fs_kib: Option<u32>,
}

/// Quotes `s` for sh.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// A stand-in for Slurm's step daemon of `job`: a root-owned process whose executable is
/// named `slurmstepd` (a copy of /bin/sh) and whose title is `slurmstepd: [JOB.0]`, so
/// the agent attributes its children to the job by ancestry as it does under Slurm.
/// It runs `argv` as its child with `env`; `script_tail` follows the command in the
/// shell script it reads from stdin.
fn in_step(dir: &Path, job: &str, argv: &[&str], env: &[(&str, &str)], script_tail: &str) -> Child {
    let exe = dir.join("bin/slurmstepd");
    if !exe.exists() {
        std::fs::create_dir_all(dir.join("bin")).expect("bin dir");
        std::fs::copy("/bin/sh", &exe).expect("copy /bin/sh");
    }
    let mut cmd = Command::new(&exe);
    cmd.arg0(format!("slurmstepd: [{job}.0]"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .env_remove("SLURM_JOB_ID");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("stand-in slurmstepd");
    let line: Vec<String> = argv.iter().map(|a| sh_quote(a)).collect();
    let script = format!("{} {script_tail}\n", line.join(" "));
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(script.as_bytes())
        .expect("script");
    child
}

impl Fixture {
    fn new(name: &str, node_budget_w: Option<f64>, lease_ttl_s: u64) -> Fixture {
        Fixture::with_controller(name, node_budget_w, lease_ttl_s, None)
    }

    /// `controller`: the port a test controller listens on and the site key file.
    fn with_controller(
        name: &str,
        node_budget_w: Option<f64>,
        lease_ttl_s: u64,
        controller: Option<(u16, &Path)>,
    ) -> Fixture {
        build();
        let dir = std::env::temp_dir().join(format!("pf-agent-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let node = Node::init(&dir.join("sim/n1"), "n1", "H200", 8, true).expect("sim node");
        let metrics_port = free_port();
        let config = dir.join("powerflex.toml");
        let (port, key) = match controller {
            Some((port, key)) => (port, key.to_path_buf()),
            None => (9, dir.join("no-such.key")),
        };
        SiteBuilder::new(100000.0)
            .h200(&[700.0, 600.0, 500.0, 400.0, 300.0, 200.0], 500.0)
            .controller(([127, 0, 0, 1], port).into(), lease_ttl_s, 2)
            .key_file(&key)
            .agent_paths(
                &format!("{}/%n.sock", dir.display()),
                &format!("{}/state/%n", dir.display()),
                &profile_dir().join("libpowerflex_sim_nvml.so"),
            )
            .agent_metrics(([127, 0, 0, 1], metrics_port).into())
            .calibration_s(1.0, 1.0, 3.0)
            .calibration_budget_pct(0.2)
            .edit(|raw| {
                raw.agent.calibration_allowance_pct = Some(5.0);
                raw.agent.node_budget_w = node_budget_w;
            })
            .write(&config)
            .unwrap_or_else(|e| panic!("{e}"));
        let mut f = Fixture {
            dir,
            node,
            config,
            agent: None,
            jobs: Vec::new(),
            metrics_port,
            release_on_exit: false,
            small_state_fs_kib: None,
        };
        f.start_agent();
        f
    }

    fn socket(&self) -> PathBuf {
        self.dir.join("n1.sock")
    }

    fn start_agent(&mut self) {
        let _ = std::fs::remove_file(self.socket());
        let log = std::fs::File::create(self.dir.join("agent.log")).expect("log");
        let mut command = match self.small_state_fs_kib {
            None => Command::new(binary("powerflexd")),
            Some(kib) => {
                // unshare and sh exec in turn: the child's PID is the agent's.
                let mut c = Command::new("unshare");
                c.args([
                    "--mount",
                    "sh",
                    "-c",
                    &format!(
                        "mount -t tmpfs -o size={kib}k pf-state \"$1\" && shift && exec \"$@\""
                    ),
                    "sh",
                ])
                .arg(self.state_fs())
                .arg(binary("powerflexd"));
                c
            }
        };
        let child = command
            .args([
                "--config",
                self.config.to_str().expect("utf-8"),
                "--node",
                "n1",
                "--sample-interval-ms",
                "200",
            ])
            .args(self.release_on_exit.then_some("--release-on-exit"))
            .env("POWERFLEX_SIM_DIR", self.node.dir())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start powerflexd");
        self.agent = Some(child);
        wait_until("the agent's socket", Duration::from_secs(20), || {
            (UnixStream::connect(self.socket()).is_ok()).then_some(())
        });
    }

    /// The directory holding the agent's state directory (`state/%n`).
    fn state_fs(&self) -> PathBuf {
        self.dir.join("state")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }

    fn request(&self, op: ControlOp) -> ControlReply {
        let mut stream = UnixStream::connect(self.socket()).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(3)))
            .expect("timeout");
        stream
            .write_all(ControlRequest::new(op).to_line().as_bytes())
            .expect("send");
        let mut line = String::new();
        BufReader::new(stream).read_line(&mut line).expect("reply");
        ControlReply::from_line(&line).expect("valid reply")
    }

    fn register(&self, job: &str, gpus: &[&str], flex: &str) -> ControlReply {
        self.request(ControlOp::Register {
            job_id: job.into(),
            step_id: "0".into(),
            uid: 0,
            node: "n1".into(),
            gpus: gpus.iter().map(|g| g.to_string()).collect(),
            flex: flex.into(),
        })
    }

    fn status(&self) -> AgentStatus {
        self.request(ControlOp::Status)
            .status()
            .cloned()
            .expect("status")
    }

    fn job_status(&self, job: &str) -> Option<AgentJobStatus> {
        self.status().jobs.into_iter().find(|j| j.job == job)
    }

    fn limit_w(&self, gpu: u32) -> f64 {
        f64::from(self.node.gpu(gpu).expect("gpu").power_limit_mw) / 1000.0
    }

    /// Starts a simulated job process under a stand-in step daemon of `job`; returns
    /// the step daemon's PID (killing it ends the job as far as the agent can tell).
    fn simjob(&mut self, job: &str, gpus: &str, profile: &str, progress: Option<&str>) -> u32 {
        let simjob = profile_dir().join("powerflex-simjob");
        let sim_dir = self.node.dir().display().to_string();
        let mut env = vec![
            ("POWERFLEX_SIM_DIR", sim_dir.as_str()),
            ("SLURM_JOB_ID", job),
            ("SLURM_JOB_GPUS", gpus),
        ];
        if let Some(p) = progress {
            env.push(("POWERFLEX_PROGRESS", p));
        }
        let argv = [
            simjob.to_str().expect("utf-8"),
            "--profile",
            profile,
            "--time-scale",
            "20",
        ];
        let mut child = in_step(
            &self.dir,
            job,
            &argv,
            &env,
            "</dev/null >/dev/null & echo $!; wait $!",
        );
        let mut first = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut first)
            .expect("job pid");
        let job_pid: u32 = first.trim().parse().expect("job pid");
        let pid = child.id();
        self.jobs.push((child, job_pid));
        pid
    }

    /// Ends the job whose stand-in step daemon is `stepd`: both processes, by PID.
    fn end_job_processes(&mut self, stepd: u32) {
        let (mut ended, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.jobs)
            .into_iter()
            .partition(|(c, _)| c.id() == stepd);
        for (child, job_pid) in &mut ended {
            let _ = kill(*job_pid, Signal::KILL);
            let _ = child.kill();
            let _ = child.wait();
        }
        self.jobs = kept;
    }

    fn signal_agent(&mut self, signal: Signal) -> Option<std::process::ExitStatus> {
        let mut child = self.agent.take()?;
        // The agent process this fixture started, by its PID.
        let _ = kill(child.id(), signal);
        child.wait().ok()
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = self.signal_agent(Signal::KILL);
        for (child, job_pid) in &mut self.jobs {
            // The job process and its stand-in step daemon this fixture started, by PID.
            let _ = kill(*job_pid, Signal::KILL);
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Runs the socket client under a stand-in step daemon of `job`.
fn client_in_job(
    dir: &Path,
    job: &str,
    args: &[&str],
    as_nobody: bool,
    env: &[(&str, &str)],
) -> Vec<String> {
    let probe = profile_dir().join("examples/socket_client");
    let probe = probe.to_str().expect("utf-8");
    let mut argv: Vec<&str> = Vec::new();
    if as_nobody {
        argv.extend([
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
        ]);
    }
    argv.push(probe);
    argv.extend(args);
    let out = in_step(dir, job, &argv, env, "</dev/null; exit $?")
        .wait_with_output()
        .expect("client");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

fn client(args: &[&str], as_nobody: bool, env: &[(&str, &str)]) -> Vec<String> {
    let probe = profile_dir().join("examples/socket_client");
    let mut cmd = if as_nobody {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(&probe);
        c
    } else {
        Command::new(&probe)
    };
    cmd.args(args).env_remove("SLURM_JOB_ID");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("client");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn calibrates_a_job_measures_its_pfi_and_restores_at_job_end() {
    if !can_run(&[Need::Root]) {
        return;
    }
    // Standalone with a node budget above what the GPUs can draw: the agent grants the
    // job the GPUs' maximum, so the walk starts from the uncapped point. (In controller
    // mode with no controller, a job would wait at the fail-safe cap instead.)
    let mut f = Fixture::new("calibrate", Some(100_000.0), 3600);
    let reply = f.register("101", &["0", "1"], "flex3");
    assert!(reply.is_ok(), "{reply:?}");
    assert_eq!(reply.tier(), Some("flex3"));
    let progress = reply
        .progress()
        .map(str::to_string)
        .expect("progress address for a managed job");
    let profile = "qwen3-30b-a3b-moe-ft-8g";
    f.simjob("101", "0,1", profile, Some(&progress));
    // Calibration walks the grid: caps on the job's GPUs go below 700 W meanwhile, one
    // cap for the whole job. (The agent writes the GPUs one after the other, so a read
    // between the two writes sees them differ for a moment: wait for both.)
    wait_until(
        "one calibration level below 700 W on both of the job's GPUs",
        Duration::from_secs(60),
        || {
            let (a, b) = (f.limit_w(0), f.limit_w(1));
            (a < 700.0 && a == b).then_some(())
        },
    );
    assert_eq!(f.limit_w(2), 700.0, "GPUs of no job untouched");
    let done = wait_until("calibration to finish", Duration::from_secs(120), || {
        f.job_status("101")
            .filter(|j| j.calibration == CalibrationState::Done)
    });
    // The measured PFI against the profile's own PFI on the caps the walk visited.
    let caps: Vec<f64> = done.points.iter().map(|p| p.cap_w.0).collect();
    assert!(caps.len() >= 4, "walked {caps:?}");
    let library = powerflex_sim::profiles::Library::builtin().expect("library");
    let truth = library
        .find(profile)
        .expect("profile")
        .physics
        .pfi_on(&caps)
        .expect("true pfi");
    let measured = done.pfi.expect("pfi");
    assert!(
        (measured - truth).abs() <= 0.05,
        "measured PFI {measured} vs true {truth} on {caps:?}"
    );
    assert!(done.calibration_s.expect("duration") > 0.0);
    assert!(done.calibration_cost > 0.0);
    // Back to uncapped after the walk (no budget, no controller lease yet).
    wait_until(
        "the cap back at 700 W after calibration",
        Duration::from_secs(10),
        || (f.limit_w(0) == 700.0).then_some(()),
    );
    // Metrics carry the job's PFI.
    let metrics = client_http(f.metrics_port);
    assert!(
        metrics.contains("powerflex_job_pfi{node=\"n1\",job=\"101\",tier=\"flex3\"}"),
        "{metrics}"
    );
    assert!(metrics.contains("powerflex_gpu_power_watts{node=\"n1\",gpu=\"0\""));
    // Job end: defaults restored.
    let end = f.request(ControlOp::EndJob {
        job_id: "101".into(),
    });
    assert!(end.is_ok());
    wait_until(
        "job end to restore defaults",
        Duration::from_secs(10),
        || {
            (f.job_status("101").is_none() && f.limit_w(0) == 700.0 && f.limit_w(1) == 700.0)
                .then_some(())
        },
    );
}

fn client_http(port: u16) -> String {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("metrics");
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n")
        .expect("request");
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body
}

#[test]
fn standalone_budget_caps_jobs_and_a_stop_keeps_running_jobs_capped_until_release_on_exit() {
    if !can_run(&[Need::Root]) {
        return;
    }
    // 8 GPUs at up to 700 W: a 3 kW node budget must cap the busy ones hard.
    let mut f = Fixture::new("standalone", Some(3000.0), 3600);
    let reply = f.register("301", &["0", "1", "2", "3"], "flex3,calibrate=off");
    assert!(reply.is_ok(), "{reply:?}");
    f.simjob(
        "301",
        "0,1,2,3",
        "llama-3.1-70b-dense-pt-8g-compile",
        Some(reply.progress().expect("progress")),
    );
    wait_until("the budget to cap the job", Duration::from_secs(20), || {
        (f.limit_w(0) < 700.0).then_some(())
    });
    let total = wait_until(
        "the job's draw spending the node budget, within it",
        Duration::from_secs(20),
        || {
            let total: f64 = (0..8)
                .map(|g| f64::from(f.node.reading(g).expect("reading").1.power_mw) / 1000.0)
                .sum();
            // Spent, not wasted: the busy job draws most of the budget, within it.
            (total > 2000.0 && total <= 3000.0 * 1.005).then_some(total)
        },
    );
    assert!(total <= 3000.0 * 1.005, "{total}");
    let before: Vec<f64> = (0..4).map(|g| f.limit_w(g)).collect();
    let status = f.signal_agent(Signal::TERM).expect("agent exit");
    assert!(status.success(), "clean exit on SIGTERM");
    // Fail-static: a stop (a restart, an upgrade) leaves every GPU at the limit in force:
    // the running job's at their caps, the idle ones at their default.
    for g in 0..4 {
        assert_eq!(
            f.limit_w(g),
            before[g as usize],
            "GPU {g} of the running job kept its cap"
        );
        assert!(f.limit_w(g) < 700.0);
    }
    for g in 4..8 {
        assert_eq!(
            f.limit_w(g),
            700.0,
            "GPU {g} of no job at its default, as it was"
        );
    }
    // The next agent takes the job over (its step daemon still runs) within the budget;
    // stopped with --release-on-exit (decommissioning), it hands every GPU back.
    f.release_on_exit = true;
    f.start_agent();
    wait_until("the job managed again", Duration::from_secs(20), || {
        f.status().jobs.iter().any(|j| j.job == "301").then_some(())
    });
    let capped: f64 = (0..4).map(|g| f.limit_w(g)).sum();
    assert!(
        capped <= 3000.0,
        "caps within the node budget after the restart: {capped}"
    );
    let status = f.signal_agent(Signal::TERM).expect("agent exit");
    assert!(status.success(), "clean exit on SIGTERM");
    for g in 0..8 {
        assert_eq!(
            f.limit_w(g),
            700.0,
            "GPU {g} restored with --release-on-exit"
        );
    }
}

/// The node's draw every 50 ms, read from the simulated GPUs themselves (not from the
/// agent), on a thread until [`DrawSampler::stop`].
struct DrawSampler {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<DrawSamples>,
}

/// What a [`DrawSampler`] saw.
struct DrawSamples {
    worst_w: f64,
    samples: u32,
    /// The first 20 samples more than 0.5 % over the budget: (ms since the start, W).
    over: Vec<(u128, f64)>,
    started: std::time::Instant,
}

impl DrawSampler {
    fn start(node: &Node, budget_w: f64) -> DrawSampler {
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (node, flag) = (node.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut seen = DrawSamples {
                worst_w: 0.0,
                samples: 0,
                over: Vec::new(),
                started: std::time::Instant::now(),
            };
            while !flag.load(Ordering::Relaxed) {
                let draw_w: f64 = (0..node.info().gpu_count)
                    .filter_map(|g| node.reading(g).ok())
                    .map(|(_, r)| f64::from(r.power_mw) / 1000.0)
                    .sum();
                seen.worst_w = seen.worst_w.max(draw_w);
                if draw_w > budget_w * 1.005 && seen.over.len() < 20 {
                    seen.over
                        .push((seen.started.elapsed().as_millis(), draw_w.round()));
                }
                seen.samples += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            seen
        });
        DrawSampler { stop, thread }
    }

    fn stop(self) -> DrawSamples {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().expect("the draw sampler")
    }
}

/// One GPU's limit and draw every 50 ms, read from the simulated GPU itself (not from
/// the agent), on a thread until [`GpuSampler::stop`].
struct GpuSampler {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<GpuSamples>,
}

/// What a [`GpuSampler`] saw.
struct GpuSamples {
    worst_limit_w: f64,
    worst_draw_w: f64,
    samples: u32,
}

impl GpuSampler {
    fn start(node: &Node, gpu: u32) -> GpuSampler {
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (node, flag) = (node.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut seen = GpuSamples {
                worst_limit_w: 0.0,
                worst_draw_w: 0.0,
                samples: 0,
            };
            while !flag.load(Ordering::Relaxed) {
                let limit_w = f64::from(node.gpu(gpu).expect("gpu").power_limit_mw) / 1000.0;
                let draw_w = node
                    .reading(gpu)
                    .map_or(0.0, |(_, r)| f64::from(r.power_mw) / 1000.0);
                seen.worst_limit_w = seen.worst_limit_w.max(limit_w);
                seen.worst_draw_w = seen.worst_draw_w.max(draw_w);
                seen.samples += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            seen
        });
        GpuSampler { stop, thread }
    }

    fn stop(self) -> GpuSamples {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().expect("the GPU sampler")
    }
}

/// An agent restarted (stopped as an upgrade stops it) in the middle of a
/// job's calibration walk keeps the node within its budget at every 50 ms sample, through
/// the stop, the gap and the new agent's start, and the new agent walks the job again to
/// a PFI as right as an uninterrupted walk's (a walk cut short saves no partial curve: the
/// first walk's windows are not a curve to plan on).
#[test]
fn an_agent_restarted_mid_walk_keeps_the_budget_and_walks_the_job_again() {
    if !can_run(&[Need::Root]) {
        return;
    }
    const BUDGET_W: f64 = 1500.0;
    let mut f = Fixture::new("midwalk", Some(BUDGET_W), 3600);
    let reply = f.register("401", &["0", "1"], "flex3");
    assert!(reply.is_ok(), "{reply:?}");
    let profile = "qwen3-30b-a3b-moe-ft-8g";
    f.simjob("401", "0,1", profile, reply.progress());
    let sampler = DrawSampler::start(&f.node, BUDGET_W);
    // Past its first level (the grant, 500 W a GPU here): stopped mid-walk.
    let walking = wait_until("the walk under way", Duration::from_secs(90), || {
        f.job_status("401").filter(|j| {
            j.calibration == CalibrationState::Walking
                && j.calibration_level_w.is_some_and(|w| w <= 400.0)
        })
    });
    let before: Vec<f64> = (0..2).map(|g| f.limit_w(g)).collect();
    let stopped_at = std::time::Instant::now();
    let status = f.signal_agent(Signal::TERM).expect("agent exit");
    assert!(status.success(), "clean exit on SIGTERM");
    for g in 0..2 {
        assert_eq!(
            f.limit_w(g),
            before[g as usize],
            "GPU {g} keeps the walk's cap through the stop"
        );
    }
    // The gap of a package upgrade.
    std::thread::sleep(Duration::from_secs(2));
    let restarted_at = std::time::Instant::now();
    f.start_agent();
    let done = wait_until("the walk done again", Duration::from_secs(180), || {
        f.job_status("401")
            .filter(|j| j.calibration == CalibrationState::Done)
    });
    // The walk's end hands the job its steady cap: that moment is sampled too.
    std::thread::sleep(Duration::from_secs(3));
    let DrawSamples {
        worst_w: worst_draw_w,
        samples,
        over,
        started: t0,
    } = sampler.stop();
    assert!(samples > 40, "{samples} samples");
    assert!(
        worst_draw_w <= BUDGET_W * 1.005,
        "the node drew {worst_draw_w:.0} W against a {BUDGET_W} W budget; over it at (ms, W) {over:?}; stopped at {} ms, restarted at {} ms",
        stopped_at.duration_since(t0).as_millis(),
        restarted_at.duration_since(t0).as_millis()
    );
    assert!(
        f.log().contains("still running; managing it again"),
        "{}",
        f.log()
    );
    let caps: Vec<f64> = done.points.iter().map(|p| p.cap_w.0).collect();
    // The grant (500 W a GPU) and the levels below it that the chord bound shows within
    // the tier (a walk topped at a grant below the maximum goes no lower): at least two,
    // enough for the PFI checked below.
    assert!(
        caps.len() >= 2,
        "walked {caps:?} (stopped at the {:?} W level)",
        walking.calibration_level_w
    );
    let truth = powerflex_sim::profiles::Library::builtin()
        .expect("library")
        .find(profile)
        .expect("profile")
        .physics
        .pfi_on(&caps)
        .expect("true pfi");
    let measured = done.pfi.expect("pfi");
    assert!(
        (measured - truth).abs() <= 0.05,
        "measured PFI {measured} vs true {truth} on {caps:?}"
    );
    println!(
        "mid-walk restart: worst draw {worst_draw_w:.0} W of {BUDGET_W} W over {samples} samples; PFI {measured:.3} vs {truth:.3} on {caps:?}"
    );
}

/// A full `/var`. The agent's state saves fail (logged) while jobs start, get
/// capped and end; the caps in force stay and the node keeps its budget at every 50 ms
/// sample; once space is back the next save holds the jobs as they are.
#[test]
fn a_full_state_filesystem_keeps_the_caps_the_jobs_and_the_budget() {
    if !can_run(&[Need::Root]) {
        return;
    }
    const BUDGET_W: f64 = 2000.0;
    let mut f = Fixture::new("fullvar", Some(BUDGET_W), 3600);
    f.signal_agent(Signal::TERM).expect("first agent exit");
    f.small_state_fs_kib = Some(512);
    f.start_agent();
    let agent_pid = f.agent.as_ref().expect("agent").id();
    // The agent's view of its state directory, from outside its mount namespace.
    let state_fs = PathBuf::from(format!("/proc/{agent_pid}/root")).join(
        f.state_fs()
            .strip_prefix("/")
            .expect("absolute state directory"),
    );
    let state_file =
        || std::fs::read_to_string(state_fs.join("n1/agent-state.json")).unwrap_or_default();
    let first = f.register("501", &["0", "1", "2", "3"], "flex3,calibrate=off");
    assert!(first.is_ok(), "{first:?}");
    f.simjob(
        "501",
        "0,1,2,3",
        "llama-3.1-70b-dense-pt-8g-compile",
        first.progress(),
    );
    wait_until(
        "the budget capping the job",
        Duration::from_secs(20),
        || (f.limit_w(0) < 700.0).then_some(()),
    );
    wait_until("job 501 saved", Duration::from_secs(30), || {
        state_file().contains("\"501\"").then_some(())
    });
    // Fill the file system to the last byte.
    let fill = state_fs.join("fill");
    let mut filler = std::fs::File::create(&fill).expect("fill file");
    let chunk = vec![0u8; 4096];
    while filler.write_all(&chunk).is_ok() {}
    let _ = filler.write_all(&[0u8]);
    drop(filler);
    let sampler = DrawSampler::start(&f.node, BUDGET_W);
    // A second job starts on the full file system: managed and capped all the same.
    let second = f.register("502", &["4", "5"], "flex3,calibrate=off");
    assert!(second.is_ok(), "{second:?}");
    f.simjob(
        "502",
        "4,5",
        "llama-3.1-70b-dense-pt-8g-compile",
        second.progress(),
    );
    wait_until("job 502 capped", Duration::from_secs(20), || {
        (f.limit_w(4) < 700.0 && f.job_status("502").is_some()).then_some(())
    });
    wait_until("a failed save logged", Duration::from_secs(30), || {
        f.log().contains("cannot persist agent state").then_some(())
    });
    assert!(
        !state_file().contains("\"502\""),
        "the full file system held no save naming job 502"
    );
    let caps: Vec<f64> = (0..8).map(|g| f.limit_w(g)).collect();
    std::thread::sleep(Duration::from_secs(3));
    let DrawSamples {
        worst_w: worst_draw_w,
        samples,
        ..
    } = sampler.stop();
    assert!(samples > 40, "{samples} samples");
    assert!(
        worst_draw_w <= BUDGET_W * 1.005,
        "the node drew {worst_draw_w:.0} W against a {BUDGET_W} W budget"
    );
    assert!(caps[..6].iter().all(|&c| c < 700.0), "{caps:?}");
    assert_eq!(
        f.status()
            .jobs
            .iter()
            .map(|j| j.job.as_str())
            .collect::<Vec<_>>(),
        ["501", "502"]
    );
    // Space back: the next save holds both jobs.
    std::fs::remove_file(&fill).expect("free the space");
    wait_until("both jobs saved", Duration::from_secs(60), || {
        let text = state_file();
        (text.contains("\"501\"") && text.contains("\"502\"")).then_some(())
    });
    // One line when saves started failing and one when they worked again, not one per
    // failed save.
    let log = f.log();
    assert_eq!(
        log.matches("cannot persist agent state").count(),
        1,
        "{log}"
    );
    wait_until("the recovery logged", Duration::from_secs(10), || {
        f.log()
            .contains("agent state persisted again")
            .then_some(())
    });
    println!(
        "full state fs: worst draw {worst_draw_w:.0} W of {BUDGET_W} W over {samples} samples"
    );
}

#[test]
fn restart_after_kill_9_reconciles_with_live_jobs() {
    if !can_run(&[Need::Root]) {
        return;
    }
    // A 5 s lease: with no controller here, a restarted agent releases a GPU whose job
    // ended only once the lease it never got would have run out (fail-static: until a
    // current lease, nothing rises above what the GPUs read back at start).
    let mut f = Fixture::new("kill9", None, 5);
    // Job 201 keeps running; job 202's process dies while the agent is down.
    let r1 = f.register("201", &["2"], "flex3");
    let r2 = f.register("202", &["4"], "flex3");
    assert!(r1.is_ok() && r2.is_ok());
    f.simjob("201", "2", "synthetic-memory-bound", r1.progress());
    let doomed = f.simjob("202", "4", "synthetic-memory-bound", r2.progress());
    wait_until(
        "both jobs capped by their walks",
        Duration::from_secs(60),
        || (f.limit_w(2) < 700.0 && f.limit_w(4) < 700.0).then_some(()),
    );
    f.signal_agent(Signal::KILL);
    // The simulated job and its step daemon this test started, by PID.
    f.end_job_processes(doomed);
    assert!(
        f.limit_w(4) < 700.0,
        "a crashed agent leaves its caps behind"
    );
    f.start_agent();
    wait_until(
        "the ended job's GPU back to default",
        Duration::from_secs(20),
        || (f.limit_w(4) == 700.0).then_some(()),
    );
    let status = f.status();
    let jobs: Vec<&str> = status.jobs.iter().map(|j| j.job.as_str()).collect();
    assert_eq!(
        jobs,
        vec!["201"],
        "the live job is managed again, the dead one is gone"
    );
    assert!(f.log().contains("still running"), "{}", f.log());
}

#[test]
fn only_root_changes_jobs_and_progress_must_come_from_the_job() {
    if !can_run(&[Need::Root]) {
        return;
    }
    let mut f = Fixture::new("trust", None, 3600);
    let socket = f.socket();
    let socket = socket.to_str().expect("utf-8");
    let register = ControlRequest::new(ControlOp::Register {
        job_id: "401".into(),
        step_id: "0".into(),
        uid: 0,
        node: "n1".into(),
        gpus: vec!["5".into()],
        flex: "flex2".into(),
    })
    .to_line();
    let as_nobody = client(&[socket, register.trim_end()], true, &[]);
    assert!(as_nobody[0].contains("only root"), "{as_nobody:?}");
    assert!(f.job_status("401").is_none());
    let status_as_nobody = client(&[socket, "{\"v\":1,\"op\":\"status\"}"], true, &[]);
    assert!(
        status_as_nobody[0].contains("\"ok\":true"),
        "status is open to everyone"
    );

    let reply = f.register("401", &["5"], "flex2");
    let progress = reply.progress().map(str::to_string).expect("progress");
    f.simjob("401", "5", "synthetic-compute-bound", Some(&progress));
    let forged = "{\"v\":1,\"job_id\":\"401\",\"tokens\":999999999,\"steps\":1}";
    // A process outside any job, its environment naming job 401.
    let no_job = client(&[&progress, forged], false, &[("SLURM_JOB_ID", "401")]);
    assert!(no_job[0].contains("runs in no Slurm job"), "{no_job:?}");
    // Another job's process, its environment naming job 401.
    let other_job = client_in_job(
        &f.dir,
        "999",
        &[&progress, forged],
        false,
        &[("SLURM_JOB_ID", "401")],
    );
    assert!(other_job[0].contains("runs in job 999"), "{other_job:?}");
    // A process of job 401 (by ancestry), the wrong user.
    let other_uid = client_in_job(&f.dir, "401", &[&progress, forged], true, &[]);
    assert!(
        other_uid
            .first()
            .is_some_and(|l| l.contains("may not report")),
        "{other_uid:?}"
    );
    // The counter is published with the agent's next tick.
    wait_until("the refusals counted", Duration::from_secs(5), || {
        (f.status().progress_rejected >= 3).then_some(())
    });

    // Malformed and oversized requests get an error and the agent keeps serving.
    let garbage = client(&[socket, "this is not json"], false, &[]);
    assert!(garbage[0].contains("\"ok\":false"), "{garbage:?}");
    let huge = "x".repeat(10_000);
    let oversized = client(&[socket, &huge], false, &[]);
    assert!(oversized[0].contains("limit"), "{oversized:?}");
    let unknown_tier = f.register("402", &["6"], "flex9");
    assert!(
        !unknown_tier.is_ok()
            && unknown_tier
                .error_message()
                .is_some_and(|e| e.contains("unknown tier"))
    );
    let wrong_node = f.request(ControlOp::Register {
        job_id: "403".into(),
        step_id: "0".into(),
        uid: 0,
        node: "n7".into(),
        gpus: vec!["6".into()],
        flex: "flex2".into(),
    });
    assert!(wrong_node
        .error_message()
        .is_some_and(|e| e.contains("serves node n1")));
    assert!(f.status().jobs.iter().any(|j| j.job == "401"));
}

#[test]
fn without_a_controller_the_failsafe_cap_applies_after_the_lease() {
    if !can_run(&[Need::Root]) {
        return;
    }
    let f = Fixture::new("failsafe", None, 5);
    let reply = f.register("501", &["0"], "flex2,calibrate=off");
    assert!(reply.is_ok());
    // No controller has granted the job a cap: it runs at the fail-safe cap at once, not
    // at the GPU's maximum, and the agent reports the fail-safe once the lease is overdue.
    wait_until(
        "the fail-safe cap for a job no lease covers",
        Duration::from_secs(20),
        || (f.limit_w(0) == 500.0).then_some(()),
    );
    wait_until("the fail-safe reported", Duration::from_secs(20), || {
        f.status().failsafe.then_some(())
    });
    assert_eq!(f.limit_w(1), 700.0, "GPUs of no job keep their default");
}

#[test]
fn a_failing_gpu_is_degraded_and_the_others_carry_on() {
    if !can_run(&[Need::Root]) {
        return;
    }
    let mut f = Fixture::new("degraded", None, 3600);
    f.node.set_fault(6, Some(Fault::GpuLost)).expect("fault");
    wait_until("GPU 6 marked degraded", Duration::from_secs(10), || {
        let s = f.status();
        (s.degraded && s.gpus[6].degraded.is_some()).then_some(())
    });
    let reply = f.register("601", &["7"], "flex3");
    assert!(reply.is_ok());
    f.simjob("601", "7", "synthetic-memory-bound", reply.progress());
    wait_until("GPU 7 calibrating", Duration::from_secs(60), || {
        (f.limit_w(7) < 700.0).then_some(())
    });
    assert!(
        f.log().contains("GPU reading failed"),
        "the failure is logged"
    );
}

#[test]
fn the_python_helper_reports_progress_the_agent_accepts() {
    if !can_run(&[Need::Root, Need::Program("python3")]) {
        return;
    }
    let f = Fixture::new("python", None, 3600);
    let reply = f.register("701", &["3"], "flex2");
    let progress = reply
        .progress()
        .map(str::to_string)
        .expect("progress address");
    let helper_dir = repo_root().join("agent/python");
    // A training loop of 40 steps of 1000 tokens, reporting through the shipped helper.
    let script = "import sys, time\n\
                  sys.path.insert(0, sys.argv[1])\n\
                  from powerflex_progress import ProgressReporter\n\
                  with ProgressReporter(min_interval_s=0.0) as r:\n\
                  \x20   for _ in range(40):\n\
                  \x20       time.sleep(0.05)\n\
                  \x20       r.add(tokens=1000, steps=1)\n";
    // Run as the job's process: under (a stand-in for) its step daemon.
    let out = in_step(
        &f.dir,
        "701",
        &["python3", "-c", script, helper_dir.to_str().expect("utf-8")],
        &[("POWERFLEX_PROGRESS", &progress), ("SLURM_JOB_ID", "701")],
        "</dev/null; echo exit=$?",
    )
    .wait_with_output()
    .expect("python3");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("exit=0"), "{said}");
    assert_eq!(f.status().progress_rejected, 0, "every report accepted");
    let throughput = wait_until(
        "the job's throughput in status",
        Duration::from_secs(10),
        || f.job_status("701").and_then(|j| j.throughput),
    );
    assert!(
        (10_000.0..=25_000.0).contains(&throughput),
        "~20k tokens/s reported, got {throughput}"
    );
    // The helper's own unit tests (stdlib unittest).
    let unit = Command::new("python3")
        .arg(helper_dir.join("test_powerflex_progress.py"))
        .output()
        .expect("python3");
    assert!(
        unit.status.success(),
        "{}",
        String::from_utf8_lossy(&unit.stderr)
    );
}

#[test]
fn leases_from_an_authenticated_controller_are_applied_and_expire_to_the_failsafe() {
    if !can_run(&[Need::Root]) {
        return;
    }
    use powerflex_proto::link::{controller_accept, fresh_nonce, node_key, Body, Session};
    use std::os::unix::fs::PermissionsExt;
    let site_key = b"0123456789abcdef0123456789abcdef".to_vec();
    let keydir = std::env::temp_dir().join(format!("pf-agent-key-{}", std::process::id()));
    std::fs::create_dir_all(&keydir).expect("dir");
    // The site key stays with the controller (this test); the node holds its own key,
    // where the builder's config puts it.
    let key_file = keydir.join("powerflex.key");
    let node_key_file = keydir.join("node-n1.key");
    std::fs::write(&node_key_file, node_key(&site_key, "n1").expect("n1 key")).expect("key");
    std::fs::set_permissions(&node_key_file, std::fs::Permissions::from_mode(0o600))
        .expect("chmod");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("controller port");
    let port = listener.local_addr().expect("addr").port();
    let f = Fixture::with_controller("link", None, 3600, Some((port, &key_file)));
    // Registered as slurmstepd does (root, on the control socket), for a job of uid 4242:
    // the reports carry that uid as the job's owner.
    let registered = f.request(ControlOp::Register {
        job_id: "801".into(),
        step_id: "0".into(),
        uid: 4242,
        node: "n1".into(),
        gpus: vec!["0".into(), "1".into()],
        flex: "flex2,calibrate=off".into(),
    });
    assert!(registered.is_ok(), "{registered:?}");
    let now_ms = powerflex_daemon::clock::unix_ms;

    // The agent connects and opens the handshake with its node key; the test controller
    // answers the challenge; hello follows under the session key.
    let accept = |listener: &std::net::TcpListener| -> (
        std::net::TcpStream,
        std::io::Lines<BufReader<std::net::TcpStream>>,
        Session,
    ) {
        let (mut stream, _) = listener.accept().expect("agent connects");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let mut lines = BufReader::new(stream.try_clone().expect("clone")).lines();
        let open = lines.next().expect("open").expect("line");
        let (session, challenge) =
            controller_accept(&site_key, &open, fresh_nonce().expect("nonce"), now_ms())
                .expect("an open sealed with n1's key");
        stream.write_all(challenge.as_bytes()).expect("challenge");
        (stream, lines, session)
    };
    let (stream, mut lines, mut session) = accept(&listener);
    let hello = session
        .open(&lines.next().expect("hello").expect("line"), now_ms())
        .expect("authentic hello");
    let Body::Hello { gpus } = hello else {
        panic!("expected hello, got {hello:?}")
    };
    assert_eq!(gpus.len(), 8);
    // Reports follow, carrying the job.
    let report = wait_until(
        "a report with job 801",
        Duration::from_secs(10),
        || match session.open(&lines.next()?.ok()?, now_ms()).ok()? {
            Body::Report { jobs, .. } if jobs.iter().any(|j| j.job_id == "801") => Some(jobs),
            _ => None,
        },
    );
    let reported = report.iter().find(|j| j.job_id == "801").expect("job");
    assert_eq!(reported.tier, "flex2,calibrate=off");
    assert_eq!(
        reported.owner_uid,
        Some(4242),
        "the owner is the uid slurmstepd registered the job with"
    );

    let mut to_agent = stream;
    let lease_body = |node: &str, cap: f64, ttl_s: f64| Body::Lease {
        node: node.to_string(),
        caps: [("801".to_string(), cap)].into(),
        ttl_s,
        start_cap_w: None,
        recalibrate: Vec::new(),
        learn: Vec::new(),
        // An event announced ten minutes ahead: the lease still applies (job 801 does
        // not calibrate, so nothing else changes).
        next_event_in_s: Some(600.0),
        walk_to_w: Default::default(),
        event_in_force: false,
        epoch: 0,
    };
    // Above the 500 W fail-safe, so that the lease running out lowers the cap.
    let first = session
        .seal(&lease_body("n1", 600.0, 4.0), now_ms())
        .expect("seal");
    to_agent.write_all(first.as_bytes()).expect("send lease");
    wait_until(
        "the leased cap on both GPUs",
        Duration::from_secs(10),
        || (f.limit_w(0) == 600.0 && f.limit_w(1) == 600.0).then_some(()),
    );
    // A forged lease (a session under another key) changes nothing; nor does an
    // authentic lease naming another node.
    let other_site = b"not the site key at all, no no no";
    let (_, other_open) = powerflex_proto::link::AgentHandshake::start(
        &node_key(other_site, "n1").expect("key"),
        "n1",
        fresh_nonce().expect("nonce"),
        now_ms(),
    )
    .expect("open");
    let (mut forged, _) = controller_accept(
        other_site,
        &other_open,
        fresh_nonce().expect("nonce"),
        now_ms(),
    )
    .expect("another site's session");
    to_agent
        .write_all(
            forged
                .seal(&lease_body("n1", 300.0, 4.0), now_ms())
                .expect("seal")
                .as_bytes(),
        )
        .expect("send forged");
    to_agent
        .write_all(
            session
                .seal(&lease_body("n2", 300.0, 4.0), now_ms())
                .expect("seal")
                .as_bytes(),
        )
        .expect("send misrouted");
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(f.limit_w(0), 600.0, "forged and misrouted leases ignored");
    // The lease runs out: fail-safe cap. Replaying the old lease on its own connection
    // does not revive it.
    wait_until(
        "the fail-safe cap after the lease",
        Duration::from_secs(15),
        || (f.limit_w(0) == 500.0).then_some(()),
    );
    to_agent.write_all(first.as_bytes()).expect("replay");
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(f.limit_w(0), 500.0, "replayed lease refused");
    // Nor after a reconnect: the agent's next connection has a new session key.
    drop(to_agent);
    drop(lines);
    let (mut again, _lines2, _session2) = accept(&listener);
    again
        .write_all(first.as_bytes())
        .expect("replay after reconnect");
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(
        f.limit_w(0),
        500.0,
        "a lease from the last connection refused"
    );
    let log = f.log();
    assert!(log.contains("fails authentication"), "{log}");
    assert!(log.contains("replayed"), "{log}");
    assert!(log.contains("lease for another node refused"), "{log}");
    let _ = std::fs::remove_dir_all(&keydir);
}

#[test]
fn a_second_agent_on_the_node_refuses_to_start_and_the_first_keeps_its_socket() {
    if !can_run(&[Need::Root]) {
        return;
    }
    let mut f = Fixture::new("instance-lock", None, 3600);
    let first_pid = f.agent.as_ref().expect("first agent").id();
    let reply = f.register("501", &["0", "1"], "flex1,calibrate=off");
    assert!(reply.is_ok(), "{reply:?}");

    let second = Command::new(binary("powerflexd"))
        .args([
            "--config",
            f.config.to_str().expect("utf-8"),
            "--node",
            "n1",
        ])
        .env("POWERFLEX_SIM_DIR", f.node.dir())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start a second powerflexd");
    let second_pid = second.id();
    // It must give up at once; if it does not, it is stopped by its PID, not left running.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(second.wait_with_output());
    });
    let out = match rx.recv_timeout(Duration::from_secs(20)) {
        Ok(out) => out.expect("second agent's output"),
        Err(_) => {
            let _ = kill(second_pid, Signal::KILL);
            panic!("the second agent did not exit within 20 s");
        }
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("another powerflexd (pid {first_pid}) holds"))
            && stderr.contains("powerflexd.lock"),
        "{stderr}"
    );

    // The first agent's socket is still there and still its own: it answers, and knows
    // the job registered before the second one tried.
    assert!(f.socket().exists());
    assert!(f.job_status("501").is_some(), "{:?}", f.status());

    // The lock dies with its holder: after a clean stop a new agent starts.
    let status = f.signal_agent(Signal::TERM).expect("agent exit");
    assert!(status.success());
    f.start_agent();
    assert!(f.request(ControlOp::Status).is_ok());
}

/// Holds `count` idle connections to `socket` as uid 65534 for `hold_s` seconds; the
/// returned child prints `held` once they are open.
fn idle_connections(socket: &Path, count: u32, hold_s: u32) -> Child {
    let script = "import socket, sys, time\n\
                  held = []\n\
                  for _ in range(int(sys.argv[2])):\n\
                  \x20   s = socket.socket(socket.AF_UNIX)\n\
                  \x20   s.connect(sys.argv[1])\n\
                  \x20   held.append(s)\n\
                  print('held', flush=True)\n\
                  time.sleep(float(sys.argv[3]))\n";
    let mut child = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .args(["/usr/bin/python3", "-c", script])
        .arg(socket)
        .args([count.to_string(), hold_s.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("python3");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("held");
    assert_eq!(line.trim(), "held");
    child
}

/// One user holding 64 idle connections must not starve every job's progress, and
/// refreshing 64 control connections must not make registrations fail.
#[test]
fn one_user_s_idle_connections_starve_no_one_and_are_counted() {
    if !can_run(&[
        Need::Root,
        Need::Program("setpriv"),
        Need::File("/usr/bin/python3"),
    ]) {
        return;
    }
    let f = Fixture::new("flood", Some(100_000.0), 3600);
    let progress_socket = f.dir.join("n1.progress");
    let mut floods = vec![
        idle_connections(&progress_socket, 64, 30),
        idle_connections(&f.socket(), 64, 30),
    ];
    // Root's registration still gets through, and the job's own report is accepted.
    let reply = f.register("801", &["0"], "flex2,calibrate=off");
    assert!(reply.is_ok(), "{reply:?}");
    let progress = reply.progress().map(str::to_string).expect("progress");
    let report = "{\"v\":1,\"job_id\":\"801\",\"tokens\":1000,\"steps\":1}";
    let said = client_in_job(&f.dir, "801", &[&progress, report], false, &[]);
    assert!(
        said.iter().all(|l| !l.contains("\"ok\":false")),
        "the job's report is served: {said:?}"
    );
    // Another unprivileged user is served on both sockets too (uid 65534 holds its share).
    let status = Command::new("setpriv")
        .args(["--reuid=65533", "--regid=65533", "--clear-groups"])
        .arg(profile_dir().join("examples/socket_client"))
        .arg(f.socket())
        .arg("{\"v\":1,\"op\":\"status\"}")
        .output()
        .expect("client");
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(status.contains("\"ok\":true"), "{status}");
    assert!(
        status.contains("\"jobs\":[]"),
        "another user sees no one's jobs: {status}"
    );
    let metrics = client_http(f.metrics_port);
    for socket in ["control", "progress"] {
        let series = format!(
            "powerflex_agent_connections_refused_total{{node=\"n1\",socket=\"{socket}\",reason=\"per_uid\"}} "
        );
        let refused: f64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix(series.as_str()))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{series} missing: {metrics}"));
        // 64 tried; 4 (control) or 16 (progress) admitted, some control ones may have
        // timed out and been replaced meanwhile: most were refused, each counted.
        assert!(refused >= 40.0, "{series}{refused}");
    }
    for child in &mut floods {
        // The flooding clients this test started, by their Child handles.
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// A registration naming a GPU that another job's processes already use (a stray
/// process, a debugger, a job run unmanaged; NVML's process list and their ancestry)
/// is accepted: Slurm gave the GPU to the registering job, so it is that job's, capped
/// as the job is, and the other job's use is foreign use, logged, counted and shown.
/// Refusing it ran the job at the GPU's default.
#[test]
fn a_registration_naming_a_gpu_another_job_s_process_uses_is_the_job_s_and_capped() {
    if !can_run(&[Need::Root]) {
        return;
    }
    let mut f = Fixture::new("claim", Some(500.0), 3600);
    // Job 901 never registered (run unmanaged, or its stray process outlived it).
    f.simjob("901", "2", "synthetic-compute-bound", None);
    wait_until(
        "job 901's process on GPU 2",
        Duration::from_secs(20),
        || {
            f.node
                .gpu(2)
                .ok()?
                .workload
                .filter(|w| w.job_id == "901")
                .map(|_| ())
        },
    );
    let second = f.register("902", &["2"], "flex2,calibrate=off");
    assert!(second.is_ok(), "{second:?}");
    f.simjob(
        "902",
        "2",
        "synthetic-compute-bound",
        Some(second.progress().expect("progress")),
    );
    wait_until("GPU 2 capped as job 902", Duration::from_secs(20), || {
        let s = f.status();
        (s.gpus[2].job.as_deref() == Some("902")
            && s.gpus[2].cap_w.is_some_and(|c| c < 700.0)
            && f.limit_w(2) < 700.0)
            .then_some(())
    });
    let s = f.status();
    println!(
        "GPU 2 held by job 902 beside job 901's process: limit {} W (default 700 W)",
        f.limit_w(2)
    );
    assert!(s.gpus[2].foreign_use, "{:?}", s.gpus[2]);
    assert_eq!(s.gpus[2].foreign_jobs, ["901"]);
    assert_eq!(s.gpu_foreign_use, 1, "counted once, at the registration");
    assert!(
        client_http(f.metrics_port).contains("\npowerflex_gpu_foreign_use_total{node=\"n1\"} 1\n"),
        "counted in the metrics"
    );
    assert!(s.jobs.iter().any(|j| j.job == "902"));
    let log = std::fs::read_to_string(f.dir.join("agent.log")).unwrap_or_default();
    assert!(
        log.contains("other jobs' processes already use a GPU Slurm gave this job"),
        "logged"
    );
}

/// A job whose registration failed, or a process started outside Slurm, would run its
/// GPU at the default. With `agent.unregistered_gpu_use = "failsafe"` the agent sees
/// it in NVML's process list and holds that GPU at the fail-safe cap until the process
/// is gone; the GPUs of registered jobs and idle GPUs are untouched. A stop leaves it
/// there: only the process's end frees it.
#[test]
fn a_gpu_used_by_no_registered_job_is_held_at_the_failsafe_until_its_process_ends() {
    if !can_run(&[Need::Root]) {
        return;
    }
    let mut f = Fixture::new("unregistered", Some(100_000.0), 3600);
    // The site opts in (the default leaves such GPUs alone: `none` jobs are not
    // registered either); the agent is started again on the edited config.
    powerflex::site_config::edit_site_file(&f.config, |raw| {
        raw.agent.unregistered_gpu_use = Some("failsafe".into());
    })
    .unwrap_or_else(|e| panic!("{e}"));
    f.signal_agent(Signal::TERM);
    f.start_agent();
    let registered = f.register("960", &["1"], "flex0");
    assert!(registered.is_ok(), "{registered:?}");
    f.simjob("960", "1", "synthetic-compute-bound", None);
    // Job 961 never registered (its plugin could not reach the agent).
    let stray = f.simjob("961", "3", "synthetic-compute-bound", None);
    wait_until(
        "GPU 3 at the fail-safe, shown as unregistered use",
        Duration::from_secs(20),
        || {
            let s = f.status();
            (f.limit_w(3) == 500.0 && s.gpus[3].unregistered_use).then_some(())
        },
    );
    let s = f.status();
    assert!(
        s.gpus[3]
            .processes
            .iter()
            .any(|p| p.job.as_deref() == Some("961")),
        "{:?}",
        s.gpus[3]
    );
    assert!(!s.gpus[1].unregistered_use, "a registered job's GPU");
    assert_eq!(f.limit_w(1), 700.0, "flex0 is never capped");
    for idle in [0, 2, 4, 5, 6, 7] {
        assert_eq!(f.limit_w(idle), 700.0, "idle GPU {idle}");
    }
    // A stop (SIGTERM, what `systemctl restart` sends) leaves GPU 3 at the fail-safe
    // through the stop, a 2 s gap and the next agent's start, its limit and draw sampled
    // every 50 ms: only the process's end gives it back.
    let sampler = GpuSampler::start(&f.node, 3);
    let status = f.signal_agent(Signal::TERM).expect("agent exit");
    assert!(status.success(), "clean exit on SIGTERM");
    assert_eq!(f.limit_w(3), 500.0, "kept at the fail-safe by the stop");
    std::thread::sleep(Duration::from_secs(2));
    f.start_agent();
    wait_until(
        "the next agent to see GPU 3's unregistered use",
        Duration::from_secs(20),
        || f.status().gpus[3].unregistered_use.then_some(()),
    );
    let seen = sampler.stop();
    println!(
        "GPU 3 through the stop and restart: {} samples, highest limit {} W, highest draw {:.0} W",
        seen.samples, seen.worst_limit_w, seen.worst_draw_w
    );
    assert!(seen.samples >= 40, "{} samples", seen.samples);
    assert_eq!(seen.worst_limit_w, 500.0, "never above the fail-safe");
    assert!(seen.worst_draw_w <= 500.0 * 1.01, "{}", seen.worst_draw_w);
    assert_eq!(f.limit_w(3), 500.0);
    f.end_job_processes(stray);
    wait_until(
        "GPU 3 back at its default once the process is gone",
        Duration::from_secs(20),
        || {
            let s = f.status();
            (f.limit_w(3) == 700.0 && !s.gpus[3].unregistered_use).then_some(())
        },
    );
}

/// A GPU Slurm gave to a job stays that job's, capped as the job is, when another job's
/// process runs on it (a stray process, a debugger, a shared node): job 970 holds GPUs
/// 0 to 3 under a 3 kW node budget and runs on 1 to 3 only; job 971's process lands on
/// GPU 0. GPU 0 keeps 970's cap at every 50 ms sample, and the foreign use is counted,
/// logged and shown.
#[test]
fn another_job_s_process_on_a_job_s_gpu_leaves_it_the_job_s_and_capped() {
    if !can_run(&[Need::Root]) {
        return;
    }
    let mut f = Fixture::new("foreign", Some(3000.0), 3600);
    let reply = f.register("970", &["0", "1", "2", "3"], "flex3,calibrate=off");
    assert!(reply.is_ok(), "{reply:?}");
    f.simjob(
        "970",
        "1,2,3",
        "llama-3.1-70b-dense-pt-8g-compile",
        Some(reply.progress().expect("progress")),
    );
    wait_until("the budget to cap the job", Duration::from_secs(20), || {
        (f.limit_w(0) < 700.0).then_some(())
    });
    let sampler = GpuSampler::start(&f.node, 0);
    let started = std::time::Instant::now();
    f.simjob("971", "0", "synthetic-compute-bound", None);
    wait_until("GPU 0's foreign use shown", Duration::from_secs(20), || {
        f.status().gpus[0].foreign_use.then_some(())
    });
    // Past two more process scans (every 2 s), where the old agent gave the GPU back.
    std::thread::sleep(Duration::from_secs(5));
    let seen = sampler.stop();
    println!(
        "GPU 0 with job 971's process on it: {} samples over {:.1} s, highest limit {} W",
        seen.samples,
        started.elapsed().as_secs_f64(),
        seen.worst_limit_w
    );
    assert!(seen.samples >= 60, "{} samples", seen.samples);
    assert!(
        seen.worst_limit_w < 700.0,
        "GPU 0 went back to its default: {} W",
        seen.worst_limit_w
    );
    let s = f.status();
    assert_eq!(s.gpus[0].job.as_deref(), Some("970"), "still the job's");
    assert_eq!(s.gpus[0].foreign_jobs, ["971"]);
    assert!(s.gpu_foreign_use >= 1);
    assert!(
        client_http(f.metrics_port).contains("\npowerflex_gpu_foreign_use_total{node=\"n1\"} 1\n"),
        "counted in the metrics"
    );
    let log = std::fs::read_to_string(f.dir.join("agent.log")).unwrap_or_default();
    assert!(
        log.contains("other jobs' processes use this job's GPU"),
        "logged"
    );
}

/// Another power manager (here the test, writing the simulated GPU's limit as DPS or a
/// BMC would) that keeps lowering a job's GPU below the agent's cap is left alone after
/// the third time within two minutes: the GPU stays at its limit, status says it is held
/// elsewhere; once the other manager lets go (its default limit back), the agent's cap is
/// written again.
#[test]
fn a_gpu_another_power_manager_keeps_lower_is_not_fought() {
    if !can_run(&[Need::Root]) {
        return;
    }
    let mut f = Fixture::new("owner", Some(3000.0), 3600);
    let reply = f.register("311", &["0", "1", "2", "3"], "flex3,calibrate=off");
    assert!(reply.is_ok(), "{reply:?}");
    f.simjob(
        "311",
        "0,1,2,3",
        "llama-3.1-70b-dense-pt-8g-compile",
        Some(reply.progress().expect("progress")),
    );
    let ours = wait_until("the budget to cap the job", Duration::from_secs(20), || {
        let cap = f.limit_w(0);
        (cap < 700.0 && cap > 250.0).then_some(cap)
    });
    // Lowered to 250 W three times, each once the agent has written its cap back.
    for time in 1..=3 {
        f.node
            .set_power_limit(0, 250_000, 0)
            .expect("the other manager's write");
        if time < 3 {
            wait_until(
                "the agent's cap written back",
                Duration::from_secs(10),
                || (f.limit_w(0) > 250.0).then_some(()),
            );
        }
    }
    wait_until("GPU 0 held elsewhere", Duration::from_secs(10), || {
        let s = f.status();
        (s.gpus[0].owned_elsewhere && s.gpus_owned_elsewhere == 1).then_some(())
    });
    // Left at 250 W, sampled every 50 ms for 3 s.
    let until = std::time::Instant::now() + Duration::from_secs(3);
    while std::time::Instant::now() < until {
        assert_eq!(f.limit_w(0), 250.0, "the agent does not fight it");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The other manager lets go: the agent takes the GPU back at its cap.
    f.node.set_power_limit(0, 700_000, 0).expect("let go");
    wait_until("the agent's cap again", Duration::from_secs(10), || {
        let cap = f.limit_w(0);
        (cap < 700.0 && !f.status().gpus[0].owned_elsewhere).then_some(())
    });
    assert!(
        f.limit_w(0) <= ours + 50.0,
        "{} W against {ours} W",
        f.limit_w(0)
    );
}
