//! The real `power_flex.so` under a real slurmctld and `slurmd -N` nodes, talking to real
//! `powerflexd` agents on simulated GPUs.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use powerflex::needs::{can_run, Need};
use powerflex::site_config::SiteBuilder;
use powerflex::slurm::{Cluster, ClusterOptions};
use powerflex::{binary, cargo_build, profile_dir, wait_until};
use powerflex_proto::status::AgentStatus;
use powerflex_proto::{ControlOp, ControlReply, ControlRequest};

fn plugin() -> PathBuf {
    cargo_build(&["-p", "powerflex-spank", "--lib"]);
    let so = profile_dir().join("libpower_flex.so");
    assert!(so.is_file(), "{} missing", so.display());
    so
}

/// A cluster whose nodes each run a powerflexd on 4 simulated H200s.
struct Site {
    cluster: Cluster,
    agents: Vec<(String, Child)>,
    base: PathBuf,
}

/// How a [`Site`] differs from the default (2 nodes).
struct SiteOptions {
    nodes: u32,
    with_agents: bool,
    /// Run as slurmstepd instead of the installed one (`ClusterOptions::slurmstepd`).
    slurmstepd: Option<PathBuf>,
    extra_conf: Vec<String>,
}

impl Site {
    fn start(name: &str, with_agents: bool) -> Site {
        Site::start_with(
            name,
            SiteOptions {
                nodes: 2,
                with_agents,
                slurmstepd: None,
                extra_conf: Vec::new(),
            },
        )
    }

    fn start_with(name: &str, options: SiteOptions) -> Site {
        let with_agents = options.with_agents;
        let so = plugin();
        cargo_build(&["-p", "powerflex-sim-nvml", "--lib"]);
        let agent_bin = binary("powerflexd");
        let base = std::env::temp_dir().join(format!("pf-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(base.join("agent")).expect("dir");
        let site = base.join("powerflex.toml");
        // No controller runs here: the agents wait out a long warm-up at the default
        // caps, which is all the plugin tests need.
        SiteBuilder::new(100000.0)
            .edit(|raw| raw.controller.lease_ttl_s = Some(3600))
            .key_file(&base.join("no.key"))
            .agent_paths(
                &format!("{}/agent/%n.sock", base.display()),
                &format!("{}/state/%n", base.display()),
                &profile_dir().join("libpowerflex_sim_nvml.so"),
            )
            .edit(|raw| raw.agent.calibration_warmup_s = Some(600.0))
            .write(&site)
            .unwrap_or_else(|e| panic!("{e}"));
        let plugstack = format!(
            "optional {} site={} socket={}/agent/%n.sock timeout_ms=200\n",
            so.display(),
            site.display(),
            base.display()
        );
        let cluster = Cluster::start(
            name,
            ClusterOptions {
                nodes: options.nodes,
                gpus_per_node: 4,
                plugstack: Some(plugstack),
                slurmstepd: options.slurmstepd,
                extra_conf: options.extra_conf,
                ..ClusterOptions::default()
            },
        );
        let mut agents = Vec::new();
        if with_agents {
            for node in cluster.node_names().to_vec() {
                let sim = base.join("sim").join(&node);
                powerflex_sim::state::Node::init(&sim, &node, "H200", 4, true).expect("sim node");
                let log =
                    std::fs::File::create(base.join(format!("agent-{node}.log"))).expect("log");
                let child = Command::new(&agent_bin)
                    .args([
                        "--config",
                        site.to_str().expect("utf-8"),
                        "--node",
                        &node,
                        "--sample-interval-ms",
                        "200",
                    ])
                    .env("POWERFLEX_SIM_DIR", &sim)
                    .stdout(Stdio::null())
                    .stderr(log)
                    .spawn()
                    .expect("powerflexd");
                agents.push((node.clone(), child));
                let sock = base.join("agent").join(format!("{node}.sock"));
                wait_until("agent socket", Duration::from_secs(20), || {
                    UnixStream::connect(&sock).is_ok().then_some(())
                });
            }
        }
        Site {
            cluster,
            agents,
            base,
        }
    }

    fn status(&self, node: &str) -> AgentStatus {
        let mut s = UnixStream::connect(self.base.join("agent").join(format!("{node}.sock")))
            .expect("agent");
        s.set_read_timeout(Some(Duration::from_secs(3)))
            .expect("timeout");
        s.write_all(ControlRequest::new(ControlOp::Status).to_line().as_bytes())
            .expect("send");
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).expect("reply");
        ControlReply::from_line(&line)
            .expect("a reply")
            .status()
            .cloned()
            .expect("a status")
    }

    /// Stops `node`'s agent (SIGKILL to the PID this test started, as a crash would).
    fn stop_agent(&mut self, node: &str) {
        for (_, a) in self.agents.iter_mut().filter(|(n, _)| n == node) {
            let _ = a.kill();
            let _ = a.wait();
        }
        self.agents.retain(|(n, _)| n != node);
    }

    fn agent_log(&self, node: &str) -> String {
        std::fs::read_to_string(self.base.join(format!("agent-{node}.log"))).unwrap_or_default()
    }
}

impl Drop for Site {
    fn drop(&mut self) {
        for (_, a) in &mut self.agents {
            let _ = a.kill();
            let _ = a.wait();
        }
    }
}

fn out_text(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

#[test]
fn option_is_offered_validated_and_reaches_the_agents() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let site = Site::start("spank-plugin", true);
    let c = &site.cluster;

    // --help lists the option with its usage.
    let help = c.run("sbatch", &["--help"]);
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("--power-flex=TIER"), "{help}");

