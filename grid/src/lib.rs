//! `powerflex-grid`: the site's OpenADR 3 VEN. It follows the events of the programs
//! named in `[grid.openadr]` on the utility's VTN, turns each into a powerflex grid event
//! at the controller (through its admin socket, the same typed `proto::admin` requests as
//! `powerflexctl event add/cancel`), and reports the metered GPU draw back to the VTN
//! while an event is in force.
//!
//! - [`map`]: pure: VTN event → powerflex event request, reconciliation, report timing.
//! - [`Ven`], with [`Vtn`], [`Ctld`] and the ledger functions: the I/O around it: the
//!   VTN through `openleadr-client` (LF Energy OpenLEADR; the protocol is not written
//!   here), the controller's admin socket, the ledger file that remembers which VTN
//!   event is which powerflex event.
//!
//! The async runtime lives in this crate only (the VTN client is async); the controller
//! stays free of it. Polling is the baseline; the VTN's subscriptions (webhooks, MQTT)
//! are not used yet.

pub mod map;

use powerflex_daemon::clock::unix_ms;
use std::path::{Path, PathBuf};
use std::time::Duration;

use openleadr_client::{
    Client, ClientCredentials, EventClient, Filter, PaginationOptions, ProgramClient,
    VirtualEndNode,
};
use openleadr_wire::interval::IntervalPeriod;
use openleadr_wire::report::{ReportPayloadDescriptor, ReportResource, ReportType, ResourceName};
use openleadr_wire::values_map::{Value, ValueType, ValuesMap};
use openleadr_wire::ven::VenVenRequest;
use openleadr_wire::{Event, Unit};
use powerflex_core::config::OpenAdrConfig;
use powerflex_daemon::fsx::{write_atomic, AtomicWrite};
use powerflex_proto::admin::{AdminAnswer, AdminOp, AdminReply, Refusal};
use powerflex_proto::status::CtldStatus;
use serde::Deserialize;
use tracing::{info, warn};

use crate::map::{Action, Ledger, Mapping, Meaning, VtnView, LEDGER_VERSION};

/// Why the VEN could not start or a step failed.
#[derive(Debug, thiserror::Error)]
pub enum GridError {
    #[error("site config {path}: {message}")]
    Config { path: String, message: String },
    #[error(
        "site config {path} has no [grid.openadr] section; add one (see slurm-conf/powerflex.toml)"
    )]
    NotConfigured { path: String },
    #[error("credentials file {path}: {reason}")]
    Credentials { path: String, reason: String },
    #[error("ledger {path}: {reason}")]
    Ledger { path: String, reason: String },
    #[error("vtn: {0}")]
    Vtn(String),
    #[error("controller: {0}")]
    Ctld(String),
    /// The controller answered and refused; `refusal` says which, when it is one a
    /// client may act on.
    #[error("controller refused: {message}")]
    CtldRefused {
        refusal: Option<Refusal>,
        message: String,
    },
}

/// What the credentials file holds: a bearer token the utility issued, or OAuth 2 client
/// credentials for its token endpoint.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCredentials {
    bearer_token: Option<String>,
    client_id: Option<String>,
    client_secret: Option<String>,
}

/// How the VEN authenticates at the VTN.
pub enum Credentials {
    Bearer(String),
    Client { id: String, secret: String },
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print a secret.
        match self {
            Credentials::Bearer(_) => f.write_str("Credentials::Bearer(..)"),
            Credentials::Client { id, .. } => write!(f, "Credentials::Client {{ id: {id:?}, .. }}"),
        }
    }
}

/// Largest credentials file read, bytes.
const MAX_CREDENTIALS_BYTES: u64 = 65_536;

