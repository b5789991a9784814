//! The controller on a real Slurm cluster: jobs submitted with --power-flex reach it
//! through the plugin and the agents, it caps them across nodes, and Slurm shows its
//! decision in `scontrol show job` (AdminComment).

use std::process::Command;
use std::time::Duration;

use powerflex::needs::{can_run, Need};
use powerflex::site_config::SiteBuilder;
use powerflex::slurm::{Cluster, ClusterOptions};
use powerflex::{
    binary, cargo_build, free_loopback_port, profile_dir, run, wait_until, write_node_keys,
    write_site_key, Children,
};
use powerflex_proto::status::SiteJobStatus;

#[test]
fn the_controller_caps_slurm_jobs_across_nodes_and_annotates_them() {
    if !can_run(&[Need::Root, Need::Slurm]) {
        return;
    }
    cargo_build(&["-p", "powerflex-spank", "-p", "powerflex-sim-nvml", "--lib"]);
    let (agent, ctld, ctl) = (
        binary("powerflexd"),
        binary("powerflex-ctld"),
        binary("powerflexctl"),
    );
    let base = std::env::temp_dir().join(format!("pf-ctld-slurm-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(base.join("agent")).expect("dir");
    let key = base.join("site.key");
    write_site_key(&key, "controller-on-slurm test site key\n");
    let port = free_loopback_port();
    let site = base.join("powerflex.toml");
    SiteBuilder::new(100000.0)
        .h200(&[700.0, 600.0], 500.0)
        .controller(([127, 0, 0, 1], port).into(), 6, 1)
        .key_file(&key)
        .controller_paths(&base.join("ctld.sock"), &base.join("ctld"))
        .agent_paths(
            &format!("{}/agent/%n.sock", base.display()),
            &format!("{}/state/%n", base.display()),
            &profile_dir().join("libpowerflex_sim_nvml.so"),
        )
        .write(&site)
        .unwrap_or_else(|e| panic!("{e}"));
    let cluster = Cluster::start(
        "ctld-slurm",
        ClusterOptions {
            nodes: 2,
            gpus_per_node: 4,
            plugstack: Some(format!(
                "optional {} site={} socket={}/agent/%n.sock timeout_ms=500\n",
                profile_dir().join("libpower_flex.so").display(),
                site.display(),
                base.display()
            )),
            ..ClusterOptions::default()
        },
    );
    let names: Vec<&str> = cluster.node_names().iter().map(String::as_str).collect();
    write_node_keys(&ctl, &site, &names);
    let mut procs = Children(Vec::new());
    let mut ctld_cmd = Command::new(&ctld);
    ctld_cmd
        .args(["--config", site.to_str().expect("utf-8")])
        .stderr(std::fs::File::create(base.join("ctld.log")).expect("log"));
    for (k, v) in cluster.env() {
        ctld_cmd.env(k, v); // scontrol finds this cluster
    }
    procs.0.push(ctld_cmd.spawn().expect("ctld"));
    let mut sims = Vec::new();
    for node in cluster.node_names().to_vec() {
        let sim =
            powerflex_sim::state::Node::init(&base.join("sim").join(&node), &node, "H200", 4, true)
                .expect("sim");
        procs.0.push(
            Command::new(&agent)
                .args([
                    "--config",
                    site.to_str().expect("utf-8"),
                    "--node",
                    &node,
                    "--sample-interval-ms",
                    "250",
                ])
                .env("POWERFLEX_SIM_DIR", sim.dir())
                .stderr(std::fs::File::create(base.join(format!("agent-{node}.log"))).expect("log"))
                .spawn()
                .expect("agent"),
        );
        let sock = base.join("agent").join(format!("{node}.sock"));
        wait_until("agent socket", Duration::from_secs(20), || {
            std::os::unix::net::UnixStream::connect(&sock)
                .is_ok()
                .then_some(())
        });
        sims.push(sim);
    }
    let admin = base.join("ctld.sock");
    let socket = admin.to_str().expect("utf-8").to_string();
    // A 2-node job, 2 GPUs per node, running simulated training on them.
    let job = cluster
        .sbatch(
            &[
                "-N2",
                "--gres=gpu:2",
                "--power-flex=flex3,calibrate=off",
                "--wrap",
                &format!(
                    "srun env POWERFLEX_SIM_DIR={}/sim/%n bash -c 'POWERFLEX_SIM_DIR=${{POWERFLEX_SIM_DIR/\\%n/$SLURMD_NODENAME}} {} --profile synthetic-memory-bound --duration 600 --time-scale 20 > /dev/null'",
                    base.display(),
                    profile_dir().join("powerflex-simjob").display()
                ),
            ],
            None,
        )
        .expect("sbatch");
    let id = job.to_string();
    wait_until(
        "the job on both nodes at the controller",
        Duration::from_secs(40),
        || {
            let out = run(&ctl, &["jobs", "--format", "json", "--socket", &socket]);
            let jobs: Vec<SiteJobStatus> = serde_json::from_str(&out.stdout).ok()?;
            let j = jobs.into_iter().find(|j| j.job == id)?;
            (j.gpus == 4).then_some(j)
        },
    );
    // Slurm shows the controller's decision.
    let comment = wait_until(
        "AdminComment in scontrol show job",
        Duration::from_secs(30),
        || {
            let info = cluster.job_info(job);
            info.split_whitespace()
                .find(|w| w.starts_with("AdminComment=powerflex;"))
                .map(str::to_string)
        },
    );
    assert!(comment.contains("tier=flex3"), "{comment}");
    // A budget that pays for ~300 W on each of the job's GPUs (idle GPUs draw 75 W each).
    assert_eq!(
        run(&ctl, &["budget", "set", "1.8kW", "--socket", &socket]).code,
        Some(0)
    );
    wait_until(
        "the job's GPUs capped on both nodes",
        Duration::from_secs(20),
        || {
            sims.iter()
                .all(|n| {
                    (0..2).all(|g| {
                        n.gpu(g)
                            // Below the 500 W fail-safe cap a job waits at
                            // until the controller has allocated it.
                            .map(|s| s.power_limit_mw < 500_000)
                            .unwrap_or(false)
                    })
                })
                .then_some(())
        },
    );
    let caps: Vec<u32> = sims
        .iter()
        .flat_map(|n| (0..2).map(move |g| n.gpu(g).expect("gpu").power_limit_mw))
        .collect();
    assert!(
        caps.iter().all(|&c| c == caps[0]),
        "one cap on every GPU of the job: {caps:?}"
    );
    cluster.run("scancel", &[&id]);
    assert!(matches!(
        cluster.wait_job_done(job, Duration::from_secs(60)).as_str(),
        "CANCELLED" | "COMPLETED"
    ));
    cluster.assert_no_node_drained();
}
