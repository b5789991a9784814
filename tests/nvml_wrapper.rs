//! The production NVML client, `nvml-wrapper`, against the simulated library: the code
//! path the node agent runs, loaded exactly as it loads the real libnvidia-ml.so.1.

mod sim_nvml;

use std::ffi::OsStr;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
use powerflex::needs::{can_run, Need};
use powerflex_sim::state::{Node, Workload};

/// GPUs of the shared in-process node; each test owns one so they can run in parallel.
const READ_GPU: u32 = 0;
const SET_GPU: u32 = 1;
const NON_ROOT_GPU: u32 = 2;
const ENERGY_GPU: u32 = 3;
const BUSY_GPU: u32 = 4;

/// The in-process node: NVML state is per process, so every test here shares one node,
/// chosen through POWERFLEX_SIM_DIR before the first init.
fn shared() -> &'static (PathBuf, Node) {
    static NODE: OnceLock<(PathBuf, Node)> = OnceLock::new();
    NODE.get_or_init(|| {
        let dir = sim_nvml::scratch("shared").join("t1");
        let node = sim_nvml::make_node(&dir, "t1", 6);
        std::env::set_var("POWERFLEX_SIM_DIR", &dir);
        (dir, node)
    })
}

fn nvml() -> Nvml {
    shared();
    Nvml::builder()
        .lib_path(OsStr::new(&sim_nvml::library()))
        .init()
        .expect("nvml-wrapper loads the simulated library")
}

#[test]
// device_by_serial is deprecated in nvml-wrapper (dual-GPU boards share a serial), but
// the library still exports the function and clients call it.
#[allow(deprecated)]
fn enumerates_and_identifies_devices() {
    let nvml = nvml();
    assert_eq!(nvml.device_count().expect("count"), 6);
    let mut uuids = Vec::new();
    for i in 0..6 {
        let d = nvml.device_by_index(i).expect("device");
        assert_eq!(d.name().expect("name"), "NVIDIA H200 (simulated)");
        assert_eq!(d.index().expect("index"), i);
        let uuid = d.uuid().expect("uuid");
        let same = nvml.device_by_uuid(uuid.as_str()).expect("by uuid");
        assert_eq!(same.index().expect("index"), i);
        let pci = d.pci_info().expect("pci");
        assert_eq!(
            nvml.device_by_pci_bus_id(pci.bus_id.as_str())
                .expect("by bus id")
                .index()
                .expect("index"),
            i
        );
        let serial = d.serial().expect("serial");
        assert_eq!(
            nvml.device_by_serial(serial.as_str())
                .expect("by serial")
                .index()
                .expect("index"),
            i
        );
        uuids.push(uuid);
    }
    uuids.sort();
    uuids.dedup();
    assert_eq!(uuids.len(), 6, "UUIDs are unique");
    assert!(matches!(
        nvml.device_by_index(6),
        Err(NvmlError::InvalidArg)
    ));
    assert!(matches!(
        nvml.device_by_uuid("GPU-00000000-0000-0000-0000-000000000000"),
        Err(NvmlError::NotFound)
    ));
}

#[test]
fn reads_every_value_the_agent_reads() {
    let nvml = nvml();
    let d = nvml.device_by_index(READ_GPU).expect("device");
    let c = d.power_management_limit_constraints().expect("constraints");
    assert_eq!((c.min_limit, c.max_limit), (200_000, 700_000));
    assert_eq!(
        d.power_management_limit_default().expect("default"),
        700_000
    );
    assert_eq!(d.power_management_limit().expect("limit"), 700_000);
    assert_eq!(d.enforced_power_limit().expect("enforced"), 700_000);
    let idle = d.power_usage().expect("power");
    assert!(
        (74_000..=76_000).contains(&idle),
        "idle draw ~75 W in mW, got {idle}"
    );
    let _ = d.total_energy_consumption().expect("energy");
    let u = d.utilization_rates().expect("utilization");
    assert_eq!((u.gpu, u.memory), (0, 0), "idle");
    assert_eq!(d.clock_info(Clock::SM).expect("sm clock"), 345);
    assert_eq!(d.clock_info(Clock::Memory).expect("mem clock"), 3201);
    assert_eq!(d.max_clock_info(Clock::SM).expect("max sm"), 1980);
    let m = d.memory_info().expect("memory");
    assert_eq!(m.total, 143_771 * 1024 * 1024);
    assert!(m.used + m.free <= m.total);
    let t = d.temperature(TemperatureSensor::Gpu).expect("temperature");
    assert!((30..=40).contains(&t), "idle temperature {t}");
    let reasons = d.current_throttle_reasons().expect("throttle reasons");
    assert!(reasons.contains(nvml_wrapper::bitmasks::device::ThrottleReasons::GPU_IDLE));
    assert!(nvml
        .sys_driver_version()
        .expect("driver")
        .starts_with("550."));
}

