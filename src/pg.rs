//! A real PostgreSQL 16 on this machine for the tests and the demo: the `pgserver`
//! wheel's binaries (installed by `scripts/install-deps.sh` into `$POWERFLEX_CACHE`), run
//! as an unprivileged user ([`PG_USER`]; initdb and postgres refuse root) on a free
//! loopback port, with trust authentication, and stopped by PID when the [`PgBed`] is
//! dropped (also when a test panics). The OpenADR test bed ([`crate::vtn`]) runs its VTN
//! on one; the controller's accounting database tests use one directly.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::free_loopback_port;

/// Version of the `pgserver` wheel whose PostgreSQL the bed runs.
pub const PGSERVER_VERSION: &str = "0.1.4";
/// The unprivileged user PostgreSQL runs as: made by the test bed when missing, so a
/// machine without Debian's PostgreSQL packages needs none.
pub const PG_USER: &str = "pf-postgres";

/// Why a test bed (PostgreSQL, the VTN) could not start.
#[derive(Debug, thiserror::Error)]
pub enum BedError {
    #[error("{what} is missing at {path}: run scripts/install-deps.sh (as root) first")]
    Missing { what: &'static str, path: String },
    #[error("{what}: {message}")]
    Failed { what: String, message: String },
    #[error("timed out after {timeout_s} s waiting for {what}; its log: {log}")]
    Timeout {
        what: &'static str,
        timeout_s: u64,
        log: String,
    },
}

pub(crate) fn failed(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> BedError {
    let what = what.into();
    move |e| BedError::Failed {
        what,
        message: e.to_string(),
    }
}

/// The cache the installer fills.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("POWERFLEX_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/powerflex"))
}

/// The directory holding PostgreSQL 16's `postgres`, `initdb`, `createdb`.
pub fn pg_bin_dir() -> PathBuf {
    cache_dir()
        .join(format!("pgserver-{PGSERVER_VERSION}"))
        .join("pgserver/pginstall/bin")
}

/// Whether a database can start here: installed, its user present (made when root).
pub fn available() -> Result<(), BedError> {
    let postgres = pg_bin_dir().join("postgres");
    if !postgres.is_file() {
        return Err(BedError::Missing {
            what: "PostgreSQL 16 (pgserver)",
            path: postgres.display().to_string(),
        });
    }
    user_ids(PG_USER).map(|_| ())
}

pub(crate) fn user_ids(name: &str) -> Result<(u32, u32), BedError> {
    let user = crate::users::TestUser::ensure(name).map_err(|e| BedError::Missing {
        what: "the unprivileged user for PostgreSQL",
        path: format!("user {name} (the test bed creates it with useradd, as root): {e}"),
    })?;
    Ok((user.uid, user.gid))
}

/// A command run as `user` (uid, gid) through util-linux's setpriv, which execs: the
/// child's PID is the program's own, so it can be stopped by PID.
pub(crate) fn as_user(ids: (u32, u32), program: &Path) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.arg(format!("--reuid={}", ids.0))
        .arg(format!("--regid={}", ids.1))
        .arg("--clear-groups")
        .arg(program);
    cmd
}

