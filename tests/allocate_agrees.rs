//! `powerflexctl allocate` on a curves file decides what the running controller decides
//! from the same measurements (`whatif`): one decision path, checked end to end. A real
//! `powerflex-ctld` hears three nodes over the real link (harness agents: the reports are
//! the subject here, not the GPUs), each with one job and its measured curve with
//! per-point uncertainty; the same points and uncertainties go into a curves file.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};

use powerflex::link_peer::{h200s, LinkPeer};
use powerflex::needs::{can_run, Need};
use powerflex::site_config::SiteBuilder;
use powerflex::{binary, free_loopback_port, run, wait_until, write_site_key, Children};
use powerflex_proto::link::Body;
use powerflex_proto::report::JobReport;
use powerflex_proto::status::{CtldStatus, CurvePoint, DecisionView};
use powerflex_proto::usage::ThroughputUnit;

/// One job's measured curve: (per-GPU cap W, job power W, throughput, σ power W, σ
/// throughput), highest cap first, as an agent reports it.
type Curve = Vec<(f64, f64, f64, f64, f64)>;

/// Three jobs of 4 GPUs each, of clearly different elasticity, with uncertainties that
/// differ point by point (the cautious rule weighs them).
fn jobs() -> Vec<(&'static str, &'static str, Curve)> {
    let shape = |t_max: f64, rel: [f64; 5], watts: [f64; 5], sigma_t: [f64; 5]| -> Curve {
        [700.0, 600.0, 500.0, 400.0, 300.0]
            .iter()
            .enumerate()
            .map(|(i, &cap)| {
                let power = 4.0 * watts[i];
                (cap, power, t_max * rel[i], 0.01 * power, sigma_t[i] * t_max)
            })
            .collect()
    };
    vec![
        (
            "101",
            "flex1",
            shape(
                1000.0,
                [1.0, 0.995, 0.98, 0.95, 0.88],
                [650.0, 590.0, 495.0, 398.0, 299.0],
                [0.004, 0.006, 0.005, 0.008, 0.02],
            ),
        ),
        (
            "102",
            "flex2",
            shape(
                2000.0,
                [1.0, 0.95, 0.87, 0.76, 0.62],
                [700.0, 600.0, 500.0, 400.0, 300.0],
                [0.005, 0.004, 0.006, 0.01, 0.015],
            ),
        ),
        (
            "103",
            "flex3",
            shape(
                1500.0,
                [1.0, 0.98, 0.94, 0.87, 0.75],
                [680.0, 598.0, 499.0, 399.0, 300.0],
                [0.003, 0.005, 0.004, 0.007, 0.03],
            ),
        ),
    ]
}

fn report(id: &str, tier: &str, curve: &Curve) -> JobReport {
    let top = curve[0];
    JobReport {
        job_id: id.into(),
        tier: tier.into(),
        gpus: 4,
        cap_w: Some(top.0),
        power_w: Some(top.1),
        throughput: Some(top.2),
        throughput_unit: Some(ThroughputUnit::Tokens),
        points: curve
            .iter()
            .map(|p| powerflex_proto::point::from_array([p.0, p.1, p.2]))
            .collect(),
        power_cap_w: Some(top.0),
        power_cap_steady_s: Some(600.0),
        curve: curve
            .iter()
            .map(|p| CurvePoint {
                cap_w: p.0,
                power_w: p.1,
                throughput: p.2,
                power_sigma_w: p.3,
                throughput_sigma: p.4,
                windows: 4,
            })
            .collect(),
        ..JobReport::default()
    }
}

fn caps(pairs: impl Iterator<Item = (String, f64)>) -> BTreeMap<String, f64> {
    pairs.collect()
}

