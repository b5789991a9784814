//! The accounting database end to end: a real `powerflex-ctld` with `[controller.database]`
//! on a real PostgreSQL 16, fed jobs' energy shares over the real link by harness agents
//! (the shares are the subject here, not the GPUs: `tests/accounting.rs` checks them
//! against the simulated GPUs' counters on real Slurm).
//!
//! Checked: the controller migrates the schema; each ended job's record is one row equal
//! to the JSON-lines log's record; while the database is away the record waits (in the log,
//! and `status` says so) and arrives when it answers; a record written while the
//! controller ran without its database reaches it at the next start, and nothing is
//! written twice.

use std::process::Command;
use std::time::{Duration, Instant};

use powerflex::link_peer::{h200s, LinkPeer};
use powerflex::needs::{can_run, Need};
use powerflex::pg::PgBed;
use powerflex::site_config::SiteBuilder;
use powerflex::{binary, free_loopback_port, run, wait_until, write_site_key, Children};
use powerflex_core::config::RawDatabase;
use powerflex_proto::link::Body;
use powerflex_proto::report::JobReport;
use powerflex_proto::status::CtldStatus;
use powerflex_proto::usage::{EnergySource, GpuEnergy, JobEnergyRecord, NodeUsage};

const OWNER: u32 = 4242;

fn share(job: &str, node: &str, energy_mj: u64, ended: bool) -> NodeUsage {
    let from = 1_760_000_000_000u64 + job.parse::<u64>().unwrap_or(0) * 1_000;
    NodeUsage {
        job_id: job.into(),
        node: node.into(),
        uid: OWNER,
        tier: "flex2".into(),
        gpus: vec![GpuEnergy {
            uuid: format!("GPU-{node}-0"),
            index: 0,
            from_unix_ms: from,
            to_unix_ms: from + 60_000,
            counter_from_mj: Some(1_000),
            counter_to_mj: Some(1_000 + energy_mj),
            energy_mj,
            source: EnergySource::Counter,
        }],
        energy_mj,
        energy_source: EnergySource::Counter,
        from_unix_ms: from,
        to_unix_ms: from + 60_000,
        peak_power_w: 612.5,
        observed_s: 60.0,
        capped_s: 15.0,
        event_s: 0.0,
        power_throttled_s: 3.0,
        throttle_known_s: 60.0,
        caps: vec![],
        slowdown_pct: Some(4.1),
        bound_pct: Some(25.0),
        bound_held: Some(true),
        bound_judgement: None,
        saved_estimate_j: Some(1_234.5),
        work: Some(6.0e6),
        work_unit: Some(powerflex_proto::usage::ThroughputUnit::Tokens),
        pfi: Some(1.8),
        ended,
        simulated: false,
    }
}

/// One node's report of `job` running (its running share inside).
fn running(peer: &mut LinkPeer, node: &str, job: &str, energy_mj: u64) {
    peer.send(&Body::Report {
        jobs: vec![JobReport {
            job_id: job.into(),
            tier: "flex2".into(),
            gpus: 1,
            owner_uid: Some(OWNER),
            power_w: Some(600.0),
            usage: Some(share(job, node, energy_mj, false)),
            ..JobReport::default()
        }],
        power_w: 600.0,
        failsafe: false,
        cap_mismatches: 0,
        ended: Vec::new(),
        observe_only: false,
    })
    .expect("report");
}

/// The node's report after the job ended there: its final share.
fn ended(peer: &mut LinkPeer, node: &str, job: &str, energy_mj: u64) {
    peer.send(&Body::Report {
        jobs: Vec::new(),
        power_w: 80.0,
        failsafe: false,
        cap_mismatches: 0,
        ended: vec![share(job, node, energy_mj, true)],
        observe_only: false,
    })
    .expect("report");
}

struct Site {
    base: std::path::PathBuf,
    config: std::path::PathBuf,
    port: u16,
    site_key: &'static str,
}

