//! A client we did not write — NVIDIA's Python bindings (`nvidia-ml-py`, module `pynvml`)
//! — loads the simulated library as `libnvidia-ml.so.1` and uses it: proof the ABI is
//! real. The test command installs nvidia-ml-py; without it this test skips with the reason,
//! and under CI fails (see `powerflex::needs`).

mod sim_nvml;

use powerflex::needs::{can_run, Need};
use std::process::Command;

#[test]
fn nvidia_python_bindings_use_the_simulated_library() {
    if !can_run(&[Need::Root, Need::PythonModule("pynvml")]) {
        return;
    }
    let root = sim_nvml::scratch("pynvml");
    let node_dir = root.join("n1");
    sim_nvml::make_node(&node_dir, "n1", 2);
    let lib_dir = root.join("lib");
    std::fs::create_dir_all(&lib_dir).expect("lib dir");
    std::os::unix::fs::symlink(sim_nvml::library(), lib_dir.join("libnvidia-ml.so.1"))
        .expect("symlink");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/pynvml_check.py");
    let out = Command::new("python3")
        .arg(&script)
        .env("LD_LIBRARY_PATH", &lib_dir)
        .env("POWERFLEX_SIM_DIR", &node_dir)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "pynvml check failed (is nvidia-ml-py installed? `python3 -m pip install nvidia-ml-py`):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(r["count"], 2);
    assert_eq!(r["driver"], "550.54.15");
    for (i, g) in r["gpus"].as_array().expect("gpus").iter().enumerate() {
        assert_eq!(g["name"], "NVIDIA H200 (simulated)");
        assert!(g["uuid"].as_str().expect("uuid").starts_with("GPU-"));
        assert_eq!(g["min_mw"], 200_000);
        assert_eq!(g["max_mw"], 700_000);
        assert_eq!(g["default_mw"], 700_000);
        assert_eq!(g["limit_mw"], g["enforced_mw"]);
        assert!(g["power_mw"].as_u64().expect("power") <= 700_000);
        assert_eq!(g["by_uuid_index"], i);
    }
    assert_eq!(
        r["after_set_mw"], 350_000,
        "pynvml set a limit through the simulator"
    );
    assert_eq!(r["out_of_range"], 2, "NVML_ERROR_INVALID_ARGUMENT");
    assert_eq!(r["bad_index"], 2, "NVML_ERROR_INVALID_ARGUMENT");
}
