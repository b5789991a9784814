//! A real Slurm cluster on this machine for the whole-system tests: one `slurmctld` and
//! several `slurmd -N` nodes on loopback, GPUs declared as gres on device nodes made with
//! `mknod` (the recipe in `/work/shared/docs/slurm-local.md`). Needs root and Debian's
//! `slurm-wlm` (22.05); authentication is `auth/none`, so never point it at a real site.
//!
//! ```no_run
//! use powerflex::slurm::{Cluster, ClusterOptions};
//! let cluster = Cluster::start("my-test", ClusterOptions::default());
//! let id = cluster.sbatch(&["-N3", "--gres=gpu:2", "--wrap", "srun true"], None).unwrap();
//! assert_eq!(cluster.wait_job_done(id, std::time::Duration::from_secs(60)), "COMPLETED");
//! ```
//!
//! - **One cluster at a time per test process.** `Cluster::start` waits on a process-wide
//!   lock that the cluster holds until it is stopped or dropped, so tests in one binary
//!   may run in parallel but their clusters take turns (two `slurmd`s per CPU on a small
//!   machine make timing-sensitive tests flaky). Holding two clusters in one test
//!   deadlocks. Across processes, ports are fresh and the directory is keyed by `name`,
//!   so give every test its own name.
//! - **Stopping**: `stop()` or `Drop` (which also runs when the test panics) cancels the
//!   cluster's jobs, sends SIGTERM to the daemons by the PIDs in their pid files, then
//!   SIGKILL after a deadline. Daemons are never looked up by name. Leftovers
//!   (`slurmstepd`, job tasks) are found through `/proc` — a marker variable in their
//!   environment, or files open under the cluster's directory — and killed by PID.
//!   Whatever a killed test run (SIGKILL, abort) left is cleaned up the next time a
//!   cluster of the same name starts.
//! - **Environment**: Slurm clients find the cluster through `SLURM_CONF`. The process
//!   environment is never changed; `env()` / `command()` put it on each `Command`, and
//!   `sbatch` passes it on to the job, so `srun` inside a batch script finds it too.

use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Condvar, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use powerflex_daemon::os::{kill, Signal};

use crate::{profile_dir, scratch_dir};

/// Set for every daemon, client and (through `sbatch`) job of a cluster; its value is the
/// cluster's directory. Used to find the processes left behind after the daemons stop.
const MARKER_VAR: &str = "POWERFLEX_SLURM_TEST_DIR";
/// How long the daemons get to start and every node to become idle.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a daemon gets to exit after SIGTERM before it gets SIGKILL.
const TERM_TIMEOUT: Duration = Duration::from_secs(10);
/// How long cancelled jobs get to leave the queue when the cluster stops.
const CANCEL_TIMEOUT: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(100);
/// Lines of each log shown when something goes wrong.
const TAIL_LINES: usize = 30;

/// Job states after which a job never runs again (`scontrol show job` spelling).
const TERMINAL_STATES: &[&str] = &[
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
];

/// The shape of a test cluster.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Number of nodes, named `n1` … `nN` (default 3).
    pub nodes: u32,
    /// GPUs declared as gres per node, `Gres=gpu:N` (default 4; 0 declares none).
    pub gpus_per_node: u32,
    /// CPUs declared per node (default 2). `SlurmdParameters=config_overrides` makes
    /// slurmd believe it, so it may exceed the machine's real count.
    pub cpus_per_node: u32,
    /// Contents of `plugstack.conf` (SPANK plugins); `None` writes an empty file.
    pub plugstack: Option<String>,
    /// Environment set for every `slurmd` (and so every `slurmstepd` it starts); `%n` in
    /// a value becomes the node's name, e.g. `("POWERFLEX_SIM_DIR", "/tmp/sim/%n")`.
    pub extra_node_env: Vec<(String, String)>,
    /// `Prolog=` script (absolute path), run by slurmd as root before a job's first step.
    pub prolog: Option<PathBuf>,
    /// `Epilog=` script (absolute path), run by slurmd as root when a job ends.
    pub epilog: Option<PathBuf>,
    /// Extra lines appended to `slurm.conf` before the node lines (e.g. `KillWait=5`).
    pub extra_conf: Vec<String>,
    /// The program every `slurmd` runs as its `slurmstepd` (`slurmd -d PATH`), e.g. a
    /// script that runs the installed one under valgrind; `None` runs the installed one.
    /// Nothing outside the test's own files changes: slurmd takes the path per daemon.
    pub slurmstepd: Option<PathBuf>,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        ClusterOptions {
            nodes: 3,
            gpus_per_node: 4,
            cpus_per_node: 2,
            plugstack: None,
            extra_node_env: Vec::new(),
            prolog: None,
            epilog: None,
            extra_conf: Vec::new(),
            slurmstepd: None,
        }
    }
}

