//! Leadership and state in PostgreSQL (`[controller.ha]`): the I/O half of
//! [`powerflex_controller_machine::controller::leader`].
//!
//! One thread owns one connection and runs, in order, what the loop hands it: claims
//! (renew or take leadership) and state saves. Each answer goes back to the loop with
//! the time its request was sent, which is what the machine's deadlines count from. A
//! database that does not answer holds this thread, never the loop: the machine steps
//! down on its own clock.
//!
//! **Why a lease row and not an advisory lock.** An advisory lock lives as long as its
//! session: a partitioned active controller whose TCP connection the server has not yet
//! noticed is dead keeps the lock for minutes (keepalives), and one whose connection
//! died keeps steering without knowing it lost the lock until it next asks. A row with an
//! expiry on the database's clock lapses at a time both sides can reason about, so the
//! active controller can step down a margin before a standby may take over, and taking
//! leadership can raise the epoch in the same transaction.
//!
//! The schema (created at the first connection, under a transaction-scoped advisory lock
//! so two controllers starting at once create it once):
//! - `powerflex_leader`: one row, `holder`, `token`, `epoch`, `expires_at`. `token` is
//!   the holding process's instance token, random at its start (added to an older table
//!   by `ALTER TABLE ... ADD COLUMN IF NOT EXISTS`): a live row is renewed or taken again
//!   only by the process whose name and token it holds, so two controllers given the
//!   same `controller.ha.name` do not take it from each other forever (see
//!   [`powerflex_controller_machine::controller::lease_row`]);
//! - `powerflex_ctld_state`: one row, the active controller's `CtldState` as JSON with
//!   the epoch it was written under. A save is fenced: it is written only while the row
//!   of `powerflex_leader` names this controller with that epoch, under a share lock of
//!   that row, so a takeover (which locks it for update) reads either the state before
//!   the save or after it, never a save from a controller that lost leadership.
//!
//! Each save's outcome goes back to the loop (`Inbound::Saved`): a failed one leaves
//! the database's copy stale, and the loop sends the newest state again with each claim
//! until one is written. A committed state is read with a size cap and checked
//! ([`CtldState::from_json`]) before it is steered from; one that fails is refused like
//! one that does not parse, except by the process that holds the row, which steers from
//! the state in its memory (the state it committed, or newer).

use std::path::PathBuf;
use std::time::Duration;

use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender};
use tracing::{error, info, warn};

use powerflex_controller_machine::controller::leader::{Claim, ClaimAnswer, LeaderInput};
use powerflex_controller_machine::controller::lease_row::{self, Me, Row, RowAction};
use powerflex_controller_machine::controller::state::{CtldState, MAX_STATE_BYTES};
use powerflex_controller_machine::error::MachineError;
use powerflex_core::UnixMs;

use super::Inbound;

/// Where the leadership database is, who this controller is, how long leadership lasts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HaOptions {
    /// This controller's name (`controller.ha.name`).
    pub name: String,
    /// A PostgreSQL URL without a password.
    pub url: String,
    /// A root-only file whose first line is the password.
    pub password_file: Option<PathBuf>,
    /// Longest wait to connect, and for one statement.
    pub timeout: Duration,
    /// How long leadership lasts unless renewed.
    pub leader_ttl: Duration,
}

impl HaOptions {
    /// From the validated site config.
    pub fn from_config(ha: &powerflex_core::config::HaConfig) -> HaOptions {
        HaOptions {
            name: ha.name.clone(),
            url: ha.database.url.clone(),
            password_file: ha.database.password_file.clone(),
            timeout: Duration::from_secs(ha.database.timeout_s),
            leader_ttl: ha.leader_ttl(),
        }
    }
}

/// The advisory lock key the schema's creation holds ("pfha" in ASCII).
const SCHEMA_LOCK: i64 = 0x7066_6861;

const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS powerflex_leader (
        id          integer PRIMARY KEY CHECK (id = 1),
        holder      text NOT NULL,
        epoch       bigint NOT NULL,
        expires_at  timestamptz NOT NULL
    );
    CREATE TABLE IF NOT EXISTS powerflex_ctld_state (
        id          integer PRIMARY KEY CHECK (id = 1),
        epoch       bigint NOT NULL,
        holder      text NOT NULL,
        state       jsonb NOT NULL,
        saved_at    timestamptz NOT NULL
    );
    ALTER TABLE powerflex_leader ADD COLUMN IF NOT EXISTS token text NOT NULL DEFAULT '';";

