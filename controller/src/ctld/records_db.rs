//! The accounting store in PostgreSQL (`[controller.database]`): every ended job's
//! [`JobEnergyRecord`] as a row of `powerflex_job_energy`, for the site's own queries and
//! reports (as EAR keeps `eacct`'s records in a site database).
//!
//! An I/O edge on a thread of its own, so that a slow or absent database never holds the
//! allocation loop. Delivery is at least once and idempotent:
//! - the JSON-lines log under `state_dir` stays the local journal, written first, before a
//!   record is handed here;
//! - a record is written on its key, the job id and its run (Slurm's start of the run,
//!   or its first reading where the controller reads no Slurm: a requeued job, whose id
//!   Slurm reuses, starts a new run); a later revision of a run's record (a late final
//!   share) replaces the row, an older or equal one changes nothing;
//! - records that could not be written stay queued (at most [`MAX_QUEUED`]) and go when
//!   the database answers again; at start, the records read back from the log that the
//!   database lacks are written, so one written while the controller was down or the
//!   database away arrives once it returns.
//!
//! The schema is created and migrated by the controller ([`MIGRATIONS`], under a
//! transaction-scoped advisory lock, so two controllers starting at once migrate once).
//! A database whose schema is newer than this controller's is not written to.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender, TrySendError};
use tracing::{error, info, warn};

use powerflex_proto::status::AccountingDbView;
use powerflex_proto::usage::JobEnergyRecord;

/// Where the database is and how long to wait for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordsDbOptions {
    /// A PostgreSQL URL without a password.
    pub url: String,
    /// A root-only file whose first line is the password.
    pub password_file: Option<PathBuf>,
    /// Longest wait to connect, and for one statement.
    pub timeout: Duration,
}

impl RecordsDbOptions {
    /// From the validated site config.
    pub fn from_config(db: &powerflex_core::config::DatabaseConfig) -> RecordsDbOptions {
        RecordsDbOptions {
            url: db.url.clone(),
            password_file: db.password_file.clone(),
            timeout: Duration::from_secs(db.timeout_s),
        }
    }
}

/// Records kept in memory while the database is away; older ones are dropped from the
/// queue (they stay in the log and are written at the next start).
pub const MAX_QUEUED: usize = 100_000;
/// Rows per insert transaction.
const BATCH: usize = 256;
/// Job ids per catch-up query at start.
const CATCH_UP_CHUNK: usize = 2_000;
/// Longest pause between two connection attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// The advisory lock key the migrations hold ("pflx" in ASCII).
const MIGRATION_LOCK: i64 = 0x7066_6c78;

/// The schema, one step per version; never edit a released step, add one.
pub const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "job energy records",
        "CREATE TABLE powerflex_job_energy (
        job_id              text NOT NULL,
        run_unix_ms         bigint NOT NULL,
        revision            integer NOT NULL,
        record_version      integer NOT NULL,
        simulated           boolean NOT NULL,
        uid                 bigint NOT NULL,
        account             text,
        tier                text NOT NULL,
        written_at          timestamptz NOT NULL,
        started_at          timestamptz NOT NULL,
        ended_at            timestamptz NOT NULL,
        gpus                integer NOT NULL,
        energy_j            double precision NOT NULL,
        energy_kwh          double precision NOT NULL,
        energy_source       text NOT NULL,
        avg_power_w         double precision NOT NULL,
        peak_power_w        double precision NOT NULL,
        capped_pct          double precision NOT NULL,
        event_s             double precision NOT NULL,
        power_throttled_pct double precision,
        slowdown_pct        double precision,
        bound_pct           double precision,
        bound_held          boolean,
        saved_estimate_j    double precision,
        tokens_per_j        double precision,
        pfi                 double precision,
        incomplete_nodes    text[] NOT NULL,
        record              jsonb NOT NULL,
        PRIMARY KEY (job_id, run_unix_ms)
    );
    CREATE INDEX powerflex_job_energy_ended ON powerflex_job_energy (ended_at);
    CREATE INDEX powerflex_job_energy_uid ON powerflex_job_energy (uid, ended_at);
    CREATE INDEX powerflex_job_energy_account ON powerflex_job_energy (account, ended_at);",
    ),
    (
        2,
        "how long and how deep a job's bound was broken",
        "ALTER TABLE powerflex_job_energy
        ADD COLUMN bound_past_s    double precision,
        ADD COLUMN bound_depth_pct double precision;",
    ),
];

