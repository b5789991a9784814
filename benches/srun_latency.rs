//! Launch cost of `power_flex.so`, side by side with an empty C SPANK plugin that this
//! bench builds, and with no plugin at all. Two launches are timed:
//! - **standalone**: `srun -N1 --gres=gpu:1 true` (allocation, step, release);
//! - **step in an allocation**: `srun --jobid=J --overlap true` into a job that holds
//!   the node (what a training script's repeated `srun`s cost).
//!
//! Four one-node local clusters (no plugin; empty plugin; power_flex.so with its agent up;
//! power_flex.so with the agent down) take turns over `--rounds` rounds, each round in a
//! rotated order, so that a noisy machine's drift lands on every configuration alike.
//! Each turn times `--per-turn` launches of each kind after warm-ups. Prints medians,
//! quartiles and the ratios to the empty plugin (the issue's yardstick) and to none.
//! Run: `cargo bench -p powerflex --bench srun_latency [-- --rounds 4 --per-turn 12]`
//! (root; needs slurm-wlm and gcc).

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use powerflex::site_config::SiteBuilder;
use powerflex::slurm::{Cluster, ClusterOptions};
use powerflex::{binary, cargo_build, profile_dir};

/// The smallest plugin Slurm loads: the symbols it requires and nothing else.
const EMPTY_PLUGIN_C: &str = r#"#include <slurm/spank.h>
SPANK_PLUGIN(empty, 1);
int slurm_spank_init(spank_t sp, int ac, char **av) { (void)sp; (void)ac; (void)av; return 0; }
"#;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Setup {
    NoPlugin,
    EmptyPlugin,
    AgentUp,
    AgentDown,
}

impl Setup {
    const ALL: [Setup; 4] = [
        Setup::NoPlugin,
        Setup::EmptyPlugin,
        Setup::AgentUp,
        Setup::AgentDown,
    ];

    fn label(self) -> &'static str {
        match self {
            Setup::NoPlugin => "no plugin",
            Setup::EmptyPlugin => "empty C plugin",
            Setup::AgentUp => "power_flex.so, agent up",
            Setup::AgentDown => "power_flex.so, agent down",
        }
    }

    fn flex_args(self) -> &'static [&'static str] {
        match self {
            Setup::AgentUp | Setup::AgentDown => &["--power-flex=flex2"],
            _ => &[],
        }
    }
}

struct Paths {
    base: PathBuf,
    site: PathBuf,
    power_flex_so: PathBuf,
    empty_so: PathBuf,
    agent_bin: PathBuf,
}

fn quartiles(v: &[f64]) -> (f64, f64, f64) {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (at(0.25), at(0.5), at(0.75))
}