/// A running cluster; stops its daemons when dropped.
#[derive(Debug)]
pub struct Cluster {
    dir: PathBuf,
    conf: PathBuf,
    nodes: Vec<String>,
    /// Daemon (`slurmctld` or a node name) and PID, as read from the pid files at start.
    pids: Vec<(String, u32)>,
    stopped: bool,
    /// Environment for each node's slurmd (`%n` already replaced), kept for restarts.
    node_env: Vec<(String, Vec<(String, String)>)>,
    /// `ClusterOptions::slurmstepd`, kept for restarts.
    slurmstepd: Option<PathBuf>,
    _turn: Turn,
}

impl Cluster {
    /// Writes the configuration under a fresh scratch directory `name`, starts
    /// `slurmctld` and one `slurmd` per node, and returns once every node is idle.
    /// Panics with the daemons' log tails when that takes longer than ~30 s.
    ///
    /// `name` must be unique among tests and short: slurmstepd's Unix socket lives under
    /// it, so with the default target dir it may have about 39 bytes (checked up front).
    pub fn start(name: &str, options: ClusterOptions) -> Cluster {
        assert!(options.nodes >= 1, "a cluster needs at least one node");
        let turn = Turn::take();
        // Same path as `scratch_dir(name)`; reap what a killed earlier run left there
        // before that directory, and its pid files, are wiped.
        let previous = profile_dir().join("test-scratch").join(name);
        reap_leftovers(&previous);
        let nodes: Vec<String> = (1..=options.nodes).map(|i| format!("n{i}")).collect();
        // slurmstepd listens on `<spool>/<node>_<job>.<step>`, and a Unix socket path has
        // at most 107 bytes; past that every job fails at launch and is requeued.
        let longest = nodes.last().map_or(0, String::len);
        let socket_len = previous.display().to_string().len()
            + "/spool/".len()
            + longest
            + "/".len()
            + longest
            + "_9999999.4294967291".len();
        assert!(
            socket_len <= 107,
            "cluster name {name:?} is too long: slurmstepd's socket path under {} would \
             have {socket_len} bytes, more than 107",
            previous.display()
        );
        let dir = scratch_dir(name);
        let mut cluster = Cluster {
            conf: dir.join("slurm.conf"),
            dir,
            nodes,
            pids: Vec::new(),
            stopped: false,
            node_env: Vec::new(),
            slurmstepd: options.slurmstepd.clone(),
            _turn: turn,
        };
        // From here on a panic drops `cluster`, which stops whatever already started.
        cluster.write_files(&options);
        cluster.boot(&options);
        cluster
    }

    /// The cluster's scratch directory (absolute); a good place for job output files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `slurm.conf` of this cluster.
    pub fn conf_path(&self) -> &Path {
        &self.conf
    }

    /// Node names, `n1` … `nN`.
    pub fn node_names(&self) -> &[String] {
        &self.nodes
    }

    /// The device node standing for GPU `index` (the same files on every node).
    pub fn gpu_device(&self, index: u32) -> PathBuf {
        self.dir.join("dev").join(format!("nvidia{index}"))
    }

