//! The whole powerflex stack on a local Slurm cluster, for the fault tests: the cluster
//! ([`crate::slurm`]) with the SPANK plugin, one simulated GPU node and one `powerflexd`
//! per Slurm node, and `powerflex-ctld`; plus the checks every fault must pass — the draw
//! within the budget, no GPU capped without a live job on it, no node drained.
//!
//! Every process it starts is stopped by PID when the stack is dropped (the agents and
//! the controller first, then the cluster), or gracefully by [`Stack::shutdown`].
//!
//! Two faces: the `try_*` methods return [`StackError`] (the demo reports it and exits
//! 1); the plain ones panic with the same message (the tests' `assert` style), as thin
//! wrappers over them.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

use powerflex_core::config::RawSiteConfig;
use powerflex_daemon::os::{kill, Signal};
use powerflex_proto::status::{AgentStatus, CtldStatus, NodeStatus};
use powerflex_proto::{ControlAnswer, ControlOp, ControlReply, ControlRequest};
use powerflex_sim::state::Node;

use crate::site_config::{edit_site_file, SiteBuilder, SiteError};
use crate::slurm::{Cluster, ClusterOptions};
use crate::{
    binary, cargo_build, free_loopback_port, profile_dir, run, wait_until, write_site_key,
};

/// The shape of a stack.
#[derive(Debug, Clone)]
pub struct StackOptions {
    pub nodes: u32,
    pub gpus_per_node: u32,
    /// The facility's GPU budget, W.
    pub budget_w: f64,
    pub lease_ttl_s: u64,
    /// Extra environment for one node's agent: (node index, name, value).
    pub agent_env: Vec<(usize, String, String)>,
    /// Changes to the site config after the stack's own settings (the demo's grid,
    /// objective and header); a plain `fn` so the options stay `Clone` and `Debug`.
    pub site: Option<fn(SiteBuilder) -> SiteBuilder>,
    /// How often each agent samples its GPUs, ms.
    pub sample_interval_ms: u64,
    /// Build the plugin and the simulated NVML first (tests: yes; the demo runs what was
    /// built and only checks that it is there).
    pub build: bool,
    /// Where the daemons' logs go [default: the stack's base directory].
    pub log_dir: Option<PathBuf>,
    /// Where the product's binaries and plugin come from.
    pub artifacts: Artifacts,
    /// The program every `slurmd` runs as its `slurmstepd` (`ClusterOptions::slurmstepd`);
    /// `None` runs the installed one.
    pub slurmstepd: Option<PathBuf>,
}

/// Where a stack's powerflexd, powerflex-ctld, powerflexctl and SPANK plugin come from.
/// The test bed's own parts (the simulated NVML library, `powerflex-simjob`) always come
/// from this workspace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Artifacts {
    /// This workspace's build.
    #[default]
    Workspace,
    /// Where the Debian packages install them (`tests/packages.rs`).
    Installed,
}

/// Where the packages install each part (see `[package.metadata.deb]` in the crates).
pub mod installed {
    pub const AGENT: &str = "/usr/sbin/powerflexd";
    pub const CONTROLLER: &str = "/usr/sbin/powerflex-ctld";
    pub const VEN: &str = "/usr/sbin/powerflex-grid";
    pub const CLI: &str = "/usr/bin/powerflexctl";
    pub const PLUGIN: &str = "/usr/lib/x86_64-linux-gnu/slurm-wlm/power_flex.so";
    /// The site config, a conffile of powerflex-cli.
    pub const SITE_CONFIG: &str = "/etc/slurm/powerflex.toml";
}

/// `path`, which must be a file already: a stack never builds or installs one itself.
fn existing(path: PathBuf) -> Result<PathBuf, StackError> {
    if path.is_file() {
        Ok(path)
    } else {
        Err(StackError::MissingArtifact {
            path: path.display().to_string(),
        })
    }
}

/// An installed part, which must be there.
fn installed_artifact(path: &str) -> Result<PathBuf, StackError> {
    existing(PathBuf::from(path))
}

impl Default for StackOptions {
    fn default() -> Self {
        StackOptions {
            nodes: 2,
            gpus_per_node: 4,
            budget_w: 5600.0,
            lease_ttl_s: 10,
            agent_env: Vec::new(),
            site: None,
            sample_interval_ms: 250,
            build: true,
            log_dir: None,
            artifacts: Artifacts::Workspace,
            slurmstepd: None,
        }
    }
}