    // Each valid tier is accepted; invalid values are refused with the core's message.
    for tier in [
        "flex0",
        "flex1",
        "flex2",
        "flex3",
        "none",
        "max-slowdown=15%",
        "flex2,calibrate=off",
    ] {
        let job = c
            .sbatch(
                &[&format!("--power-flex={tier}"), "--hold", "--wrap", "true"],
                None,
            )
            .unwrap_or_else(|e| panic!("{tier} refused: {e}"));
        c.run("scancel", &[&job.to_string()]);
    }
    for (value, message) in [
        ("flex9", "unknown tier \"flex9\"; this site offers: flex0, flex1, flex2, flex3, none, or max-slowdown=N%"),
        ("max-slowdown=150%", "bad max-slowdown \"150%\""),
        ("flex1,color=red", "unknown key \"color\""),
        ("", "--power-flex value is empty"),
    ] {
        let refused = c.sbatch(&[&format!("--power-flex={value}"), "--wrap", "true"], None);
        let stderr = refused.expect_err(&format!("{value:?} must be refused"));
        assert!(stderr.contains(message), "{value:?}: {stderr}");
    }
    let squeue = c.run("squeue", &["-h", "-t", "PD,R"]);
    assert!(
        String::from_utf8_lossy(&squeue.stdout).trim().is_empty(),
        "no job was created for a refused value"
    );

    // A 2-node batch job with srun steps registers with each node's agent.
    let out = c.dir().join("reg.out");
    let job = c
        .sbatch(
            &[
                "-N2",
                "--gres=gpu:2",
                "--power-flex=flex2",
                "-o",
                out.to_str().expect("utf-8"),
                "--wrap",
                "srun bash -c 'echo $SLURMD_NODENAME tier=$POWERFLEX_TIER progress=$POWERFLEX_PROGRESS; sleep 3'",
            ],
            None,
        )
        .expect("sbatch");
    let job_id = job.to_string();
    for node in ["n1", "n2"] {
        let j = wait_until(
            &format!("job on {node}'s agent"),
            Duration::from_secs(30),
            || site.status(node).jobs.into_iter().find(|j| j.job == job_id),
        );
        assert_eq!(j.tier, "flex2");
        assert_eq!(j.gpus.len(), 2, "{j:?}");
        assert_eq!(j.uid, 0);
    }
    assert_eq!(c.wait_job_done(job, Duration::from_secs(60)), "COMPLETED");
    let text = out_text(&out);
    assert!(
        text.contains("tier=flex2") && text.contains("progress=/"),
        "{text}"
    );
    // The job's end reaches both agents (epilog): no job left, GPUs at default.
    for node in ["n1", "n2"] {
        wait_until(
            &format!("job end on {node}"),
            Duration::from_secs(30),
            || site.status(node).jobs.is_empty().then_some(()),
        );
        assert!(
            site.agent_log(node).contains("job ended"),
            "{}",
            site.agent_log(node)
        );
    }