    /// Environment for a Slurm client of this cluster: `SLURM_CONF` and the marker that
    /// lets `stop()` find processes left behind. Pass it with `Command::envs`.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("SLURM_CONF".to_string(), self.conf.display().to_string()),
            (MARKER_VAR.to_string(), self.dir.display().to_string()),
        ]
    }

    /// A `Command` for `program` with `env()` set, run in `dir()` so that relative paths
    /// (and sbatch's default `slurm-%j.out`) land in the scratch directory.
    pub fn command(&self, program: &str) -> Command {
        let mut command = Command::new(program);
        command.envs(self.env()).current_dir(&self.dir);
        command
    }

    /// Runs a Slurm client (`sinfo`, `scontrol`, `srun`, …) against this cluster to
    /// completion.
    pub fn run(&self, program: &str, args: &[&str]) -> Output {
        self.command(program)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {program}: {e}"))
    }

    /// Submits a batch job: `sbatch --parsable ARGS`, with `script` (which must start with
    /// `#!`) on stdin, or none when ARGS hold `--wrap`. Returns the job id, or sbatch's
    /// stderr when it refused the job.
    pub fn sbatch(&self, args: &[&str], script: Option<&str>) -> Result<u32, String> {
        let mut child = self
            .command("sbatch")
            .arg("--parsable")
            .args(args)
            .stdin(if script.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run sbatch: {e}"));
        if let (Some(script), Some(mut stdin)) = (script, child.stdin.take()) {
            stdin
                .write_all(script.as_bytes())
                .unwrap_or_else(|e| panic!("cannot write the script to sbatch: {e}"));
        }
        let out = child
            .wait_with_output()
            .unwrap_or_else(|e| panic!("cannot wait for sbatch: {e}"));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        if !out.status.success() {
            return Err(stderr);
        }
        // `--parsable` prints `<id>` or `<id>;<cluster>`.
        let id = stdout.trim().split(';').next().unwrap_or_default();
        id.parse()
            .map_err(|_| format!("sbatch printed no job id: {stdout:?}; stderr: {stderr}"))
    }

    /// `scontrol show job -o ID`: one line of `Key=Value` fields, or scontrol's error.
    pub fn job_info(&self, job_id: u32) -> String {
        let out = self.run("scontrol", &["show", "job", "-o", &job_id.to_string()]);
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    /// The job's current `JobState` (`PENDING`, `RUNNING`, `COMPLETED`, …), if
    /// slurmctld knows the job.
    pub fn job_state(&self, job_id: u32) -> Option<String> {
        let info = self.job_info(job_id);
        info.split_whitespace()
            .find_map(|field| field.strip_prefix("JobState="))
            .map(str::to_string)
    }

    /// Polls until the job reaches a terminal state and returns it (`COMPLETED`, `FAILED`,
    /// `CANCELLED`, `TIMEOUT`, `NODE_FAIL`, …). Panics with the job and the logs when
    /// `timeout` passes first.
    pub fn wait_job_done(&self, job_id: u32, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(state) = self.job_state(job_id) {
                if TERMINAL_STATES.contains(&state.as_str()) {
                    return state;
                }
            }
            if Instant::now() >= deadline {
                panic!(
                    "job {job_id} not done after {timeout:?}:\n{}\n{}",
                    self.job_info(job_id),
                    self.logs_tail()
                );
            }
            thread::sleep(POLL);
        }
    }

    /// `(node, state)` for every node, from `sinfo -N -h -o "%N %t"`: short states such
    /// as `idle`, `alloc`, `mix`, `drain`, `drng`, `down*` (`*` = not responding).
    /// Empty when slurmctld does not answer.
    pub fn node_states(&self) -> Vec<(String, String)> {
        let out = self.run("sinfo", &["-N", "-h", "-o", "%N %t"]);
        let mut states: Vec<(String, String)> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|line| {
                let (node, state) = line.trim().split_once(' ')?;
                Some((node.to_string(), state.trim().to_string()))
            })
            .collect();
        // A node in several partitions is listed once per partition.
        states.sort();
        states.dedup();
        states
    }

    /// Panics, with `sinfo -R` and the logs, when any node is drained, draining, down or
    /// failed — e.g. after a SPANK plugin or epilog error.
    pub fn assert_no_node_drained(&self) {
        let states = self.node_states();
        assert!(
            !states.is_empty(),
            "sinfo gave no nodes\n{}",
            self.logs_tail()
        );
        let bad: Vec<&(String, String)> = states
            .iter()
            .filter(|(_, state)| {
                ["drain", "drng", "down", "fail"]
                    .iter()
                    .any(|prefix| state.starts_with(prefix))
            })
            .collect();
        if !bad.is_empty() {
            let reasons = self.run("sinfo", &["-R"]);
            panic!(
                "nodes not usable: {bad:?}\n{}\n{}",
                String::from_utf8_lossy(&reasons.stdout),
                self.logs_tail()
            );
        }
    }

    /// Log file of `which`: `"slurmctld"` or a node name (`"n1"`, …) for its slurmd.
    pub fn log_path(&self, which: &str) -> PathBuf {
        let file = if which == "slurmctld" {
            "slurmctld.log".to_string()
        } else {
            format!("slurmd-{which}.log")
        };
        self.dir.join("log").join(file)
    }

    /// The last `lines` lines of `which`'s log (see `log_path`); empty if there is none.
    pub fn log_tail(&self, which: &str, lines: usize) -> String {
        tail(&self.log_path(which), lines)
    }

    /// Tails of every daemon's log and captured stderr, for failure messages.
    pub fn logs_tail(&self) -> String {
        let mut text = String::new();
        let mut files: Vec<PathBuf> = fs::read_dir(self.dir.join("log"))
            .map(|entries| entries.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default();
        files.sort();
        for file in files {
            // Without PMIx every daemon logs the same harmless mpi/pmix errors.
            let body = tail_filtered(&file, TAIL_LINES, |line| {
                !line.contains("pmix") && !line.contains("MPI: Cannot create context")
            });
            if !body.trim().is_empty() {
                text.push_str(&format!("--- {} ---\n{body}\n", file.display()));
            }
        }
        text
    }

    /// `(daemon, pid)` of `slurmctld` and each node's `slurmd`, as started.
    pub fn daemon_pids(&self) -> Vec<(String, u32)> {
        self.pids.clone()
    }

    /// Stops `slurmctld` and every `slurmd` with SIGTERM (by their PIDs) and waits for
    /// them to exit, as a package upgrade's `systemctl stop slurmctld slurmd` does;
    /// running jobs' slurmstepd processes live on. [`Cluster::start_daemons`] brings them
    /// back.
    pub fn stop_daemons(&mut self) {
        let pids = std::mem::take(&mut self.pids);
        for (_, pid) in &pids {
            signal(*pid, Signal::TERM);
        }
        let deadline = Instant::now() + TERM_TIMEOUT;
        while let Some((which, pid)) = pids.iter().find(|(_, pid)| pid_alive(*pid)) {
            assert!(
                Instant::now() < deadline,
                "{which} (pid {pid}) ignored SIGTERM"
            );
            thread::sleep(POLL);
        }
    }

    /// Starts `slurmctld` from its saved state (no `-c`: the jobs it knew are recovered)
    /// and every `slurmd` again, as after an in-place upgrade; returns once every node
    /// responds.
    pub fn start_daemons(&mut self) {
        let conf = self.conf.display().to_string();
        self.spawn_daemon("slurmctld", "slurmctld", &["-f", &conf], &[]);
        for node in self.nodes.clone() {
            self.start_slurmd(&node);
        }
        self.wait_responding(&self.nodes.clone(), "after the daemons started again");
    }

    /// Starts `node`'s slurmd again, with the environment it was first started with.
    fn start_slurmd(&mut self, node: &str) {
        let env = self
            .node_env
            .iter()
            .find(|(n, _)| n == node)
            .map(|(_, env)| env.clone())
            .unwrap_or_default();
        let args = self.slurmd_args(node);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.spawn_daemon(node, "slurmd", &args, &env);
    }

    /// Waits until every node of `nodes` responds to slurmctld (no `*` on its state).
    fn wait_responding(&self, nodes: &[String], after: &str) {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let states = self.node_states();
            let responding = nodes.iter().all(|node| {
                states
                    .iter()
                    .any(|(n, state)| n == node && !state.ends_with('*'))
            });
            if responding {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{nodes:?} not responding {after}: {states:?}\n{}",
                self.logs_tail()
            );
            thread::sleep(POLL);
        }
    }

    /// Stops `node`'s slurmd with SIGTERM (by its PID) and starts it again, as an admin's
    /// `systemctl restart slurmd` would; running jobs' slurmstepd processes live on.
    /// Returns once the new slurmd has written its pid file and the node responds.
    pub fn restart_slurmd(&mut self, node: &str) {
        let Some(index) = self.pids.iter().position(|(which, _)| which == node) else {
            panic!("no slurmd for node {node:?}");
        };
        let (_, pid) = self.pids.remove(index);
        signal(pid, Signal::TERM);
        let deadline = Instant::now() + TERM_TIMEOUT;
        while pid_alive(pid) {
            assert!(
                Instant::now() < deadline,
                "slurmd of {node} (pid {pid}) ignored SIGTERM"
            );
            thread::sleep(POLL);
        }
        self.start_slurmd(node);
        self.wait_responding(&[node.to_string()], "after its slurmd restarted");
    }

    /// Cancels the jobs and stops the daemons (see the module docs). Panics if a daemon
    /// survives SIGKILL. Dropping the cluster does the same without panicking.
    pub fn stop(&mut self) {
        let problems = self.shutdown();
        assert!(problems.is_empty(), "stopping the cluster: {problems:?}");
    }

    fn write_files(&self, options: &ClusterOptions) {
        let d = &self.dir;
        for sub in ["state", "log", "dev"] {
            create_dir(&d.join(sub));
        }
        for node in &self.nodes {
            create_dir(&d.join("spool").join(node));
        }
        for i in 0..options.gpus_per_node {
            let device = self.gpu_device(i);
            let out = Command::new("mknod")
                .arg(&device)
                .args(["c", "195", &i.to_string()])
                .output()
                .unwrap_or_else(|e| panic!("cannot run mknod: {e}"));
            assert!(
                out.status.success(),
                "mknod {}: {}",
                device.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        write(
            &d.join("plugstack.conf"),
            options.plugstack.as_deref().unwrap_or(""),
        );
        let gres = match options.gpus_per_node {
            0 => String::new(),
            1 => format!("Name=gpu File={}/dev/nvidia0\n", d.display()),
            n => format!("Name=gpu File={}/dev/nvidia[0-{}]\n", d.display(), n - 1),
        };
        write(&d.join("gres.conf"), &gres);

        let mut ports = free_ports(self.nodes.len() + 1).into_iter();
        let ctld_port = ports.next().unwrap_or_default();
        let host = hostname();
        let d = d.display();
        let mut conf = format!(
            "# Written by powerflex::slurm (src/slurm.rs) for a test or the demo; not for real use.\n\
             ClusterName=pftest\n\
             SlurmctldHost={host}(127.0.0.1)\n\
             AuthType=auth/none\n\
             CredType=cred/none\n\
             SlurmUser=root\n\
             SlurmdUser=root\n\
             SlurmctldPort={ctld_port}\n\
             StateSaveLocation={d}/state\n\
             SlurmdSpoolDir={d}/spool/%n\n\
             SlurmctldPidFile={d}/slurmctld.pid\n\
             SlurmdPidFile={d}/slurmd-%n.pid\n\
             SlurmctldLogFile={d}/log/slurmctld.log\n\
             SlurmdLogFile={d}/log/slurmd-%n.log\n\
             SlurmdParameters=config_overrides\n\
             ProctrackType=proctrack/linuxproc\n\
             PrologFlags=Contain\n\
             TaskPlugin=task/none\n\
             JobAcctGatherType=jobacct_gather/none\n\
             AccountingStorageType=accounting_storage/none\n\
             SelectType=select/cons_tres\n\
             SelectTypeParameters=CR_Core\n\
             GresTypes=gpu\n\
             ReturnToService=2\n\
             MpiDefault=none\n\
             MailProg=/bin/true\n\
             SchedulerParameters=batch_sched_delay=0\n\
             PlugStackConfig={d}/plugstack.conf\n"
        );
        if let Some(prolog) = &options.prolog {
            conf.push_str(&format!("Prolog={}\n", prolog.display()));
        }
        if let Some(epilog) = &options.epilog {
            conf.push_str(&format!("Epilog={}\n", epilog.display()));
        }
        for line in &options.extra_conf {
            conf.push_str(line);
            conf.push('\n');
        }
        let gres = match options.gpus_per_node {
            0 => String::new(),
            n => format!(" Gres=gpu:{n}"),
        };
        // One line per node so each gets its own free port (ranges need adjacent ones).
        for (node, port) in self.nodes.iter().zip(ports) {
            conf.push_str(&format!(
                "NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} \
                 CPUs={} RealMemory=2000{gres} State=UNKNOWN\n",
                options.cpus_per_node
            ));
        }
        conf.push_str(&format!(
            "PartitionName=debug Nodes={} Default=YES MaxTime=INFINITE State=UP\n",
            self.nodes.join(",")
        ));
        write(&self.conf, &conf);
    }

    fn boot(&mut self, options: &ClusterOptions) {
        let conf = self.conf.display().to_string();
        self.spawn_daemon("slurmctld", "slurmctld", &["-c", "-f", &conf], &[]);
        for node in self.nodes.clone() {
            let env: Vec<(String, String)> = options
                .extra_node_env
                .iter()
                .map(|(k, v)| (k.clone(), v.replace("%n", &node)))
                .collect();
            let args = self.slurmd_args(&node);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            self.spawn_daemon(&node, "slurmd", &args, &env);
            self.node_env.push((node.clone(), env));
        }
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let states = self.node_states();
            let idle = states.iter().filter(|(_, s)| s == "idle").count();
            if idle == self.nodes.len() && states.len() == self.nodes.len() {
                return;
            }
            if let Some((daemon, pid)) = self.pids.iter().find(|(_, pid)| !pid_alive(*pid)) {
                panic!(
                    "{daemon} (pid {pid}) died while the cluster started; nodes: {states:?}\n{}",
                    self.logs_tail()
                );
            }
            if Instant::now() >= deadline {
                panic!(
                    "nodes not idle after {START_TIMEOUT:?}: {states:?}\n{}",
                    self.logs_tail()
                );
            }
            thread::sleep(POLL);
        }
    }

    /// `slurmd`'s arguments for `node`: its name, the cluster's config and, when set, the
    /// program to run as slurmstepd.
    fn slurmd_args(&self, node: &str) -> Vec<String> {
        let mut args = vec![
            "-N".to_string(),
            node.to_string(),
            "-f".to_string(),
            self.conf.display().to_string(),
        ];
        if let Some(stepd) = &self.slurmstepd {
            args.push("-d".to_string());
            args.push(stepd.display().to_string());
        }
        args
    }

    /// Starts a daemon (which forks into the background) and records the PID from its
    /// pid file.
    fn spawn_daemon(
        &mut self,
        which: &str,
        program: &str,
        args: &[&str],
        env: &[(String, String)],
    ) {
        let stderr_path = self.dir.join("log").join(format!("{which}.stderr"));
        let stderr = fs::File::create(&stderr_path)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", stderr_path.display()));
        let status = self
            .command(program)
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
        assert!(
            status.success(),
            "{program} {args:?} failed: {status}\n{}",
            self.logs_tail()
        );
        let pid_file = self.pid_file(which);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(pid) = read_pid(&pid_file).filter(|pid| pid_alive(*pid)) {
                self.pids.push((which.to_string(), pid));
                return;
            }
            if Instant::now() >= deadline {
                panic!(
                    "{which} wrote no pid file {} within {START_TIMEOUT:?}\n{}",
                    pid_file.display(),
                    self.logs_tail()
                );
            }
            thread::sleep(POLL);
        }
    }

    fn pid_file(&self, which: &str) -> PathBuf {
        if which == "slurmctld" {
            self.dir.join("slurmctld.pid")
        } else {
            self.dir.join(format!("slurmd-{which}.pid"))
        }
    }

    /// Stops everything; returns what went wrong instead of panicking, since it also runs
    /// in `Drop` while a test unwinds.
    fn shutdown(&mut self) -> Vec<String> {
        if self.stopped {
            return Vec::new();
        }
        self.stopped = true;
        let mut problems = Vec::new();
        let ctld_alive = self
            .pids
            .iter()
            .any(|(which, pid)| which == "slurmctld" && pid_alive(*pid));
        if ctld_alive {
            self.cancel_all_jobs();
        }

        // The pid files name the daemons; fall back to the PIDs read at start when a
        // daemon has removed (or never wrote) its file. Only processes whose command line
        // names this cluster's slurm.conf are signalled, so a reused PID is left alone.
        let mut pids: Vec<(String, u32)> = self.pids.clone();
        let whiches: Vec<String> = std::iter::once("slurmctld".to_string())
            .chain(self.nodes.iter().cloned())
            .collect();
        for which in whiches {
            if let Some(pid) = read_pid(&self.pid_file(&which)) {
                if !pids.contains(&(which.clone(), pid)) {
                    pids.push((which, pid));
                }
            }
        }
        let conf = self.conf.display().to_string();
        pids.retain(|(_, pid)| cmdline_contains(*pid, &conf));
        for (_, pid) in &pids {
            signal(*pid, Signal::TERM);
        }
        let deadline = Instant::now() + TERM_TIMEOUT;
        while pids.iter().any(|(_, pid)| pid_alive(*pid)) && Instant::now() < deadline {
            thread::sleep(POLL);
        }
        for (which, pid) in &pids {
            if pid_alive(*pid) {
                eprintln!("slurm harness: {which} (pid {pid}) ignored SIGTERM; killing it");
                signal(*pid, Signal::KILL);
            }
        }
        let deadline = Instant::now() + TERM_TIMEOUT;
        while pids.iter().any(|(_, pid)| pid_alive(*pid)) && Instant::now() < deadline {
            thread::sleep(POLL);
        }
        for (which, pid) in &pids {
            if pid_alive(*pid) {
                problems.push(format!("{which} (pid {pid}) survived SIGKILL"));
            }
        }
        let stray = kill_marked(&self.dir);
        if !stray.is_empty() {
            eprintln!("slurm harness: killed leftover processes {stray:?}");
        }
        // Not done until every process of the cluster has exited, not merely been
        // signalled: the daemons' own helpers (slurmctld's slurmscriptd, a slurmstepd
        // finishing a step) and what `kill_marked` just killed. A caller that returns
        // earlier leaves a `slurmctld` running behind the demo or the next test.
        let deadline = Instant::now() + TERM_TIMEOUT;
        loop {
            let left = cluster_processes(&self.dir, &conf);
            if left.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                for pid in &left {
                    problems.push(format!(
                        "{} (pid {pid}) still runs after the cluster stopped",
                        process_name(*pid)
                    ));
                }
                break;
            }
            for &pid in &left {
                signal(pid, Signal::KILL);
            }
            thread::sleep(POLL);
        }
        problems
    }

    /// Processes of this cluster still running (those whose command line names its slurm.conf,
    /// carry its marker, or are Slurm programs using its directory); none once
    /// [`Cluster::stop`] has returned.
    pub fn processes_left(&self) -> Vec<u32> {
        cluster_processes(&self.dir, &self.conf.display().to_string())
    }

    /// Cancels every job and waits (bounded) for the queue to empty, so `slurmstepd`s and
    /// job tasks end the Slurm way before the daemons go.
    fn cancel_all_jobs(&self) {
        let queued = |cluster: &Cluster| -> Vec<String> {
            let out = cluster.run("squeue", &["-h", "-o", "%i"]);
            String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .map(str::to_string)
                .collect()
        };
        let jobs = queued(self);
        if jobs.is_empty() {
            return;
        }
        let mut args: Vec<&str> = vec!["--quiet"];
        args.extend(jobs.iter().map(String::as_str));
        self.run("scancel", &args);
        let deadline = Instant::now() + CANCEL_TIMEOUT;
        while !queued(self).is_empty() && Instant::now() < deadline {
            thread::sleep(POLL);
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for problem in self.shutdown() {
            eprintln!("slurm harness: {problem}");
        }
    }
}

