//! A real OpenADR 3 VTN on this machine, for the grid tests and the demo: PostgreSQL 16
//! (from the `pgserver` wheel; Debian 12's 15 fails one of the VTN's migrations) run as
//! an unprivileged user on loopback, and LF Energy's `openleadr-vtn` on top, both
//! installed by `scripts/install-deps.sh` into `$POWERFLEX_CACHE` and both stopped by PID
//! when the [`VtnBed`] is dropped (also when a test panics).
//!
//! The VTN is built with external OAuth: it accepts HS256 JWTs signed with the secret
//! the bed gives it, so the bed mints tokens ([`VtnBed::token`]) for the utility (the
//! test) and for the VEN. [`Utility`] is the test playing the utility through the VTN's
//! HTTP API, with the wire types of `openleadr-wire`.
//!
//! The VTN binds 0.0.0.0 (its own choice); everything here talks to 127.0.0.1 only.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use base64::Engine;
use openleadr_wire::event::EventRequest;
use openleadr_wire::program::ProgramRequest;
use openleadr_wire::report::Report;
use openleadr_wire::{Event, Program};
use serde::Serialize;

use crate::free_loopback_port;

/// Version of `openleadr-vtn` the bed runs (scripts/install-deps.sh installs it).
pub const VTN_VERSION: &str = "0.2.8";
pub use crate::pg::{cache_dir, pg_bin_dir, BedError as VtnError, PGSERVER_VERSION, PG_USER};
use crate::pg::{failed, stop, wait_port, PgBed};

/// Scopes a utility's business logic holds at the VTN.
pub const UTILITY_SCOPES: &str = "read_all write_programs write_events write_vens_bl";
/// Scopes a VEN holds at the VTN.
pub const VEN_SCOPES: &str =
    "read_targets read_ven_objects write_reports_ven write_vens_ven write_subscriptions_ven";

/// The installed `openleadr-vtn`.
pub fn vtn_binary() -> PathBuf {
    cache_dir()
        .join(format!("openleadr-vtn-{VTN_VERSION}"))
        .join("bin/openleadr-vtn")
}

/// Whether the bed can start here: both installed, the PostgreSQL user present, root.
pub fn available() -> Result<(), VtnError> {
    for (what, path) in [
        ("openleadr-vtn", vtn_binary()),
        ("PostgreSQL 16 (pgserver)", pg_bin_dir().join("postgres")),
    ] {
        if !path.is_file() {
            return Err(VtnError::Missing {
                what,
                path: path.display().to_string(),
            });
        }
    }
    crate::pg::available()
}

/// PostgreSQL and the VTN, running. Dropping it stops the VTN, then the database.
#[derive(Debug)]
pub struct VtnBed {
    vtn: Option<Child>,
    pg: Option<PgBed>,
    /// Where the database, its socket and the logs live.
    pub dir: PathBuf,
    pub pg_port: u16,
    pub vtn_port: u16,
    secret: Vec<u8>,
}

impl VtnBed {
    /// Starts a fresh database and the VTN in `dir` (created; must be new or empty).
    pub fn start(dir: &Path) -> Result<VtnBed, VtnError> {
        available()?;
        let _ = std::fs::remove_dir_all(dir);
        let pg = PgBed::start(dir, "openadr", "openadr")?;
        let mut bed = VtnBed {
            vtn: None,
            pg_port: pg.port,
            pg: Some(pg),
            dir: dir.to_path_buf(),
            vtn_port: 0,
            secret: Vec::new(),
        };
        bed.secret = random_bytes(32)?;
        bed.vtn_port = free_loopback_port();
        bed.start_vtn()?;
        Ok(bed)
    }