/// Reads the credentials: a regular file owned by root with no group or other
/// permission bits (0600 or 0400), holding `bearer_token`, or `client_id` and
/// `client_secret`.
pub fn read_credentials(path: &Path) -> Result<Credentials, GridError> {
    use std::os::unix::fs::MetadataExt;
    let shown = path.display().to_string();
    let fail = |reason: String| GridError::Credentials {
        path: shown.clone(),
        reason,
    };
    let meta = std::fs::symlink_metadata(path).map_err(|e| fail(e.to_string()))?;
    if !meta.file_type().is_file() {
        return Err(fail(
            "not a regular file; accepted: a regular file owned by root, mode 0600".into(),
        ));
    }
    if meta.uid() != 0 {
        return Err(fail(format!(
            "owned by uid {}; accepted: owned by root (uid 0), mode 0600",
            meta.uid()
        )));
    }
    let mode = meta.mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(fail(format!(
            "mode {mode:04o} lets others read it; accepted: 0600 or 0400"
        )));
    }
    if meta.len() > MAX_CREDENTIALS_BYTES {
        return Err(fail(format!(
            "{} bytes; accepted: at most {MAX_CREDENTIALS_BYTES}",
            meta.len()
        )));
    }
    let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
    let raw: RawCredentials =
        toml::from_str(&text).map_err(|e| fail(e.to_string().trim_end().to_string()))?;
    match raw {
        RawCredentials {
            bearer_token: Some(token),
            client_id: None,
            client_secret: None,
        } if !token.trim().is_empty() => Ok(Credentials::Bearer(token.trim().to_string())),
        RawCredentials {
            bearer_token: None,
            client_id: Some(id),
            client_secret: Some(secret),
        } if !id.is_empty() && !secret.is_empty() => Ok(Credentials::Client { id, secret }),
        _ => Err(fail(
            "accepted: either bearer_token, or client_id and client_secret (non-empty)".into(),
        )),
    }
}

/// The ledger file under the VEN's state directory.
pub fn ledger_path(config: &OpenAdrConfig) -> PathBuf {
    config.state_dir.join("openadr-ledger.json")
}

/// Reads the ledger; a missing file is an empty ledger (first start).
pub fn load_ledger(path: &Path) -> Result<Ledger, GridError> {
    let fail = |reason: String| GridError::Ledger {
        path: path.display().to_string(),
        reason,
    };
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Ledger::new()),
        Err(e) => return Err(fail(e.to_string())),
    };
    let ledger: Ledger = serde_json::from_str(&text).map_err(|e| fail(e.to_string()))?;
    if ledger.v != LEDGER_VERSION {
        return Err(fail(format!(
            "version {}; this powerflex-grid reads version {LEDGER_VERSION}",
            ledger.v
        )));
    }
    Ok(ledger)
}

/// Writes the ledger atomically, fsynced, mode 0600.
pub fn save_ledger(path: &Path, ledger: &Ledger) -> Result<(), GridError> {
    let fail = |reason: String| GridError::Ledger {
        path: path.display().to_string(),
        reason,
    };
    let text = serde_json::to_vec_pretty(ledger).map_err(|e| fail(e.to_string()))?;
    write_atomic(path, &text, AtomicWrite::durable()).map_err(|e| fail(e.to_string()))
}

/// The controller's admin socket, through the same client `powerflexctl` uses.
#[derive(Debug, Clone)]
pub struct Ctld {
    pub socket: PathBuf,
}

impl Ctld {
    async fn ask(&self, op: AdminOp) -> Result<AdminAnswer, GridError> {
        let socket = self.socket.clone();
        // The admin client is blocking (one line each way, 10 s timeout): keep it off the
        // runtime's worker.
        let reply =
            tokio::task::spawn_blocking(move || powerflex_admin_client::request(&socket, &op))
                .await
                .map_err(|e| GridError::Ctld(e.to_string()))?
                .map_err(|e| GridError::Ctld(e.to_string()))?;
        match reply {
            AdminReply::Done(answer) => Ok(answer),
            AdminReply::Refused { message, refusal } => {
                Err(GridError::CtldRefused { refusal, message })
            }
        }
    }

    pub async fn status(&self) -> Result<CtldStatus, GridError> {
        match self.ask(AdminOp::Status).await? {
            AdminAnswer::Status(status) => Ok(*status),
            _ => Err(GridError::Ctld(
                "the answer to status carries no status".into(),
            )),
        }
    }
}

/// The new event's id in the answer to `event-add`.
fn event_id(answer: AdminAnswer) -> Option<u64> {
    match answer {
        AdminAnswer::EventAdded(id) => Some(id),
        _ => None,
    }
}

/// The VTN, through openleadr-client.
#[derive(Debug, Clone)]
pub struct Vtn {
    client: Client<VirtualEndNode>,
}