fn timed(cluster: &Cluster, args: &[&str]) -> f64 {
    let t = Instant::now();
    let out = cluster.run("srun", args);
    let ms = t.elapsed().as_secs_f64() * 1e3;
    assert!(
        out.status.success(),
        "srun {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    ms
}

fn build_empty_plugin(base: &Path) -> PathBuf {
    let src = base.join("empty_spank.c");
    let so = base.join("empty_spank.so");
    std::fs::write(&src, EMPTY_PLUGIN_C).expect("write the empty plugin's source");
    let out = Command::new("gcc")
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&so)
        .arg(&src)
        .output()
        .expect("run gcc");
    assert!(
        out.status.success(),
        "gcc could not build the empty plugin: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    so
}

fn plugstack(setup: Setup, paths: &Paths) -> Option<String> {
    match setup {
        Setup::NoPlugin => None,
        Setup::EmptyPlugin => Some(format!("optional {}\n", paths.empty_so.display())),
        Setup::AgentUp | Setup::AgentDown => Some(format!(
            "optional {} site={} socket={}/agent/%n.sock timeout_ms=200\n",
            paths.power_flex_so.display(),
            paths.site.display(),
            paths.base.display()
        )),
    }
}

fn start_agent(paths: &Paths) -> Child {
    let sim = paths.base.join("sim/n1");
    let _ = std::fs::remove_dir_all(&sim);
    powerflex_sim::state::Node::init(&sim, "n1", "H200", 4, true).expect("sim");
    let agent = Command::new(&paths.agent_bin)
        .args([
            "--config",
            paths.site.to_str().expect("utf-8"),
            "--node",
            "n1",
        ])
        .env("POWERFLEX_SIM_DIR", &sim)
        .stderr(std::fs::File::create(paths.base.join("agent.log")).expect("agent log"))
        .spawn()
        .expect("agent");
    let sock = paths.base.join("agent/n1.sock");
    let deadline = Instant::now() + Duration::from_secs(60);
    while UnixStream::connect(&sock).is_err() {
        assert!(Instant::now() < deadline, "agent did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    agent
}

/// One turn of `setup`: a fresh cluster, warm-ups, then `per_turn` launches of each kind.
fn turn(setup: Setup, paths: &Paths, per_turn: usize) -> (Vec<f64>, Vec<f64>) {
    let cluster = Cluster::start(
        "srun-bench",
        ClusterOptions {
            nodes: 1,
            plugstack: plugstack(setup, paths),
            ..ClusterOptions::default()
        },
    );
    let mut agent = (setup == Setup::AgentUp).then(|| start_agent(paths));
    let mut standalone_args = vec!["-N1", "--gres=gpu:1"];
    standalone_args.extend_from_slice(setup.flex_args());
    standalone_args.push("true");
    for _ in 0..3 {
        timed(&cluster, &standalone_args);
    }
    let standalone = (0..per_turn)
        .map(|_| timed(&cluster, &standalone_args))
        .collect();

    let mut hold = vec!["-N1", "--gres=gpu:1"];
    hold.extend_from_slice(setup.flex_args());
    hold.extend_from_slice(&["--wrap", "sleep 600"]);
    let job = cluster.sbatch(&hold, None).expect("sbatch the holding job");
    let deadline = Instant::now() + Duration::from_secs(60);
    while cluster.job_state(job).as_deref() != Some("RUNNING") {
        assert!(Instant::now() < deadline, "the holding job did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    let jobid = format!("--jobid={job}");
    let step_args = [jobid.as_str(), "--overlap", "-N1", "true"];
    for _ in 0..3 {
        timed(&cluster, &step_args);
    }
    let in_allocation = (0..per_turn).map(|_| timed(&cluster, &step_args)).collect();
    cluster.run("scancel", &[&job.to_string()]);
    if let Some(agent) = agent.as_mut() {
        let _ = agent.kill();
        let _ = agent.wait();
    }
    drop(cluster);
    (standalone, in_allocation)
}

fn flag(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name} takes a whole number, got {v:?}"))
        })
        .unwrap_or(default)
}

fn main() {
    let rounds = flag("--rounds", 3);
    let per_turn = flag("--per-turn", 12);
    cargo_build(&["-p", "powerflex-spank", "--lib"]);
    cargo_build(&["-p", "powerflex-sim-nvml", "--lib"]);
    let base = std::env::temp_dir().join(format!("pf-srun-bench-{}", std::process::id()));
    std::fs::create_dir_all(base.join("agent")).expect("dir");
    let paths = Paths {
        site: base.join("powerflex.toml"),
        power_flex_so: profile_dir().join("libpower_flex.so"),
        empty_so: build_empty_plugin(&base),
        agent_bin: binary("powerflexd"),
        base: base.clone(),
    };
    SiteBuilder::new(100000.0)
        .h200(&[700.0, 600.0], 500.0)
        .edit(|raw| raw.controller.lease_ttl_s = Some(3600))
        .key_file(&base.join("no.key"))
        .agent_paths(
            &format!("{}/agent/%n.sock", base.display()),
            &format!("{}/state/%n", base.display()),
            &profile_dir().join("libpowerflex_sim_nvml.so"),
        )
        .write(&paths.site)
        .unwrap_or_else(|e| panic!("{e}"));

    let mut standalone: Vec<Vec<f64>> = vec![Vec::new(); Setup::ALL.len()];
    let mut in_allocation: Vec<Vec<f64>> = vec![Vec::new(); Setup::ALL.len()];
    for round in 0..rounds {
        for k in 0..Setup::ALL.len() {
            let i = (k + round) % Setup::ALL.len();
            let (s, a) = turn(Setup::ALL[i], &paths, per_turn);
            standalone[i].extend(s);
            in_allocation[i].extend(a);
            eprintln!(
                "round {}/{rounds}: {} done",
                round + 1,
                Setup::ALL[i].label()
            );
        }
    }

    let empty = Setup::ALL
        .iter()
        .position(|s| *s == Setup::EmptyPlugin)
        .expect("empty plugin setup");
    let n = rounds * per_turn;
    for (title, samples) in [
        ("standalone `srun -N1 --gres=gpu:1 true`", &standalone),
        (
            "step in an allocation `srun --jobid=J --overlap -N1 true`",
            &in_allocation,
        ),
    ] {
        println!("{title}: {n} launches per configuration, {rounds} rounds, local cluster, SIMULATED GPUs");
        println!(
            "{:<28} {:>9} {:>9} {:>9} {:>10} {:>10}",
            "configuration", "p25 ms", "median", "p75 ms", "÷ empty", "÷ none"
        );
        let medians: Vec<f64> = samples.iter().map(|v| quartiles(v).1).collect();
        for (i, setup) in Setup::ALL.iter().enumerate() {
            let (p25, p50, p75) = quartiles(&samples[i]);
            println!(
                "{:<28} {:>9.1} {:>9.1} {:>9.1} {:>10.3} {:>10.3}",
                setup.label(),
                p25,
                p50,
                p75,
                p50 / medians[empty],
                p50 / medians[0]
            );
        }
        println!();
    }
    if std::env::var_os("POWERFLEX_BENCH_KEEP").is_none() {
        let _ = std::fs::remove_dir_all(&base);
    }
}
