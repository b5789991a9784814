//! powerflex as a whole, on this machine: a real Slurm cluster ([`slurm`]) and the helpers
//! the whole-process tests in `tests/` and the demo (`powerflex-demo`) share — where the
//! built binaries and the project's data are, how to run a binary and capture what it
//! says, a guard that ends the processes it started by PID.

pub mod ha_pair;
pub mod lanes;
pub mod link_peer;
pub mod needs;
pub mod pg;
pub mod site_config;
pub mod slurm;
pub mod stack;
pub mod users;
pub mod vtn;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::sync::{Mutex, OnceLock, PoisonError};

/// The cargo profile directory holding the workspace's binaries (set by `build.rs`).
pub fn profile_dir() -> PathBuf {
    PathBuf::from(env!("POWERFLEX_PROFILE_DIR"))
}

/// Makes sure the artifacts `args` name (`cargo build` arguments) are built and current,
/// once per test process, in the profile the tests were built with, with the cargo that
/// runs the tests.
///
/// `cargo test` compiles other packages' binaries only as unit-test harnesses (and their
/// cdylibs and examples not at all), so the real artifacts in the profile directory may
/// be stale or missing. In the dev profile this builds the whole workspace, every target
/// (a superset of `args`): that is the feature set the test command's build step
/// (`cargo build --workspace --all-targets`) used, so after it this is a freshness check
/// of a second or two. Building only `args` would resolve features for that subset of the
/// workspace and rebuild shared dependencies, and the binaries under test, with another
/// feature set, once per distinct subset (minutes of a CI run). Other profiles (the
/// benches') build `args` only.
pub fn cargo_build(args: &[&str]) {
    static BUILT: OnceLock<Mutex<HashSet<Vec<String>>>> = OnceLock::new();
    let built = BUILT.get_or_init(|| Mutex::new(HashSet::new()));
    let mut built = built.lock().unwrap_or_else(PoisonError::into_inner);
    let profile = match profile_dir().file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev".to_string(),
        Some(other) => other.to_string(),
    };
    let build_args: &[&str] = if profile == "dev" {
        &["--workspace", "--all-targets"]
    } else {
        args
    };
    let key: Vec<String> = build_args.iter().map(|a| a.to_string()).collect();
    if built.contains(&key) {
        return;
    }
    let status = cargo_command()
        .current_dir(repo_root())
        .args(["build", "--quiet", "--profile", &profile])
        .args(build_args)
        .status()
        .unwrap_or_else(|e| panic!("cannot run cargo build {args:?}: {e}"));
    assert!(status.success(), "cargo build {args:?} failed");
    built.insert(key);
}

/// The package variables cargo sets for a crate it builds, runs or tests.
const CARGO_PACKAGE_VARIABLES: &[&str] = &[
    "CARGO_PKG_",
    "CARGO_MANIFEST_",
    "CARGO_CRATE_",
    "CARGO_BIN_",
    "CARGO_PRIMARY_PACKAGE",
    "CARGO_TARGET_TMPDIR",
];

/// The cargo that runs the tests (`CARGO`, else `cargo` on the PATH), without the package
/// variables cargo gave this process. Build scripts such as ring's declare
/// `rerun-if-env-changed=CARGO_MANIFEST_DIR` and `CARGO_PKG_NAME`; a cargo started from a
/// test (or from `cargo run`) inherits that test's values, so without this each package's
/// tests rebuilt those crates, and the next package's tests rebuilt them back (80 s of
/// ring, rustls and sqlx in one clean-clone run). Without them the nested cargo sees what
/// the suite's build step saw.
pub fn cargo_command() -> Command {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    for (name, _) in std::env::vars_os() {
        let Some(text) = name.to_str() else {
            continue;
        };
        if CARGO_PACKAGE_VARIABLES.iter().any(|p| text.starts_with(p)) {
            command.env_remove(&name);
        }
    }
    command
}

/// Path of a workspace binary, built fresh for this test run (see [`cargo_build`]).
pub fn binary(name: &str) -> PathBuf {
    cargo_build(&["--bin", name]);
    let path = profile_dir().join(name);
    assert!(
        path.is_file(),
        "{} is missing after building it",
        path.display()
    );
    path
}

/// Polls `check` every 100 ms until it yields a value; panics naming `what` after
/// `timeout`. Tests wait for conditions this way, never with a fixed sleep.
pub fn wait_until<T>(
    what: &str,
    timeout: std::time::Duration,
    mut check: impl FnMut() -> Option<T>,
) -> T {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Some(v) = check() {
            return v;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// The repository root: the workspace's, which is this package's own directory.
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

/// Processes a test started: killed (by PID) and reaped when the test ends, pass or fail.
#[derive(Debug, Default)]
pub struct Children(pub Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Loopback ports below the kernel's ephemeral range (see the daemon crate's
/// `test_ports`).
pub use powerflex_daemon::test_ports::free_loopback_port;

/// Writes each node's own link key where the site config `site` puts it
/// (`agent.key_file`), with `powerflexctl` at `ctl` (`link-key`: the deploy step a site
/// runs, derived from the site key). Panics on failure.
pub fn write_node_keys(ctl: &Path, site: &Path, nodes: &[&str]) {
    let text = std::fs::read_to_string(site).unwrap_or_else(|e| panic!("{}: {e}", site.display()));
    let config = powerflex_core::config::SiteConfig::from_toml_str(&text)
        .unwrap_or_else(|e| panic!("{}: {e}", site.display()));
    for node in nodes {
        let out = config.agent.key_file(node);
        let ran = run(
            ctl,
            &[
                "link-key",
                "--site",
                &site.display().to_string(),
                "--node",
                node,
                "--out",
                &out.display().to_string(),
            ],
        );
        assert_eq!(
            ran.code,
            Some(0),
            "powerflexctl link-key for {node}: {}",
            ran.stderr
        );
    }
}

/// Writes a site key readable by root only, as powerflexd and powerflex-ctld demand.
pub fn write_site_key(path: &Path, key: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, key).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Under `cargo test` this process holds its package's variables; the cargo a test
    /// starts must not inherit them (see [`cargo_command`]), and must keep the rest.
    #[test]
    fn a_nested_cargo_gets_none_of_the_package_variables() {
        assert!(
            std::env::var_os("CARGO_PKG_NAME").is_some(),
            "cargo test sets CARGO_PKG_NAME for a test process"
        );
        let command = cargo_command();
        let removed: Vec<String> = command
            .get_envs()
            .filter(|(_, value)| value.is_none())
            .map(|(name, _)| name.to_string_lossy().into_owned())
            .collect();
        for must_go in ["CARGO_PKG_NAME", "CARGO_MANIFEST_DIR"] {
            assert!(
                removed.iter().any(|n| n == must_go),
                "{must_go}: {removed:?}"
            );
        }
        assert!(
            removed.iter().all(|n| n != "PATH" && n != "CARGO_HOME"),
            "{removed:?}"
        );
    }
}