/// The schema version this controller writes.
pub fn schema_version() -> i32 {
    MIGRATIONS.last().map_or(0, |m| m.0)
}

const INSERT: &str = "INSERT INTO powerflex_job_energy (
        job_id, run_unix_ms, record_version, simulated, uid, tier,
        written_at, started_at, ended_at, gpus, energy_j, energy_kwh, energy_source,
        avg_power_w, peak_power_w, capped_pct, event_s, power_throttled_pct,
        slowdown_pct, bound_pct, bound_held, saved_estimate_j, tokens_per_j, pfi,
        incomplete_nodes, record, account, revision, bound_past_s, bound_depth_pct)
    VALUES ($1, $2, $3, $4, $5, $6,
        to_timestamp($7::bigint / 1000.0), to_timestamp($8::bigint / 1000.0),
        to_timestamp($9::bigint / 1000.0), $10, $11, $12, $13, $14, $15, $16, $17, $18,
        $19, $20, $21, $22, $23, $24, $25, $26::text::jsonb, $27, $28, $29, $30)
    ON CONFLICT (job_id, run_unix_ms) DO UPDATE SET
        record_version = EXCLUDED.record_version,
        simulated = EXCLUDED.simulated,
        uid = EXCLUDED.uid,
        tier = EXCLUDED.tier,
        written_at = EXCLUDED.written_at,
        started_at = EXCLUDED.started_at,
        ended_at = EXCLUDED.ended_at,
        gpus = EXCLUDED.gpus,
        energy_j = EXCLUDED.energy_j,
        energy_kwh = EXCLUDED.energy_kwh,
        energy_source = EXCLUDED.energy_source,
        avg_power_w = EXCLUDED.avg_power_w,
        peak_power_w = EXCLUDED.peak_power_w,
        capped_pct = EXCLUDED.capped_pct,
        event_s = EXCLUDED.event_s,
        power_throttled_pct = EXCLUDED.power_throttled_pct,
        slowdown_pct = EXCLUDED.slowdown_pct,
        bound_pct = EXCLUDED.bound_pct,
        bound_held = EXCLUDED.bound_held,
        saved_estimate_j = EXCLUDED.saved_estimate_j,
        tokens_per_j = EXCLUDED.tokens_per_j,
        pfi = EXCLUDED.pfi,
        incomplete_nodes = EXCLUDED.incomplete_nodes,
        record = EXCLUDED.record,
        account = EXCLUDED.account,
        revision = EXCLUDED.revision,
        bound_past_s = EXCLUDED.bound_past_s,
        bound_depth_pct = EXCLUDED.bound_depth_pct
    WHERE powerflex_job_energy.revision < EXCLUDED.revision";

/// A Unix-ms figure as PostgreSQL's bigint (clamped: a record's times come from agents).
fn ms_i64(ms: u64) -> i64 {
    i64::try_from(ms).unwrap_or(i64::MAX)
}

/// A Unix-ms time for `to_timestamp`: held to the year 9999 (shares are refused beyond
/// it; an older log's record must not make a row the database refuses).
fn time_ms_i64(ms: u64) -> i64 {
    ms_i64(ms.min(powerflex_proto::usage::MAX_UNIX_MS))
}

/// A record's key in the table: the job and its run (Slurm's start of the run, else its
/// first reading).
pub fn record_key(r: &JobEnergyRecord) -> (String, i64) {
    (
        r.job_id.clone(),
        ms_i64(r.run_start_unix_ms.unwrap_or(r.from_unix_ms)),
    )
}

/// A record's revision as the table's integer.
fn revision_i32(r: &JobEnergyRecord) -> i32 {
    i32::try_from(r.revision).unwrap_or(i32::MAX)
}

/// The handle the loop holds: hands records to the writer thread, reads its state.
#[derive(Debug)]
pub struct RecordsDb {
    to_writer: Option<Sender<JobEnergyRecord>>,
    view: Arc<Mutex<AccountingDbView>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Longest wait for the writer at stop.
    stop_within: Duration,
}