impl Vtn {
    pub fn connect(config: &OpenAdrConfig, credentials: Credentials) -> Result<Vtn, GridError> {
        let base: url::Url = config
            .vtn_url
            .parse()
            .map_err(|e| GridError::Vtn(format!("vtn_url {}: {e}", config.vtn_url)))?;
        let mut builder = reqwest::Client::builder()
            .timeout(Duration::from_secs(15))
            .connect_timeout(Duration::from_secs(5));
        let auth = match credentials {
            Credentials::Bearer(token) => {
                let mut headers = reqwest::header::HeaderMap::new();
                let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {token}"))
                    .map_err(|_| {
                        GridError::Vtn("bearer_token holds characters a header cannot carry".into())
                    })?;
                value.set_sensitive(true);
                headers.insert(reqwest::header::AUTHORIZATION, value);
                builder = builder.default_headers(headers);
                None
            }
            Credentials::Client { id, secret } => Some(ClientCredentials::new(id, secret)),
        };
        let http = builder
            .build()
            .map_err(|e| GridError::Vtn(format!("http client: {e}")))?;
        let oauth: url::Url = match &config.oauth_token_url {
            Some(u) => u.parse(),
            None => base.join("auth/token"),
        }
        .map_err(|e| GridError::Vtn(format!("oauth_token_url: {e}")))?;
        Ok(Vtn {
            client: Client::with_details(base, oauth, http, auth),
        })
    }

    /// Registers the VEN under its name; one that is there already is fine.
    pub async fn register(&self, ven_name: &str) -> Result<(), GridError> {
        let request = VenVenRequest {
            ven_name: ven_name.to_string(),
            attributes: None,
        };
        match self.client.create_ven(request).await {
            Ok(_) => {
                info!(ven_name, "registered at the vtn");
                Ok(())
            }
            Err(e) if e.is_conflict() => Ok(()),
            Err(e) => Err(GridError::Vtn(format!("registering {ven_name}: {e}"))),
        }
    }

    /// Every event of each configured program. A program that cannot be read is left
    /// out of `programs_read`, so its events are neither added nor cancelled this round.
    pub async fn read(
        &self,
        config: &OpenAdrConfig,
        mapping: &Mapping,
        now_ms: u64,
    ) -> Result<(VtnView, Vec<EventClient<VirtualEndNode>>), GridError> {
        let programs = self
            .client
            .get_program_list(Filter::none())
            .await
            .map_err(|e| GridError::Vtn(format!("listing programs: {e}")))?;
        let mut view = VtnView::default();
        let mut clients = Vec::new();
        for name in &config.programs {
            let Some(program) = programs.iter().find(|p| &p.content().program_name == name) else {
                warn!(program = %name, "program not found at the vtn");
                continue;
            };
            let (events, whole) = match program.get_event_list(Filter::none()).await {
                Ok(events) => (events, true),
                // One event the wire types cannot read fails the whole list: read it
                // event by event, so the others are still followed.
                Err(openleadr_client::Error::Reqwest(e)) if e.is_decode() => {
                    warn!(program = %name, error = %e, "the program's event list cannot be read whole; reading it event by event");
                    match one_by_one(program, name).await {
                        Some(read) => read,
                        None => continue,
                    }
                }
                Err(e) => {
                    warn!(program = %name, error = %e, "cannot list the program's events");
                    continue;
                }
            };
            for client in events {
                let event = Event {
                    id: client.id().clone(),
                    created_date_time: client.created_date_time(),
                    modification_date_time: client.modification_date_time(),
                    content: client.content().clone(),
                };
                let meaning = mapping.interpret_for(name, &event, now_ms);
                view.events
                    .insert(event.id.to_string(), (name.clone(), meaning));
                clients.push(client);
            }
            // With an event unread, an entry missing from the list may be that event:
            // nothing of this program is cancelled for being absent this round.
            if whole {
                view.programs_read.insert(name.clone());
            }
        }
        map::bound_applied(&mut view, map::MAX_APPLIED_EVENTS);
        Ok((view, clients))
    }
}

/// The most events [`one_by_one`] reads of one program (a program has a handful).
const MAX_EVENTS_ONE_BY_ONE: usize = 1_000;

