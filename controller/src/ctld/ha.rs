//! Leadership and state in PostgreSQL (`[controller.ha]`, issue 22): the I/O half of
//! [`powerflex_controller_machine::ctld::leader`].
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
//! - `powerflex_leader`: one row, `holder`, `epoch`, `expires_at`;
//! - `powerflex_ctld_state`: one row, the active controller's `CtldState` as JSON with
//!   the epoch it was written under. A save is fenced: it is written only while the row
//!   of `powerflex_leader` names this controller with that epoch, under a share lock of
//!   that row, so a takeover (which locks it for update) reads either the state before
//!   the save or after it, never a save from a controller that lost leadership.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender};
use tracing::{info, warn};

use powerflex_controller_machine::ctld::leader::{Claim, ClaimAnswer, LeaderInput};
use powerflex_controller_machine::ctld::state::CtldState;
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
    );";

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
        let (tx, rx) = unbounded::<Request>();
        let thread = std::thread::Builder::new()
            .name("ha-db".into())
            .spawn(move || Worker::new(options, to_loop).run(&rx))?;
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

    /// Saves `state` as the committed state of leadership `epoch` (only the newest of
    /// those queued is written).
    pub fn save(&self, sent: UnixMs, epoch: u64, state: &CtldState) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Request::Save {
                sent,
                epoch,
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

struct Worker {
    options: HaOptions,
    to_loop: Sender<Inbound>,
    client: Option<postgres::Client>,
}

impl Worker {
    fn new(options: HaOptions, to_loop: Sender<Inbound>) -> Worker {
        Worker {
            options,
            to_loop,
            client: None,
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
                    Request::Save { sent, epoch, state } => save = Some((sent, epoch, state)),
                }
            }
            for (sent, claim) in claims {
                let answer = self.with_client(|c, name, ttl| claim_in(c, name, ttl, claim));
                self.answer(sent, answer);
            }
            if let Some((sent, epoch, state)) = save {
                match self.with_client(|c, name, _| save_in(c, name, epoch, &state)) {
                    Ok(None) => {}
                    // The fence refused the save: leadership moved on. The machine
                    // hears who holds it as it would from a claim.
                    Ok(Some(held)) => self.answer(sent, Ok(held)),
                    Err(e) => {
                        warn!(error = %e, epoch, "cannot save the controller state to the database; the next change saves it again")
                    }
                }
            }
        }
    }

    fn answer(&self, sent: UnixMs, answer: Result<ClaimAnswer, String>) {
        let _ = self
            .to_loop
            .send(Inbound::Leader(LeaderInput::Answer { sent, answer }));
    }

    /// Runs `f` on the connection (made first when there is none); a failure drops the
    /// connection, so the next request connects afresh.
    fn with_client<T>(
        &mut self,
        f: impl FnOnce(&mut postgres::Client, &str, Duration) -> Result<T, postgres::Error>,
    ) -> Result<T, String> {
        if self.client.is_none() {
            self.client = Some(self.connect()?);
        }
        let client = self.client.as_mut().ok_or("no connection")?;
        match f(client, &self.options.name, self.options.leader_ttl) {
            Ok(t) => Ok(t),
            Err(e) => {
                self.client = None;
                Err(format!("leadership database: {e}"))
            }
        }
    }

    fn connect(&self) -> Result<postgres::Client, String> {
        let mut config = postgres::Config::from_str(&self.options.url)
            .map_err(|e| format!("controller.ha.url: {e}"))?;
        if let Some(path) = &self.options.password_file {
            config.password(super::records_db::read_password(path)?);
        }
        let timeout_ms = self.options.timeout.as_millis();
        let session = format!("-c statement_timeout={timeout_ms} -c lock_timeout={timeout_ms}");
        // A partition (no reset) must fail a claim within the timeout rather than
        // after TCP's retransmissions (many minutes), or this controller could not
        // compete again until then: data unacknowledged that long, or a peer silent to
        // three keepalives, ends the connection. (A server that is alive but stuck is
        // not bounded here; the machine's deadline bounds what that costs.)
        config
            .connect_timeout(self.options.timeout)
            .tcp_user_timeout(self.options.timeout)
            .keepalives(true)
            .keepalives_idle(self.options.timeout)
            .keepalives_interval(Duration::from_secs(1))
            .keepalives_retries(3)
            .application_name("powerflex-ctld-ha")
            .options(&session);
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

/// One claim, in one transaction on the database's clock (see the module docs).
fn claim_in(
    client: &mut postgres::Client,
    me: &str,
    ttl: Duration,
    claim: Claim,
) -> Result<ClaimAnswer, postgres::Error> {
    let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
    let mut tx = client.transaction()?;
    // The row exists from the first claim on, lapsed, held by nobody.
    tx.execute(
        "INSERT INTO powerflex_leader (id, holder, epoch, expires_at)
         VALUES (1, '', 0, to_timestamp(0)) ON CONFLICT (id) DO NOTHING",
        &[],
    )?;
    let row = tx.query_one(
        "SELECT holder, epoch, expires_at > now() AS live,
                GREATEST(0, (EXTRACT(EPOCH FROM (expires_at - now())) * 1000))::bigint
                    AS expires_in_ms
         FROM powerflex_leader WHERE id = 1 FOR UPDATE",
        &[],
    )?;
    let holder: String = row.get("holder");
    let epoch: i64 = row.get("epoch");
    let live: bool = row.get("live");
    let expires_in_ms: i64 = row.get::<_, Option<i64>>("expires_in_ms").unwrap_or(0);
    let epoch = u64::try_from(epoch).unwrap_or(0);
    let answer = if holder == me && claim.renew_epoch == Some(epoch) {
        tx.execute(
            "UPDATE powerflex_leader
             SET expires_at = now() + make_interval(secs => $1::bigint::float8 / 1000.0)
             WHERE id = 1",
            &[&ttl_ms],
        )?;
        ClaimAnswer::Renewed { epoch }
    } else if !live || holder == me {
        // Lapsed, or this controller's own (a restart, or one that stepped down): take
        // it with a new epoch, and the state the last holder committed.
        let new_epoch = epoch + 1;
        let new_epoch_i = i64::try_from(new_epoch).unwrap_or(i64::MAX);
        tx.execute(
            "UPDATE powerflex_leader
             SET holder = $1, epoch = $2,
                 expires_at = now() + make_interval(secs => $3::bigint::float8 / 1000.0)
             WHERE id = 1",
            &[&me, &new_epoch_i, &ttl_ms],
        )?;
        let state = tx
            .query_opt(
                "SELECT state::text FROM powerflex_ctld_state WHERE id = 1",
                &[],
            )?
            .map(|r| r.get::<_, String>(0));
        let state = match state {
            None => None,
            Some(text) => match serde_json::from_str::<CtldState>(&text) {
                Ok(s) => Some(Box::new(s)),
                Err(e) => {
                    // Taking over with no state would drop the events in force: refuse
                    // leadership rather than steer blind (nothing is committed).
                    tx.rollback()?;
                    return Ok(ClaimAnswer::HeldBy {
                        holder: format!("nobody (the committed state is unreadable: {e})"),
                        epoch,
                        expires_in_ms: 0,
                    });
                }
            },
        };
        ClaimAnswer::TookOver {
            epoch: new_epoch,
            state,
            previous_holder: (!holder.is_empty()).then_some(holder),
        }
    } else {
        ClaimAnswer::HeldBy {
            holder,
            epoch,
            expires_in_ms: u64::try_from(expires_in_ms).unwrap_or(0),
        }
    };
    tx.commit()?;
    Ok(answer)
}

/// A fenced save: `None` when written, or who holds leadership when it is not this
/// controller with `epoch` (nothing written).
fn save_in(
    client: &mut postgres::Client,
    me: &str,
    epoch: u64,
    state: &CtldState,
) -> Result<Option<ClaimAnswer>, postgres::Error> {
    let epoch_i = i64::try_from(epoch).unwrap_or(i64::MAX);
    // A CtldState always encodes (maps keyed by strings, finite numbers).
    let text = serde_json::to_string(state).unwrap_or_else(|_| "{}".into());
    let mut tx = client.transaction()?;
    let row = tx.query_opt(
        "SELECT holder, epoch,
                GREATEST(0, (EXTRACT(EPOCH FROM (expires_at - now())) * 1000))::bigint
         FROM powerflex_leader WHERE id = 1 FOR SHARE",
        &[],
    )?;
    let Some(row) = row else {
        tx.rollback()?;
        return Ok(Some(ClaimAnswer::HeldBy {
            holder: String::new(),
            epoch: 0,
            expires_in_ms: 0,
        }));
    };
    let holder: String = row.get(0);
    let held_epoch: i64 = row.get(1);
    if holder == me && held_epoch != epoch_i {
        // A save queued under an earlier leadership of this same controller: stale,
        // and not a sign that another one steers.
        tx.rollback()?;
        return Ok(None);
    }
    if holder != me {
        let expires_in_ms: i64 = row.get::<_, Option<i64>>(2).unwrap_or(0);
        tx.rollback()?;
        return Ok(Some(ClaimAnswer::HeldBy {
            holder,
            epoch: u64::try_from(held_epoch).unwrap_or(0),
            expires_in_ms: u64::try_from(expires_in_ms).unwrap_or(0),
        }));
    }
    tx.execute(
        "INSERT INTO powerflex_ctld_state (id, epoch, holder, state, saved_at)
         VALUES (1, $1, $2, $3::text::jsonb, now())
         ON CONFLICT (id) DO UPDATE SET epoch = EXCLUDED.epoch, holder = EXCLUDED.holder,
             state = EXCLUDED.state, saved_at = EXCLUDED.saved_at",
        &[&epoch_i, &me, &text],
    )?;
    tx.commit()?;
    Ok(None)
}
