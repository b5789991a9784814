//! What the whole-system tests of a controller pair share: two `powerflex-ctld` with
//! `[controller.ha]` on one PostgreSQL, and harness agents on the real link that follow
//! whichever controller steers, as `powerflexd` does (connect to each address in turn, set
//! a silent one aside, refuse a lease of a lower epoch than one accepted, fall to the
//! fail-safe when the lease runs out).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use powerflex_core::config::{RawHa, RawSiteConfig};
use powerflex_proto::link::Body;
use powerflex_proto::report::JobReport;
use powerflex_proto::status::{CtldStatus, LeadershipRole};

use crate::link_peer::{h200s, LinkPeer};
use crate::site_config::SiteBuilder;
use crate::{binary, run, wait_until, Children, Ran};

/// The uncapped cap of the simulated H200s the harness agents announce, W.
const H200_MAX_W: f64 = 700.0;

/// One controller of the pair: its directory, config and link address.
#[derive(Debug)]
pub struct PairCtld {
    pub name: &'static str,
    pub dir: PathBuf,
    pub config: PathBuf,
    pub addr: SocketAddr,
}

impl PairCtld {
    pub fn socket(&self) -> PathBuf {
        self.dir.join("ctld.sock")
    }

    /// Started, its log appended to `ctld.log` in its directory; returns once its admin
    /// socket is there.
    pub fn start(&self) -> Children {
        self.start_with(|_| {})
    }

    /// [`PairCtld::start`] with `bin` first on its `PATH` (a logging `scontrol`, say).
    pub fn start_with_path_first(&self, bin: &Path) -> Children {
        let path = format!(
            "{}:{}",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        self.start_with(|command| {
            command.env("PATH", path);
        })
    }

    fn start_with(&self, edit: impl FnOnce(&mut Command)) -> Children {
        let _ = std::fs::remove_file(self.socket());
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("ctld.log"))
            .expect("log");
        let mut command = Command::new(binary("powerflex-ctld"));
        command
            .args(["--config", self.config.to_str().expect("utf-8")])
            .env("RUST_LOG", "info")
            .stderr(log);
        edit(&mut command);
        let child = command.spawn().expect("powerflex-ctld");
        let socket = self.socket();
        wait_until("the admin socket", Duration::from_secs(20), || {
            socket.exists().then_some(())
        });
        Children(vec![child])
    }

    /// `powerflexctl ARGS --socket` this controller's admin socket.
    pub fn ctl(&self, args: &[&str]) -> Ran {
        let socket = self.socket();
        let mut all: Vec<&str> = args.to_vec();
        all.extend(["--socket", socket.to_str().expect("utf-8")]);
        run(&binary("powerflexctl"), &all)
    }

    /// Its status, when it answers with one.
    pub fn status(&self) -> Option<CtldStatus> {
        serde_json::from_str(&self.ctl(&["status", "--format", "json"]).stdout).ok()
    }

    pub fn role(&self) -> Option<LeadershipRole> {
        self.status().and_then(|s| s.leadership).map(|l| l.role)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("ctld.log")).unwrap_or_default()
    }
}

/// The site both controllers of a pair run.
#[derive(Debug, Clone, Copy)]
pub struct PairSite {
    pub budget_w: f64,
    pub failsafe_w: f64,
    pub lease_ttl_s: u64,
    pub leader_ttl_s: u64,
}

impl PairSite {
    /// A controller of this site at `own` in `base/name` (the site key at
    /// `base/powerflex.key`), placement from the agents' reports, a hard budget, then
    /// `edit` (its `[controller.ha]`, say).
    pub fn ctld(
        &self,
        base: &Path,
        name: &'static str,
        own: SocketAddr,
        edit: impl FnOnce(&mut RawSiteConfig),
    ) -> PairCtld {
        let dir = base.join(name);
        std::fs::create_dir_all(&dir).expect("dir");
        let config = dir.join("powerflex.toml");
        SiteBuilder::new(self.budget_w)
            .placement_from_reports()
            .h200(&[700.0, 600.0, 500.0, 400.0, 300.0], self.failsafe_w)
            .controller(own, self.lease_ttl_s, 1)
            .key_file(&base.join("powerflex.key"))
            .controller_paths(&dir.join("ctld.sock"), &dir.join("state"))
            .edit(|raw| {
                raw.facility.budget_mode = Some("hard".into());
                edit(raw);
            })
            .write(&config)
            .unwrap_or_else(|e| panic!("{e}"));
        PairCtld {
            name,
            dir,
            config,
            addr: own,
        }
    }