/// Whether `pid` is a live process (a zombie counts as gone).
pub fn pid_alive(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state letter follows the command name, which is in parentheses and may
        // itself contain spaces or parentheses.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// One test process's turn to run a cluster; the next `take` waits until it is dropped.
#[derive(Debug)]
struct Turn;

static BUSY: Mutex<bool> = Mutex::new(false);
static FREED: Condvar = Condvar::new();

impl Turn {
    fn take() -> Turn {
        let mut busy = BUSY.lock().unwrap_or_else(PoisonError::into_inner);
        while *busy {
            busy = FREED.wait(busy).unwrap_or_else(PoisonError::into_inner);
        }
        *busy = true;
        Turn
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        *BUSY.lock().unwrap_or_else(PoisonError::into_inner) = false;
        FREED.notify_one();
    }
}

/// Kills, by PID, daemons that a previous (killed) run left in `dir`, and anything
/// carrying that run's marker.
fn reap_leftovers(dir: &Path) {
    let conf = dir.join("slurm.conf").display().to_string();
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|ext| ext == "pid") {
            if let Some(pid) = read_pid(&path) {
                if pid_alive(pid) && cmdline_contains(pid, &conf) {
                    eprintln!("slurm harness: killing leftover daemon {pid} of {conf}");
                    signal(pid, Signal::KILL);
                }
            }
        }
    }
    kill_marked(dir);
}