/// A program's events, one request each (`limit=1`), for a list one of whose events the
/// wire types cannot read: those are logged by position and skipped. Returns the events
/// read and whether every one was; `None` when the VTN stops answering.
async fn one_by_one(
    program: &ProgramClient<VirtualEndNode>,
    name: &str,
) -> Option<(Vec<EventClient<VirtualEndNode>>, bool)> {
    let mut events = Vec::new();
    let mut unread = 0usize;
    for skip in 0..MAX_EVENTS_ONE_BY_ONE {
        let page = program
            .get_events_request(Filter::none(), PaginationOptions { skip, limit: 1 })
            .await;
        match page {
            Ok(page) if page.is_empty() => return Some((events, unread == 0)),
            Ok(page) => events.extend(page),
            Err(openleadr_client::Error::Reqwest(e)) if e.is_decode() => {
                unread += 1;
                warn!(program = %name, position = skip, error = %e, "an event the vtn serves cannot be read, not applied; the program's other events are followed");
            }
            Err(e) => {
                warn!(program = %name, error = %e, "cannot list the program's events");
                return None;
            }
        }
    }
    warn!(program = %name, read = MAX_EVENTS_ONE_BY_ONE, "the program lists more events than are read one by one; the rest are not followed");
    Some((events, false))
}

/// What one round did, for logs and tests.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Round {
    pub actions: usize,
    pub refused: usize,
    pub reports: usize,
}

/// The VEN: config, connections, the ledger.
#[derive(Debug)]
pub struct Ven {
    pub config: OpenAdrConfig,
    pub mapping: Mapping,
    pub vtn: Vtn,
    pub ctld: Ctld,
    pub ledger_path: PathBuf,
    pub ledger: Ledger,
    /// VTN events already logged as refused, with the reason (logged once per change).
    refused: std::collections::BTreeMap<String, String>,
    /// When the VTN last answered a read, Unix ms (the VEN's start until it does: a VEN
    /// that starts with the VTN away waits out each program's `after_s` from there).
    pub last_vtn_answer_ms: u64,
}

impl Ven {
    pub fn new(config: OpenAdrConfig, vtn: Vtn, ctld: Ctld) -> Result<Ven, GridError> {
        std::fs::create_dir_all(&config.state_dir).map_err(|e| GridError::Ledger {
            path: config.state_dir.display().to_string(),
            reason: e.to_string(),
        })?;
        let ledger_path = ledger_path(&config);
        let ledger = load_ledger(&ledger_path)?;
        // The last answer the ledger kept, else the start: a VEN that starts with the VTN
        // away waits out each program's allowance from there. One kept "in the future"
        // (the clock stepped back since) counts as now, or it would delay safe mode by
        // the size of the step.
        let now = unix_ms();
        let last_vtn_answer_ms = ledger.last_vtn_answer_ms.map_or(now, |t| t.min(now));
        Ok(Ven {
            mapping: Mapping::from_config(&config),
            config,
            vtn,
            ctld,
            ledger_path,
            ledger,
            refused: Default::default(),
            last_vtn_answer_ms,
        })
    }

    /// One poll: read the VTN and the controller, reconcile, report. Either side being
    /// unreachable ends the round early with nothing changed.
    pub async fn round(&mut self) -> Result<Round, GridError> {
        let now = unix_ms();
        let (view, clients) = match self.vtn.read(&self.config, &self.mapping, now).await {
            Ok(read) => read,
            Err(e) => {
                // The VTN is away: past a program's allowance its safe mode holds.
                if let Err(safe) = self.keep_safe_modes(now, false).await {
                    warn!(error = %safe, "cannot engage a safe mode");
                }
                return Err(e);
            }
        };
        self.last_vtn_answer_ms = now;
        self.ledger.last_vtn_answer_ms = Some(now);
        save_ledger(&self.ledger_path, &self.ledger)?;
        self.keep_safe_modes(now, true).await?;
        let mut round = Round::default();
        // Remembered only while the VTN serves the event: the map stays as small as the
        // VTN's list, however many events come and go.
        self.refused.retain(|id, _| view.events.contains_key(id));
        for (vtn_id, (program, meaning)) in &view.events {
            if let Meaning::Refused(reason) = meaning {
                round.refused += 1;
                self.refused_once(vtn_id, program, reason);
            }
        }
        let status = self.ctld.status().await?;
        let actions = map::reconcile(now, &view, &self.ledger, &status.events);
        round.actions = actions.len();
        for action in &actions {
            match self.execute(action).await {
                Ok(()) => {}
                // The controller heard the event and refused it: that event is not
                // applied (tried again next round, logged once), the others go on.
                Err(GridError::CtldRefused { message, .. }) => {
                    round.refused += 1;
                    let program = match action {
                        Action::Add { program, .. } => program.as_str(),
                        _ => "",
                    };
                    self.refused_once(
                        action.vtn_id(),
                        program,
                        &format!("the controller refused it: {message}"),
                    );
                }
                // The controller or the ledger is unreachable: stop the round, change
                // nothing more.
                Err(e) => return Err(e),
            }
        }
        round.reports = self.report(&clients, &status, now).await;
        Ok(round)
    }