    // srun alone, with the option.
    let srun = c.run(
        "srun",
        &[
            "-N1",
            "--gres=gpu:1",
            "--power-flex=flex1",
            "bash",
            "-c",
            "echo $POWERFLEX_TIER",
        ],
    );
    assert!(
        srun.status.success(),
        "{}",
        String::from_utf8_lossy(&srun.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&srun.stdout).trim(), "flex1");
    // An opted-out job registers its GPUs as `none`: they are a job's, left at their
    // default limit, not use no job registered (which a site may hold at the fail-safe).
    let none = c
        .sbatch(
            &[
                "-N1",
                "--gres=gpu:2",
                "--power-flex=none",
                "--wrap",
                "sleep 5",
            ],
            None,
        )
        .expect("sbatch --power-flex=none");
    let none_id = none.to_string();
    let seen = wait_until(
        "the opted-out job on its agent",
        Duration::from_secs(30),
        || {
            ["n1", "n2"]
                .iter()
                .find_map(|n| site.status(n).jobs.into_iter().find(|j| j.job == none_id))
        },
    );
    assert_eq!(seen.tier, "none", "{seen:?}");
    assert_eq!(seen.gpus.len(), 2, "{seen:?}");
    assert!(seen.cap_w.is_none_or(|c| c >= 700.0), "{seen:?}");
    assert_eq!(c.wait_job_done(none, Duration::from_secs(60)), "COMPLETED");
    let bad = c.run("srun", &["-N1", "--power-flex=flex7", "true"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown tier \"flex7\""));
    // A value that never met submission's check (the option's own variable exported,
    // which srun forwards to the step as it forwards a given option) does not parse on
    // the node: the step runs under the site's default tier (`none` here, so its least
    // flexible one, flex0), never unmanaged.
    let forged = c
        .command("srun")
        .args([
            "-N1",
            "--gres=gpu:1",
            "bash",
            "-c",
            "echo tier=$POWERFLEX_TIER",
        ])
        .env(
            "_SLURM_SPANK_OPTION_power_flex_power_flex",
            "flex2,colour=red",
        )
        .stdin(Stdio::null())
        .output()
        .expect("srun");
    assert!(
        forged.status.success(),
        "{}",
        String::from_utf8_lossy(&forged.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&forged.stdout).trim(),
        "tier=flex0",
        "{}",
        String::from_utf8_lossy(&forged.stderr)
    );
    c.assert_no_node_drained();
}

#[test]
fn with_the_agent_down_jobs_run_and_say_so_once() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    let site = Site::start("spank-down", false);
    let c = &site.cluster;
    let out = c.dir().join("down.out");
    let job = c
        .sbatch(
            &[
                "-N1",
                "--gres=gpu:1",
                "--power-flex=flex3",
                "-o",
                out.to_str().expect("utf-8"),
                "--wrap",
                "srun echo ran",
            ],
            None,
        )
        .expect("sbatch");
    assert_eq!(c.wait_job_done(job, Duration::from_secs(60)), "COMPLETED");
    let text = out_text(&out);
    assert!(text.contains("ran"), "{text}");
    assert!(text.contains("power agent is not reachable"), "{text}");
    let log = c.log_tail("n1", 200);
    assert!(log.contains("cannot reach the powerflex agent"), "{log}");
    c.assert_no_node_drained();
}