/// SIGKILLs every process (but this one) left over from the cluster in `dir`; returns
/// their PIDs. A process belongs to the cluster when its environment holds the cluster's
/// marker (clients, job tasks), or when it is a Slurm program (`slurm*`) whose working
/// directory or an open file lies under `dir`: `slurmstepd` overwrites its environment
/// with its process title, but keeps the node's log open and runs in `dir/log`.
fn kill_marked(dir: &Path) -> Vec<u32> {
    let marker = format!("{MARKER_VAR}={}", dir.display());
    let mut killed = Vec::new();
    for pid in other_live_pids() {
        if environ_holds(pid, &marker) || (is_slurm_program(pid) && uses_dir(pid, dir)) {
            signal(pid, Signal::KILL);
            killed.push(pid);
        }
    }
    killed
}

/// Every live process of the cluster in `dir` whose slurm.conf is `conf`: a process whose
/// command line names that file (the daemons and the helpers they start with the same
/// arguments), one carrying the cluster's marker, or a Slurm program that uses `dir`.
fn cluster_processes(dir: &Path, conf: &str) -> Vec<u32> {
    let marker = format!("{MARKER_VAR}={}", dir.display());
    other_live_pids()
        .into_iter()
        .filter(|&pid| {
            cmdline_contains(pid, conf)
                || environ_holds(pid, &marker)
                || (is_slurm_program(pid) && uses_dir(pid, dir))
        })
        .collect()
}