pub(crate) fn wait_port(
    port: u16,
    child: &mut Child,
    what: &'static str,
    log: &Path,
    timeout: Duration,
) -> Result<(), BedError> {
    let deadline = Instant::now() + timeout;
    loop {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        let tail = || {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let start = text.len().saturating_sub(2000);
            text.get(start..).unwrap_or_default().to_string()
        };
        if let Ok(Some(status)) = child.try_wait() {
            return Err(BedError::Failed {
                what: format!("{what} exited ({status})"),
                message: tail(),
            });
        }
        if Instant::now() >= deadline {
            return Err(BedError::Timeout {
                what,
                timeout_s: timeout.as_secs(),
                log: tail(),
            });
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Stops a child by its PID: `signal` first (a clean shutdown), SIGKILL after 10 s.
pub(crate) fn stop(child: &mut Child, signal: powerflex_daemon::os::Signal) {
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    let _ = powerflex_daemon::os::kill(child.id(), signal);
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

pub(crate) fn path_str(p: &Path) -> Result<&str, BedError> {
    p.to_str().ok_or_else(|| BedError::Failed {
        what: "path".into(),
        message: format!("{} is not utf-8", p.display()),
    })
}

/// PostgreSQL running, with one database owned by one superuser (trust authentication,
/// loopback only). Dropping it stops the server and removes its data.
#[derive(Debug)]
pub struct PgBed {
    server: Option<Child>,
    ids: (u32, u32),
    /// Where the data, the socket and the logs live.
    pub dir: PathBuf,
    pub port: u16,
    pub user: String,
    pub database: String,
}

impl PgBed {
    /// A fresh cluster in `dir/pg` (made; the rest of `dir` is left alone), with
    /// `database` owned by `user`.
    pub fn start(dir: &Path, user: &str, database: &str) -> Result<PgBed, BedError> {
        available()?;
        let ids = user_ids(PG_USER)?;
        std::fs::create_dir_all(dir).map_err(failed(format!("mkdir {}", dir.display())))?;
        // The database user must reach its own directory under the test's.
        let mut up = Some(dir);
        while let Some(d) = up {
            use std::os::unix::fs::PermissionsExt;
            if let Ok(meta) = std::fs::metadata(d) {
                let mode = meta.permissions().mode();
                if mode & 0o001 == 0 {
                    let _ =
                        std::fs::set_permissions(d, std::fs::Permissions::from_mode(mode | 0o001));
                }
            }
            up = d.parent().filter(|p| p != &Path::new("/"));
        }
        let pg_dir = dir.join("pg");
        let _ = std::fs::remove_dir_all(&pg_dir);
        std::fs::create_dir_all(&pg_dir).map_err(failed("mkdir pg"))?;
        std::os::unix::fs::chown(&pg_dir, Some(ids.0), Some(ids.1)).map_err(failed("chown pg"))?;
        let data = pg_dir.join("data");
        let initdb_log = dir.join("initdb.log");
        let initdb = as_user(ids, &pg_bin_dir().join("initdb"))
            .args(["-D", path_str(&data)?, "-U", user])
            .args(["--auth=trust", "-E", "UTF8", "--no-sync"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&initdb_log).map_err(failed("initdb log"))?)
            .status()
            .map_err(failed("initdb"))?;
        if !initdb.success() {
            return Err(BedError::Failed {
                what: "initdb".into(),
                message: std::fs::read_to_string(&initdb_log).unwrap_or_default(),
            });
        }
        let mut bed = PgBed {
            server: None,
            ids,
            dir: dir.to_path_buf(),
            port: free_loopback_port(),
            user: user.to_string(),
            database: database.to_string(),
        };
        bed.start_server()?;
        let created = Command::new(pg_bin_dir().join("createdb"))
            .args(["-h", "127.0.0.1", "-p", &bed.port.to_string(), "-U", user])
            .arg(database)
            .output()
            .map_err(failed("createdb"))?;
        if !created.status.success() {
            return Err(BedError::Failed {
                what: "createdb".into(),
                message: String::from_utf8_lossy(&created.stderr).into_owned(),
            });
        }
        Ok(bed)
    }

    fn start_server(&mut self) -> Result<(), BedError> {
        let pg_dir = self.dir.join("pg");
        let log = self.dir.join("postgres.log");
        let mut server = as_user(self.ids, &pg_bin_dir().join("postgres"))
            .args(["-D", path_str(&pg_dir.join("data"))?])
            .args(["-p", &self.port.to_string(), "-k", path_str(&pg_dir)?])
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"])
            .stdout(Stdio::null())
            .stderr(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log)
                    .map_err(failed("postgres log"))?,
            )
            .spawn()
            .map_err(failed("postgres"))?;
        let ready = wait_port(
            self.port,
            &mut server,
            "PostgreSQL",
            &log,
            Duration::from_secs(60),
        );
        self.server = Some(server);
        ready
    }

    /// Stops the server (its data kept): the database is away until [`PgBed::resume`].
    pub fn pause(&mut self) {
        // SIGINT is PostgreSQL's fast shutdown: it ends its sessions and exits cleanly.
        if let Some(mut p) = self.server.take() {
            stop(&mut p, powerflex_daemon::os::Signal::INT);
        }
    }

    /// Starts the server again on the same port and data.
    pub fn resume(&mut self) -> Result<(), BedError> {
        if self.server.is_some() {
            return Ok(());
        }
        self.start_server()
    }

    /// `postgres://USER@127.0.0.1:PORT/DATABASE`.
    pub fn url(&self) -> String {
        format!(
            "postgres://{}@127.0.0.1:{}/{}",
            self.user, self.port, self.database
        )
    }

    /// `psql`'s unaligned, tuples-only answer to `sql` (the pgserver wheel ships psql).
    pub fn query(&self, sql: &str) -> Result<String, BedError> {
        // Bounded: a test that asks never waits on a server that does not answer.
        let out = Command::new(pg_bin_dir().join("psql"))
            .env("PGCONNECT_TIMEOUT", "10")
            .env("PGOPTIONS", "-c statement_timeout=10000")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(["-U", &self.user, "-d", &self.database])
            .args(["-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-c", sql])
            .output()
            .map_err(failed("psql"))?;
        if !out.status.success() {
            return Err(BedError::Failed {
                what: format!("psql -c {sql:?}"),
                message: String::from_utf8_lossy(&out.stderr).into_owned(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for PgBed {
    fn drop(&mut self) {
        self.pause();
        // The database files (~40 MB) go; the logs stay for a failed test's reader.
        let _ = std::fs::remove_dir_all(self.dir.join("pg").join("data"));
    }
}
