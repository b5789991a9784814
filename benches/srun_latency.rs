//! `srun` launch latency with power_flex.so loaded, against no plugin: one run, three
//! local clusters (no plugin; plugin with agents up; plugin with agents down), 25 timed
//! `srun -N1 --gres=gpu:1 true` each after 3 warm-ups. Prints medians and ratios.
//! Run: `cargo bench -p powerflex-testbed --bench srun_latency` (root; needs slurm-wlm).

use std::os::unix::net::UnixStream;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use powerflex_testbed::site::SiteBuilder;
use powerflex_testbed::slurm::{Cluster, ClusterOptions};
use powerflex_testbed::{binary, cargo_build, profile_dir};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn time_srun(cluster: &Cluster, extra: &[&str]) -> f64 {
    let mut args = vec!["-N1", "--gres=gpu:1"];
    args.extend_from_slice(extra);
    args.push("true");
    for _ in 0..3 {
        cluster.run("srun", &args);
    }
    median(
        (0..25)
            .map(|_| {
                let t = Instant::now();
                let out = cluster.run("srun", &args);
                assert!(
                    out.status.success(),
                    "{}",
                    String::from_utf8_lossy(&out.stderr)
                );
                t.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    )
}

fn main() {
    cargo_build(&["-p", "powerflex-spank", "--lib"]);
    cargo_build(&["-p", "powerflex-sim-nvml", "--lib"]);
    let agent_bin = binary("powerflexd");
    let so = profile_dir().join("libpower_flex.so");
    let base = std::env::temp_dir().join(format!("pf-srun-bench-{}", std::process::id()));
    std::fs::create_dir_all(base.join("agent")).expect("dir");
    let site = base.join("powerflex.toml");
    SiteBuilder::new(100000.0)
        .h200(&[700.0, 600.0], 500.0)
        .edit(|raw| raw.controller.lease_ttl_s = Some(3600))
        .key_file(&base.join("no.key"))
        .agent_paths(
            &format!("{}/agent/%n.sock", base.display()),
            &format!("{}/state/%n", base.display()),
            &profile_dir().join("libpowerflex_sim_nvml.so"),
        )
        .write(&site)
        .unwrap_or_else(|e| panic!("{e}"));
    let plugstack = format!(
        "optional {} site={} socket={}/agent/%n.sock timeout_ms=200\n",
        so.display(),
        site.display(),
        base.display()
    );

    let bare = {
        let c = Cluster::start(
            "srun-bare",
            ClusterOptions {
                nodes: 1,
                ..ClusterOptions::default()
            },
        );
        time_srun(&c, &[])
    };
    let (up, down) = {
        let c = Cluster::start(
            "srun-plugin",
            ClusterOptions {
                nodes: 1,
                plugstack: Some(plugstack),
                ..ClusterOptions::default()
            },
        );
        let down = time_srun(&c, &["--power-flex=flex2"]);
        let sim = base.join("sim/n1");
        powerflex_sim::state::Node::init(&sim, "n1", "H200", 4, true).expect("sim");
        let mut agent: Child = Command::new(&agent_bin)
            .args(["--config", site.to_str().expect("utf-8"), "--node", "n1"])
            .env("POWERFLEX_SIM_DIR", &sim)
            .stderr(std::fs::File::create(base.join("agent.log")).expect("agent log"))
            .spawn()
            .expect("agent");
        let sock = base.join("agent/n1.sock");
        let deadline = Instant::now() + Duration::from_secs(20);
        while UnixStream::connect(&sock).is_err() {
            assert!(Instant::now() < deadline, "agent did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
        let up = time_srun(&c, &["--power-flex=flex2"]);
        let _ = agent.kill();
        let _ = agent.wait();
        (up, down)
    };
    println!("srun launch latency, median of 25 (`srun -N1 --gres=gpu:1 true`, local cluster, SIMULATED GPUs)");
    println!("{:<28} {:>10} {:>8}", "configuration", "median ms", "ratio");
    println!("{:<28} {:>10.1} {:>8.2}", "no plugin", bare, 1.0);
    println!(
        "{:<28} {:>10.1} {:>8.2}",
        "power_flex.so, agent up",
        up,
        up / bare
    );
    println!(
        "{:<28} {:>10.1} {:>8.2}",
        "power_flex.so, agent down",
        down,
        down / bare
    );
    if std::env::var_os("POWERFLEX_BENCH_KEEP").is_none() {
        let _ = std::fs::remove_dir_all(&base);
    }
}