    /// Engages or lifts the programs' safe modes ([`map::safe_mode_actions`]): each
    /// engagement and lifting is logged, recorded in the ledger, and shown by the
    /// controller as an event of the program's domain (`powerflexctl event list`).
    async fn keep_safe_modes(&mut self, now: u64, vtn_answers: bool) -> Result<(), GridError> {
        if self.config.safe_mode.is_empty() && self.ledger.safe_mode.is_empty() {
            return Ok(());
        }
        let status = self.ctld.status().await?;
        let rules = map::SafeModeRules {
            modes: &self.config.safe_mode,
            mapping: &self.mapping,
            duration_ms: self.mapping.max_event_duration_ms,
        };
        let actions = map::safe_mode_actions(
            &rules,
            now,
            vtn_answers,
            self.last_vtn_answer_ms,
            &self.ledger,
            &status.events,
        );
        for action in actions {
            match action {
                map::SafeAction::Engage { program, request } => {
                    // Recorded first: a crash after the controller hears it finds the
                    // event again by its fields (Adopt or Lift), never adds it twice.
                    self.ledger.safe_mode.insert(
                        program.clone(),
                        map::SafeEntry {
                            request: request.clone(),
                            pf_id: None,
                        },
                    );
                    save_ledger(&self.ledger_path, &self.ledger)?;
                    let reply = self.ctld.ask(request.event_add()).await?;
                    let pf_id = event_id(reply).ok_or_else(|| {
                        GridError::Ctld("the answer to event-add carries no event id".into())
                    })?;
                    warn!(
                        program = %program,
                        event = pf_id,
                        domain = request.domain.as_deref().unwrap_or("(site)"),
                        cut = ?request.cut,
                        silent_s = now.saturating_sub(self.last_vtn_answer_ms) / 1000,
                        "the VTN has not answered past the program's allowance: safe mode engaged"
                    );
                    if let Some(entry) = self.ledger.safe_mode.get_mut(&program) {
                        entry.pf_id = Some(pf_id);
                    }
                }
                map::SafeAction::Adopt { program, pf_id } => {
                    info!(program = %program, event = pf_id, "safe mode's event found at the controller");
                    if let Some(entry) = self.ledger.safe_mode.get_mut(&program) {
                        entry.pf_id = Some(pf_id);
                    }
                }
                map::SafeAction::Lift { program, pf_id } => {
                    if let Some(pf_id) = pf_id {
                        match self.ctld.ask(AdminOp::EventCancel { id: pf_id }).await {
                            Ok(_)
                            | Err(GridError::CtldRefused {
                                refusal: Some(Refusal::NoSuchEvent),
                                ..
                            }) => {}
                            Err(e) => return Err(e),
                        }
                    }
                    info!(program = %program, event = ?pf_id, "the VTN answers again: safe mode lifted");
                    self.ledger.safe_mode.remove(&program);
                }
            }
            save_ledger(&self.ledger_path, &self.ledger)?;
        }
        Ok(())
    }

    /// Logs a refused event once per reason (a refusal is seen every round).
    fn refused_once(&mut self, vtn_id: &str, program: &str, reason: &str) {
        if self.refused.get(vtn_id).map(String::as_str) != Some(reason) {
            warn!(vtn_event = %vtn_id, program = %program, reason = %reason, "grid event refused, not applied");
            self.refused.insert(vtn_id.to_string(), reason.to_string());
        }
    }

