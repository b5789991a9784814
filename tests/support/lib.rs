//! Helpers for the whole-system tests in `tests/`: where the built binaries and the
//! project's data are, and how to run a binary and capture what it says.

pub mod slurm;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, OnceLock, PoisonError};

/// The cargo profile directory holding the workspace's binaries (set by `build.rs`).
pub fn profile_dir() -> PathBuf {
    PathBuf::from(env!("POWERFLEX_PROFILE_DIR"))
}

/// Path of a workspace binary, built fresh for this test run.
///
/// `cargo test` compiles other packages' binaries only as unit-test harnesses, so the real
/// executable in the profile directory may be stale or missing. Each binary is therefore
/// (re)built once per test process with the cargo that runs the tests, in the same
/// profile; when it is already current that costs a fraction of a second.
pub fn binary(name: &str) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    let built = BUILT.get_or_init(|| Mutex::new(HashSet::new()));
    let mut built = built.lock().unwrap_or_else(PoisonError::into_inner);
    if !built.contains(name) {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let profile_dir = profile_dir();
        let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") | None => "dev".to_string(),
            Some(other) => other.to_string(),
        };
        let status = Command::new(cargo)
            .current_dir(repo_root())
            .args(["build", "--quiet", "--profile", &profile, "--bin", name])
            .status()
            .unwrap_or_else(|e| panic!("cannot run cargo to build {name}: {e}"));
        assert!(status.success(), "cargo build --bin {name} failed");
        built.insert(name.to_string());
    }
    let path = profile_dir().join(name);
    assert!(
        path.is_file(),
        "{} is missing after building it",
        path.display()
    );
    path
}

/// The repository root.
pub fn repo_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A file under the repository's `data/`.
pub fn data_file(relative: &str) -> PathBuf {
    repo_root().join("data").join(relative)
}

/// A fresh scratch directory under the target dir, removed and recreated on each call.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = profile_dir().join("test-scratch").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    dir
}

/// What a finished command said.
#[derive(Debug)]
pub struct Ran {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `binary` with `args` to completion.
pub fn run(binary: &Path, args: &[&str]) -> Ran {
    let Output {
        status,
        stdout,
        stderr,
    } = Command::new(binary)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", binary.display()));
    Ran {
        code: status.code(),
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
    }
}
