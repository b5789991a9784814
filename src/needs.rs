//! Tests that need what a developer's machine may lack (root, a local Slurm, valgrind,
//! a Python module) say so and skip, instead of failing deep inside a
//! cluster start-up. Under CI (`CI` set to anything but `false` or `0`) a missing need
//! fails the test instead: CI must run every test, so a skip there would hide one.
//!
//! Every such test starts with
//!
//! ```no_run
//! use powerflex::needs::{can_run, Need};
//! if !can_run(&[Need::Root, Need::Slurm]) {
//!     return;
//! }
//! ```

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One thing a test needs from the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Effective uid 0: the daemons set (simulated) GPU limits and start Slurm, the
    /// tests switch users with `setpriv` and change budgets as root.
    Root,
    /// A local Slurm (Debian's `slurm-wlm`): the daemons and the clients on `PATH`.
    Slurm,
    /// A program on `PATH`, e.g. `valgrind`.
    Program(&'static str),
    /// A file, e.g. a preload library.
    File(&'static str),
    /// A module `python3` can import, e.g. `pynvml` (PyPI `nvidia-ml-py`).
    PythonModule(&'static str),
    /// The test bed's PostgreSQL 16 (`crate::pg`: pgserver's binaries in the cache and
    /// the unprivileged user it runs as, made here when root).
    Postgres,
}

/// The programs [`Need::Slurm`] stands for: what `crate::slurm` starts and runs.
pub const SLURM_PROGRAMS: [&str; 6] = [
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "scontrol",
    "squeue",
];

/// Whether the calling test can run here. If not: under CI, panics naming what is
/// missing; elsewhere, prints `SKIPPED <test>: <why>` to the real stderr (past the test
/// harness's capture, so a plain `cargo test` shows it) and returns `false`.
pub fn can_run(needs: &[Need]) -> bool {
    let missing = missing(needs, &Machine::this());
    if missing.is_empty() {
        return true;
    }
    let test = std::thread::current()
        .name()
        .unwrap_or("this test")
        .to_string();
    let why = missing.join("; ");
    assert!(
        !strict(std::env::var("CI").ok().as_deref()),
        "{test} cannot run here and CI must run every test: {why} (scripts/install-deps.sh installs the packages)"
    );
    // Written to the stderr handle directly: libtest captures the print macros only.
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED {test}: {why} (with CI=true this fails instead)"
    );
    false
}

/// What `needs` finds missing on `machine`, one reason each, in order.
pub fn missing(needs: &[Need], machine: &Machine) -> Vec<String> {
    let mut reasons = Vec::new();
    for need in needs {
        match *need {
            Need::Root => {
                if machine.euid != Some(0) {
                    let uid = machine
                        .euid
                        .map_or_else(|| "unknown".to_string(), |u| u.to_string());
                    reasons.push(format!("needs root (effective uid {uid})"));
                }
            }
            Need::Slurm => {
                let absent: Vec<&str> = SLURM_PROGRAMS
                    .iter()
                    .copied()
                    .filter(|p| !machine.on_path(p))
                    .collect();
                if !absent.is_empty() {
                    reasons.push(format!(
                        "needs a local Slurm: {} not on PATH (apt-get install slurm-wlm)",
                        absent.join(", ")
                    ));
                }
            }
            Need::Program(name) => {
                if !machine.on_path(name) {
                    reasons.push(format!("needs {name} on PATH"));
                }
            }
            Need::File(path) => {
                if !Path::new(path).exists() {
                    reasons.push(format!("needs {path}"));
                }
            }
            Need::PythonModule(module) => {
                if !machine.python_imports(module) {
                    reasons.push(format!("needs python3 with the module {module}"));
                }
            }
            Need::Postgres => {
                if let Err(e) = crate::pg::available() {
                    reasons.push(format!(
                        "needs PostgreSQL (scripts/test.sh installs it): {e}"
                    ));
                }
            }
        }
    }
    reasons
}

/// Whether the `CI` variable's value makes a skip a failure: set and not `false`/`0`.
pub fn strict(ci: Option<&str>) -> bool {
    ci.is_some_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// What [`missing`] looks at: the effective uid and the `PATH` directories.
#[derive(Debug, Clone)]
pub struct Machine {
    /// `None`: `/proc/self/status` could not be read.
    pub euid: Option<u32>,
    pub path: Vec<PathBuf>,
}

impl Machine {
    /// This process's view.
    pub fn this() -> Machine {
        Machine {
            euid: std::fs::read_to_string("/proc/self/status")
                .ok()
                .and_then(|s| effective_uid(&s)),
            path: std::env::var_os("PATH")
                .map(|p| std::env::split_paths(&p).collect())
                .unwrap_or_default(),
        }
    }

    fn on_path(&self, program: &str) -> bool {
        use std::os::unix::fs::PermissionsExt;
        self.path.iter().any(|dir| {
            std::fs::metadata(dir.join(program))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    }

    fn python_imports(&self, module: &str) -> bool {
        self.on_path("python3")
            && Command::new("python3")
                .args(["-c", &format!("import {module}")])
                .output()
                .is_ok_and(|o| o.status.success())
    }
}

/// The effective uid from the text of `/proc/<pid>/status` (`Uid:` real, effective, …).
fn effective_uid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        .and_then(|id| id.parse().ok())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn machine(euid: Option<u32>, path: Vec<PathBuf>) -> Machine {
        Machine { euid, path }
    }

    #[test]
    fn the_effective_uid_is_the_second_field() {
        let status = "Name:\tcargo\nUid:\t1000\t0\t0\t0\nGid:\t0\t0\t0\t0\n";
        assert_eq!(effective_uid(status), Some(0));
        assert_eq!(effective_uid("Name:\tx\n"), None);
        assert_eq!(effective_uid("Uid:\t1000\n"), None);
    }

    #[test]
    fn each_missing_need_gives_its_reason_in_order() {
        let nobody = machine(Some(65534), Vec::new());
        assert_eq!(
            missing(
                &[
                    Need::Root,
                    Need::Slurm,
                    Need::Program("valgrind"),
                    Need::File("/no/such/file")
                ],
                &nobody
            ),
            [
                "needs root (effective uid 65534)".to_string(),
                format!(
                    "needs a local Slurm: {} not on PATH (apt-get install slurm-wlm)",
                    SLURM_PROGRAMS.join(", ")
                ),
                "needs valgrind on PATH".to_string(),
                "needs /no/such/file".to_string(),
            ]
        );
        assert_eq!(
            missing(&[Need::Root], &machine(None, Vec::new())),
            ["needs root (effective uid unknown)"]
        );
    }

    #[test]
    fn what_is_there_is_not_missing() {
        let dir = std::env::temp_dir().join(format!("pf-needs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for program in SLURM_PROGRAMS {
            let p = dir.join(program);
            std::fs::write(&p, "#!/bin/sh\n").unwrap();
            std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o755))
                .unwrap();
        }
        // A file that is not executable does not count as a program.
        std::fs::write(dir.join("valgrind"), "").unwrap();
        let root = machine(Some(0), vec![dir.clone()]);
        assert!(missing(&[Need::Root, Need::Slurm, Need::File("/")], &root).is_empty());
        assert_eq!(
            missing(&[Need::Program("valgrind")], &root),
            ["needs valgrind on PATH"]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn ci_makes_a_skip_a_failure_unless_it_says_false() {
        assert!(strict(Some("true")) && strict(Some("1")) && strict(Some("yes")));
        assert!(!strict(None) && !strict(Some("")) && !strict(Some("false")) && !strict(Some("0")));
    }
}