impl Site {
    fn start_ctld(&self) -> Children {
        let mut procs = Children(Vec::new());
        let _ = std::fs::remove_file(self.base.join("ctld.sock"));
        procs.0.push(
            Command::new(binary("powerflex-ctld"))
                .args(["--config", self.config.to_str().expect("utf-8")])
                .stderr(
                    std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(self.base.join("ctld.log"))
                        .expect("log"),
                )
                .spawn()
                .expect("powerflex-ctld"),
        );
        let admin = self.base.join("ctld.sock");
        wait_until("the admin socket", Duration::from_secs(20), || {
            admin.exists().then_some(())
        });
        procs
    }

    fn node(&self, name: &str) -> LinkPeer {
        LinkPeer::connect(
            ([127, 0, 0, 1], self.port).into(),
            self.site_key.trim().as_bytes(),
            name,
            h200s(name, 1),
        )
        .unwrap_or_else(|e| panic!("{name} on the link: {e}"))
    }

    fn status(&self) -> CtldStatus {
        let admin = self.base.join("ctld.sock");
        let out = run(
            &binary("powerflexctl"),
            &[
                "status",
                "--format",
                "json",
                "--socket",
                admin.to_str().expect("utf-8"),
            ],
        );
        serde_json::from_str(&out.stdout)
            .unwrap_or_else(|e| panic!("status json: {e}: {}", out.stdout))
    }

    fn status_text(&self) -> String {
        let admin = self.base.join("ctld.sock");
        run(
            &binary("powerflexctl"),
            &["status", "--socket", admin.to_str().expect("utf-8")],
        )
        .stdout
    }