    /// One controller of the pair, the other at `other`, both on the database at `url`.
    pub fn pair_member(
        &self,
        base: &Path,
        name: &'static str,
        own: SocketAddr,
        other: SocketAddr,
        url: &str,
    ) -> PairCtld {
        let url = url.to_string();
        let leader_ttl_s = self.leader_ttl_s;
        self.ctld(base, name, own, |raw| {
            raw.controller.standby_addresses = Some(vec![other.to_string()]);
            raw.controller.ha = Some(RawHa {
                name: name.into(),
                url,
                password_file: None,
                timeout_s: Some(1),
                leader_ttl_s: Some(leader_ttl_s),
            });
        })
    }
}

/// What one harness agent holds, as its agent would.
#[derive(Debug, Clone)]
pub struct Held {
    pub failsafe_w: f64,
    /// The highest epoch a lease was accepted from.
    pub epoch: u64,
    /// The per-GPU cap of the last lease accepted (the GPUs' maximum before any).
    pub cap_w: f64,
    pub lease_until: Option<Instant>,
    /// Every lease accepted that named the job: (when, epoch, the job's cap).
    pub leases: Vec<(Instant, u64, f64)>,
    /// When the first lease of each epoch came.
    pub first_lease: BTreeMap<u64, Instant>,
    /// Leases accepted, counted by epoch.
    pub leases_by_epoch: BTreeMap<u64, u64>,
    /// Leases of a lower epoch than one accepted, refused.
    pub refused: u64,
}

impl Held {
    pub fn new(failsafe_w: f64) -> Held {
        Held {
            failsafe_w,
            epoch: 0,
            cap_w: H200_MAX_W,
            lease_until: None,
            leases: Vec::new(),
            first_lease: BTreeMap::new(),
            leases_by_epoch: BTreeMap::new(),
            refused: 0,
        }
    }

    /// The cap on the node's GPUs now: the lease's while it lasts, then
    /// min(fail-safe, last grant), as the agent's fail-safe rule.
    pub fn cap_in_force(&self, now: Instant) -> f64 {
        match self.lease_until {
            Some(until) if now >= until => self.cap_w.min(self.failsafe_w),
            _ => self.cap_w,
        }
    }
}

/// One harness agent's node: `n{node}` with `gpus` H200s running job `100 + node` of
/// `tier`, measured at `points_w` (per-GPU caps) on a concave curve.
#[derive(Debug, Clone)]
pub struct HarnessNode {
    pub node: usize,
    pub gpus: u32,
    pub tier: &'static str,
    pub points_w: &'static [f64],
    pub site_key: &'static str,
    /// A controller that sent no lease for this long is set aside for as long.
    pub silent_after: Duration,
}

impl HarnessNode {
    fn job(&self) -> String {
        format!("{}", 100 + self.node)
    }

