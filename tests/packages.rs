//! The Debian packages on the machine with the local Slurm cluster, around a
//! running job on SIMULATED GPUs: built by `scripts/package.sh` from the suite's debug
//! build, installed with dpkg, a job run through the installed plugin and agent, an
//! upgrade to a rebuilt package while the job runs (the agent restarted on the new
//! binary, as the unit's `try-restart` does), and removal, which must leave no GPU
//! capped. Caps are read every 50 ms through the upgrade.
//!
//! This machine runs no systemd, so the maintainer scripts' `systemctl` lines are
//! skipped here, as on any host without it: the test stops and starts the agent by PID
//! where systemd would, and checks what the packages' own files and scripts do.
//!
//! It installs into the system's paths, so it runs only where dpkg knows none of the three
//! packages and neither conffile exists (a site's own installation, or files it wrote,
//! are never touched), and it purges them when it ends, also when it fails. That purge
//! leaves every GPU limit as it is (`POWERFLEX_REMOVE_WITHOUT_RELEASE=1`): on a failure
//! the site config may still be the shipped example, which names the system's NVML, and
//! a test never writes a real GPU's limit.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use powerflex::needs::{can_run, Need};
use powerflex::stack::{installed, Artifacts, Stack, StackOptions, DEFAULT_CAP_W};
use powerflex::{cargo_build, repo_root, scratch_dir, wait_until};

const PACKAGES: [&str; 3] = ["powerflex-node", "powerflex-controller", "powerflex-cli"];
const TRAIN: &str = "qwen3-30b-a3b-moe-ft-8g";

/// `dpkg-query`'s status and version of `package`, when dpkg knows it.
fn installed_version(package: &str) -> Option<String> {
    let out = Command::new("dpkg-query")
        .args(["-W", "-f", "${db:Status-Abbrev} ${Version}", package])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let mut words = text.split_whitespace();
    let status = words.next()?;
    // The second letter is the package's state: "ii" installed, "ri" installed and
    // asked to go, "rc" removed with its conffiles left.
    (status.chars().nth(1) == Some('i')).then(|| words.next().unwrap_or("").to_string())
}

fn dpkg(args: &[&str], envs: &[(&str, &Path)]) -> std::process::Output {
    let mut command = Command::new("dpkg");
    command.args(args);
    for (k, v) in envs {
        command.env(k, v);
    }
    command
        .output()
        .unwrap_or_else(|e| panic!("cannot run dpkg {args:?}: {e}"))
}

/// Whether dpkg holds any state for `package` (installed, half-installed, or removed with
/// its conffiles left).
fn known_to_dpkg(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f", "${db:Status-Abbrev}", package])
        .output()
        .map(|o| {
            let status = String::from_utf8_lossy(&o.stdout).to_string();
            o.status.success() && status.chars().nth(1).is_some_and(|c| c != 'n')
        })
        .unwrap_or(false)
}

