//! Ordinary (unprivileged) users for the whole-system tests: the attacks of issue 14 are
//! tried as a job's user would, not as root.
//!
//! [`TestUser::ensure`] creates a system user with `useradd` (no home, `/bin/sh`), or
//! reuses it when it exists: idempotent, so tests running at once or one after another
//! share the users; they are left in place (creating and removing accounts while another
//! test's jobs run as them would break those jobs). [`TestUser::command`] runs a program
//! as the user with `runuser`, which needs root.

use std::process::Command;

use crate::slurm::Cluster;

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
    /// The user `name` (e.g. `pf-alice`), created if missing.
    pub fn ensure(name: &str) -> Result<TestUser, UserError> {
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
        // Another test may have created it between the check and here.
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
}
