//! Ordinary (unprivileged) users for the whole-system tests: the attacks of
//! `docs/security.md` are tried as a job's user would, not as root.
//!
//! [`TestUser::ensure`] creates a system user with `useradd` (no home, `/bin/sh`), or
//! reuses it when it exists: idempotent, so tests running at once or one after another
//! share the users; they are left in place (creating and removing accounts while another
//! test's jobs run as them would break those jobs). [`TestUser::command`] runs a program
//! as the user with `runuser`, which needs root.
//!
//! **One creation, machine-wide.** `useradd` checks that the name is free *before* it
//! locks `/etc/passwd`, and once it holds the lock it replaces an entry of the same name.
//! So two `useradd pf-alice` started at once both succeed, and the second gives the user
//! a new uid after the first caller has already read the old one (reproduced on Debian
//! 12: four concurrent calls all exited 0; two callers read uid 999, the user ended as
//! 995). A test would then hold a uid the system no longer gives its user. `ensure`
//! therefore checks and creates under an exclusive `flock` on [`USERS_LOCK`], shared by
//! every test process on the machine (test binaries run in parallel lanes, and two
//! checkouts may test at once), and reads the uid back from the system after creating.

use std::path::{Path, PathBuf};
use std::process::Command;

use powerflex_daemon::os::FileLock;

use crate::slurm::Cluster;

/// The lock every test process takes around "does the user exist, else create it":
/// under `/run/lock` (machine-wide, cleared at boot), else the temporary directory.
pub const USERS_LOCK: &str = "powerflex-testbed-users.lock";

fn users_lock_path() -> PathBuf {
    let run_lock = Path::new("/run/lock");
    let dir = if run_lock.is_dir() {
        run_lock.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    dir.join(USERS_LOCK)
}

/// A local user account the tests submit jobs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestUser {
    pub name: String,
    pub uid: u32,
    /// The user's primary group.
    pub gid: u32,
}