#[test]
fn srun_loads_the_plugin_cleanly_under_valgrind() {
    if !can_run(&[Need::Root, Need::Slurm, Need::Program("valgrind")]) {
        return;
    }
    let site = Site::start("spank-valgrind", true);
    let c = &site.cluster;
    // srun (local and allocator contexts) loads power_flex.so, registers and validates the
    // option; valgrind watches the plugin's code in that process.
    let out = c.run(
        "valgrind",
        &[
            "--error-exitcode=99",
            "--leak-check=no",
            "--errors-for-leak-kinds=none",
            "srun",
            "-N1",
            "--gres=gpu:1",
            "--power-flex=flex2",
            "true",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "exit {:?}\n{stderr}",
        out.status.code()
    );
    assert!(stderr.contains("ERROR SUMMARY: 0 errors"), "{stderr}");
    let refused = c.run(
        "valgrind",
        &[
            "--error-exitcode=99",
            "srun",
            "-N1",
            "--power-flex=flex9",
            "true",
        ],
    );
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("ERROR SUMMARY: 0 errors"), "{stderr}");
    assert!(stderr.contains("unknown tier \"flex9\""), "{stderr}");
}

/// memcheck's options for every slurmstepd of the test below (docs/security.md says what
/// was run and found):
/// - one text log per process (`%p`): the part of a forked task before its `exec`, where
///   `slurm_spank_task_init` runs, gets a file of its own (with `--xml` a forked child
///   writes into its parent's file, interleaved);
/// - `--trace-children=no`: the tasks themselves (bash, the job) run natively;
/// - `-v` lists every object whose symbols memcheck read (proof the plugin was loaded);
///   `--show-error-list=no` stops `-v` from printing every error a second time at exit;
/// - `--fullpath-after=` prints whole source paths, so that Rust frames are recognisable;
/// - `--keep-debuginfo=yes`: slurmstepd unloads its SPANK plugins before it exits, and
///   without it the leak report shows the plugin's frames as bare `???`;
/// - definite leaks count as errors; other leak kinds are not reported;
/// - no suppressions: errors in Slurm's own frames are counted and printed, not hidden.
const MEMCHECK_OPTIONS: &[&str] = &[
    "--tool=memcheck",
    "--error-exitcode=97",
    "--trace-children=no",
    "--leak-check=full",
    "--show-leak-kinds=definite",
    "--errors-for-leak-kinds=definite",
    "--num-callers=40",
    "--fullpath-after=",
    "--keep-debuginfo=yes",
    "-v",
    "--show-error-list=no",
];

/// The program `slurmd -d` runs as its slurmstepd: a script that runs the installed
/// slurmstepd under memcheck. Nothing outside the test's directory changes.
struct StepdUnderValgrind {
    /// The test's own directory: the wrapper and the logs.
    dir: PathBuf,
    wrapper: PathBuf,
    logs: PathBuf,
    /// The installed binary, as memcheck's "Command:" line names it.
    stepd: PathBuf,
}

