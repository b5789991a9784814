//! The whole powerflex stack on a local Slurm cluster, for the fault tests: the cluster
//! ([`crate::slurm`]) with the SPANK plugin, one simulated GPU node and one `powerflexd`
//! per Slurm node, and `powerflex-ctld`; plus the checks every fault must pass — the draw
//! within the budget, no GPU capped without a live job on it, no node drained.
//!
//! Every process it starts is stopped by PID when the stack is dropped (the agents and
//! the controller first, then the cluster).

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::Duration;

use powerflex_core::config::RawSiteConfig;
use powerflex_daemon::os::{kill, Signal};
use powerflex_proto::status::{AgentStatus, CtldStatus, NodeStatus};
use powerflex_proto::{ControlOp, ControlReply, ControlRequest};
use powerflex_sim::state::Node;

use crate::site::{edit_site_file, SiteBuilder};
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
}

impl Default for StackOptions {
    fn default() -> Self {
        StackOptions {
            nodes: 2,
            gpus_per_node: 4,
            budget_w: 5600.0,
            lease_ttl_s: 10,
            agent_env: Vec::new(),
        }
    }
}

/// A running stack. Field order is drop order: daemons before the cluster.
#[derive(Debug)]
pub struct Stack {
    ctld: Option<Child>,
    agents: Vec<Option<Child>>,
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
    /// returns once every agent is live at the controller.
    pub fn start(name: &str, options: StackOptions) -> Stack {
        cargo_build(&["-p", "powerflex-spank", "-p", "powerflex-sim-nvml", "--lib"]);
        let (ctl, simjob) = (binary("powerflexctl"), binary("powerflex-simjob"));
        let base = std::env::temp_dir().join(format!("pf-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(base.join("agent")).expect("stack dir");
        let key = base.join("site.key");
        write_site_key(&key, "fault-test site key, loopback only\n");
        let site = base.join("powerflex.toml");
        SiteBuilder::new(options.budget_w)
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
                &profile_dir().join("libpowerflex_sim_nvml.so"),
            )
            .calibration_s(1.0, 1.0, 2.0)
            .write(&site)
            .unwrap_or_else(|e| panic!("{e}"));
        let cluster = Cluster::start(
            name,
            ClusterOptions {
                nodes: options.nodes,
                gpus_per_node: options.gpus_per_node,
                cpus_per_node: 8,
                plugstack: Some(format!(
                    "optional {} site={} socket={}/agent/%n.sock timeout_ms=500\n",
                    profile_dir().join("libpower_flex.so").display(),
                    site.display(),
                    base.display()
                )),
                ..ClusterOptions::default()
            },
        );
        let sims = cluster
            .node_names()
            .iter()
            .map(|node| {
                Node::init(
                    &base.join("sim").join(node),
                    node,
                    "H200",
                    options.gpus_per_node,
                    true,
                )
                .expect("simulated node")
            })
            .collect();
        let mut stack = Stack {
            ctld: None,
            agents: Vec::new(),
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
        stack.start_ctld();
        for i in 0..stack.sims.len() {
            let agent = stack.spawn_agent(i);
            stack.agents.push(Some(agent));
        }
        stack.wait_live(options.nodes as usize);
        stack
    }

    fn log(&mut self, name: &str) -> std::fs::File {
        self.restarts += 1;
        std::fs::File::create(self.base.join(format!("{name}-{}.log", self.restarts)))
            .expect("log file")
    }

    /// Starts the controller (again).
    pub fn start_ctld(&mut self) {
        let log = self.log("ctld");
        let mut command = Command::new(binary("powerflex-ctld"));
        command
            .args(["--config", &self.site.to_string_lossy()])
            .envs(self.cluster.env())
            .stderr(log);
        self.ctld = Some(command.spawn().expect("powerflex-ctld"));
        let socket = self.socket.clone();
        wait_until(
            "the controller's admin socket",
            Duration::from_secs(20),
            || {
                std::os::unix::net::UnixStream::connect(&socket)
                    .ok()
                    .map(|_| ())
            },
        );
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
        use std::io::{BufRead, Write};
        let mut stream = std::os::unix::net::UnixStream::connect(self.agent_socket(i)).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        let request = ControlRequest::new(ControlOp::Status).to_line();
        stream.write_all(request.as_bytes()).ok()?;
        let mut line = String::new();
        std::io::BufReader::new(stream).read_line(&mut line).ok()?;
        ControlReply::from_line(&line).ok()?.status
    }

    /// Rewrites the site config through its types (see [`edit_site_file`]): the edit may
    /// set an out-of-range value, for the daemons to refuse on reload.
    pub fn edit_site(&self, edit: impl FnOnce(&mut RawSiteConfig)) {
        edit_site_file(&self.site, edit).unwrap_or_else(|e| panic!("{e}"));
    }

    fn spawn_agent(&mut self, i: usize) -> Child {
        let node = self.cluster.node_names()[i].clone();
        let log = self.log(&format!("agent-{node}"));
        Command::new(binary("powerflexd"))
            .args(["--config", &self.site.to_string_lossy(), "--node", &node])
            .args(["--sample-interval-ms", "250"])
            .env("POWERFLEX_SIM_DIR", self.sims[i].dir())
            .envs(
                self.agent_env
                    .iter()
                    .filter(|(node, _, _)| *node == i)
                    .map(|(_, k, v)| (k, v)),
            )
            .stderr(log)
            .spawn()
            .expect("powerflexd")
    }

    /// The agent's control socket on node `i`.
    pub fn agent_socket(&self, i: usize) -> PathBuf {
        self.base
            .join("agent")
            .join(format!("{}.sock", self.cluster.node_names()[i]))
    }

    /// kill -9 the agent of node `i`.
    pub fn kill_agent(&mut self, i: usize) {
        if let Some(mut child) = self.agents[i].take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the agent of node `i` (again) and waits for its control socket.
    pub fn start_agent(&mut self, i: usize) {
        let agent = self.spawn_agent(i);
        self.agents[i] = Some(agent);
        let socket = self.agent_socket(i);
        wait_until("the agent's socket", Duration::from_secs(20), || {
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

    fn wait_live(&self, nodes: usize) {
        wait_until(
            "every agent live at the controller",
            Duration::from_secs(30),
            || {
                let listed: Vec<NodeStatus> = self.ctl_json(&["nodes"])?;
                let live = listed.iter().filter(|n| n.live).count();
                (live == nodes).then_some(())
            },
        );
    }

    /// `powerflexctl ARGS --format json --socket …`, parsed as `T` (e.g. `CtldStatus` for
    /// `status`, `Vec<SiteJobStatus>` for `jobs`); `None` if it fails.
    pub fn ctl_json<T: serde::de::DeserializeOwned>(&self, args: &[&str]) -> Option<T> {
        let socket = self.socket.to_string_lossy();
        let mut all = args.to_vec();
        all.extend(["--format", "json", "--socket", &socket]);
        let out = run(&self.ctl, &all);
        (out.code == Some(0))
            .then(|| serde_json::from_str(&out.stdout).ok())
            .flatten()
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
        self.sims
            .iter()
            .flat_map(|n| {
                (0..self.gpus_per_node)
                    .map(move |g| f64::from(n.reading(g).expect("reading").1.power_mw) / 1000.0)
            })
            .sum()
    }

    /// Every simulated GPU's cap, W, node by node.
    pub fn caps_w(&self) -> Vec<f64> {
        self.sims
            .iter()
            .flat_map(|n| {
                (0..self.gpus_per_node)
                    .map(move |g| f64::from(n.gpu(g).expect("gpu").power_limit_mw) / 1000.0)
            })
            .collect()
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
        while next < start + duration {
            let draw = self.draw_w();
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