/// Why a test user could not be made.
#[derive(Debug, thiserror::Error)]
pub enum UserError {
    #[error("cannot run {program}: {source}")]
    Spawn {
        program: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("useradd {name} failed: {stderr}")]
    Useradd { name: String, stderr: String },
    #[error("user {name} has no numeric uid (id -u said {said:?})")]
    NoUid { name: String, said: String },
    #[error("cannot take the test users' lock: {0}")]
    Lock(#[from] powerflex_daemon::DaemonError),
}

fn uid_of(name: &str) -> Result<Option<u32>, UserError> {
    id_of(name, "-u")
}

fn id_of(name: &str, flag: &str) -> Result<Option<u32>, UserError> {
    let out = Command::new("id")
        .args([flag, name])
        .output()
        .map_err(|source| UserError::Spawn {
            program: "id",
            source,
        })?;
    if !out.status.success() {
        return Ok(None);
    }
    let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
    said.parse().map(Some).map_err(|_| UserError::NoUid {
        name: name.to_string(),
        said,
    })
}

impl TestUser {
    /// The user `name` (e.g. `pf-alice`), created if missing: at most once on this
    /// machine however many tests ask at once (see the module docs).
    pub fn ensure(name: &str) -> Result<TestUser, UserError> {
        let _one_creator = FileLock::acquire(&users_lock_path())?;
        if let (Some(uid), Some(gid)) = (uid_of(name)?, id_of(name, "-g")?) {
            return Ok(TestUser {
                name: name.to_string(),
                uid,
                gid,
            });
        }
        let out = Command::new("useradd")
            .args([
                "--system",
                "--no-create-home",
                "--shell",
                "/bin/sh",
                "--user-group",
                name,
            ])
            .output()
            .map_err(|source| UserError::Spawn {
                program: "useradd",
                source,
            })?;
        // Under the lock no other test creates it; something outside the tests might.
        if !out.status.success() && uid_of(name)?.is_none() {
            return Err(UserError::Useradd {
                name: name.to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        let no_id = || UserError::NoUid {
            name: name.to_string(),
            said: String::new(),
        };
        let uid = uid_of(name)?.ok_or_else(no_id)?;
        let gid = id_of(name, "-g")?.ok_or_else(no_id)?;
        Ok(TestUser {
            name: name.to_string(),
            uid,
            gid,
        })
    }

    /// `program ARGS` as this user (`runuser -u NAME -- program`), with the cluster's
    /// client environment and `/tmp` as the working directory (the cluster's scratch
    /// directory is root's).
    pub fn command(&self, cluster: &Cluster, program: &str) -> Command {
        let mut cmd = Command::new("runuser");
        cmd.args(["-u", &self.name, "--", program])
            .envs(cluster.env())
            .current_dir("/tmp");
        cmd
    }

    /// `program` as this user in the same process (`setpriv` execs it): for processes a
    /// test keeps running and later ends by the PID it started (`runuser` forks, and
    /// ending it would leave `program` behind).
    pub fn exec_command(&self, cluster: &Cluster, program: &str) -> Command {
        let mut cmd = Command::new("setpriv");
        cmd.arg(format!("--reuid={}", self.uid))
            .arg(format!("--regid={}", self.gid))
            .args(["--clear-groups", "--", program])
            .envs(cluster.env())
            .current_dir("/tmp");
        cmd
    }

    /// `sbatch --parsable ARGS` as this user, output to /dev/null unless ARGS say
    /// otherwise; the job id, or sbatch's stderr.
    pub fn sbatch(&self, cluster: &Cluster, args: &[&str]) -> Result<u32, String> {
        let out = self
            .command(cluster, "sbatch")
            .args(["--parsable", "--chdir=/tmp", "--output=/dev/null"])
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .map_err(|e| format!("cannot run sbatch as {}: {e}", self.name))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        stdout
            .trim()
            .split(';')
            .next()
            .and_then(|id| id.parse().ok())
            .ok_or_else(|| format!("sbatch printed no job id: {stdout:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_user_is_made_once_and_reused() {
        if !crate::needs::can_run(&[
            crate::needs::Need::Root,
            crate::needs::Need::Program("useradd"),
        ]) {
            return;
        }
        let a = TestUser::ensure("pf-testuser").expect("made");
        let b = TestUser::ensure("pf-testuser").expect("reused");
        assert_eq!(a, b);
        assert_ne!(a.uid, 0);
    }

    /// Tests asking for a missing user at once all get the uid the system
    /// keeps for it. Without the lock, concurrent `useradd`s of one name all succeed and
    /// re-number the user after some callers have read its uid; several rounds make
    /// that (seen about one round in three with four callers) near certain to show.
    #[test]
    fn concurrent_callers_of_a_missing_user_all_read_the_uid_it_keeps() {
        use std::sync::{Arc, Barrier};
        if !crate::needs::can_run(&[
            crate::needs::Need::Root,
            crate::needs::Need::Program("useradd"),
            crate::needs::Need::Program("userdel"),
        ]) {
            return;
        }
        const NAME: &str = "pf-race-test";
        const CALLERS: usize = 6;
        let remove = || {
            let _ = Command::new("userdel").arg(NAME).output();
            let _ = Command::new("groupdel").arg(NAME).output();
        };
        for round in 0..5 {
            remove();
            assert_eq!(uid_of(NAME).expect("id"), None, "{NAME} still exists");
            let start = Arc::new(Barrier::new(CALLERS));
            let seen: Vec<TestUser> = (0..CALLERS)
                .map(|_| {
                    let start = Arc::clone(&start);
                    std::thread::spawn(move || {
                        start.wait();
                        TestUser::ensure(NAME).expect("ensure")
                    })
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|t| t.join().expect("caller thread"))
                .collect();
            let kept = uid_of(NAME).expect("id").expect("the user exists");
            for user in &seen {
                assert_eq!(
                    user.uid,
                    kept,
                    "round {round}: a caller read uid {} but the system keeps {kept} for {NAME}; \
                     all read {:?}",
                    user.uid,
                    seen.iter().map(|u| u.uid).collect::<Vec<_>>()
                );
            }
        }
        remove();
    }
}