impl StepdUnderValgrind {
    fn prepare(name: &str) -> StepdUnderValgrind {
        let dir = std::env::temp_dir().join(format!("pf-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let logs = dir.join("memcheck");
        std::fs::create_dir_all(&logs).expect("dir");
        // Debian installs slurmstepd behind two links (/usr/sbin/slurmstepd →
        // /etc/alternatives/slurmstepd → slurmstepd-wlm); memcheck only reads the file.
        let stepd = std::fs::canonicalize("/usr/sbin/slurmstepd")
            .unwrap_or_else(|e| panic!("no installed slurmstepd at /usr/sbin/slurmstepd: {e}"));
        let valgrind = std::env::var_os("PATH")
            .and_then(|path| {
                std::env::split_paths(&path)
                    .map(|d| d.join("valgrind"))
                    .find(|p| p.is_file())
            })
            .expect("valgrind on PATH");
        let wrapper = dir.join("slurmstepd");
        let script = format!(
            "#!/bin/sh\n\
             # Written by tests/spank_plugin.rs; `slurmd -d` runs it as slurmstepd.\n\
             exec {} {} --log-file={}/%p.log {} \"$@\"\n",
            valgrind.display(),
            MEMCHECK_OPTIONS.join(" "),
            logs.display(),
            stepd.display()
        );
        std::fs::write(&wrapper, script).expect("wrapper");
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        StepdUnderValgrind {
            dir,
            wrapper,
            logs,
            stepd,
        }
    }

    /// `(pid, log)` of every process memcheck has logged so far.
    fn logs(&self) -> Vec<(u32, String)> {
        let mut logs: Vec<(u32, String)> = std::fs::read_dir(&self.logs)
            .map(|entries| {
                entries
                    .flatten()
                    .filter_map(|e| {
                        let pid = e.file_name().to_str()?.strip_suffix(".log")?.parse().ok()?;
                        Some((pid, std::fs::read_to_string(e.path()).ok()?))
                    })
                    .collect()
            })
            .unwrap_or_default();
        logs.sort();
        logs
    }

    /// Waits until every logged process has exited (its summary written) or left
    /// memcheck (a task's `exec`, or a PID already gone), so every log is complete.
    fn wait_all_done(&self, timeout: Duration) -> Vec<(u32, String)> {
        wait_until(
            "slurmstepd processes under memcheck to finish",
            timeout,
            || {
                let logs = self.logs();
                logs.iter()
                    .all(|(pid, log)| log.contains("ERROR SUMMARY:") || !self.watching(*pid))
                    .then_some(logs)
            },
        )
    }

    /// Whether `pid` is alive and still memcheck writing into this test's logs (not yet
    /// exec'd into a task, not a reused PID).
    fn watching(&self, pid: u32) -> bool {
        let memcheck = std::fs::read_link(format!("/proc/{pid}/exe"))
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .is_some_and(|name| name.starts_with("memcheck"));
        let logs_here = format!("--log-file={}/", self.logs.display());
        powerflex::slurm::pid_alive(pid)
            && memcheck
            && std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| {
                cmdline
                    .split(|b| *b == 0)
                    .any(|arg| arg.starts_with(logs_here.as_bytes()))
            })
    }
}

impl Drop for StepdUnderValgrind {
    /// A step daemon under memcheck is not found by the cluster's own clean-up (its
    /// command is `memcheck-amd64-linux`, not `slurm…`): whatever is still running once
    /// the cluster has stopped (a test that failed midway) is killed by the PID its log
    /// is named after.
    fn drop(&mut self) {
        for (pid, _) in self.logs() {
            if self.watching(pid) {
                let _ = powerflex_daemon::os::kill(pid, powerflex_daemon::os::Signal::KILL);
            }
        }
    }
}

/// What memcheck reports that the test judges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Finding {
    /// Invalid read or write.
    InvalidAccess,
    /// A branch, a pointer or a system call's argument built from uninitialised memory.
    Uninitialised,
    /// An invalid or mismatched free.
    BadFree,
    /// A block no pointer reaches any more.
    DefiniteLeak,
    /// Anything else memcheck calls an error: overlapping copies, fishy sizes, jumps to
    /// invalid addresses, a fatal signal.
    Other,
}

fn finding(headline: &str) -> Option<Finding> {
    let starts = |p: &str| headline.starts_with(p);
    if starts("Invalid read") || starts("Invalid write") {
        Some(Finding::InvalidAccess)
    } else if headline.contains("uninitialised") {
        Some(Finding::Uninitialised)
    } else if starts("Invalid free") || starts("Mismatched free") {
        Some(Finding::BadFree)
    } else if headline.contains("are definitely lost in loss record") {
        Some(Finding::DefiniteLeak)
    } else if starts("Source and destination overlap")
        || starts("Argument '")
        || starts("Jump to the invalid address")
        || starts("Process terminating")
    {
        Some(Finding::Other)
    } else {
        None
    }
}

/// One error memcheck reported: its headline and every stack (the access's, and the
/// block's allocation and free).
#[derive(Debug)]
struct Reported {
    finding: Finding,
    /// Whether any frame of any of its stacks is the plugin's (see [`plugin_frame`]).
    in_plugin: bool,
    text: String,
}

/// One process's memcheck log, as the test reads it.
#[derive(Debug, Default)]
struct MemcheckLog {
    /// The "Command:" line: the program memcheck ran.
    command: String,
    /// memcheck read the plugin's symbols: the plugin was loaded into this process.
    loaded_plugin: bool,
    /// The process exited under memcheck (the summary, and so the leak check, ran).
    exited: bool,
    errors: Vec<Reported>,
}

