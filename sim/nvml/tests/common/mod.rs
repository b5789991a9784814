//! Shared by the simulator library's integration tests: build the library and the probe,
//! make simulated nodes in directories other users can read.

#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// target/<profile>, from this test binary's own path (target/<profile>/deps/<test>).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>")
        .to_path_buf()
}

/// Builds the cdylib and the probe example once per test binary (cargo test does not
/// promise either is current), and returns the library's path.
pub fn library() -> PathBuf {
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| {
        let profile = match profile_dir().file_name().and_then(|n| n.to_str()) {
            Some("debug") | None => "dev".to_string(),
            Some(p) => p.to_string(),
        };
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let status = Command::new(cargo)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .args([
                "build",
                "--quiet",
                "--profile",
                &profile,
                "-p",
                "powerflex-sim-nvml",
                "--lib",
                "--examples",
            ])
            .status()
            .expect("run cargo");
        assert!(
            status.success(),
            "building the simulated NVML library failed"
        );
    });
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