/// `pid`'s command name, for messages.
fn process_name(pid: u32) -> String {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|c| c.trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

/// Every live process on the machine but this one (from `/proc`).
pub fn other_live_pids() -> Vec<u32> {
    let me = std::process::id();
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me && pid_alive(pid))
        .collect()
}

/// Whether `pid`'s environment holds the entry `NAME=value` exactly.
pub fn environ_holds(pid: u32, entry: &str) -> bool {
    fs::read(format!("/proc/{pid}/environ")).is_ok_and(|environ| {
        environ
            .split(|b| *b == 0)
            .any(|var| var == entry.as_bytes())
    })
}

fn is_slurm_program(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|comm| comm.starts_with("slurm"))
}

/// Whether the process runs in, or holds a file open under, `dir` (also once deleted).
fn uses_dir(pid: u32, dir: &Path) -> bool {
    let under = |link: PathBuf| fs::read_link(link).is_ok_and(|target| target.starts_with(dir));
    under(PathBuf::from(format!("/proc/{pid}/cwd")))
        || fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|fds| fds.flatten().any(|fd| under(fd.path())))
            .unwrap_or(false)
}

fn cmdline_contains(pid: u32, needle: &str) -> bool {
    fs::read(format!("/proc/{pid}/cmdline"))
        .map(|cmdline| {
            cmdline
                .split(|b| *b == 0)
                .any(|arg| arg == needle.as_bytes())
        })
        .unwrap_or(false)
}