/// Whether a stack frame line lies in the plugin: it names the plugin's file (a frame
/// without line info), one of the workspace's crates or files, or any Rust source
/// (`/rustc/…` for the standard library, `.cargo/registry` for dependencies). slurmstepd,
/// its plugins and libraries are C, so Rust code in it can only be `power_flex.so`'s.
/// A frame memcheck cannot place at all (`???` and no object: code unloaded before the
/// report, had `--keep-debuginfo` been off) counts as the plugin's too, since nothing
/// shows it is not.
fn plugin_frame(frame: &str, plugin_so: &str, workspace: &str) -> bool {
    frame.ends_with(": ???")
        || frame.contains(plugin_so)
        || frame.contains(workspace)
        || frame.contains("powerflex_")
        || frame.contains("/rustc/")
        || frame.contains("/.cargo/registry/")
}

/// Reads a memcheck text log (`==PID== ` for output, `--PID-- ` for `-v` commentary).
/// An error is a headline that [`finding`] knows, then indented lines up to a blank one.
fn parse_memcheck_log(text: &str, plugin_so: &str, workspace: &str) -> MemcheckLog {
    let mut log = MemcheckLog::default();
    let mut current: Option<Reported> = None;
    for line in text.lines() {
        let body = if let Some(rest) = line.strip_prefix("--") {
            // `-v` commentary, e.g. "--123-- Reading syms from /path/libpower_flex.so".
            let body = rest.split_once("-- ").map_or("", |(_, b)| b);
            if body.starts_with("Reading syms from ") && body.contains(plugin_so) {
                log.loaded_plugin = true;
            }
            continue;
        } else if let Some(rest) = line.strip_prefix("==") {
            rest.split_once("==")
                .map_or("", |(_, b)| b.strip_prefix(' ').unwrap_or(b))
        } else {
            continue;
        };
        if let Some(command) = body.strip_prefix("Command: ") {
            log.command = command.to_string();
        }
        if body.starts_with("ERROR SUMMARY:") {
            log.exited = true;
        }
        if body.trim().is_empty() {
            log.errors.extend(current.take());
            continue;
        }
        match &mut current {
            Some(error) => {
                let frame = body.trim_start();
                if (frame.starts_with("at 0x") || frame.starts_with("by 0x"))
                    && plugin_frame(frame, plugin_so, workspace)
                {
                    error.in_plugin = true;
                }
                error.text.push('\n');
                error.text.push_str(body);
            }
            None => {
                if let Some(finding) = finding(body) {
                    current = Some(Reported {
                        finding,
                        in_plugin: false,
                        text: body.to_string(),
                    });
                }
            }
        }
    }
    log.errors.extend(current);
    log
}

