//! Shared by the simulated NVML library's tests (`nvml_wrapper`, `pynvml`): build the
//! library and the probe, make simulated nodes in directories other users can read.

#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

pub use powerflex::profile_dir;

/// The simulated NVML library (built, with the probe example, for this test run).
pub fn library() -> PathBuf {
    powerflex::cargo_build(&["-p", "powerflex-sim-nvml", "--lib", "--examples"]);
    let lib = profile_dir().join("libpowerflex_sim_nvml.so");
    assert!(lib.is_file(), "{} missing", lib.display());
    lib
}

pub fn probe() -> PathBuf {
    library();
    profile_dir().join("examples").join("nvml_probe")
}

/// A fresh directory readable by every user (the non-root test reads node state).
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pf-nvml-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    dir
}

/// Makes a simulated node in `dir` and leaves its files world-readable.
pub fn make_node(dir: &Path, node: &str, gpus: u32) -> powerflex_sim::state::Node {
    let n = powerflex_sim::state::Node::init(dir, node, "H200", gpus, true).expect("init node");
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    n
}

/// Runs the probe against node `dir` (None = no POWERFLEX_SIM_DIR), optionally as
/// another user via setpriv; returns one JSON value per output line.
pub fn run_probe(dir: Option<&Path>, as_nobody: bool, args: &[&str]) -> Vec<serde_json::Value> {
    let lib = library();
    let mut cmd = if as_nobody {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(probe());
        c
    } else {
        Command::new(probe())
    };
    cmd.arg(&lib).args(args).env_remove("POWERFLEX_SIM_DIR");
    if let Some(d) = dir {
        cmd.env("POWERFLEX_SIM_DIR", d);
    }
    let out = cmd.output().expect("run probe");
    assert!(
        out.status.success(),
        "probe failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("probe prints JSON"))
        .collect()
}