/// What the loop asks of the database thread.
#[derive(Debug)]
enum Request {
    Claim {
        sent: UnixMs,
        claim: Claim,
    },
    Save {
        sent: UnixMs,
        epoch: u64,
        /// The machine's version of this state (`Output::persist_version`).
        version: u64,
        state: Box<CtldState>,
    },
}

/// The database thread's handle.
#[derive(Debug)]
pub struct HaDb {
    tx: Option<Sender<Request>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HaDb {
    /// Starts the thread; its answers go to `to_loop` as [`Inbound::Leader`].
    pub(crate) fn spawn(options: HaOptions, to_loop: Sender<Inbound>) -> std::io::Result<HaDb> {
        let token = instance_token()?;
        let (tx, rx) = unbounded::<Request>();
        let thread = std::thread::Builder::new()
            .name("ha-db".into())
            .spawn(move || Worker::new(options, token, to_loop).run(&rx))?;
        Ok(HaDb {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Runs `claim` (sent at `sent`).
    pub fn claim(&self, sent: UnixMs, claim: Claim) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Request::Claim { sent, claim });
        }
    }

    /// Saves `state`, the machine's `version`, as the committed state of leadership
    /// `epoch` (only the newest of those queued is written; its outcome answers for the
    /// older ones).
    pub fn save(&self, sent: UnixMs, epoch: u64, version: u64, state: &CtldState) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Request::Save {
                sent,
                epoch,
                version,
                state: Box::new(state.clone()),
            });
        }
    }

    /// Stops the thread (waits at most for the statement in progress, bounded by the
    /// timeout; a stopped server cannot answer, so the thread is left behind after that).
    pub fn stop(mut self, within: Duration) {
        self.tx = None;
        if let Some(thread) = self.thread.take() {
            let deadline = std::time::Instant::now() + within;
            while !thread.is_finished() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if thread.is_finished() {
                let _ = thread.join();
            }
        }
    }
}

/// This process's instance token: 16 random bytes from the operating system, in hex.
fn instance_token() -> std::io::Result<String> {
    let nonce = powerflex_proto::link::fresh_nonce()
        .map_err(|e| std::io::Error::other(format!("no instance token: {e}")))?;
    Ok(nonce.iter().take(16).map(|b| format!("{b:02x}")).collect())
}

struct Worker {
    options: HaOptions,
    /// This process's instance token, held in the row beside its name.
    token: String,
    to_loop: Sender<Inbound>,
    client: Option<postgres::Client>,
    /// The last claim found a live row of this name held by another process (logged
    /// once until that changes).
    same_name: bool,
    /// The last save this process tried failed: the database's copy of the state is
    /// behind the one in this process's memory until a save is written.
    copy_behind: bool,
}

impl Worker {
    fn new(options: HaOptions, token: String, to_loop: Sender<Inbound>) -> Worker {
        Worker {
            options,
            token,
            to_loop,
            client: None,
            same_name: false,
            copy_behind: false,
        }
    }

    fn run(mut self, rx: &Receiver<Request>) {
        loop {
            let first = match rx.recv_timeout(Duration::from_millis(500)) {
                Ok(r) => r,
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return,
            };
            // Whatever queued behind a slow statement: the claims first (a renewal must
            // not wait behind saves), then only the newest save.
            let mut claims = Vec::new();
            let mut save = None;
            for request in std::iter::once(first).chain(rx.try_iter()) {
                match request {
                    Request::Claim { sent, claim } => claims.push((sent, claim)),
                    Request::Save {
                        sent,
                        epoch,
                        version,
                        state,
                    } => save = Some((sent, epoch, version, state)),
                }
            }
            for (sent, claim) in claims {
                let memory_newer = self.copy_behind;
                let answer = self
                    .with_client(|c, me, ttl| {
                        // The committed state's events are in wall time: checked against
                        // the wall clock, never against `sent` (the leader's monotonic
                        // stamp, which a wall-clock step leaves behind or ahead).
                        claim_in(
                            c,
                            me,
                            ttl,
                            claim,
                            memory_newer,
                            UnixMs(crate::ctld::unix_ms()),
                        )
                    })
                    .and_then(|a| a);
                self.log_same_name(&answer);
                self.answer(sent, answer);
            }
            if let Some((sent, epoch, version, state)) = save {
                let outcome = self
                    .with_client(|c, me, _| save_in(c, me, epoch, &state))
                    .and_then(|o| o);
                match outcome {
                    Ok(Saved::Written) => {
                        self.copy_behind = false;
                        self.saved(epoch, version, Ok(()));
                    }
                    // Queued under an earlier leadership of this same process: stale.
                    Ok(Saved::Stale) => {}
                    // The fence refused the save: leadership moved on. The machine
                    // hears who holds it as it would from a claim.
                    Ok(Saved::Held(held)) => self.answer(sent, Ok(held)),
                    Err(e) => {
                        self.copy_behind = true;
                        self.saved(epoch, version, Err(e));
                    }
                }
            }
        }
    }