impl RecordsDb {
    /// Starts the writer. `backlog`: the records read back from the log at start; those
    /// the database lacks are written first.
    pub fn spawn(
        options: RecordsDbOptions,
        backlog: Vec<JobEnergyRecord>,
    ) -> std::io::Result<RecordsDb> {
        let view = Arc::new(Mutex::new(AccountingDbView {
            connected: false,
            schema_version: None,
            pending: backlog.len() as u64,
            written: 0,
            dropped: 0,
            error: None,
            since_unix_ms: powerflex_daemon::clock::unix_ms(),
        }));
        // The loop never waits on the writer: a full channel means the writer is behind,
        // and the record is still in the log (see `send`).
        let (tx, rx) = bounded::<JobEnergyRecord>(4096);
        let shared = view.clone();
        // One connection attempt and one batch's statements, with room to spare.
        let stop_within = options.timeout * 3 + Duration::from_secs(1);
        let thread = std::thread::Builder::new()
            .name("records-db".into())
            .spawn(move || Writer::new(options, shared).run(rx, backlog))?;
        Ok(RecordsDb {
            to_writer: Some(tx),
            view,
            thread: Some(thread),
            stop_within,
        })
    }

    /// Hands a record (already in the log) to the writer, never blocking.
    pub fn send(&self, record: JobEnergyRecord) {
        let Some(tx) = &self.to_writer else { return };
        match tx.try_send(record) {
            Ok(()) => {}
            Err(TrySendError::Full(r)) => {
                warn!(job_id = %r.job_id, "the database writer is behind; the record stays in the log and is written at the next start");
                self.view
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .dropped += 1;
            }
            Err(TrySendError::Disconnected(r)) => {
                warn!(job_id = %r.job_id, "the database writer stopped; the record stays in the log")
            }
        }
    }