    /// The node's report with its job at `cap_w` a GPU.
    pub fn report(&self, cap_w: f64) -> Body {
        let gpus = f64::from(self.gpus);
        let throughput = |c: f64| 1000.0 * (1.0 - 0.5 * (1.0 - c / H200_MAX_W).powi(2));
        Body::Report {
            jobs: vec![JobReport {
                job_id: self.job(),
                tier: self.tier.into(),
                gpus: self.gpus,
                cap_w: Some(cap_w),
                power_w: Some(cap_w * gpus),
                throughput: Some(throughput(cap_w)),
                throughput_unit: Some(powerflex_proto::usage::ThroughputUnit::Tokens),
                pfi_source: Some(powerflex_proto::status::PfiSource::Measured),
                points: self
                    .points_w
                    .iter()
                    .map(|&c| [c, c * gpus, throughput(c)])
                    .map(powerflex_proto::point::from_array)
                    .collect(),
                power_cap_w: Some(cap_w),
                power_cap_steady_s: Some(10.0),
                ..JobReport::default()
            }],
            power_w: cap_w * gpus,
            failsafe: false,
            cap_mismatches: 0,
            ended: Vec::new(),
            observe_only: false,
        }
    }

    /// The agent's thread: connects to the controllers in turn, follows the one that
    /// leases it, reports every second and confirms each lease at once, until `stop`.
    pub fn follow(
        self,
        controllers: Vec<SocketAddr>,
        held: Arc<Mutex<Held>>,
        stop: Arc<AtomicBool>,
    ) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            let name = format!("n{}", self.node);
            let job = self.job();
            let mut next = 0usize;
            let count = controllers.len();
            // As the agent: an address that did not answer, or went silent, is set aside.
            let mut set_aside: Vec<Option<Instant>> = vec![None; count];
            while !stop.load(Ordering::SeqCst) {
                let open = |aside: &[Option<Instant>], i: usize| {
                    aside[i].is_none_or(|t| Instant::now() >= t)
                };
                let index = (0..count)
                    .map(|k| (next + k) % count)
                    .find(|&i| open(&set_aside, i))
                    .unwrap_or(next % count);
                next = index + 1;
                let Ok(mut peer) = LinkPeer::connect(
                    controllers[index],
                    self.site_key.trim().as_bytes(),
                    &name,
                    h200s(&name, self.gpus as usize),
                ) else {
                    set_aside[index] = Some(Instant::now() + self.silent_after);
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                };
                let cap = || held.lock().expect("held").cap_in_force(Instant::now());
                if peer.send(&self.report(cap())).is_err() {
                    continue;
                }
                let mut next_report = Instant::now() + Duration::from_secs(1);
                let mut last_lease = Instant::now();
                while !stop.load(Ordering::SeqCst) {
                    if last_lease.elapsed() >= self.silent_after {
                        set_aside[index] = Some(Instant::now() + self.silent_after);
                        break;
                    }
                    if Instant::now() >= next_report {
                        next_report = Instant::now() + Duration::from_secs(1);
                        if peer.send(&self.report(cap())).is_err() {
                            break;
                        }
                    }
                    let asked = Instant::now();
                    match peer.recv(Duration::from_millis(200)) {
                        Some(Ok(Body::Lease {
                            caps, ttl_s, epoch, ..
                        })) => {
                            let mut h = held.lock().expect("held");
                            if epoch < h.epoch {
                                h.refused += 1;
                                let accepted_epoch = h.epoch;
                                drop(h);
                                let _ = peer.send(&Body::Fenced {
                                    lease_epoch: epoch,
                                    accepted_epoch,
                                });
                                break;
                            }
                            let now = Instant::now();
                            h.epoch = epoch;
                            if let Some(&c) = caps.get(&job) {
                                h.cap_w = c;
                                h.leases.push((now, epoch, c));
                            }
                            h.lease_until = Some(now + Duration::from_secs_f64(ttl_s));
                            h.first_lease.entry(epoch).or_insert(now);
                            *h.leases_by_epoch.entry(epoch).or_default() += 1;
                            last_lease = now;
                            let c = h.cap_w;
                            drop(h);
                            // Confirmed at once, as the agent does after reading back.
                            if peer.send(&self.report(c)).is_err() {
                                break;
                            }
                        }
                        Some(Ok(Body::Standby { .. })) | Some(Err(_)) => break,
                        Some(Ok(_)) => {}
                        // A closed connection answers at once; a quiet one after the wait.
                        None if asked.elapsed() < Duration::from_millis(100) => break,
                        None => {}
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    }
}