/// Sends `signal` to `pid` (a daemon this harness started, read from its pid file).
/// A process already gone is what the caller wanted anyway.
fn signal(pid: u32, signal: Signal) {
    let _ = kill(pid, signal);
}

fn read_pid(path: &Path) -> Option<u32> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// `n` distinct loopback ports that were free a moment ago (see
/// [`crate::free_loopback_port`]: below the ephemeral range, so no outgoing connection
/// takes one before the daemon binds it).
fn free_ports(n: usize) -> Vec<u16> {
    let mut ports: Vec<u16> = Vec::with_capacity(n);
    while ports.len() < n {
        let port = crate::free_loopback_port();
        if !ports.contains(&port) {
            ports.push(port);
        }
    }
    ports
}

/// This machine's short host name, which slurmctld and slurmd compare with the config.
fn hostname() -> String {
    let name = fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_else(|e| panic!("cannot read the host name: {e}"));
    let name = name.trim();
    name.split('.').next().unwrap_or(name).to_string()
}

fn tail(path: &Path, lines: usize) -> String {
    tail_filtered(path, lines, |_| true)
}

/// The last `lines` lines of `path` that `keep` accepts.
fn tail_filtered(path: &Path, lines: usize, keep: impl Fn(&str) -> bool) -> String {
    let text = fs::read(path)
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_default();
    let kept: Vec<&str> = text.lines().filter(|line| keep(line)).collect();
    kept[kept.len().saturating_sub(lines)..].join("\n")
}

fn create_dir(path: &Path) {
    fs::create_dir_all(path).unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
}

fn write(path: &Path, contents: &str) {
    fs::write(path, contents).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
}