#[test]
fn allocate_on_a_curves_file_decides_what_the_controller_decides() {
    if !can_run(&[Need::Root]) {
        return;
    }
    let base = std::env::temp_dir().join(format!("pf-agree-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).expect("dir");
    let key_path = base.join("powerflex.key");
    let site_key = "a site key for the agreement test\n";
    write_site_key(&key_path, site_key);
    let port = free_loopback_port();
    let config = base.join("powerflex.toml");
    SiteBuilder::new(100_000.0)
        .placement_from_reports()
        .h200(&[700.0, 600.0, 500.0, 400.0, 300.0], 500.0)
        .controller(([127, 0, 0, 1], port).into(), 30, 1)
        .key_file(&key_path)
        .controller_paths(&base.join("ctld.sock"), &base.join("ctld-state"))
        .write(&config)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut procs = Children(Vec::new());
    procs.0.push(
        Command::new(binary("powerflex-ctld"))
            .args(["--config", config.to_str().expect("utf-8")])
            .stderr(std::fs::File::create(base.join("ctld.log")).expect("log"))
            .spawn()
            .expect("powerflex-ctld"),
    );
    let admin = base.join("ctld.sock");
    wait_until("the admin socket", Duration::from_secs(20), || {
        admin.exists().then_some(())
    });

    let jobs = jobs();
    let mut peers: Vec<(LinkPeer, JobReport)> = jobs
        .iter()
        .enumerate()
        .map(|(i, (id, tier, curve))| {
            let node = format!("n{}", i + 1);
            let peer = LinkPeer::connect(
                ([127, 0, 0, 1], port).into(),
                site_key.trim().as_bytes(),
                &node,
                h200s(&node, 4),
            )
            .unwrap_or_else(|e| panic!("{node} on the link: {e}"));
            (peer, report(id, tier, curve))
        })
        .collect();
    let say = |peers: &mut Vec<(LinkPeer, JobReport)>| {
        for (peer, job) in peers.iter_mut() {
            let power_w = job.power_w.unwrap_or(0.0);
            peer.send(&Body::Report {
                jobs: vec![job.clone()],
                power_w,
                failsafe: false,
                cap_mismatches: 0,
                ended: Vec::new(),
                observe_only: false,
            })
            .expect("report");
        }
    };
    let ctl = |args: &[&str]| {
        let mut all: Vec<&str> = args.to_vec();
        all.extend(["--socket", admin.to_str().expect("utf-8")]);
        run(&binary("powerflexctl"), &all)
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        say(&mut peers);
        let status = ctl(&["status", "--format", "json"]);
        let seen: Option<CtldStatus> = serde_json::from_str(&status.stdout).ok();
        if seen.is_some_and(|s| s.jobs.len() == 3) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the controller never showed the three jobs: {}",
            status.stdout
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // The same measurements as a curves file, uncertainty columns included.
    let mut csv =
        String::from("job,cap_w,power_w,throughput,gpus,tier,power_sigma_w,throughput_sigma\n");
    for (id, tier, curve) in &jobs {
        for p in curve {
            csv.push_str(&format!(
                "{id},{},{},{},4,{tier},{},{}\n",
                p.0, p.1, p.2, p.3, p.4
            ));
        }
    }
    let curves = base.join("curves.csv");
    std::fs::write(&curves, csv).expect("curves file");

    // Budgets from no cut to below every floor, each policy: the two paths agree on
    // every job's cap.
    let mut compared = 0;
    let mut distinct: Vec<BTreeMap<String, f64>> = Vec::new();
    for budget in ["8200", "7000", "6000", "5200", "4000"] {
        for policy in ["optimal", "equal", "pfi-proportional"] {
            say(&mut peers);
            let whatif = ctl(&[
                "whatif",
                "--policy",
                policy,
                "--budget",
                &format!("{budget}W"),
                "--format",
                "json",
            ]);
            assert_eq!(whatif.code, Some(0), "{}", whatif.stderr);
            let decision: DecisionView = serde_json::from_str(&whatif.stdout).expect("json");
            let controller = caps(
                decision
                    .allocation
                    .as_ref()
                    .expect("an allocation")
                    .jobs
                    .iter()
                    .map(|j| (j.id.clone(), j.cap_w.0)),
            );
            let offline = run(
                &binary("powerflexctl"),
                &[
                    "allocate",
                    "--curves",
                    curves.to_str().expect("utf-8"),
                    "--budget-w",
                    budget,
                    "--policy",
                    policy,
                    "--site",
                    config.to_str().expect("utf-8"),
                    "--format",
                    "json",
                ],
            );
            assert_eq!(offline.code, Some(0), "{}", offline.stderr);
            let plan: serde_json::Value = serde_json::from_str(&offline.stdout).expect("json");
            let planned = caps(plan["jobs"].as_array().expect("jobs").iter().map(|j| {
                (
                    j["job"].as_str().expect("job").to_string(),
                    j["cap_w"].as_f64().expect("cap"),
                )
            }));
            assert_eq!(
                planned, controller,
                "{policy} at {budget} W: allocate {planned:?}, the controller {controller:?}"
            );
            if !distinct.contains(&controller) {
                distinct.push(controller);
            }
            compared += 1;
        }
    }
    assert_eq!(compared, 15);
    // The decisions differ with budget and policy: the paths agreed on something.
    assert!(distinct.len() >= 8, "{distinct:?}");
    assert!(
        distinct.iter().any(|c| {
            let mut watts: Vec<u64> = c.values().map(|w| w.to_bits()).collect();
            watts.dedup();
            watts.len() == 3
        }),
        "some decision gives each job its own cap: {distinct:?}"
    );
    drop(procs);
}