    /// The writer's state now.
    pub fn view(&self) -> AccountingDbView {
        self.view
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Stops the writer after one last attempt at what is queued; what is left stays in
    /// the log. Waits at most a few timeouts: a database that stopped answering (the
    /// server's statement timeout cannot fire in a stopped server) never holds the
    /// controller's stop; the writer is then left to the process's exit.
    pub fn stop(mut self) {
        self.to_writer = None;
        let Some(t) = self.thread.take() else { return };
        let deadline = Instant::now() + self.stop_within;
        while !t.is_finished() {
            if Instant::now() >= deadline {
                warn!("the accounting database writer did not stop in time; what it had queued stays in the log");
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = t.join();
    }
}

/// The writer thread's state.
struct Writer {
    options: RecordsDbOptions,
    view: Arc<Mutex<AccountingDbView>>,
    client: Option<postgres::Client>,
    queue: VecDeque<JobEnergyRecord>,
    backoff: Duration,
    next_attempt: Instant,
    /// The backlog from the log is compared with the table once, after the first
    /// connection.
    backlog: Option<Vec<JobEnergyRecord>>,
}

impl Writer {
    fn new(options: RecordsDbOptions, view: Arc<Mutex<AccountingDbView>>) -> Writer {
        Writer {
            options,
            view,
            client: None,
            queue: VecDeque::new(),
            backoff: Duration::from_millis(500),
            next_attempt: Instant::now(),
            backlog: None,
        }
    }

    fn run(mut self, rx: Receiver<JobEnergyRecord>, backlog: Vec<JobEnergyRecord>) {
        self.backlog = Some(backlog);
        let mut open = true;
        while open || !self.queue.is_empty() {
            // Wait for a record, or until the next attempt is due.
            let wait = if self.queue.is_empty() && self.backlog.is_none() {
                Duration::from_secs(3600)
            } else {
                self.next_attempt.saturating_duration_since(Instant::now())
            };
            if open {
                match rx.recv_timeout(wait) {
                    Ok(r) => self.enqueue(r),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => open = false,
                }
                while let Ok(r) = rx.try_recv() {
                    self.enqueue(r);
                }
            }
            if Instant::now() < self.next_attempt && open {
                self.publish();
                continue;
            }
            match self.write_queued() {
                Ok(()) => self.backoff = Duration::from_millis(500),
                Err(e) => {
                    self.client = None;
                    self.next_attempt = Instant::now() + self.backoff;
                    self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
                    self.failed(&e);
                    if !open {
                        // Stopping: what is left stays in the log.
                        break;
                    }
                }
            }
            self.publish();
        }
        self.publish();
    }

    fn enqueue(&mut self, record: JobEnergyRecord) {
        self.queue.push_back(record);
        if self.queue.len() > MAX_QUEUED {
            self.queue.pop_front();
            self.view
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .dropped += 1;
        }
    }

    fn publish(&self) {
        let mut v = self.view.lock().unwrap_or_else(PoisonError::into_inner);
        v.pending = (self.queue.len() + self.backlog.as_ref().map_or(0, Vec::len)) as u64;
    }

    fn failed(&self, error: &str) {
        let mut v = self.view.lock().unwrap_or_else(PoisonError::into_inner);
        if v.connected || v.error.as_deref() != Some(error) {
            warn!(error, pending = self.queue.len(), "the accounting database is unreachable; records stay in the log and are written when it answers");
            v.since_unix_ms = powerflex_daemon::clock::unix_ms();
        }
        v.connected = false;
        v.error = Some(error.to_string());
    }

    fn connect(&mut self) -> Result<(), String> {
        if self.client.is_some() {
            return Ok(());
        }
        let config = client_config(
            "controller.database",
            &self.options.url,
            self.options.password_file.as_deref(),
            self.options.timeout,
            "powerflex-ctld",
        )?;
        let mut client = config
            .connect(postgres::NoTls)
            .map_err(|e| format!("cannot connect to the accounting database: {e}"))?;
        let version = migrate(&mut client)?;
        {
            let mut v = self.view.lock().unwrap_or_else(PoisonError::into_inner);
            v.connected = true;
            v.error = None;
            v.schema_version = Some(version);
            v.since_unix_ms = powerflex_daemon::clock::unix_ms();
        }
        info!(
            schema_version = version,
            "connected to the accounting database"
        );
        self.client = Some(client);
        Ok(())
    }

    /// Writes the backlog's missing records, then the queue, in batches.
    fn write_queued(&mut self) -> Result<(), String> {
        if self.queue.is_empty() && self.backlog.is_none() {
            return Ok(());
        }
        self.connect()?;
        let client = self.client.as_mut().ok_or("no connection")?;
        // A catch-up that fails (a slow database) does not hold the new records: they are
        // written first, and the catch-up is tried again after the back-off.
        let mut catch_up_failed = None;
        if let Some(backlog) = self.backlog.take() {
            match missing_from_table(client, backlog) {
                Ok(missing) => {
                    if !missing.is_empty() {
                        info!(
                            records = missing.len(),
                            "writing the log's records the accounting database lacks"
                        );
                    }
                    // Oldest first, ahead of the records that ended since the start.
                    for r in missing.into_iter().rev() {
                        self.queue.push_front(r);
                    }
                }
                Err((e, backlog)) => {
                    self.backlog = Some(backlog);
                    catch_up_failed = Some(e);
                }
            }
        }
        while !self.queue.is_empty() {
            let n = self.queue.len().min(BATCH);
            let batch: Vec<&JobEnergyRecord> = self.queue.iter().take(n).collect();
            let client = self.client.as_mut().ok_or("no connection")?;
            let inserted = match insert(client, &batch) {
                Ok(inserted) => inserted,
                // A row the database refuses as data (a value out of its range) must not
                // hold every record behind it: the batch goes row by row, and a refused
                // row is dropped here with an error (it stays in the JSON-lines log).
                Err(InsertError::Data(_)) => {
                    let mut inserted = 0;
                    for r in &batch {
                        match insert(client, &[r]) {
                            Ok(n) => inserted += n,
                            Err(InsertError::Data(e)) => {
                                error!(job_id = %r.job_id, error = %e, "the accounting database refuses this record; it stays in the log only")
                            }
                            Err(InsertError::Other(e)) => return Err(e),
                        }
                    }
                    inserted
                }
                Err(InsertError::Other(e)) => return Err(e),
            };
            self.queue.drain(..n);
            let mut v = self.view.lock().unwrap_or_else(PoisonError::into_inner);
            v.written += inserted;
        }
        match catch_up_failed {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// The password file's first line; refused unless only its owner may read it.
/// The client settings for the database a config section names (`section`:
/// `controller.database` or `controller.ha`): its URL as the client library reads it
/// (the config refused a password in it; the library's reading is checked too, and the
/// URL is never repeated), the password from `{section}.password_file`, and every
/// statement and lock wait bounded by `timeout`.
pub(crate) fn client_config(
    section: &str,
    url: &str,
    password_file: Option<&std::path::Path>,
    timeout: Duration,
    application: &str,
) -> Result<postgres::Config, String> {
    let mut config =
        postgres::Config::from_str(url).map_err(|e| format!("{section}.url (not shown): {e}"))?;
    if config.get_password().is_some() {
        return Err(format!(
            "{section}.url carries a password (not shown); accepted: a URL without one, \
             the password in {section}.password_file"
        ));
    }
    if let Some(path) = password_file {
        config.password(read_password(section, path)?);
    }
    let timeout_ms = timeout.as_millis();
    // A client that stops between its statements and its COMMIT (frozen, partitioned)
    // has its transaction ended by the server after the timeout too, so the locks it
    // holds (the leadership row's, above all) free within it.
    let session = format!(
        "-c statement_timeout={timeout_ms} -c lock_timeout={timeout_ms} \
         -c idle_in_transaction_session_timeout={timeout_ms}"
    );
    config
        .connect_timeout(timeout)
        .keepalives(true)
        .application_name(application)
        // No statement, lock wait or open transaction outlasts the timeout.
        .options(&session);
    Ok(config)
}

/// The first line of `{section}.password_file`, refused unless only its owner can read
/// it.
fn read_password(section: &str, path: &std::path::Path) -> Result<String, String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path)
        .map_err(|e| format!("{section}.password_file {}: {e}", path.display()))?;
    if meta.mode() & 0o077 != 0 {
        return Err(format!(
            "{section}.password_file {} is readable by others (mode {:o}); accepted: owner only (chmod 600)",
            path.display(),
            meta.mode() & 0o777
        ));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("{section}.password_file {}: {e}", path.display()))?;
    Ok(text.lines().next().unwrap_or("").to_string())
}

/// Creates or migrates the schema; the version in force.
fn migrate(client: &mut postgres::Client) -> Result<i32, String> {
    let failed = |what: &str| {
        let what = what.to_string();
        move |e: postgres::Error| format!("accounting database migration ({what}): {e}")
    };
    let mut tx = client.transaction().map_err(failed("begin"))?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .map_err(failed("lock"))?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS powerflex_migrations (
            version integer PRIMARY KEY,
            description text NOT NULL,
            applied_at timestamptz NOT NULL DEFAULT now())",
    )
    .map_err(failed("migrations table"))?;
    let current: i32 = tx
        .query_one(
            "SELECT COALESCE(MAX(version), 0) FROM powerflex_migrations",
            &[],
        )
        .map_err(failed("read version"))?
        .get(0);
    let ours = schema_version();
    if current > ours {
        return Err(format!(
            "the accounting database's schema is version {current}, newer than this controller's {ours}: upgrade the controller; nothing is written meanwhile"
        ));
    }
    for (version, description, sql) in MIGRATIONS.iter().filter(|m| m.0 > current) {
        tx.batch_execute(sql).map_err(failed(description))?;
        tx.execute(
            "INSERT INTO powerflex_migrations (version, description) VALUES ($1, $2)",
            &[version, description],
        )
        .map_err(failed(description))?;
        info!(version, description, "accounting database schema migrated");
    }
    tx.commit().map_err(failed("commit"))?;
    Ok(ours)
}

/// The backlog's records the table lacks, or holds at an older revision (oldest first); on failure, the
/// backlog back with the error.
fn missing_from_table(
    client: &mut postgres::Client,
    backlog: Vec<JobEnergyRecord>,
) -> Result<Vec<JobEnergyRecord>, (String, Vec<JobEnergyRecord>)> {
    // Only the backlog's own jobs are looked up (the primary key's index), a chunk at a
    // time: the table may hold years of other records.
    let mut job_ids: Vec<String> = backlog.iter().map(|r| r.job_id.clone()).collect();
    job_ids.sort();
    job_ids.dedup();
    let mut rows = Vec::new();
    for chunk in job_ids.chunks(CATCH_UP_CHUNK) {
        match client.query(
            "SELECT job_id, run_unix_ms, revision FROM powerflex_job_energy
             WHERE job_id = ANY($1)",
            &[&chunk],
        ) {
            Ok(mut found) => rows.append(&mut found),
            Err(e) => {
                return Err((
                    format!("cannot read the accounting database's records: {e}"),
                    backlog,
                ))
            }
        }
    }
    let present: BTreeMap<(String, i64), i32> = rows
        .iter()
        .map(|r| ((r.get(0), r.get(1)), r.get(2)))
        .collect();
    Ok(backlog
        .into_iter()
        .filter(|r| {
            present
                .get(&record_key(r))
                .is_none_or(|stored| *stored < revision_i32(r))
        })
        .collect())
}

/// Inserts a batch in one transaction: the rows that were new.
/// Why a batch was not written.
#[derive(Debug)]
enum InsertError {
    /// The database refused a value (SQLSTATE class 22, data exception): that row will
    /// never be taken, whatever the retries.
    Data(String),
    /// Anything else (connection, timeout): worth a retry.
    Other(String),
}

fn insert(client: &mut postgres::Client, batch: &[&JobEnergyRecord]) -> Result<u64, InsertError> {
    let failed = |e: postgres::Error| {
        let text = format!("cannot write to the accounting database: {e}");
        if e.code().is_some_and(|c| c.code().starts_with("22")) {
            InsertError::Data(text)
        } else {
            InsertError::Other(text)
        }
    };
    let mut tx = client.transaction().map_err(failed)?;
    let statement = tx.prepare(INSERT).map_err(failed)?;
    let mut inserted = 0;
    for r in batch {
        let json = serde_json::to_string(r).map_err(|e| {
            InsertError::Data(format!("cannot encode job {}'s record: {e}", r.job_id))
        })?;
        let (job_id, run) = record_key(r);
        inserted += tx
            .execute(
                &statement,
                &[
                    &job_id,
                    &run,
                    &(r.version as i32),
                    &r.simulated,
                    &i64::from(r.uid),
                    &r.tier,
                    &time_ms_i64(r.written_unix_ms),
                    &time_ms_i64(r.from_unix_ms),
                    &time_ms_i64(r.to_unix_ms),
                    &(i32::try_from(r.gpus).unwrap_or(i32::MAX)),
                    &r.energy_j,
                    &r.energy_kwh,
                    &r.energy_source.name(),
                    &r.avg_power_w,
                    &r.peak_power_w,
                    &r.capped_pct,
                    &r.event_s,
                    &r.power_throttled_pct,
                    &r.slowdown_pct,
                    &r.bound_pct,
                    &r.bound_held,
                    &r.saved_estimate_j,
                    &r.tokens_per_j,
                    &r.pfi,
                    &r.incomplete_nodes,
                    &json,
                    &r.account,
                    &revision_i32(r),
                    &r.bound_judgement.map(|j| j.past_s),
                    &r.bound_judgement.and_then(|j| j.depth_pct),
                ],
            )
            .map_err(failed)?;
    }
    tx.commit().map_err(failed)?;
    Ok(inserted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn migrations_are_numbered_in_order_from_one() {
        for (i, (version, description, sql)) in MIGRATIONS.iter().enumerate() {
            assert_eq!(*version, i as i32 + 1);
            assert!(!description.is_empty() && !sql.trim().is_empty());
        }
        assert_eq!(schema_version(), MIGRATIONS.len() as i32);
    }

    #[test]
    fn agents_times_beyond_bigint_are_clamped_not_wrapped() {
        assert_eq!(ms_i64(u64::MAX), i64::MAX);
        assert_eq!(ms_i64(1_700_000_000_000), 1_700_000_000_000);
    }

    #[test]
    fn a_password_file_others_can_read_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("pf-dbpw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("pw");
        std::fs::write(&file, "s3cret\nignored\n").expect("write");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let e = read_password("controller.database", &file).expect_err("0644 refused");
        assert!(e.contains("chmod 600") && !e.contains("s3cret"), "{e}");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        assert_eq!(
            read_password("controller.database", &file).as_deref(),
            Ok("s3cret")
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
