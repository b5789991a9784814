//! Plumbing shared by powerflex's two daemons, `powerflexd` (node agent) and
//! `powerflex-ctld` (controller), by its other binaries (`powerflexctl`, `powerflex-grid`)
//! where they need the same, and by the testbed that starts them. Each piece exists
//! once, here:
//!
//! | module | what | replaces |
//! | --- | --- | --- |
//! | [`signals`] | SIGTERM/SIGINT → shutdown flag, SIGHUP → reload, delivered without polling | a 50 ms polling loop per daemon |
//! | [`prom`] | Prometheus text writer with escaped label values, and the [`prom::catalog`] of every metric family both daemons export (name, type, help, label names) | two writers with diverging label sets |
//! | [`http`] | `/metrics` responder: a fixed number of worker threads, read/write timeouts | two hand-rolled accept loops |
//! | [`lines`] | one bounded line read (`\n`-terminated, at most N bytes), and [`lines::DeadlineReader`]: one deadline for a whole request read | six `take(N).read_line` copies; a deadline reader in each daemon |
//! | [`clock`] | wall-clock ms since the Unix epoch, the one reading every process exchanges | fourteen `unix_ms`/`now_ms` copies |
//! | [`fsx`] | atomic file write (temporary file, optional fsync, rename, settable mode) and the key-file reader (root-owned regular 0600 files, opened without following or blocking) | three atomic writers; `proto::link::read_site_key` |
//! | [`command`] | a site command (`squeue`, `scontrol`) with a deadline and a bound on its output | a wait-then-read copy that a big output deadlocks |
//! | [`os`] | `kill`, `flock`, `SO_PEERCRED` through `rustix` | `unsafe` libc calls and `kill` run as a subprocess |
//! | [`trace`] | tracing init from `POWERFLEX_LOG` | two copies in the binaries |
//! | [`man`] | man pages of every binary from its clap definitions (one per subcommand) | none: the packages had no man pages |
//! | [`program`] | every binary's `main` prologue (`--write-man-pages`, `--check-config`, tracing) and end (`NAME: error: WHY`), and the exit codes as one enum, [`program::Exit`] | the same prologue and code mapping in four `main`s |
//! | [`gate`] | admission of Unix-socket connections by uid: per user, all users, root, in all | the agent's `Admission` and the controller's `AdminGate`, which differed in whether root may take users' places |
//!
//! ## What fits where, for a daemon that adopts it
//! - state file saved on every change: [`fsx::write_atomic`] with
//!   [`fsx::AtomicWrite::durable`] (fsync; what the controller's state needs) or
//!   [`fsx::AtomicWrite::fast`] (what survives a process crash, not a node crash); a
//!   daemon that keeps the previous copy (the controller's `ctld-state.prev.json`)
//!   hard-links the current file to that name first, then writes;
//! - an accept loop that must end: the [`http`] responder shows the pattern (blocking
//!   accept, `shutdown(2)` on the listener to wake it);
//! - a peer's uid on a Unix socket: [`os::peer_of`]; how many connections it may hold:
//!   [`gate::Gate`];
//! - a socket read of one request: [`lines::read_line`] with the protocol's limit;
//! - metrics: build the text with [`prom::TextWriter`] from [`prom::catalog`] families
//!   and serve it with [`http::MetricsServer::spawn`] given a closure that renders the
//!   current snapshot;
//! - signals: [`signals::SignalWatcher::spawn`] in `main`, stopped after the run.
//!
//! ## What it must not be linked by
//! The SPANK plugin: it runs inside slurmstepd, where no threads, no signal handlers and
//! no servers belong. That is why this is not `powerflex-proto`, which the plugin links.
//!
//! No `unsafe` here: system calls go through `rustix` and `signal-hook`.

pub mod clock;
pub mod command;
pub mod fsx;
pub mod gate;
pub mod http;
pub mod lines;
pub mod man;
pub mod os;
pub mod program;
pub mod prom;
pub mod signals;
#[cfg(feature = "test-ports")]
pub mod test_ports;
pub mod trace;

/// Why a piece of daemon plumbing failed. Every variant names the file, socket or
/// signal concerned and what is accepted.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// An I/O step on a named object failed.
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A line longer than the protocol allows.
    #[error("line exceeds the {limit_bytes}-byte limit")]
    LineTooLong { limit_bytes: usize },
    /// A key file is open to group or others.
    #[error("the key file {path} has mode {mode:o}; accepted: 600 or stricter (chmod 600 it)")]
    KeyPermissions { path: String, mode: u32 },
    /// A key file owned by someone other than root.
    #[error("the key file {path} is owned by uid {uid}; accepted: owned by root (chown root it)")]
    KeyOwner { path: String, uid: u32 },
    /// A key path that is not a regular file (a FIFO, a symlink, a directory, ...).
    #[error("the key file {path} is a {kind}; accepted: a regular file (not a symlink)")]
    KeyNotRegular { path: String, kind: &'static str },
    /// A key file holds too little.
    #[error("the key file {path} is shorter than {min_bytes} bytes (whitespace ignored)")]
    KeyTooShort { path: String, min_bytes: usize },
    /// A key file holds too much to be a key.
    #[error("the key file {path} is longer than {max_bytes} bytes; accepted: one key line")]
    KeyTooLong { path: String, max_bytes: u64 },
    /// A process id that cannot name a single process (0 or above `i32::MAX`).
    #[error("pid {pid} names no single process; accepted: 1..={}", i32::MAX)]
    BadPid { pid: u32 },
    /// A signal number the system does not name.
    #[error("signal {signal} is not a named signal; accepted: e.g. 1 (HUP), 9 (KILL), 15 (TERM)")]
    BadSignal { signal: i32 },
    /// A site command (`squeue`, `scontrol`) gave no usable output.
    #[error("{program}: {why}")]
    Command { program: String, why: String },
}

impl DaemonError {
    /// Wraps an I/O error with what was being done and on what.
    pub fn io_on(
        what: &'static str,
        path: impl std::fmt::Display,
    ) -> impl FnOnce(std::io::Error) -> DaemonError {
        DaemonError::io(what, path)
    }

    pub(crate) fn io(
        what: &'static str,
        path: impl std::fmt::Display,
    ) -> impl FnOnce(std::io::Error) -> DaemonError {
        let path = path.to_string();
        move |source| DaemonError::Io { what, path, source }
    }
}
