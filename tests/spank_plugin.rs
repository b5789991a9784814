//! The real `power_flex.so` under a real slurmctld and `slurmd -N` nodes, talking to real
//! `powerflexd` agents on simulated GPUs.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use powerflex_testbed::needs::{can_run, Need};
use powerflex_testbed::site::SiteBuilder;
use powerflex_testbed::slurm::{Cluster, ClusterOptions};
use powerflex_testbed::{binary, cargo_build, profile_dir, wait_until};
use serde_json::Value;

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

impl Site {
    fn start(name: &str, with_agents: bool) -> Site {
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
                nodes: 2,
                gpus_per_node: 4,
                plugstack: Some(plugstack),
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

    fn status(&self, node: &str) -> Value {
        let mut s = UnixStream::connect(self.base.join("agent").join(format!("{node}.sock")))
            .expect("agent");
        s.set_read_timeout(Some(Duration::from_secs(3)))
            .expect("timeout");
        s.write_all(b"{\"v\":1,\"op\":\"status\"}\n").expect("send");
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).expect("reply");
        serde_json::from_str::<Value>(&line).expect("json")["status"].clone()
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
            || {
                site.status(node)["jobs"]
                    .as_array()?
                    .iter()
                    .find(|j| j["job"].as_str() == Some(job_id.as_str()))
                    .cloned()
            },
        );
        assert_eq!(j["tier"], "flex2");
        assert_eq!(j["gpus"].as_array().map(Vec::len), Some(2), "{j}");
        assert_eq!(j["uid"], 0);
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
            || {
                let s = site.status(node);
                s["jobs"].as_array()?.is_empty().then_some(())
            },
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
    let bad = c.run("srun", &["-N1", "--power-flex=flex7", "true"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown tier \"flex7\""));
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