#[test]
fn the_memcheck_log_reader_tells_the_plugin_s_errors_from_slurm_s() {
    let so = "/w/target/debug/libpower_flex.so";
    let log = "\
==41== Memcheck, a memory error detector
==41== Command: /usr/sbin/slurmstepd-wlm
==41== Parent PID: 40
==41== 
--41-- Reading syms from /usr/sbin/slurmstepd-wlm
--41-- Reading syms from /w/target/debug/libpower_flex.so
==41== Conditional jump or move depends on uninitialised value(s)
==41==    at 0x1234: pack_msg (in /usr/lib/x86_64-linux-gnu/slurm-wlm/libslurmfull.so)
==41==    by 0x1235: main (in /usr/sbin/slurmstepd-wlm)
==41== 
==41== Invalid read of size 8
==41==    at 0x4848: getenv (/w/spank-plugin/src/lib.rs:140)
==41==    by 0x4849: spank_getenv (in /usr/lib/x86_64-linux-gnu/slurm-wlm/libslurmfull.so)
==41==  Address 0x0 is not stack'd, malloc'd or (recently) free'd
==41== 
==41== Syscall param write(buf) points to uninitialised byte(s)
==41==    at 0x5000: write (in /usr/lib/x86_64-linux-gnu/libc.so.6)
==41==    by 0x5001: std::sys::pal::unix::fd::FileDesc::write (/rustc/abc/library/std/src/sys/pal/unix/fd.rs:1)
==41== 
==41== HEAP SUMMARY:
==41==     in use at exit: 100 bytes in 2 blocks
==41== 
==41== 48 bytes in 1 blocks are definitely lost in loss record 2 of 9
==41==    at 0x6000: malloc (in /usr/libexec/valgrind/vgpreload_memcheck-amd64-linux.so)
==41==    by 0x6001: slurm_spank_init (in /w/target/debug/libpower_flex.so)
==41== 
==41== 16 bytes in 1 blocks are definitely lost in loss record 1 of 9
==41==    at 0x6000: malloc (in /usr/libexec/valgrind/vgpreload_memcheck-amd64-linux.so)
==41==    by 0x7001: xstrdup (in /usr/lib/x86_64-linux-gnu/slurm-wlm/libslurmfull.so)
==41== 
==41== 5 bytes in 1 blocks are definitely lost in loss record 3 of 9
==41==    at 0x6000: malloc (in /usr/libexec/valgrind/vgpreload_memcheck-amd64-linux.so)
==41==    by 0x58B1E06: ???
==41==    by 0x49258F2: ??? (in /usr/lib/x86_64-linux-gnu/slurm-wlm/libslurmfull.so)
==41== 
==41== ERROR SUMMARY: 6 errors from 6 contexts (suppressed: 0 from 0)
";
    let parsed = parse_memcheck_log(log, so, "/w/");
    assert_eq!(parsed.command, "/usr/sbin/slurmstepd-wlm");
    assert!(parsed.loaded_plugin && parsed.exited);
    let seen: Vec<(Finding, bool)> = parsed
        .errors
        .iter()
        .map(|e| (e.finding, e.in_plugin))
        .collect();
    assert_eq!(
        seen,
        [
            (Finding::Uninitialised, false),
            (Finding::InvalidAccess, true),
            (Finding::Uninitialised, true),
            (Finding::DefiniteLeak, true),
            (Finding::DefiniteLeak, false),
            (Finding::DefiniteLeak, true),
        ]
    );
    // Without the plugin's symbols read, a process never loaded it.
    let other = parse_memcheck_log(
        "==7== Command: /bin/true\n--7-- Reading syms from /bin/true\n",
        so,
        "/w/",
    );
    assert!(!other.loaded_plugin && !other.exited && other.errors.is_empty());
}