    fn saved(&self, epoch: u64, version: u64, outcome: Result<(), String>) {
        let _ = self.to_loop.send(Inbound::Saved {
            epoch,
            version,
            outcome,
        });
    }

    /// A live row of this name held by another process: said as an error once, until
    /// a claim finds otherwise.
    fn log_same_name(&mut self, answer: &Result<ClaimAnswer, String>) {
        let same = matches!(answer, Ok(ClaimAnswer::HeldBy { holder, .. }) if *holder == lease_row::same_name_message(&self.options.name));
        if same && !self.same_name {
            error!(
                name = %self.options.name,
                "{}",
                lease_row::same_name_message(&self.options.name)
            );
        }
        self.same_name = same;
    }

    fn answer(&self, sent: UnixMs, answer: Result<ClaimAnswer, String>) {
        let _ = self.to_loop.send(Inbound::Leader(LeaderInput::Answer {
            sent,
            answer: answer.map_err(MachineError::Database),
        }));
    }

    /// Runs `f` on the connection (made first when there is none); a failure drops the
    /// connection, so the next request connects afresh.
    fn with_client<T>(
        &mut self,
        f: impl FnOnce(&mut postgres::Client, Me<'_>, Duration) -> Result<T, postgres::Error>,
    ) -> Result<T, String> {
        if self.client.is_none() {
            self.client = Some(self.connect()?);
        }
        let client = self.client.as_mut().ok_or("no connection")?;
        let me = Me {
            name: &self.options.name,
            token: &self.token,
        };
        match f(client, me, self.options.leader_ttl) {
            Ok(t) => Ok(t),
            Err(e) => {
                self.client = None;
                Err(format!("leadership database: {}", describe(&e)))
            }
        }
    }

    fn connect(&self) -> Result<postgres::Client, String> {
        let mut config = super::records_db::client_config(
            "controller.ha",
            &self.options.url,
            self.options.password_file.as_deref(),
            self.options.timeout,
            "powerflex-ctld-ha",
        )?;
        // A partition (no reset) must fail a claim within the timeout rather than
        // after TCP's retransmissions (many minutes), or this controller could not
        // compete again until then: data unacknowledged that long, or a peer silent to
        // three keepalives, ends the connection. (A server that is alive but stuck is
        // not bounded here; the machine's deadline bounds what that costs.)
        config
            .tcp_user_timeout(self.options.timeout)
            .keepalives_idle(self.options.timeout)
            .keepalives_interval(Duration::from_secs(1))
            .keepalives_retries(3);
        let mut client = config
            .connect(postgres::NoTls)
            .map_err(|e| format!("cannot connect to the leadership database: {e}"))?;
        let mut tx = client
            .transaction()
            .map_err(|e| format!("leadership database: {e}"))?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&SCHEMA_LOCK])
            .and_then(|_| tx.batch_execute(SCHEMA))
            .and_then(|()| tx.commit())
            .map_err(|e| format!("cannot create the leadership tables: {e}"))?;
        info!(name = %self.options.name, "connected to the leadership database");
        Ok(client)
    }
}

/// A database error with the server's own words where it sent some (`postgres` shows
/// only `db error` for those): what an admin refused for it reads.
fn describe(e: &postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!(
            "{e}: {} {}: {}",
            db.severity(),
            db.code().code(),
            db.message()
        ),
        None => e.to_string(),
    }
}