    async fn execute(&mut self, action: &Action) -> Result<(), GridError> {
        match action {
            Action::Add {
                vtn_id, request, ..
            } => {
                // Pending first: a crash after the controller hears it is found by its
                // fields on the next start, not added twice.
                let before = self.ledger.events.get(vtn_id).cloned();
                map::record(&mut self.ledger, action, None);
                save_ledger(&self.ledger_path, &self.ledger)?;
                let asked = self.ctld.ask(request.event_add()).await;
                let reply = match asked {
                    Ok(reply) => reply,
                    Err(refused @ GridError::CtldRefused { .. }) => {
                        // Not held by the controller: the entry goes back to what it
                        // was (an earlier version stays in force, not superseded).
                        match before {
                            Some(entry) => self.ledger.events.insert(vtn_id.clone(), entry),
                            None => self.ledger.events.remove(vtn_id),
                        };
                        save_ledger(&self.ledger_path, &self.ledger)?;
                        return Err(refused);
                    }
                    Err(e) => return Err(e),
                };
                let pf_id = event_id(reply).ok_or_else(|| {
                    GridError::Ctld("the answer to event-add carries no event id".into())
                })?;
                if let Some(e) = self.ledger.events.get_mut(vtn_id) {
                    e.pf_id = Some(pf_id);
                }
                info!(vtn_event = %vtn_id, event = pf_id, cut = ?request.cut, start_ms = request.start_ms, duration_ms = request.duration_ms, ramp_ms = request.ramp_ms, "grid event applied");
            }
            Action::Adopt { vtn_id, pf_id } => {
                map::record(&mut self.ledger, action, None);
                info!(vtn_event = %vtn_id, event = pf_id, "grid event found at the controller");
            }
            Action::Cancel { vtn_id, pf_id } => {
                match self.ctld.ask(AdminOp::EventCancel { id: *pf_id }).await {
                    Ok(_) => info!(vtn_event = %vtn_id, event = pf_id, "grid event cancelled"),
                    // Already gone (ended, or cancelled by an admin): the goal is met.
                    Err(GridError::CtldRefused {
                        refusal: Some(Refusal::NoSuchEvent),
                        ..
                    }) => {}
                    Err(e) => return Err(e),
                }
                map::record(&mut self.ledger, action, None);
            }
            Action::Forget { vtn_id } => {
                map::record(&mut self.ledger, action, None);
                info!(vtn_event = %vtn_id, "grid event forgotten");
            }
        }
        save_ledger(&self.ledger_path, &self.ledger)
    }