#[test]
fn slurmstepd_runs_the_plugin_cleanly_under_valgrind() {
    if !can_run(&[Need::Root, Need::Slurm, Need::Program("valgrind")]) {
        return;
    }
    let memcheck = StepdUnderValgrind::prepare("vgstepd");
    // memcheck makes slurmstepd start in seconds rather than milliseconds: Slurm's own
    // message timeout (srun waiting for the launch, slurmd for the step) is raised, the
    // plugin's `timeout_ms` is not.
    let mut site = Site::start_with(
        "spank-vgstepd",
        SiteOptions {
            nodes: 1,
            with_agents: true,
            slurmstepd: Some(memcheck.wrapper.clone()),
            extra_conf: vec!["MessageTimeout=60".to_string()],
        },
    );
    let so = plugin().display().to_string();
    let workspace = format!("{}/", powerflex::repo_root().display());
    let step = [
        "-N1",
        "--gres=gpu:1",
        "--power-flex=flex2",
        "bash",
        "-c",
        "echo ran tier=$POWERFLEX_TIER",
    ];

    // 1. The agent up: the step registers from a slurmstepd under memcheck, its tasks get
    // the tier, and the ends of the step and of the job reach the agent.
    let started = std::time::Instant::now();
    let up = site.cluster.run("srun", &step);
    let up_s = started.elapsed().as_secs_f64();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&up.stdout),
        String::from_utf8_lossy(&up.stderr),
    );
    assert!(
        up.status.success() && stdout.contains("ran tier=flex2"),
        "exit {:?}\n{stdout}\n{stderr}\n{}",
        up.status.code(),
        site.cluster.logs_tail()
    );
    wait_until(
        "the job's end at the agent",
        Duration::from_secs(60),
        || site.status("n1").jobs.is_empty().then_some(()),
    );
    let agent_log = site.agent_log("n1");
    let registered_by: u32 = agent_log
        .lines()
        .find(|l| l.contains("step registered"))
        .and_then(|l| l.split_whitespace().find_map(|f| f.strip_prefix("pid=")))
        .and_then(|pid| pid.parse().ok())
        .unwrap_or_else(|| panic!("no step registered with a pid:\n{agent_log}"));
    assert!(agent_log.contains("step ended"), "{agent_log}");
    assert!(agent_log.contains("job ended"), "{agent_log}");

    // 2. The agent down (killed): the step runs, its task says so once.
    let before: Vec<u32> = memcheck.logs().iter().map(|(pid, _)| *pid).collect();
    site.stop_agent("n1");
    let started = std::time::Instant::now();
    let down = site.cluster.run("srun", &step);
    let down_s = started.elapsed().as_secs_f64();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&down.stdout),
        String::from_utf8_lossy(&down.stderr),
    );
    assert!(
        down.status.success()
            && stdout.contains("ran tier=")
            && stderr.contains("power agent is not reachable"),
        "exit {:?}\n{stdout}\n{stderr}\n{}",
        down.status.code(),
        site.cluster.logs_tail()
    );

    // 3. memcheck's logs, once every process is done.
    let logs = memcheck.wait_all_done(Duration::from_secs(120));
    let parsed: Vec<(u32, MemcheckLog)> = logs
        .iter()
        .map(|(pid, text)| (*pid, parse_memcheck_log(text, &so, &workspace)))
        .collect();
    let stepd = memcheck.stepd.display().to_string();
    for (pid, log) in &parsed {
        assert!(
            log.command.starts_with(&stepd),
            "memcheck log {pid} ran {:?}, not {stepd}",
            log.command
        );
    }
    // The wrapper really ran: the process that registered the step is one memcheck
    // watched, and it loaded the plugin.
    let registrar = parsed
        .iter()
        .find(|(pid, _)| *pid == registered_by)
        .unwrap_or_else(|| {
            panic!("the step was registered by pid {registered_by}, which memcheck did not watch")
        });
    assert!(registrar.1.loaded_plugin, "{registrar:?}");
    let exited = |new: bool| {
        parsed
            .iter()
            .filter(|(pid, log)| log.exited && log.loaded_plugin && before.contains(pid) != new)
            .count()
    };
    // Each srun makes two step daemons on the node (the extern step and step 0).
    assert!(
        exited(false) >= 2,
        "agent up: {} of 2 slurmstepd exited under memcheck",
        exited(false)
    );
    assert!(
        exited(true) >= 2,
        "agent down: {} of 2 slurmstepd exited under memcheck",
        exited(true)
    );

    let ours: Vec<&Reported> = parsed
        .iter()
        .flat_map(|(_, log)| &log.errors)
        .filter(|e| e.in_plugin)
        .collect();
    let mut slurms: std::collections::BTreeMap<Finding, usize> = Default::default();
    for e in parsed
        .iter()
        .flat_map(|(_, log)| &log.errors)
        .filter(|e| !e.in_plugin)
    {
        *slurms.entry(e.finding).or_default() += 1;
    }
    eprintln!(
        "memcheck watched {} processes ({} exited under it, {} loaded power_flex.so); \
         srun took {up_s:.1} s with the agent up, {down_s:.1} s down; errors in the \
         plugin's frames: {}; in Slurm's own frames only: {slurms:?}",
        parsed.len(),
        parsed.iter().filter(|(_, l)| l.exited).count(),
        parsed.iter().filter(|(_, l)| l.loaded_plugin).count(),
        ours.len()
    );
    assert!(
        ours.is_empty(),
        "memcheck found errors in power_flex.so's frames (logs in {}):\n{}",
        memcheck.logs.display(),
        ours.iter()
            .map(|e| e.text.as_str())
            .collect::<Vec<_>>()
            .join("\n\n")
    );
    site.cluster.assert_no_node_drained();
    // Kept when anything above failed, for a look at the whole logs.
    let _ = std::fs::remove_dir_all(&memcheck.dir);
}