/// One claim, in one transaction on the database's clock (see the module docs). `Ok(Err)`:
/// the row refuses every claim (its epoch is out of range), with the recovery.
/// `memory_newer`: this process's last save failed, so when it takes back its own row
/// (after stepping down while the database was away) the state in its memory, not the
/// database's older copy, is what it steers from.
fn claim_in(
    client: &mut postgres::Client,
    me: Me<'_>,
    ttl: Duration,
    claim: Claim,
    memory_newer: bool,
    wall_now: UnixMs,
) -> Result<Result<ClaimAnswer, String>, postgres::Error> {
    let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
    let mut tx = client.transaction()?;
    // The row exists from the first claim on, lapsed, held by nobody.
    tx.execute(
        "INSERT INTO powerflex_leader (id, holder, epoch, expires_at)
         VALUES (1, '', 0, to_timestamp(0)) ON CONFLICT (id) DO NOTHING",
        &[],
    )?;
    let found = tx.query_one(
        "SELECT holder, token, epoch, expires_at > now() AS live,
                GREATEST(0, (EXTRACT(EPOCH FROM (expires_at - now())) * 1000))::bigint
                    AS expires_in_ms
         FROM powerflex_leader WHERE id = 1 FOR UPDATE",
        &[],
    )?;
    let row = Row {
        holder: found.try_get("holder")?,
        token: found.try_get("token")?,
        epoch: found.try_get("epoch")?,
        live: found.try_get("live")?,
    };
    let expires_in_ms: i64 = found
        .try_get::<_, Option<i64>>("expires_in_ms")?
        .unwrap_or(0);
    let expires_in_ms = u64::try_from(expires_in_ms).unwrap_or(0);
    let answer = match lease_row::decide(&row, me, claim) {
        RowAction::Refuse(why) => {
            tx.rollback()?;
            return Ok(Err(why));
        }
        RowAction::Renew { epoch } => {
            tx.execute(
                "UPDATE powerflex_leader
                 SET expires_at = now() + make_interval(secs => $1::bigint::float8 / 1000.0)
                 WHERE id = 1",
                &[&ttl_ms],
            )?;
            ClaimAnswer::Renewed { epoch }
        }
        RowAction::Take { new_epoch, own } => {
            // Lapsed, or this process's own (one that stepped down): take it with a new
            // epoch, and the state the last holder committed.
            // `decide` takes only epochs the column holds; never saturated.
            let Ok(new_epoch_i) = i64::try_from(new_epoch) else {
                tx.rollback()?;
                return Ok(Err(format!(
                    "epoch {new_epoch} is beyond what the database holds"
                )));
            };
            tx.execute(
                "UPDATE powerflex_leader
                 SET holder = $1, token = $2, epoch = $3,
                     expires_at = now() + make_interval(secs => $4::bigint::float8 / 1000.0)
                 WHERE id = 1",
                &[&me.name, &me.token, &new_epoch_i, &ttl_ms],
            )?;
            if own && memory_newer {
                // Events or budgets acknowledged while the database was away are only in
                // this process's memory: the database's copy would undo them (and reuse
                // their event ids). The take-over commits the memory's state at once.
                info!(
                    epoch = new_epoch,
                    "taking back this controller's own leadership: its last save failed, so it steers from the state in its memory"
                );
                tx.commit()?;
                return Ok(Ok(ClaimAnswer::TookOver {
                    epoch: new_epoch,
                    state: None,
                    previous_holder: (!row.holder.is_empty()).then_some(row.holder),
                }));
            }
            // Not read whole when it is over the cap.
            let cap = i32::try_from(MAX_STATE_BYTES).unwrap_or(i32::MAX);
            let committed = match tx.query_opt(
                "SELECT octet_length(state::text),
                        CASE WHEN octet_length(state::text) <= $1 THEN state::text END
                 FROM powerflex_ctld_state WHERE id = 1",
                &[&cap],
            )? {
                None => None,
                Some(r) => Some((r.try_get::<_, i32>(0)?, r.try_get::<_, Option<String>>(1)?)),
            };
            let read = match committed {
                None => Ok(None),
                Some((_, Some(text))) => CtldState::from_json(text.as_bytes(), wall_now)
                    .map(Some)
                    .map_err(|e| e.to_string()),
                Some((bytes, None)) => Err(format!(
                    "the state is {bytes} bytes; accepted: at most {MAX_STATE_BYTES}"
                )),
            };
            let state = match read {
                Ok(state) => state.map(Box::new),
                Err(e) if own => {
                    // This process committed that row's state (or a newer one it could
                    // not save): its memory holds what the row should.
                    warn!(error = %e, "the committed state is unreadable; this controller held leadership last and steers from the state in its memory, which it commits again");
                    None
                }
                Err(e) => {
                    // Taking over with no state would drop the events in force: refuse
                    // leadership rather than steer blind (nothing is committed).
                    tx.rollback()?;
                    return Ok(Ok(ClaimAnswer::HeldBy {
                        holder: format!(
                            "nobody (the committed state is unreadable: {e}; see docs/admins.md, \"Recovering the leadership database\")"
                        ),
                        epoch: u64::try_from(row.epoch).unwrap_or(0),
                        expires_in_ms: 0,
                    }));
                }
            };
            ClaimAnswer::TookOver {
                epoch: new_epoch,
                state,
                previous_holder: (!row.holder.is_empty()).then_some(row.holder),
            }
        }
        RowAction::SameName { epoch } => ClaimAnswer::HeldBy {
            holder: lease_row::same_name_message(me.name),
            epoch,
            expires_in_ms,
        },
        RowAction::Held { holder, epoch } => ClaimAnswer::HeldBy {
            holder,
            epoch,
            expires_in_ms,
        },
    };
    tx.commit()?;
    Ok(Ok(answer))
}