    /// Sends the reports that are due; returns how many arrived.
    async fn report(
        &mut self,
        clients: &[EventClient<VirtualEndNode>],
        status: &CtldStatus,
        now: u64,
    ) -> usize {
        let interval_ms = self.config.report_interval_s * 1000;
        let mut sent = 0;
        for vtn_id in map::reports_due(&self.ledger, now, interval_ms) {
            let Some(client) = clients.iter().find(|c| c.id().as_str() == vtn_id) else {
                continue;
            };
            // The draw and budget where the event cuts: its program's domain, or the
            // site. A controller that has not heard from every node there (just
            // restarted, a node silent) does not know its draw: nothing is reported
            // rather than a number that is too low; the report goes out once it knows.
            let domain = self
                .ledger
                .events
                .get(&vtn_id)
                .and_then(|e| e.request.domain.clone());
            let Some((draw_w, budget_w)) = map::reported_w(domain.as_deref(), status) else {
                continue;
            };
            let mut report = client.new_report(self.config.ven_name.clone());
            report.report_name = Some("powerflex metered GPU draw".into());
            report.payload_descriptors = Some(vec![
                ReportPayloadDescriptor {
                    units: Some(Unit::KW),
                    ..ReportPayloadDescriptor::new(ReportType::Demand)
                },
                ReportPayloadDescriptor {
                    units: Some(Unit::KW),
                    ..ReportPayloadDescriptor::new(ReportType::Setpoint)
                },
            ]);
            let start = chrono::DateTime::from_timestamp_millis(now as i64).unwrap_or_default();
            report.resources = vec![ReportResource {
                resource_name: ResourceName::AggregatedReport,
                interval_period: Some(IntervalPeriod {
                    start,
                    duration: format!("PT{}S", self.config.report_interval_s).parse().ok(),
                    randomize_start: None,
                }),
                intervals: vec![openleadr_wire::interval::Interval::new(
                    0,
                    vec![
                        ValuesMap {
                            value_type: ValueType("DEMAND".into()),
                            values: vec![Value::Number(draw_w / 1000.0)],
                        },
                        ValuesMap {
                            value_type: ValueType("SETPOINT".into()),
                            values: vec![Value::Number(budget_w / 1000.0)],
                        },
                    ],
                )],
            }];
            match client.create_report(report).await {
                Ok(_) => {
                    sent += 1;
                    if let Some(e) = self.ledger.events.get_mut(&vtn_id) {
                        e.reported_ms = Some(now);
                    }
                    info!(vtn_event = %vtn_id, domain = domain.as_deref().unwrap_or("(site)"), draw_w, budget_w, "report sent");
                }
                Err(e) => warn!(vtn_event = %vtn_id, error = %e, "report not accepted"),
            }
        }
        if sent > 0 {
            if let Err(e) = save_ledger(&self.ledger_path, &self.ledger) {
                warn!(error = %e, "cannot save the ledger after reporting");
            }
        }
        sent
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("powerflex-grid-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn write(path: &Path, text: &str, mode: u32) {
        std::fs::write(path, text).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn credentials_must_be_a_private_regular_file_with_one_kind_of_secret() {
        let dir = scratch("creds");
        let path = dir.join("c.toml");
        write(&path, "bearer_token = \"abc\"\n", 0o600);
        let as_root = powerflex_daemon::os::current_uid() == 0;
        match read_credentials(&path) {
            Ok(Credentials::Bearer(t)) => assert!(as_root && t == "abc"),
            Err(e) => assert!(!as_root && e.to_string().contains("owned by root"), "{e}"),
            Ok(other) => panic!("{other:?}"),
        }
        write(&path, "bearer_token = \"abc\"\n", 0o644);
        let e = read_credentials(&path)
            .expect_err("world-readable")
            .to_string();
        assert!(e.contains("accepted"), "{e}");
        let link = dir.join("link.toml");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        let e = read_credentials(&link).expect_err("symlink").to_string();
        assert!(e.contains("not a regular file"), "{e}");
        if as_root {
            write(&path, "client_id = \"ven\"\nclient_secret = \"s\"\n", 0o600);
            assert!(matches!(
                read_credentials(&path),
                Ok(Credentials::Client { .. })
            ));
            for bad in [
                "bearer_token = \"a\"\nclient_id = \"b\"\nclient_secret = \"c\"\n",
                "client_id = \"b\"\n",
                "bearer_token = \"  \"\n",
                "token = \"a\"\n",
            ] {
                write(&path, bad, 0o600);
                let e = read_credentials(&path).expect_err(bad).to_string();
                assert!(e.contains("c.toml"), "{e}");
            }
            // The secret never shows in debug output.
            write(&path, "bearer_token = \"top-secret\"\n", 0o600);
            let shown = format!("{:?}", read_credentials(&path).unwrap());
            assert!(!shown.contains("top-secret"), "{shown}");
        }
    }

    #[test]
    fn the_ledger_is_saved_atomically_private_and_read_back() {
        let dir = scratch("ledger");
        let path = dir.join("openadr-ledger.json");
        assert_eq!(load_ledger(&path).unwrap(), Ledger::new(), "first start");
        let mut ledger = Ledger::new();
        map::record(
            &mut ledger,
            &Action::Add {
                vtn_id: "e1".into(),
                program: "p".into(),
                request: map::Request {
                    cut: powerflex_proto::event::Cut::Reduce { fraction: 0.3 },
                    start_ms: 1,
                    duration_ms: 10,
                    ramp_ms: 2,
                    domain: None,
                },
            },
            Some(7),
        );
        save_ledger(&path, &ledger).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(load_ledger(&path).unwrap(), ledger);
        std::fs::write(&path, "{\"v\":9,\"events\":{}}").unwrap();
        let e = load_ledger(&path).expect_err("version").to_string();
        assert!(e.contains("version 9") && e.contains("version 1"), "{e}");
        std::fs::write(&path, "not json").unwrap();
        assert!(load_ledger(&path).is_err());
    }
}