#[test]
fn sets_limits_as_root_within_the_constraints() {
    if !can_run(&[Need::Root]) {
        return;
    }
    let nvml = nvml();
    let mut d = nvml.device_by_index(SET_GPU).expect("device");
    d.set_power_management_limit(450_000).expect("root may set");
    assert_eq!(d.power_management_limit().expect("limit"), 450_000);
    assert_eq!(d.enforced_power_limit().expect("enforced"), 450_000);
    assert!(matches!(
        d.set_power_management_limit(199_999),
        Err(NvmlError::InvalidArg)
    ));
    assert!(matches!(
        d.set_power_management_limit(700_001),
        Err(NvmlError::InvalidArg)
    ));
    assert_eq!(
        d.power_management_limit().expect("limit"),
        450_000,
        "a refused set changes nothing"
    );
    d.set_power_management_limit(700_000).expect("restore");
}

#[test]
fn non_root_gets_no_permission() {
    if !can_run(&[Need::Root, Need::Program("setpriv")]) {
        return;
    }
    let (dir, node) = shared();
    let got = sim_nvml::run_probe(
        Some(dir),
        true,
        &["set", &NON_ROOT_GPU.to_string(), "400000"],
    );
    assert_eq!(got[0]["error"], "NoPermission", "{got:?}");
    assert_eq!(node.gpu(NON_ROOT_GPU).expect("gpu").power_limit_mw, 700_000);
    // Reading stays open to everyone, as on a real node.
    let listed = sim_nvml::run_probe(Some(dir), true, &["list"]);
    assert_eq!(listed.len(), 6);
}