    fn start_vtn(&mut self) -> Result<(), VtnError> {
        let log = self.dir.join("vtn.log");
        let mut vtn = Command::new(vtn_binary())
            .env(
                "DATABASE_URL",
                format!("postgres://openadr@127.0.0.1:{}/openadr", self.pg_port),
            )
            .env("PORT", self.vtn_port.to_string())
            .env("OAUTH_TYPE", "EXTERNAL")
            .env("OAUTH_KEY_TYPE", "HMAC")
            .env(
                "OAUTH_BASE64_SECRET",
                base64::engine::general_purpose::STANDARD.encode(&self.secret),
            )
            .env(
                "OAUTH_TOKEN_URL",
                format!("http://127.0.0.1:{}/auth/token", self.vtn_port),
            )
            .env("RUST_LOG", "info")
            .current_dir(&self.dir)
            .stdout(std::fs::File::create(self.dir.join("vtn.out")).map_err(failed("vtn out"))?)
            .stderr(std::fs::File::create(&log).map_err(failed("vtn log"))?)
            .spawn()
            .map_err(failed("openleadr-vtn"))?;
        let ready = wait_port(
            self.vtn_port,
            &mut vtn,
            "openleadr-vtn",
            &log,
            Duration::from_secs(120),
        );
        self.vtn = Some(vtn);
        ready
    }

    /// Stops the VTN (by PID) and starts it again on the same port and database.
    pub fn restart_vtn(&mut self) -> Result<(), VtnError> {
        self.stop_vtn();
        self.start_vtn()
    }

    /// Stops the VTN (by PID), the database left running: the utility is unreachable
    /// until [`VtnBed::resume_vtn`].
    pub fn stop_vtn(&mut self) {
        if let Some(mut v) = self.vtn.take() {
            stop(&mut v, powerflex_daemon::os::Signal::TERM);
        }
    }

    /// Starts the VTN again after [`VtnBed::stop_vtn`], on the same port and database.
    pub fn resume_vtn(&mut self) -> Result<(), VtnError> {
        self.start_vtn()
    }

    /// The VTN's API base URL (loopback).
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/", self.vtn_port)
    }

    /// An HS256 token for `sub` with `scopes` (space separated), valid for an hour.
    pub fn token(&self, sub: &str, scopes: &str) -> String {
        #[derive(Serialize)]
        struct Claims<'a> {
            sub: &'a str,
            exp: u64,
            scope: &'a str,
        }
        let exp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
            + 3600;
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
            &Claims {
                sub,
                exp,
                scope: scopes,
            },
            &jsonwebtoken::EncodingKey::from_secret(&self.secret),
        )
        .unwrap_or_else(|e| panic!("cannot sign a token: {e}"))
    }

    /// The utility's business logic, with its own token.
    pub fn utility(&self) -> Utility {
        Utility {
            base: self.url(),
            token: self.token("utility", UTILITY_SCOPES),
            agent: ureq::Agent::config_builder()
                .http_status_as_error(false)
                .timeout_global(Some(Duration::from_secs(15)))
                .build()
                .new_agent(),
        }
    }
}

impl Drop for VtnBed {
    fn drop(&mut self) {
        if let Some(mut v) = self.vtn.take() {
            stop(&mut v, powerflex_daemon::os::Signal::TERM);
        }
        // Then the database (its own drop stops it by PID and removes its data).
        drop(self.pg.take());
    }
}

fn random_bytes(n: usize) -> Result<Vec<u8>, VtnError> {
    let mut bytes = vec![0; n];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(failed("/dev/urandom"))?;
    Ok(bytes)
}

/// `powerflex-grid`, the site's VEN, running with the site config `site` (its
/// `[grid.openadr]` names the bed), stderr to `log`. Stopped by PID when dropped: SIGTERM
/// (it leaves its poll loop), SIGKILL after 10 s.
#[derive(Debug)]
pub struct VenProcess {
    child: Option<Child>,
}

impl VenProcess {
    pub fn start(grid: &Path, site: &Path, log: &Path) -> Result<VenProcess, VtnError> {
        let child = Command::new(grid)
            .arg("--config")
            .arg(site)
            .env("POWERFLEX_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).map_err(failed(format!("{}", log.display())))?)
            .spawn()
            .map_err(failed(format!("{}", grid.display())))?;
        Ok(VenProcess { child: Some(child) })
    }

    /// Whether it is still running (it exits 2 on a bad config or credentials).
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Stops it by PID (SIGTERM, then SIGKILL after 10 s).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            stop(&mut c, powerflex_daemon::os::Signal::TERM);
        }
    }
}