/// What a fenced save did.
enum Saved {
    Written,
    /// Queued under an earlier leadership of this same process: not written, and not a
    /// sign that another controller steers.
    Stale,
    /// Leadership is another's (nothing written).
    Held(ClaimAnswer),
}

/// A fenced save: written only while the row names this process (name and token) with
/// `epoch`. `Ok(Err)`: the state cannot be written (why).
fn save_in(
    client: &mut postgres::Client,
    me: Me<'_>,
    epoch: u64,
    state: &CtldState,
) -> Result<Result<Saved, String>, postgres::Error> {
    let Ok(epoch_i) = i64::try_from(epoch) else {
        return Ok(Err(format!(
            "epoch {epoch} is beyond what the database holds"
        )));
    };
    let text = match serde_json::to_string(state) {
        Ok(text) => text,
        Err(e) => return Ok(Err(format!("cannot encode the controller state: {e}"))),
    };
    let mut tx = client.transaction()?;
    let row = tx.query_opt(
        "SELECT holder, token, epoch,
                GREATEST(0, (EXTRACT(EPOCH FROM (expires_at - now())) * 1000))::bigint
         FROM powerflex_leader WHERE id = 1 FOR SHARE",
        &[],
    )?;
    let Some(row) = row else {
        tx.rollback()?;
        return Ok(Ok(Saved::Held(ClaimAnswer::HeldBy {
            holder: String::new(),
            epoch: 0,
            expires_in_ms: 0,
        })));
    };
    let holder: String = row.try_get(0)?;
    let token: String = row.try_get(1)?;
    let held_epoch: i64 = row.try_get(2)?;
    let mine = holder == me.name && token == me.token;
    if mine && held_epoch != epoch_i {
        tx.rollback()?;
        return Ok(Ok(Saved::Stale));
    }
    if !mine {
        let expires_in_ms: i64 = row.try_get::<_, Option<i64>>(3)?.unwrap_or(0);
        tx.rollback()?;
        let holder = if holder == me.name {
            lease_row::same_name_message(me.name)
        } else {
            holder
        };
        return Ok(Ok(Saved::Held(ClaimAnswer::HeldBy {
            holder,
            // Shown only; a row out of range is refused by the next claim.
            epoch: u64::try_from(held_epoch).unwrap_or(0),
            expires_in_ms: u64::try_from(expires_in_ms).unwrap_or(0),
        })));
    }
    tx.execute(
        "INSERT INTO powerflex_ctld_state (id, epoch, holder, state, saved_at)
         VALUES (1, $1, $2, $3::text::jsonb, now())
         ON CONFLICT (id) DO UPDATE SET epoch = EXCLUDED.epoch, holder = EXCLUDED.holder,
             state = EXCLUDED.state, saved_at = EXCLUDED.saved_at",
        &[&epoch_i, &me.name, &text],
    )?;
    tx.commit()?;
    Ok(Ok(Saved::Written))
}