#[test]
fn energy_counter_advances_with_time() {
    let nvml = nvml();
    let d = nvml.device_by_index(ENERGY_GPU).expect("device");
    let first = d.total_energy_consumption().expect("energy");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = d.total_energy_consumption().expect("energy");
        assert!(now >= first, "energy never runs backwards");
        if now > first {
            break;
        }
        assert!(Instant::now() < deadline, "energy did not advance in 5 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_busy_gpu_never_draws_above_its_enforced_limit() {
    if !can_run(&[Need::Root]) {
        return;
    }
    let (_, node) = shared();
    let library = powerflex_sim::profiles::Library::builtin().expect("library");
    let profile = library.find("qwen3-30b-a3b-moe-ft-8g").expect("profile");
    node.claim(
        &[BUSY_GPU],
        &Workload {
            job_id: "77".into(),
            pid: std::process::id(),
            profile: profile.name.clone(),
            physics: profile.physics,
            table: None,
            memory_used_bytes: 100 << 30,
            idle: false,
        },
    )
    .expect("claim");
    let nvml = nvml();
    let mut d = nvml.device_by_index(BUSY_GPU).expect("device");
    let uncapped = d.power_usage().expect("power");
    assert!(uncapped > 600_000, "busy uncapped draw {uncapped}");
    let uncapped_sm = d.clock_info(Clock::SM).expect("sm");
    for limit in [650_000, 500_000, 350_000, 200_000] {
        d.set_power_management_limit(limit).expect("set");
        for _ in 0..25 {
            let p = d.power_usage().expect("power");
            assert!(
                p <= d.enforced_power_limit().expect("enforced"),
                "{p} mW over {limit}"
            );
        }
        assert!(
            d.clock_info(Clock::SM).expect("sm") < uncapped_sm,
            "SM clock falls under a cap"
        );
        assert_eq!(
            d.clock_info(Clock::Memory).expect("mem"),
            3201,
            "memory clock stays"
        );
        let reasons = d.current_throttle_reasons().expect("reasons");
        assert!(reasons.contains(nvml_wrapper::bitmasks::device::ThrottleReasons::SW_POWER_CAP));
        let u = d.utilization_rates().expect("util");
        assert_eq!(u.gpu, 100);
    }
    // NVML lists the job's process on the busy GPU and nothing on an idle one: the agent
    // checks a job's GPU claims against these lists.
    let running = d.running_compute_processes().expect("running processes");
    assert_eq!(running.len(), 1, "{running:?}");
    assert_eq!(running[0].pid, std::process::id());
    assert_eq!(d.running_compute_processes_count().expect("count"), 1);
    let idle = nvml.device_by_index(BUSY_GPU + 1).expect("idle device");
    assert!(idle
        .running_compute_processes()
        .expect("idle list")
        .is_empty());
    d.set_power_management_limit(700_000).expect("restore");
    node.release(std::process::id()).expect("release");
    assert!(d
        .running_compute_processes()
        .expect("after release")
        .is_empty());
}

#[test]
fn two_nodes_do_not_see_each_other() {
    let root = sim_nvml::scratch("two-nodes");
    let (a, b) = (root.join("n1"), root.join("n2"));
    sim_nvml::make_node(&a, "n1", 2);
    sim_nvml::make_node(&b, "n2", 3);
    let list_a = sim_nvml::run_probe(Some(&a), false, &["list"]);
    let list_b = sim_nvml::run_probe(Some(&b), false, &["list"]);
    assert_eq!((list_a.len(), list_b.len()), (2, 3));
    for x in &list_a {
        assert!(
            list_b.iter().all(|y| y["uuid"] != x["uuid"]),
            "UUID {} on both nodes",
            x["uuid"]
        );
    }
    let set = sim_nvml::run_probe(Some(&a), false, &["set", "0", "300000"]);
    assert_eq!(set[0]["ok"], true);
    let after_b = sim_nvml::run_probe(Some(&b), false, &["list"]);
    assert_eq!(
        after_b[0]["limit_mw"], 700_000,
        "n2 untouched by a set on n1"
    );
    let after_a = sim_nvml::run_probe(Some(&a), false, &["list"]);
    assert_eq!(after_a[0]["limit_mw"], 300_000);
}

#[test]
fn injected_faults_fail_one_gpu_with_real_codes() {
    let dir = sim_nvml::scratch("faults").join("n1");
    let node = sim_nvml::make_node(&dir, "n1", 3);
    node.set_fault(1, Some(powerflex_sim::state::Fault::GpuLost))
        .expect("fault");
    node.set_fault(2, Some(powerflex_sim::state::Fault::NoPermission))
        .expect("fault");
    let listed = sim_nvml::run_probe(Some(&dir), false, &["list"]);
    assert_eq!(listed[0]["limit_mw"], 700_000, "GPU 0 unaffected");
    assert_eq!(listed[1]["error"], "GpuLost");
    let set = sim_nvml::run_probe(Some(&dir), false, &["set", "2", "500000"]);
    assert_eq!(set[0]["error"], "NoPermission");
    node.set_fault(1, None).expect("clear");
    let listed = sim_nvml::run_probe(Some(&dir), false, &["list"]);
    assert_eq!(listed[1]["limit_mw"], 700_000, "cleared fault, GPU back");
}

#[test]
fn without_a_node_the_driver_is_not_loaded() {
    let got = sim_nvml::run_probe(None, false, &["list"]);
    assert_eq!(got[0]["error"], "DriverNotLoaded");
    let missing = sim_nvml::scratch("missing").join("nowhere");
    let got = sim_nvml::run_probe(Some(&missing), false, &["list"]);
    assert_eq!(got[0]["error"], "DriverNotLoaded");
}