fn purge() {
    let mut args = vec!["--purge"];
    args.extend(PACKAGES);
    let out = dpkg(&args, &[]);
    assert!(
        out.status.success(),
        "dpkg --purge: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Purges the packages when the test ends, however it ends.
struct Purge;

impl Drop for Purge {
    fn drop(&mut self) {
        let mut args = vec!["--purge"];
        args.extend(PACKAGES);
        let _ = dpkg(
            &args,
            &[("POWERFLEX_REMOVE_WITHOUT_RELEASE", Path::new("1"))],
        );
    }
}

/// `scripts/package.sh` rewrites `target/man` and `target/rpm-stage` each run: the two
/// tests here take turns with it.
static PACKAGE_SCRIPT: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn package_script() -> std::sync::MutexGuard<'static, ()> {
    PACKAGE_SCRIPT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `scripts/package.sh --profile dev --no-build --revision REVISION --out OUT EXTRA...`
/// from the suite's debug build: the three packages it made. The caller holds
/// [`package_script`]'s turn.
fn run_package_script(out: &Path, revision: u32, extra: &[&str]) -> Vec<PathBuf> {
    let made = Command::new("bash")
        .arg(repo_root().join("scripts/package.sh"))
        .args(["--profile", "dev", "--no-build", "--revision"])
        .arg(revision.to_string())
        .arg("--out")
        .arg(out)
        .args(extra)
        .current_dir(repo_root())
        .output()
        .expect("scripts/package.sh runs");
    assert!(
        made.status.success(),
        "scripts/package.sh {extra:?} failed: {}",
        String::from_utf8_lossy(&made.stderr)
    );
    let packages: Vec<PathBuf> = String::from_utf8_lossy(&made.stdout)
        .lines()
        .map(PathBuf::from)
        .collect();
    assert_eq!(packages.len(), 3, "three packages: {packages:?}");
    packages
}

/// The three Debian packages at revision `revision`.
fn build_packages(out: &Path, revision: u32) -> Vec<PathBuf> {
    let _turn = package_script();
    run_package_script(out, revision, &[])
}

/// `dpkg -i`, an edited conffile kept without a question (what unattended upgrades do);
/// what dpkg and the maintainer scripts printed.
fn install(debs: &[PathBuf]) -> String {
    let out = try_install(debs);
    assert!(out.status.success(), "dpkg -i: {}", said(&out));
    said(&out)
}

fn try_install(debs: &[PathBuf]) -> std::process::Output {
    let mut command = Command::new("dpkg");
    command.args(["--force-confold", "-i"]).args(debs);
    command.output().expect("dpkg -i runs")
}

fn said(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `deb` rebuilt with its shipped site config changed, as a next release that changes
/// the default config would ship it.
fn with_changed_site_config(deb: &Path, work: &Path) -> PathBuf {
    let tree = work.join("repack");
    let _ = std::fs::remove_dir_all(&tree);
    let run = |program: &str, args: &[&std::ffi::OsStr]| {
        let out = Command::new(program).args(args).output().expect(program);
        assert!(out.status.success(), "{program} {args:?}: {}", said(&out));
    };
    run(
        "dpkg-deb",
        &["-R".as_ref(), deb.as_os_str(), tree.as_os_str()],
    );
    let config = tree.join("etc/slurm/powerflex.toml");
    let mut text = std::fs::read_to_string(&config).expect("the shipped config");
    text.push_str(CHANGED_DEFAULT);
    std::fs::write(&config, text).expect("change the shipped config");
    let out = work.join("powerflex-cli-changed.deb");
    run(
        "dpkg-deb",
        &[
            "--root-owner-group".as_ref(),
            "-b".as_ref(),
            tree.as_os_str(),
            out.as_os_str(),
        ],
    );
    out
}

/// What the rebuilt package's shipped config gains.
const CHANGED_DEFAULT: &str = "\n# A default this release changed (tests/packages.rs).\n";

/// The GPUs' caps sampled every 50 ms while the test does something else: the highest
/// cap each GPU showed.
struct CapWatch {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<(u32, Vec<f64>)>,
}

impl CapWatch {
    fn start(sim_dir: PathBuf, gpus: u32) -> CapWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let node = powerflex_sim::state::Node::open(&sim_dir).expect("the simulated node");
            let mut highest = vec![0.0_f64; gpus as usize];
            let mut samples = 0;
            while !flag.load(Ordering::SeqCst) {
                for (g, top) in highest.iter_mut().enumerate() {
                    if let Ok(gpu) = node.gpu(g as u32) {
                        *top = top.max(f64::from(gpu.power_limit_mw) / 1000.0);
                    }
                }
                samples += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            (samples, highest)
        });
        CapWatch { stop, thread }
    }

    fn finish(self) -> (u32, Vec<f64>) {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.join().expect("the cap sampler")
    }
}

#[test]
fn the_packages_install_upgrade_and_remove_around_a_running_job() {
    if !can_run(&[
        Need::Root,
        Need::Slurm,
        Need::Program("dpkg"),
        Need::Program("cargo-deb"),
    ]) {
        return;
    }
    for package in PACKAGES {
        assert!(
            !known_to_dpkg(package),
            "dpkg knows {package} on this machine already; this test installs and purges it, so it runs only where dpkg does not"
        );
    }
    for path in [
        installed::SITE_CONFIG,
        "/etc/slurm/plugstack.conf.d/powerflex.conf",
    ] {
        assert!(
            !Path::new(path).exists(),
            "{path} exists already; this test would overwrite and then purge it, so it runs only where it does not"
        );
    }
    let keys = ["/etc/slurm/powerflex.key", "/etc/powerflex/node.key"];
    let keys_before: Vec<bool> = keys.iter().map(|k| Path::new(k).exists()).collect();
    cargo_build(&["-p", "powerflex-agent", "-p", "powerflex-controller"]);
    let work = scratch_dir("packages");
    let v1 = build_packages(&work.join("v1"), 1);
    let _purge = Purge;
    install(&v1);

    // What the packages put where, and what they did not do.
    for path in [
        installed::AGENT,
        installed::CONTROLLER,
        installed::VEN,
        installed::CLI,
        installed::PLUGIN,
        installed::SITE_CONFIG,
        "/etc/slurm/plugstack.conf.d/powerflex.conf",
        "/usr/lib/systemd/system/powerflexd.service",
        "/usr/lib/systemd/system/powerflex-ctld.service",
        "/usr/lib/systemd/system/powerflex-grid.service",
        "/usr/share/man/man1/powerflexctl.1.gz",
        "/usr/share/man/man1/powerflexctl-event-add.1.gz",
        "/usr/share/man/man5/powerflex.toml.5.gz",
        "/usr/share/man/man8/powerflexd.8.gz",
        "/usr/share/man/man8/powerflex-ctld.8.gz",
        "/usr/share/man/man8/powerflex-grid.8.gz",
    ] {
        assert!(Path::new(path).is_file(), "{path} was not installed");
    }
    let unit = std::fs::read_to_string("/usr/lib/systemd/system/powerflexd.service")
        .expect("the agent's unit");
    assert!(
        unit.contains(&format!("ExecStart={} ", installed::AGENT)),
        "the unit starts the installed agent: {unit}"
    );
    let plugstack = std::fs::read_to_string("/etc/slurm/plugstack.conf.d/powerflex.conf")
        .expect("the plugstack line");
    assert!(plugstack.contains(&format!("optional {} ", installed::PLUGIN)));
    for (key, before) in keys.iter().zip(&keys_before) {
        assert_eq!(
            Path::new(key).exists(),
            *before,
            "{key}: installing created (or removed) a key"
        );
    }
    let conffiles = Command::new("dpkg-query")
        .args([
            "-W",
            "-f",
            "${Conffiles}\n",
            "powerflex-cli",
            "powerflex-node",
        ])
        .output()
        .expect("dpkg-query");
    let conffiles = String::from_utf8_lossy(&conffiles.stdout);
    for path in [
        installed::SITE_CONFIG,
        "/etc/slurm/plugstack.conf.d/powerflex.conf",
    ] {
        assert!(
            conffiles.contains(path),
            "{path} is not a conffile: {conffiles}"
        );
    }
    // `man` finds the pages where it looks (man-db's index is not needed for -w).
    if Command::new("man").arg("--version").output().is_ok() {
        for page in [
            ["1", "powerflexctl"],
            ["5", "powerflex.toml"],
            ["8", "powerflexd"],
        ] {
            let found = Command::new("man").args(["-w", page[0], page[1]]).output();
            let found = found.expect("man -w");
            assert!(
                found.status.success(),
                "man -w {} {}: {}",
                page[0],
                page[1],
                String::from_utf8_lossy(&found.stderr)
            );
        }
    }
    // The installed CLI's reference is the one the packages' man page was made from.
    let reference = Command::new(installed::CLI)
        .args(["reference", "config"])
        .output()
        .expect("the installed powerflexctl");
    assert!(String::from_utf8_lossy(&reference.stdout).contains("gpu_budget_w"));

    // A job through the installed plugin and agent: one node of four simulated H200s
    // under a budget that caps them.
    let budget_w = 4.0 * 450.0;
    let mut stack = Stack::start(
        "packages",
        StackOptions {
            nodes: 1,
            gpus_per_node: 4,
            budget_w,
            sample_interval_ms: 50,
            artifacts: Artifacts::Installed,
            ..StackOptions::default()
        },
    );
    // The site's own config, as an admin would edit the installed conffile (it names the
    // simulated NVML library and the stack's sockets).
    let site_text = std::fs::read_to_string(&stack.site).expect("the stack's site config");
    std::fs::write(installed::SITE_CONFIG, &site_text).expect("edit the conffile");
    let job = stack.submit("flex3", 1, 4, TRAIN);
    let capped = wait_until(
        "the job's GPUs capped by the installed agent",
        Duration::from_secs(90),
        || {
            let caps = stack.try_caps_w().ok()?;
            (stack.running(job) && caps.iter().all(|c| *c < DEFAULT_CAP_W)).then_some(caps)
        },
    );
    println!("capped through the installed agent: {capped:?}");

    // The upgrade while the job runs: a rebuilt package at revision 2, then the agent
    // restarted on the new binary (SIGTERM, then start: the unit's try-restart).
    // The rebuilt powerflex-cli also ships a changed default config, so dpkg must choose
    // between it and the site's edit.
    let v2: Vec<PathBuf> = build_packages(&work.join("v2"), 2)
        .into_iter()
        .map(|deb| {
            if deb.to_string_lossy().contains("powerflex-cli_") {
                with_changed_site_config(&deb, &work)
            } else {
                deb
            }
        })
        .collect();
    let sim_dir = stack.sims[0].dir().to_path_buf();
    let watch = CapWatch::start(sim_dir.clone(), 4);
    let upgrade_said = install(&v2);
    assert!(
        upgrade_said.contains("restart powerflexd yourself"),
        "without systemd the upgrade says the agent must be restarted: {upgrade_said}"
    );
    let shipped = std::fs::read_to_string(format!("{}.dpkg-dist", installed::SITE_CONFIG))
        .expect("the new default config beside the site's, as .dpkg-dist");
    assert!(shipped.ends_with(CHANGED_DEFAULT));
    for package in PACKAGES {
        assert_eq!(
            installed_version(package).as_deref(),
            Some("0.1.0-2"),
            "{package} upgraded"
        );
    }
    assert_eq!(
        std::fs::read_to_string(installed::SITE_CONFIG).expect("the conffile"),
        site_text,
        "the upgrade overwrote the site's edited config"
    );
    stack.stop_agent(0);
    stack.start_agent(0);
    wait_until(
        "the upgraded agent live at the controller",
        Duration::from_secs(60),
        || {
            let nodes: Vec<powerflex_proto::status::NodeStatus> = stack.ctl_json(&["nodes"])?;
            nodes.iter().any(|n| n.live).then_some(())
        },
    );
    // Two allocation periods on the new agent, still sampled.
    std::thread::sleep(Duration::from_secs(3));
    let (samples, highest) = watch.finish();
    assert!(stack.running(job), "the job ran through the upgrade");
    println!("upgrade: {samples} samples at 50 ms, highest cap per GPU {highest:?} W");
    assert!(samples > 20, "the sampler ran ({samples} samples)");
    for (g, top) in highest.iter().enumerate() {
        assert!(
            *top < DEFAULT_CAP_W,
            "GPU {g} went back to its default {DEFAULT_CAP_W} W during the upgrade (highest {top} W): the budget did not hold"
        );
    }

    // A config the new agent refuses stops the upgrade before any restart, and the
    // upgrade finishes once the file is mended (`dpkg --configure -a`).
    std::fs::write(
        installed::SITE_CONFIG,
        format!("bogus_key = 1\n{site_text}"),
    )
    .expect("break the conffile");
    let refused = try_install(&v2);
    assert!(
        !refused.status.success(),
        "a refused config still configured"
    );
    assert!(
        said(&refused).contains("refuses /etc/slurm/powerflex.toml"),
        "the upgrade says why it stopped: {}",
        said(&refused)
    );
    assert!(
        stack.running(job),
        "the job runs on through the refused upgrade"
    );
    std::fs::write(installed::SITE_CONFIG, &site_text).expect("mend the conffile");
    let configured = dpkg(&["--configure", "-a"], &[]);
    assert!(
        configured.status.success(),
        "dpkg --configure -a: {}",
        said(&configured)
    );

    // Removal while the job still runs. With the agent running (started by hand, not by
    // systemd), the package's release refuses and so does the removal.
    let node = stack.cluster.node_names()[0].clone();
    let envs: [(&str, &Path); 2] = [
        ("POWERFLEX_SIM_DIR", sim_dir.as_path()),
        ("SLURMD_NODENAME", Path::new(&node)),
    ];
    let refused = dpkg(&["-r", "powerflex-node"], &envs);
    assert!(
        !refused.status.success(),
        "dpkg -r succeeded while the agent ran: {}",
        String::from_utf8_lossy(&refused.stdout)
    );
    let said = String::from_utf8_lossy(&refused.stderr).to_string();
    assert!(
        said.contains("stop it first"),
        "the refusal says why: {said}"
    );
    let status = Command::new("dpkg-query")
        .args(["-W", "-f", "${Package} ${db:Status-Abbrev}\n"])
        .args(PACKAGES)
        .output()
        .expect("dpkg-query");
    assert!(
        installed_version("powerflex-node").is_some(),
        "still installed after the refusal: {}\n{said}",
        String::from_utf8_lossy(&status.stdout)
    );

    // As `systemctl stop` would: the agent stopped (fail-static: the job's GPUs stay
    // capped), the controller too; then the removal puts every GPU back.
    stack.stop_agent(0);
    let still = stack.caps_w();
    assert!(
        still.iter().all(|c| *c < DEFAULT_CAP_W),
        "a stopped agent keeps a running job's caps: {still:?}"
    );
    stack.kill_ctld();
    // The release reads only what it needs of the config: one the full loader refuses
    // still puts the GPUs back.
    std::fs::write(
        installed::SITE_CONFIG,
        format!("bogus_key = 1\n{site_text}"),
    )
    .expect("break the conffile again");
    let mut remove = vec!["-r"];
    remove.extend(PACKAGES);
    let removed = dpkg(&remove, &envs);
    assert!(
        removed.status.success(),
        "dpkg -r: {}{}",
        String::from_utf8_lossy(&removed.stdout),
        String::from_utf8_lossy(&removed.stderr)
    );
    let after = stack.caps_w();
    assert!(
        after.iter().all(|c| *c == DEFAULT_CAP_W),
        "removal left GPUs capped: {after:?}"
    );
    assert!(
        !Path::new(installed::AGENT).exists(),
        "the agent's binary is gone"
    );
    assert!(
        Path::new(installed::SITE_CONFIG).exists(),
        "a removal (not a purge) keeps the site's config"
    );
    purge();
    assert!(
        !Path::new(installed::SITE_CONFIG).exists(),
        "a purge removes the conffile"
    );
    for (key, before) in keys.iter().zip(&keys_before) {
        assert_eq!(
            Path::new(key).exists(),
            *before,
            "{key}: the packages touched a key"
        );
    }
    let _ = stack.cluster.run("scancel", &[&job.to_string()]);
    stack.shutdown();
}

/// `rpm -qp --queryformat FORMAT PACKAGE`'s answer.
fn rpm_query(rpm: &Path, args: &[&str]) -> String {
    let out = Command::new("rpm")
        .args(["-qp"])
        .args(args)
        .arg(rpm)
        .output()
        .expect("rpm runs");
    assert!(
        out.status.success(),
        "rpm -qp {args:?} {}: {}",
        rpm.display(),
        said(&out)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// The RPMs (`scripts/package.sh --rpm`), read back with Debian's `rpm`: the same files as
/// the Debian packages in the RPM-based distributions' places, the site config and the
/// plugstack line as `%config(noreplace)`, and the maintainer scripts as scriptlets whose
/// first line turns RPM's count into the word the script expects. No RPM-based machine
/// is in CI, so they are built and read here, not installed.
#[test]
fn the_rpms_hold_the_files_scripts_and_config_flags() {
    if !can_run(&[Need::Program("rpm"), Need::Program("cargo-generate-rpm")]) {
        return;
    }
    cargo_build(&["-p", "powerflex-agent", "-p", "powerflex-controller"]);
    let out = scratch_dir("rpms");
    // Held to the end: the checks below read target/rpm-stage, which the script rewrites.
    let _turn = package_script();
    let rpms = run_package_script(&out, 3, &["--rpm"]);
    let find = |name: &str| -> &PathBuf {
        rpms.iter()
            .find(|p| {
                p.file_name()
                    .is_some_and(|f| f.to_string_lossy().starts_with(&format!("{name}-0")))
            })
            .unwrap_or_else(|| panic!("no {name} RPM in {rpms:?}"))
    };
    let (node, controller, cli) = (
        find("powerflex-node"),
        find("powerflex-controller"),
        find("powerflex-cli"),
    );
    for (rpm, files) in [
        (
            node,
            &[
                "/usr/sbin/powerflexd",
                "/usr/lib/systemd/system/powerflexd.service",
                "/usr/share/man/man8/powerflexd.8",
            ][..],
        ),
        (
            controller,
            &[
                "/usr/sbin/powerflex-ctld",
                "/usr/sbin/powerflex-grid",
                "/usr/lib/systemd/system/powerflex-ctld.service",
                "/usr/share/man/man8/powerflex-grid.8",
            ][..],
        ),
        (
            cli,
            &[
                "/usr/bin/powerflexctl",
                "/usr/lib64/slurm/power_flex.so",
                "/etc/slurm/powerflex.toml",
                "/etc/slurm/plugstack.conf.d/powerflex.conf",
                "/usr/share/man/man1/powerflexctl-event-add.1",
                "/usr/share/man/man5/powerflex.toml.5",
            ][..],
        ),
    ] {
        let listed = rpm_query(rpm, &["-l"]);
        for file in files {
            assert!(
                listed.lines().any(|l| l == *file),
                "{}: no {file} in\n{listed}",
                rpm.display()
            );
        }
        assert!(
            rpm_query(rpm, &["--qf", "%{RELEASE}"]) == "3",
            "{}: release",
            rpm.display()
        );
    }
    // Both config files keep a site's edit ("c" config, "n" noreplace).
    let flags = rpm_query(cli, &["--qf", "[%{FILENAMES} %{FILEFLAGS:fflags}\n]"]);
    for config in [
        "/etc/slurm/powerflex.toml",
        "/etc/slurm/plugstack.conf.d/powerflex.conf",
    ] {
        let line = flags
            .lines()
            .find(|l| l.starts_with(config))
            .unwrap_or_default();
        assert!(
            line.ends_with(" cn"),
            "{config} is not %config(noreplace): {line:?}"
        );
    }
    // The plugstack line names the plugin where this package puts it.
    let plugstack = std::fs::read_to_string(repo_root().join("target/rpm-stage/plugstack.conf"))
        .expect("the staged plugstack line");
    assert!(
        plugstack.contains("optional /usr/lib64/slurm/power_flex.so "),
        "{plugstack}"
    );
    // The scriptlets: the removal releases the GPUs, the upgrade checks the config, and
    // each maps RPM's count first; every one is valid sh.
    let controller_scripts = rpm_query(controller, &["--scripts"]);
    assert!(
        controller_scripts.contains("powerflex-ctld --config")
            && controller_scripts.contains("systemctl try-restart powerflex-ctld powerflex-grid"),
        "the controller's scriptlets are its scripts (cargo-generate-rpm embeds a missing file's path as the script): {controller_scripts}"
    );
    let scripts = rpm_query(node, &["--scripts"]);
    assert!(
        scripts.contains("--release-gpus") && scripts.contains("--check-config"),
        "{scripts}"
    );
    assert!(
        scripts.contains(r#"if [ "$1" -eq 0 ]; then set -- remove"#),
        "{scripts}"
    );
    assert!(
        scripts.contains(r#"if [ "$1" -ge 2 ]; then set -- configure rpm-upgrade"#),
        "{scripts}"
    );
    for entry in std::fs::read_dir(repo_root().join("target/rpm-stage")).expect("the stage") {
        let path = entry.expect("an entry").path();
        if path.extension().is_some_and(|e| e == "sh") {
            let checked = Command::new("sh")
                .arg("-n")
                .arg(&path)
                .output()
                .expect("sh -n");
            assert!(
                checked.status.success(),
                "{}: {}",
                path.display(),
                said(&checked)
            );
        }
    }
    let requires = rpm_query(node, &["--requires"]);
    assert!(
        requires.lines().any(|l| l.starts_with("powerflex-cli")),
        "{requires}"
    );
}