impl Drop for VenProcess {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The test playing the utility: programs and events through the VTN's HTTP API.
#[derive(Debug)]
pub struct Utility {
    base: String,
    token: String,
    agent: ureq::Agent,
}

impl Utility {
    fn send<B: Serialize, T: serde::de::DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<&B>,
    ) -> Result<T, String> {
        let url = format!("{}{path}", self.base);
        let auth = format!("Bearer {}", self.token);
        let response = match (method, body) {
            ("GET", _) => self.agent.get(&url).header("Authorization", &auth).call(),
            ("DELETE", _) => self
                .agent
                .delete(&url)
                .header("Authorization", &auth)
                .call(),
            (m, Some(b)) => {
                let text = serde_json::to_string(b).map_err(|e| e.to_string())?;
                let request = if m == "PUT" {
                    self.agent.put(&url)
                } else {
                    self.agent.post(&url)
                };
                request
                    .header("Authorization", &auth)
                    .header("Content-Type", "application/json")
                    .send(text.as_bytes())
            }
            (m, None) => return Err(format!("{m} needs a body")),
        };
        let mut response = response.map_err(|e| format!("{method} {url}: {e}"))?;
        let status = response.status();
        let text = response
            .body_mut()
            .read_to_string()
            .map_err(|e| format!("{method} {url}: {e}"))?;
        if !status.is_success() {
            return Err(format!("{method} {url}: {status}: {text}"));
        }
        serde_json::from_str(&text).map_err(|e| format!("{method} {url}: {e}: {text}"))
    }

    pub fn create_program(&self, name: &str) -> Result<Program, String> {
        self.send(
            "POST",
            "programs",
            Some(&ProgramRequest::new(name.to_string())),
        )
    }

    pub fn create_event(&self, event: &EventRequest) -> Result<Event, String> {
        self.send("POST", "events", Some(event))
    }

    pub fn update_event(&self, id: &str, event: &EventRequest) -> Result<Event, String> {
        self.send("PUT", &format!("events/{id}"), Some(event))
    }

    pub fn delete_event(&self, id: &str) -> Result<Event, String> {
        self.send::<(), _>("DELETE", &format!("events/{id}"), None)
    }

    /// Reports the VENs sent for an event.
    pub fn reports(&self, event_id: &str) -> Result<Vec<Report>, String> {
        self.send::<(), _>("GET", &format!("reports?eventID={event_id}"), None)
    }
}

/// One interval of an event the utility publishes: start (Unix ms), length (s) and one
/// payload.
#[derive(Debug, Clone, Copy)]
pub struct Step {
    pub start_ms: u64,
    pub duration_s: u64,
    pub payload: Payload,
}

/// What an interval asks for.
#[derive(Debug, Clone, Copy)]
pub enum Payload {
    /// A level on the `SIMPLE` scale (integers, 0 = normal).
    Simple(i64),
    /// An import capacity limit, kW.
    ImportCapacityLimitKw(f64),
}

/// An event of `program_id` with one interval per step.
pub fn event_request(program_id: &str, name: &str, steps: &[Step]) -> EventRequest {
    use openleadr_wire::event::{EventInterval, EventType, EventValuesMap};
    use openleadr_wire::interval::IntervalPeriod;
    use openleadr_wire::values_map::Value;
    let program = program_id
        .parse()
        .unwrap_or_else(|e| panic!("program id {program_id}: {e:?}"));
    let intervals = steps
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let start = chrono::DateTime::from_timestamp_millis(s.start_ms as i64)
                .unwrap_or_else(|| panic!("time {} ms", s.start_ms));
            let duration = format!("PT{}S", s.duration_s)
                .parse()
                .unwrap_or_else(|e| panic!("duration {} s: {e:?}", s.duration_s));
            let payload = match s.payload {
                Payload::Simple(level) => EventValuesMap {
                    value_type: EventType::Simple,
                    values: vec![Value::Integer(level)],
                },
                Payload::ImportCapacityLimitKw(kw) => EventValuesMap {
                    value_type: EventType::ImportCapacityLimit,
                    values: vec![Value::Number(kw)],
                },
            };
            EventInterval {
                id: i as i32,
                interval_period: Some(IntervalPeriod {
                    start,
                    duration: Some(duration),
                    randomize_start: None,
                }),
                payloads: vec![payload],
            }
        })
        .collect();
    EventRequest::new(program)
        .with_event_name(name)
        .with_intervals(intervals)
}