    fn logged(&self) -> Vec<JobEnergyRecord> {
        std::fs::read_to_string(self.base.join("ctld-state").join("job-energy.jsonl"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("a logged record"))
            .collect()
    }
}

/// The row of `job` as the database holds it: (energy_j, uid, the whole record).
fn row(pg: &PgBed, job: &str) -> Option<(f64, u32, JobEnergyRecord)> {
    let out = pg
        .query(&format!(
            "SELECT energy_j, uid, record::text FROM powerflex_job_energy WHERE job_id = '{job}'"
        ))
        .expect("query");
    let line = out.lines().next()?;
    let mut parts = line.splitn(3, '|');
    let energy: f64 = parts.next()?.parse().ok()?;
    let uid: u32 = parts.next()?.parse().ok()?;
    let record: JobEnergyRecord = serde_json::from_str(parts.next()?).expect("record jsonb");
    Some((energy, uid, record))
}

fn count(pg: &PgBed, sql: &str) -> u64 {
    pg.query(sql)
        .expect("query")
        .trim()
        .parse()
        .expect("a count")
}

#[test]
fn job_records_reach_postgresql_once_through_outages_and_restarts() {
    if !can_run(&[Need::Root, Need::Postgres]) {
        return;
    }
    let began = Instant::now();
    let phase = |what: &str| eprintln!("[{:6.1} s] {what}", began.elapsed().as_secs_f64());
    let base = std::env::temp_dir().join(format!("pf-records-db-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).expect("dir");
    let mut pg = PgBed::start(&base.join("db"), "powerflex", "powerflex")
        .unwrap_or_else(|e| panic!("PostgreSQL: {e}"));
    let key_path = base.join("powerflex.key");
    let site_key = "a site key for the accounting database test\n";
    write_site_key(&key_path, site_key);
    let port = free_loopback_port();
    let config = base.join("powerflex.toml");
    let url = pg.url();
    SiteBuilder::new(100_000.0)
        .placement_from_reports()
        .h200(&[700.0, 600.0, 500.0, 400.0, 300.0], 500.0)
        .controller(([127, 0, 0, 1], port).into(), 30, 1)
        .key_file(&key_path)
        .controller_paths(&base.join("ctld.sock"), &base.join("ctld-state"))
        .edit(|raw| {
            raw.controller.database = Some(RawDatabase {
                url,
                password_file: None,
                timeout_s: Some(2),
            })
        })
        .write(&config)
        .unwrap_or_else(|e| panic!("{e}"));
    let site = Site {
        base: base.clone(),
        config,
        port,
        site_key,
    };

    phase("PostgreSQL up");
    // 1. Connected and migrated; a two-node job's record is one row, equal to the log's.
    let mut ctld = site.start_ctld();
    phase("controller started");
    wait_until("the database connected", Duration::from_secs(30), || {
        site.status().accounting_db.filter(|db| {
            db.connected
                && db.schema_version
                    == Some(powerflex_controller::ctld::records_db::schema_version())
        })
    });
    assert_eq!(
        count(&pg, "SELECT count(*) FROM powerflex_migrations"),
        powerflex_controller::ctld::records_db::MIGRATIONS.len() as u64,
        "every migration applied"
    );
    phase("connected and migrated");
    let (mut n1, mut n2) = (site.node("n1"), site.node("n2"));
    phase("nodes on the link");
    running(&mut n1, "n1", "501", 10_000);
    running(&mut n2, "n2", "501", 20_000);
    std::thread::sleep(Duration::from_millis(1500));
    phase("running shares sent");
    ended(&mut n1, "n1", "501", 3_600_000_123);
    ended(&mut n2, "n2", "501", 1_800_000_001);
    let (energy, uid, stored) =
        wait_until("job 501's row", Duration::from_secs(20), || row(&pg, "501"));
    phase("row 501 read");
    let logged = site.logged();
    assert_eq!(logged.len(), 1, "{logged:?}");
    assert_eq!(stored, logged[0], "the row's record is the log's");
    assert_eq!(
        energy, 5_400_000.124,
        "the sum of both nodes' counters, in J"
    );
    assert_eq!(uid, OWNER);
    assert_eq!(stored.nodes.len(), 2);
    assert!(site
        .status_text()
        .contains("accounting database: connected"));

    phase("phase 1 done");
    // 2. The database away: the record waits in the log and status says so; it arrives
    //    when the database answers again.
    pg.pause();
    running(&mut n1, "n1", "502", 5_000);
    std::thread::sleep(Duration::from_millis(1500));
    ended(&mut n1, "n1", "502", 7_200_000);
    wait_until(
        "the log to hold job 502 while the database is away",
        Duration::from_secs(20),
        || (site.logged().len() == 2).then_some(()),
    );
    let away = wait_until("status to show the outage", Duration::from_secs(20), || {
        site.status()
            .accounting_db
            .filter(|db| !db.connected && db.pending == 1 && db.error.is_some())
    });
    let text = site.status_text();
    assert!(
        text.contains("ACCOUNTING DATABASE UNREACHABLE") && text.contains("1 records pending"),
        "{text}\n{away:?}"
    );
    pg.resume()
        .unwrap_or_else(|e| panic!("PostgreSQL again: {e}"));
    let (energy, _, _) = wait_until(
        "job 502's row once it answers",
        Duration::from_secs(60),
        || row(&pg, "502"),
    );
    assert_eq!(energy, 7_200.0);

    phase("phase 2 done");
    // 3. A record written while the controller could not reach its database, then a
    //    restart: the log's missing record is written, and nothing twice.
    pg.pause();
    running(&mut n2, "n2", "503", 1);
    std::thread::sleep(Duration::from_millis(1500));
    ended(&mut n2, "n2", "503", 360_000);
    wait_until("the log to hold job 503", Duration::from_secs(20), || {
        (site.logged().len() == 3).then_some(())
    });
    drop(n1);
    drop(n2);
    drop(ctld);
    pg.resume()
        .unwrap_or_else(|e| panic!("PostgreSQL again: {e}"));
    ctld = site.start_ctld();
    let (energy, _, _) = wait_until(
        "job 503's row after the restart",
        Duration::from_secs(60),
        || row(&pg, "503"),
    );
    assert_eq!(energy, 360.0);
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        assert_eq!(
            count(&pg, "SELECT count(*) FROM powerflex_job_energy"),
            3,
            "each record once"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(
        count(&pg, "SELECT count(*) FROM powerflex_migrations"),
        powerflex_controller::ctld::records_db::MIGRATIONS.len() as u64,
        "a restart migrates nothing again"
    );
    phase("phase 3 done");
    drop(ctld);
    drop(pg);
    let _ = std::fs::remove_dir_all(&base);
}