/// Why the stack could not be started or asked something.
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    #[error("{path} is missing: build the workspace first (`cargo build --release`; scripts/demo.sh does)")]
    MissingArtifact { path: String },
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("site config: {0}")]
    Site(#[from] SiteError),
    #[error("simulated node {node}: {message}")]
    Sim { node: String, message: String },
    #[error("cannot start {daemon}: {source}")]
    Spawn {
        daemon: &'static str,
        source: std::io::Error,
    },
    #[error("timed out after {timeout_s} s waiting for {what}")]
    Timeout { what: String, timeout_s: u64 },
    #[error("powerflexctl {args}: {message}")]
    Ctl { args: String, message: String },
    #[error("agent {node}: {message}")]
    Agent { node: String, message: String },
}

fn io(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> StackError + '_ {
    move |source| StackError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Polls `check` every 100 ms until it yields a value, or fails after `timeout`.
fn poll<T>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Option<T>,
) -> Result<T, StackError> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Some(v) = check() {
            return Ok(v);
        }
        if std::time::Instant::now() >= deadline {
            return Err(StackError::Timeout {
                what: what.to_string(),
                timeout_s: timeout.as_secs(),
            });
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A workspace artifact from this profile: built first when `build`, else only checked.
fn artifact(name: &str, build: bool) -> Result<PathBuf, StackError> {
    if build {
        return Ok(binary(name));
    }
    existing(profile_dir().join(name))
}

/// A running stack. Field order is drop order: daemons before the cluster.
#[derive(Debug)]
pub struct Stack {
    ctld: Option<Child>,
    agents: Vec<Option<Child>>,
    ctld_bin: PathBuf,
    agent_bin: PathBuf,
    sample_interval_ms: u64,
    log_dir: PathBuf,
    pub cluster: Cluster,
    /// Sockets, site config, logs, simulated GPU state.
    pub base: PathBuf,
    pub site: PathBuf,
    /// The controller's admin socket.
    pub socket: PathBuf,
    pub sims: Vec<Node>,
    pub ctl: PathBuf,
    pub simjob: PathBuf,
    pub gpus_per_node: u32,
    agent_env: Vec<(usize, String, String)>,
    restarts: u32,
}

/// The simulated GPUs' default power limit, W.
pub const DEFAULT_CAP_W: f64 = 700.0;

impl Stack {
    /// Starts the cluster (named `name`), the controller and one agent per node, and
    /// returns once every agent is live at the controller. Panics on failure.
    pub fn start(name: &str, options: StackOptions) -> Stack {
        Stack::try_start(name, options).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Stack::start`], failing with what went wrong. (The cluster itself still panics
    /// with its daemons' log tails when Slurm does not come up: see `Cluster::start`.)
    pub fn try_start(name: &str, options: StackOptions) -> Result<Stack, StackError> {
        if options.build {
            cargo_build(&["-p", "powerflex-spank", "-p", "powerflex-sim-nvml", "--lib"]);
        }
        let simjob = artifact("powerflex-simjob", options.build)?;
        let nvml = artifact("libpowerflex_sim_nvml.so", false)?;
        let (ctl, ctld_bin, agent_bin, plugin) = match options.artifacts {
            Artifacts::Workspace => (
                artifact("powerflexctl", options.build)?,
                artifact("powerflex-ctld", options.build)?,
                artifact("powerflexd", options.build)?,
                artifact("libpower_flex.so", false)?,
            ),
            Artifacts::Installed => (
                installed_artifact(installed::CLI)?,
                installed_artifact(installed::CONTROLLER)?,
                installed_artifact(installed::AGENT)?,
                installed_artifact(installed::PLUGIN)?,
            ),
        };
        let base = std::env::temp_dir().join(format!("pf-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(base.join("agent")).map_err(io(&base))?;
        let log_dir = options.log_dir.clone().unwrap_or_else(|| base.clone());
        std::fs::create_dir_all(&log_dir).map_err(io(&log_dir))?;
        let key = base.join("site.key");
        write_site_key(&key, "fault-test site key, loopback only\n");
        let site = base.join("powerflex.toml");
        let builder = SiteBuilder::new(options.budget_w)
            .h200(&[700.0, 500.0, 300.0], 300.0)
            .controller(
                ([127, 0, 0, 1], free_loopback_port()).into(),
                options.lease_ttl_s,
                1,
            )
            .key_file(&key)
            .controller_paths(&base.join("ctld.sock"), &base.join("ctld"))
            .agent_paths(
                &format!("{}/agent/%n.sock", base.display()),
                &format!("{}/state/%n", base.display()),
                &nvml,
            )
            .calibration_s(1.0, 1.0, 2.0)
            .calibration_budget_pct(0.2);
        let builder = match options.site {
            Some(edit) => edit(builder),
            None => builder,
        };
        builder.write(&site)?;
        let cluster = Cluster::start(
            name,
            ClusterOptions {
                nodes: options.nodes,
                gpus_per_node: options.gpus_per_node,
                cpus_per_node: 8,
                plugstack: Some(format!(
                    "optional {} site={} socket={}/agent/%n.sock timeout_ms=500\n",
                    plugin.display(),
                    site.display(),
                    base.display()
                )),
                slurmstepd: options.slurmstepd.clone(),
                ..ClusterOptions::default()
            },
        );
        let mut sims = Vec::new();
        for node in cluster.node_names() {
            let sim = Node::init(
                &base.join("sim").join(node),
                node,
                "H200",
                options.gpus_per_node,
                true,
            )
            .map_err(|e| StackError::Sim {
                node: node.clone(),
                message: e.to_string(),
            })?;
            sims.push(sim);
        }
        let mut stack = Stack {
            ctld: None,
            agents: Vec::new(),
            ctld_bin,
            agent_bin,
            sample_interval_ms: options.sample_interval_ms,
            log_dir,
            cluster,
            socket: base.join("ctld.sock"),
            base,
            site,
            sims,
            ctl,
            simjob,
            gpus_per_node: options.gpus_per_node,
            agent_env: options.agent_env.clone(),
            restarts: 0,
        };
        // Each node gets its own link key, made from the site key as a site makes it.
        let names: Vec<&str> = stack
            .cluster
            .node_names()
            .iter()
            .map(String::as_str)
            .collect();
        crate::write_node_keys(&stack.ctl, &stack.site, &names);
        stack.try_start_ctld()?;
        for i in 0..stack.sims.len() {
            let agent = stack.spawn_agent(i)?;
            stack.agents.push(Some(agent));
        }
        stack.wait_live(options.nodes as usize)?;
        Ok(stack)
    }

    fn log(&mut self, name: &str) -> Result<std::fs::File, StackError> {
        self.restarts += 1;
        let path = self.log_dir.join(format!("{name}-{}.log", self.restarts));
        std::fs::File::create(&path).map_err(io(&path))
    }

    /// Starts the controller (again). Panics on failure.
    pub fn start_ctld(&mut self) {
        self.try_start_ctld().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Starts the controller (again) and waits for its admin socket.
    pub fn try_start_ctld(&mut self) -> Result<(), StackError> {
        let log = self.log("ctld")?;
        let mut command = Command::new(&self.ctld_bin);
        command
            .args(["--config", &self.site.to_string_lossy()])
            .envs(self.cluster.env())
            .stderr(log);
        let child = command.spawn().map_err(|source| StackError::Spawn {
            daemon: "powerflex-ctld",
            source,
        })?;
        self.ctld = Some(child);
        let socket = self.socket.clone();
        poll(
            "the controller's admin socket",
            Duration::from_secs(90),
            || {
                std::os::unix::net::UnixStream::connect(&socket)
                    .ok()
                    .map(|_| ())
            },
        )
    }

    /// The controller's process id, while the stack runs it.
    pub fn ctld_pid(&self) -> Option<u32> {
        self.ctld.as_ref().map(Child::id)
    }

    /// Everything this stack's daemons logged so far whose log name starts with `prefix`
    /// (`ctld`, `agent-<node>`), across restarts, oldest first.
    pub fn logs(&self, prefix: &str) -> String {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&self.log_dir)
            .map(|dir| {
                dir.flatten()
                    .map(|e| e.path())
                    .filter(|p| {
                        p.extension().is_some_and(|x| x == "log")
                            && p.file_name()
                                .and_then(|n| n.to_str())
                                .is_some_and(|n| n.starts_with(prefix))
                    })
                    .collect()
            })
            .unwrap_or_default();
        files.sort_by_key(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok());
        files
            .iter()
            .filter_map(|p| std::fs::read_to_string(p).ok())
            .collect()
    }

    /// kill -9 the controller.
    pub fn kill_ctld(&mut self) {
        if let Some(mut child) = self.ctld.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_file(&self.socket);
    }

    /// SIGHUP to the controller (by PID): re-read the site config.
    pub fn reload_ctld(&self) {
        let pid = self.ctld.as_ref().expect("the controller runs").id();
        kill(pid, Signal::HUP).expect("SIGHUP to the controller");
    }

    /// SIGHUP to the agent of node `i` (by PID): re-read the site config.
    pub fn reload_agent(&self, i: usize) {
        let pid = self.agents[i].as_ref().expect("the agent runs").id();
        kill(pid, Signal::HUP).expect("SIGHUP to the agent");
    }

    /// The agent's own status on node `i` (its control socket), if it answers.
    pub fn agent_status(&self, i: usize) -> Option<AgentStatus> {
        self.try_agent_status(i).ok()
    }

    /// The agent's own status on node `i`, or why it did not answer.
    pub fn try_agent_status(&self, i: usize) -> Result<AgentStatus, StackError> {
        use std::io::{BufRead, Write};
        let failed = |message: String| StackError::Agent {
            node: self.cluster.node_names()[i].clone(),
            message,
        };
        let mut stream = std::os::unix::net::UnixStream::connect(self.agent_socket(i))
            .map_err(|e| failed(e.to_string()))?;
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| failed(e.to_string()))?;
        let request = ControlRequest::new(ControlOp::Status).to_line();
        stream
            .write_all(request.as_bytes())
            .map_err(|e| failed(e.to_string()))?;
        let mut line = String::new();
        std::io::BufReader::new(stream)
            .read_line(&mut line)
            .map_err(|e| failed(e.to_string()))?;
        match ControlReply::from_line(&line).map_err(|e| failed(e.to_string()))? {
            ControlReply::Done(ControlAnswer::Status(status)) => Ok(*status),
            _ => Err(failed("no status in the reply".to_string())),
        }
    }

    /// Rewrites the site config through its types (see [`edit_site_file`]): the edit may
    /// set an out-of-range value, for the daemons to refuse on reload.
    pub fn edit_site(&self, edit: impl FnOnce(&mut RawSiteConfig)) {
        edit_site_file(&self.site, edit).unwrap_or_else(|e| panic!("{e}"));
    }

    fn spawn_agent(&mut self, i: usize) -> Result<Child, StackError> {
        let node = self.cluster.node_names()[i].clone();
        let log = self.log(&format!("agent-{node}"))?;
        let interval_ms = self.sample_interval_ms.to_string();
        Command::new(&self.agent_bin)
            .args(["--config", &self.site.to_string_lossy(), "--node", &node])
            .args(["--sample-interval-ms", &interval_ms])
            .env("POWERFLEX_SIM_DIR", self.sims[i].dir())
            .envs(
                self.agent_env
                    .iter()
                    .filter(|(node, _, _)| *node == i)
                    .map(|(_, k, v)| (k, v)),
            )
            .stderr(log)
            .spawn()
            .map_err(|source| StackError::Spawn {
                daemon: "powerflexd",
                source,
            })
    }

    /// The agent's control socket on node `i`.
    pub fn agent_socket(&self, i: usize) -> PathBuf {
        self.base
            .join("agent")
            .join(format!("{}.sock", self.cluster.node_names()[i]))
    }

    /// The PID of node `i`'s agent, while it runs (to stop it with SIGSTOP and resume it).
    pub fn agent_pid(&self, i: usize) -> Option<u32> {
        self.agents.get(i)?.as_ref().map(Child::id)
    }

    /// kill -9 the agent of node `i`.
    pub fn kill_agent(&mut self, i: usize) {
        if let Some(mut child) = self.agents[i].take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the agent of node `i` as an admin would (`systemctl stop`): SIGTERM by PID,
    /// then waits for it to exit (SIGKILL after 10 s). Returns how it exited.
    pub fn stop_agent(&mut self, i: usize) -> Option<std::process::ExitStatus> {
        let mut child = self.agents[i].take()?;
        let _ = kill(child.id(), Signal::TERM);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::time::Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        child.wait().ok()
    }

    /// Starts the agent of node `i` (again) and waits for its control socket.
    pub fn start_agent(&mut self, i: usize) {
        let agent = self.spawn_agent(i).unwrap_or_else(|e| panic!("{e}"));
        self.agents[i] = Some(agent);
        let socket = self.agent_socket(i);
        wait_until("the agent's socket", Duration::from_secs(90), || {
            std::os::unix::net::UnixStream::connect(&socket)
                .ok()
                .map(|_| ())
        });
    }

    /// The controller's persisted state file.
    pub fn ctld_state_file(&self) -> PathBuf {
        self.base.join("ctld").join("ctld-state.json")
    }

    /// The agent's persisted state file on node `i`.
    pub fn agent_state_file(&self, i: usize) -> PathBuf {
        self.base
            .join("state")
            .join(&self.cluster.node_names()[i])
            .join("agent-state.json")
    }

    fn wait_live(&self, nodes: usize) -> Result<(), StackError> {
        poll(
            "every agent live at the controller",
            Duration::from_secs(30),
            || {
                let listed: Vec<NodeStatus> = self.ctl_json(&["nodes"])?;
                let live = listed.iter().filter(|n| n.live).count();
                (live == nodes).then_some(())
            },
        )
    }

    /// `powerflexctl ARGS --format json --socket …`, parsed as `T` (e.g. `CtldStatus` for
    /// `status`, `Vec<SiteJobStatus>` for `jobs`); `None` if it fails.
    pub fn ctl_json<T: serde::de::DeserializeOwned>(&self, args: &[&str]) -> Option<T> {
        self.try_ctl_json(args).ok()
    }

    /// [`Stack::ctl_json`], failing with what `powerflexctl` said.
    pub fn try_ctl_json<T: serde::de::DeserializeOwned>(
        &self,
        args: &[&str],
    ) -> Result<T, StackError> {
        let socket = self.socket.to_string_lossy();
        let mut all = args.to_vec();
        all.extend(["--format", "json", "--socket", &socket]);
        let failed = |message: String| StackError::Ctl {
            args: args.join(" "),
            message,
        };
        let out = run(&self.ctl, &all);
        if out.code != Some(0) {
            return Err(failed(out.stderr.trim().to_string()));
        }
        serde_json::from_str(&out.stdout).map_err(|e| failed(format!("not JSON ({e})")))
    }

    /// `powerflexctl ARGS --socket …` for its effect (e.g. `event add`); fails with what
    /// it said when it exits non-zero. Returns its standard output.
    pub fn try_ctl(&self, args: &[&str]) -> Result<String, StackError> {
        let socket = self.socket.to_string_lossy();
        let mut all = args.to_vec();
        all.extend(["--socket", &socket]);
        let out = run(&self.ctl, &all);
        if out.code != Some(0) {
            return Err(StackError::Ctl {
                args: args.join(" "),
                message: out.stderr.trim().to_string(),
            });
        }
        Ok(out.stdout)
    }

    /// Submits a simulated training job: `nodes` × `gpus` GPUs, `--power-flex=flex`,
    /// `profile` for `duration_sim_s` simulated seconds at time scale 20.
    pub fn submit(&self, flex: &str, nodes: u32, gpus: u32, profile: &str) -> u32 {
        self.submit_work(
            flex,
            nodes,
            gpus,
            &format!("--profile {profile} --duration 20000 --time-scale 20"),
        )
    }

    /// Submits a simulated training job running `powerflex-simjob WORK` (e.g.
    /// `--phases idle:60,PROFILE:600 --time-scale 4`).
    pub fn submit_work(&self, flex: &str, nodes: u32, gpus: u32, work: &str) -> u32 {
        let wrap = format!(
            "srun bash -c 'POWERFLEX_SIM_DIR={}/sim/$SLURMD_NODENAME exec {} {work} > /dev/null'",
            self.base.display(),
            self.simjob.display()
        );
        self.cluster
            .sbatch(
                &[
                    &format!("-N{nodes}"),
                    &format!("--gres=gpu:{gpus}"),
                    &format!("--power-flex={flex}"),
                    "--wrap",
                    &wrap,
                ],
                None,
            )
            .expect("sbatch")
    }

    /// Summed draw of every simulated GPU, W.
    pub fn draw_w(&self) -> f64 {
        self.try_draw_w().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Summed draw of every simulated GPU (the meter), W, or which GPU could not be read.
    pub fn try_draw_w(&self) -> Result<f64, StackError> {
        self.meter().draw_w()
    }

    /// Whether Slurm says job `id` is RUNNING.
    pub fn running(&self, id: u32) -> bool {
        self.cluster.job_state(id).as_deref() == Some("RUNNING")
    }

    /// Ends `jobs` (scancel), waits for them to finish, then for every GPU to be back at
    /// its default cap within `restore_within`, and checks that no node was drained.
    pub fn ends_clean(&self, jobs: &[u32], restore_within: Duration) {
        for id in jobs {
            self.cluster.run("scancel", &[&id.to_string()]);
        }
        for &id in jobs {
            self.cluster.wait_job_done(id, Duration::from_secs(60));
        }
        crate::wait_until("every GPU back at its default cap", restore_within, || {
            self.caps_w()
                .iter()
                .all(|&c| c == DEFAULT_CAP_W)
                .then_some(())
        });
        self.cluster.assert_no_node_drained();
    }

    /// Every simulated GPU's cap, W, node by node.
    pub fn caps_w(&self) -> Vec<f64> {
        self.try_caps_w().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Every simulated GPU's cap, W, node by node, or which GPU could not be read.
    pub fn try_caps_w(&self) -> Result<Vec<f64>, StackError> {
        let mut caps = Vec::new();
        for (node, sim) in self.cluster.node_names().iter().zip(&self.sims) {
            for g in 0..self.gpus_per_node {
                let gpu = sim.gpu(g).map_err(|e| StackError::Sim {
                    node: node.clone(),
                    message: format!("GPU {g}: {e}"),
                })?;
                caps.push(f64::from(gpu.power_limit_mw) / 1000.0);
            }
        }
        Ok(caps)
    }

    /// GPUs below their default cap with no live job on them: `(node, gpu, cap W)`.
    pub fn capped_without_a_job(&self) -> Vec<(String, u32, f64)> {
        let mut found = Vec::new();
        for (node, sim) in self.cluster.node_names().iter().zip(&self.sims) {
            for g in 0..self.gpus_per_node {
                let gpu = sim.gpu(g).expect("gpu");
                let cap = f64::from(gpu.power_limit_mw) / 1000.0;
                let live = gpu
                    .running()
                    .is_some_and(|w| crate::slurm::pid_alive(w.pid));
                if cap < DEFAULT_CAP_W && !live {
                    found.push((node.clone(), g, cap));
                }
            }
        }
        found
    }

    /// The controller's budget in force, W.
    pub fn budget_w(&self) -> Option<f64> {
        self.ctl_json::<CtldStatus>(&["status"]).map(|s| s.budget_w)
    }

    /// Samples the metered draw (every simulated GPU's power reading, summed) every
    /// [`SAMPLE_INTERVAL`] for `duration` against `budget_w`. Never panics: the caller
    /// decides what the figures must be.
    pub fn watch_draw(&self, budget_w: f64, duration: Duration) -> DrawWatch {
        let until = std::time::Instant::now() + duration;
        self.meter()
            .watch(budget_w, || std::time::Instant::now() < until)
    }

    /// The stack's meter on its own: it reads the simulated GPUs' files, so a thread can
    /// sample the draw while the test restarts daemons.
    pub fn meter(&self) -> Meter {
        Meter {
            nodes: self.cluster.node_names().to_vec(),
            sims: self.sims.clone(),
            gpus_per_node: self.gpus_per_node,
        }
    }

    /// Samples the draw every 50 ms for `duration`, prints what it saw, and panics when
    /// any sample is more than [`METER_TOLERANCE`] over `budget_w`. Returns the highest
    /// sample.
    pub fn assert_draw_within(&self, budget_w: f64, duration: Duration, what: &str) -> f64 {
        let watch = self.watch_draw(budget_w, duration);
        println!("{what}: {watch}");
        assert!(
            watch.over_s == 0.0,
            "{what}: the draw went over the budget: {watch}"
        );
        watch.highest_w
    }

    /// Like [`Stack::assert_draw_within`] for the `metered` mode's promise: the draw may
    /// pass the budget after a change nobody could plan (a phase change), but is back
    /// within it in `settle`; panics on a longer stretch over.
    pub fn assert_draw_settles(
        &self,
        budget_w: f64,
        duration: Duration,
        settle: Duration,
        what: &str,
    ) -> DrawWatch {
        let watch = self.watch_draw(budget_w, duration);
        println!("{what}: {watch}");
        assert!(
            watch.longest_over_s <= settle.as_secs_f64(),
            "{what}: over the budget for longer than {:.1} s: {watch}",
            settle.as_secs_f64()
        );
        watch
    }
}

/// How often the tests sample the metered draw: fast enough to see a reallocation in which
/// one node raised its caps before another lowered them (agents sample every 250 ms).
pub const SAMPLE_INTERVAL: Duration = Duration::from_millis(50);

/// A sample counts as over the budget only beyond this fraction: the simulated GPUs'
/// power readings carry ±0.5 % noise.
pub const METER_TOLERANCE: f64 = 0.01;

/// The metered draw of a stack's simulated GPUs (see [`Stack::meter`]).
#[derive(Debug, Clone)]
pub struct Meter {
    nodes: Vec<String>,
    sims: Vec<Node>,
    gpus_per_node: u32,
}

impl Meter {
    /// Summed draw of every simulated GPU, W, or which GPU could not be read.
    pub fn draw_w(&self) -> Result<f64, StackError> {
        let mut sum = 0.0;
        for (node, sim) in self.nodes.iter().zip(&self.sims) {
            for g in 0..self.gpus_per_node {
                let (_, reading) = sim.reading(g).map_err(|e| StackError::Sim {
                    node: node.clone(),
                    message: format!("GPU {g}: {e}"),
                })?;
                sum += f64::from(reading.power_mw) / 1000.0;
            }
        }
        Ok(sum)
    }

    /// Samples the draw every [`SAMPLE_INTERVAL`] against `budget_w` while `go_on` says
    /// so. Panics only when a GPU cannot be read.
    pub fn watch(&self, budget_w: f64, go_on: impl Fn() -> bool) -> DrawWatch {
        let start = std::time::Instant::now();
        let mut watch = DrawWatch {
            budget_w,
            samples: 0,
            highest_w: 0.0,
            overshoot_w: 0.0,
            over_s: 0.0,
            longest_over_s: 0.0,
        };
        let (mut run_s, mut last) = (0.0f64, start);
        let mut next = start;
        while go_on() {
            let draw = self.draw_w().unwrap_or_else(|e| panic!("{e}"));
            let now = std::time::Instant::now();
            // A sample stands for the time since the previous one: a late sample (a busy
            // machine) counts for the whole gap, not for 50 ms.
            let dt_s = if watch.samples == 0 {
                SAMPLE_INTERVAL.as_secs_f64()
            } else {
                now.duration_since(last).as_secs_f64()
            };
            last = now;
            watch.samples += 1;
            watch.highest_w = watch.highest_w.max(draw);
            watch.overshoot_w = watch.overshoot_w.max(draw - budget_w);
            if draw > budget_w * (1.0 + METER_TOLERANCE) {
                watch.over_s += dt_s;
                run_s += dt_s;
                watch.longest_over_s = watch.longest_over_s.max(run_s);
            } else {
                run_s = 0.0;
            }
            // On a schedule, so reading the GPUs does not stretch the interval.
            next = (next + SAMPLE_INTERVAL).max(now);
            std::thread::sleep(next.saturating_duration_since(std::time::Instant::now()));
        }
        watch
    }
}

/// What the 50 ms samples of the metered draw showed against a budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DrawWatch {
    pub budget_w: f64,
    pub samples: u32,
    pub highest_w: f64,
    /// Highest sample minus the budget, W; negative when every sample was below it.
    pub overshoot_w: f64,
    /// Time the samples were over the budget (beyond [`METER_TOLERANCE`]), seconds.
    pub over_s: f64,
    /// Longest unbroken stretch over the budget, seconds.
    pub longest_over_s: f64,
}

impl std::fmt::Display for DrawWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} samples every {} ms: highest {:.0} W against a {:.0} W budget, highest overshoot {:.0} W, {:.2} s over budget (longest {:.2} s)",
            self.samples,
            SAMPLE_INTERVAL.as_millis(),
            self.highest_w,
            self.budget_w,
            self.overshoot_w.max(0.0),
            self.over_s,
            self.longest_over_s
        )
    }
}

impl Stack {
    /// Stops the stack as an admin would: SIGTERM by PID to every agent (each puts the
    /// GPUs of no running job back to their default, fail-static) and to the controller, SIGKILL after 10 s for any
    /// that has not exited, then Slurm.
    pub fn shutdown(&mut self) {
        let children = self.agents.iter_mut().flatten().chain(self.ctld.as_mut());
        for child in children {
            let _ = kill(child.id(), Signal::TERM);
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while std::time::Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        self.agents.clear();
        self.ctld = None;
        self.cluster.stop();
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        for child in self.agents.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(child) = self.ctld.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
